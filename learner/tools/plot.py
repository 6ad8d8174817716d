"""Learning curves from runs' metrics.jsonl: return over env frames, FPS over time.

    python -m learner.tools.plot runs/pong-a runs/pong-b --out curves.png   (scripts/plot.sh)

Every run directory given becomes one line on each chart, labelled with its
directory name (or --labels). Needs matplotlib (scripts/setup.sh --plot).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    """The records of a run's metrics.jsonl; a torn last line (a live run) is skipped."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: is {run_dir!r} a learner's run directory?")
    records = []
    with open(path) as file:
        for line in file:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def series(records: list[dict[str, Any]], x: str, y: str) -> tuple[list[float], list[float]]:
    points = [(r[x], r[y]) for r in records if r.get(x) is not None and r.get(y) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def plot(run_dirs: Sequence[str], out: str, labels: Sequence[str] | None = None) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(labels or [os.path.basename(os.path.normpath(d)) for d in run_dirs])
    if len(labels) != len(run_dirs):
        raise ValueError(f"{len(labels)} labels for {len(run_dirs)} runs")
    figure, (returns, fps) = plt.subplots(1, 2, figsize=(13, 4.8))
    for run_dir, label in zip(run_dirs, labels, strict=True):
        records = read_metrics(run_dir)
        returns.plot(*series(records, "env_frames", "episode_return_mean"), label=label)
        minutes, rates = series(records, "elapsed_s", "fps")
        fps.plot([m / 60 for m in minutes], rates, label=label)
    returns.set(
        title="Mean episode return (last 100 episodes)", xlabel="env frames", ylabel="return"
    )
    fps.set(title="Env frames per second", xlabel="minutes", ylabel="frames/s")
    for axes in (returns, fps):
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    figure.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="scripts/plot.sh", description="Learning curves of one or more runs, as a PNG."
    )
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    parser.add_argument("--out", default="", help="PNG to write; default RUN_DIR/curves.png")
    parser.add_argument("--labels", nargs="*", help="one legend label per run")
    args = parser.parse_args(argv)
    out = args.out or os.path.join(args.run_dirs[0], "curves.png")
    try:
        print(plot(args.run_dirs, out, args.labels))
    except (FileNotFoundError, ValueError) as error:
        sys.exit(f"plot: {error}")


if __name__ == "__main__":
    main()
