"""The table on the console, the JSON file and the PNG plots of a benchmark run."""

from __future__ import annotations

import json
import os
from typing import Any

from bench.common import CaseResult


def format_value(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def table(result: CaseResult) -> str:
    headers = [column.header for column in result.columns]
    cells = [
        [format_value(row.get(column.key), column.fmt) for column in result.columns]
        for row in result.rows
    ]
    widths = [
        max(len(header), *(len(line[index]) for line in cells)) if cells else len(header)
        for index, header in enumerate(headers)
    ]
    lines = [
        f"({result.case}) {result.title}",
        "  ".join(header.rjust(width) for header, width in zip(headers, widths, strict=True)),
        "  ".join("-" * width for width in widths),
    ]
    lines += [
        "  ".join(cell.rjust(width) for cell, width in zip(line, widths, strict=True))
        for line in cells
    ]
    lines += [f"  note: {note}" for note in result.notes]
    return "\n".join(lines)


def write_json(path: str, results: list[CaseResult], context: dict[str, Any]) -> None:
    """One object per case, each with the machine's description and the commit."""
    objects = [{**result.to_json(), **context} for result in results]
    with open(path, "w") as file:
        json.dump(objects, file, indent=2)
        file.write("\n")


def plot_raw_and_end_to_end(path: str, results: dict[str, CaseResult]) -> None:
    """Pong's env frames/s: the raw env stack (a), the whole system (c) beside the raw
    envs of its own minutes with the ratio, and training (d). The counting env's raw
    figure, a hundred times Pong's, would flatten the rest: it stays in the table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    env = "atari:Pong/84x84"
    entries: list[tuple[str, float, float | None]] = []  # label, frames/s, its ceiling
    for case in ("a", "c", "d"):
        result = results.get(case)
        for row in result.rows if result else []:
            if row["env"] != env:
                continue
            # One line each, so that neighbouring labels do not run into each other.
            lines = [f"({case}) P={row['processes']} K={row['envs_per_process']}"]
            if case == "c":
                lines.append(f"G={row['groups']}")
            if row.get("learner_placement") == "own cores":
                lines.append("learner's own core")
            label = "\n".join(lines)
            entries.append((label, row["env_frames_per_s"], row.get("raw_env_frames_per_s")))
    if not entries:
        return
    figure, axes = plt.subplots(figsize=(8, 4))
    width = 0.38
    for index, (_, value, ceiling) in enumerate(entries):
        if ceiling is None:
            bars = axes.bar(index, value, width * 2, color="#4878a8")
            axes.bar_label(bars, labels=[f"{value:,.0f}"], fontsize=8)
            continue
        bars = axes.bar(index - width / 2, value, width, color="#4878a8")
        axes.bar_label(bars, labels=[f"{value:,.0f}\n{value / ceiling:.2f}x"], fontsize=8)
        raw = axes.bar(index + width / 2, ceiling, width, color="#b0b0b0")
        axes.bar_label(raw, labels=[f"{ceiling:,.0f}"], fontsize=7)
    axes.set_xticks(range(len(entries)), [label for label, _, _ in entries], fontsize=8)
    axes.set_ylabel("env frames/s")
    axes.set_title(f"{env}: raw env (a), end to end (c; grey: raw, same minutes), training (d)")
    axes.margins(y=0.15)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_serving(path: str, result: CaseResult) -> None:
    """Actor steps/s and learner CPU per step for each streams x envs configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{row['streams']}x{row['envs_per_stream']}" for row in result.rows]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(labels, [row["actor_steps_per_s"] for row in result.rows], color="#4878a8")
    left.set_ylabel("actor steps/s served")
    left.set_xlabel("streams x envs per stream")
    right.bar(labels, [row["learner_cpu_us_per_step"] for row in result.rows], color="#c4723c")
    right.axhline(20.0, color="black", linestyle="--", linewidth=1, label="target at 16 envs")
    right.set_ylabel("learner CPU us per actor step")
    right.set_xlabel("streams x envs per stream")
    right.set_yscale("log")
    right.legend()
    figure.suptitle("(b) serving capacity: uniform random policy, counting env")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write_plots(out_dir: str, results: dict[str, CaseResult]) -> list[str]:
    """Every plot the results allow; returns the files written."""
    written = []
    if any(case in results for case in "acd"):
        path = os.path.join(out_dir, "frames_per_s.png")
        plot_raw_and_end_to_end(path, results)
        written.append(path)
    if "b" in results and results["b"].rows:
        path = os.path.join(out_dir, "serving.png")
        plot_serving(path, results["b"])
        written.append(path)
    if "e" in results and results["e"].rows:
        from bench import network

        path = os.path.join(out_dir, "network.png")
        network.plot(results["e"], path)
        written.append(path)
    return [path for path in written if os.path.exists(path)]
