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


def _bar_chart(path: str, labels: list[str], values: list[float], ylabel: str, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    bars = axes.bar(labels, values, color="#4878a8")
    axes.bar_label(bars, labels=[f"{value:,.0f}" for value in values], fontsize=8)
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.tick_params(axis="x", labelsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_raw_and_end_to_end(path: str, results: dict[str, CaseResult]) -> None:
    """Env frames/s of the raw env stack (a) beside the whole system's (c) and (d)."""
    labels, values = [], []
    for case in ("a", "c", "d"):
        result = results.get(case)
        for row in result.rows if result else []:
            groups = f" G={row['groups']}" if case == "c" else ""
            labels.append(
                f"({case}) {row['env']}\nP={row['processes']} K={row['envs_per_process']}{groups}"
            )
            values.append(row["env_frames_per_s"])
    if values:
        _bar_chart(path, labels, values, "env frames/s", "raw env (a) vs end to end (c, d)")


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
