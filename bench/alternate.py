"""Case (c) configurations against each other, alternating (docs/benchmarks.md, (c)).

One case (c) row is noisy on a shared machine: its window pairs spread over 0.1-0.3
of raw env speed. To compare two fleets (for instance actors of K = 512 against
K = 256, both in two groups), this runs each configuration's `measure_against_raw`
in turn, round after round in one process, so that both see the same stretch of the
machine, and prints every run's ratio to case (a), their mean with its 95% confidence
interval (the runs taken as independent measurements), and the CPU each env step cost
the learner, the actors and case (a)'s envs. As in case (c), each learner's
inference batch takes a whole message (256 envs for 512x2, where Pong's preset takes
64):

    .venv/bin/python -m bench.alternate --configs 512x2 128x2 --rounds 4
    .venv/bin/python -m bench.alternate --configs 512x2 256x2 --json runs/ab.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence

from bench import machine
from bench.common import alternating, mean_interval
from bench.end_to_end import measure_against_raw

RUN_KEYS = (
    "ratio_to_raw",
    "ratio_to_raw_ci95",
    "learner_cpu_us_per_step",
    "actors_cpu_us_per_step",
    "raw_cpu_us_per_step",
    "cpu_ratio_to_raw",
    "env_frames_per_s",
    "raw_env_frames_per_s",
    "inference_batch_size",
)


def configuration(text: str) -> tuple[int, int]:
    """'KxG' (envs per actor x groups) as a pair, with G dividing K."""
    try:
        envs, groups = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not KxG, for instance 128x2") from None
    if envs < 1 or groups < 1 or envs % groups:
        raise argparse.ArgumentTypeError(f"'{text}': K and G must be positive and G divide K")
    return envs, groups


def alternate(
    env: str,
    processes: int,
    configurations: Sequence[tuple[int, int]],
    rounds: int,
    warmup_s: float,
    duration_s: float,
    windows: int,
) -> dict[str, list[dict]]:
    """Per configuration ('KxG'), its runs in order: each run's figures of `RUN_KEYS` and
    the share of the machine's CPU time the hypervisor took over the run (`steal`)."""
    runs: dict[str, list[dict]] = {}
    for _ in range(rounds):
        for envs, groups in configurations:
            before = machine.cpu_times()
            row = measure_against_raw(env, processes, envs, groups, warmup_s, duration_s, windows)
            runs.setdefault(f"{envs}x{groups}", []).append(
                {
                    **{key: row[key] for key in RUN_KEYS},
                    "steal": machine.steal_share(before, machine.cpu_times()),
                }
            )
    return runs


def table(runs: dict[str, list[dict]]) -> str:
    lines = [
        "| K x G | ratio to (a), per run | mean | 95% CI of the mean "
        "| learner CPU us/env step, per run | mean "
        "| actors vs raw CPU us/env step, means | CPU ratio, mean |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, rows in runs.items():
        ratios = [row["ratio_to_raw"] for row in rows]
        # The runs as independent measurements of one ratio (Student's t over them).
        mean, half = mean_interval(ratios)
        interval = "-" if half is None else f"{mean - half:.3f}-{mean + half:.3f}"
        cpu = [row["learner_cpu_us_per_step"] for row in rows]
        actors = statistics.mean(row["actors_cpu_us_per_step"] for row in rows)
        raw = statistics.mean(row["raw_cpu_us_per_step"] for row in rows)
        cpu_ratio = statistics.mean(row["cpu_ratio_to_raw"] for row in rows)
        lines.append(
            f"| {name} | {', '.join(f'{r:.3f}' for r in ratios)} | {mean:.3f} | {interval} "
            f"| {', '.join(f'{c:.1f}' for c in cpu)} | {statistics.mean(cpu):.1f} "
            f"| {actors:.0f} vs {raw:.0f} | {cpu_ratio:.3f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", default="atari:Pong/84x84")
    parser.add_argument("--processes", type=int, default=2, help="actor processes (P)")
    parser.add_argument(
        "--configs",
        type=configuration,
        nargs="+",
        default=[(512, 2), (128, 2)],
        help="KxG: envs per actor x groups, run in this order every round",
    )
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--duration-s", type=float, default=20.0, help="per side, per run")
    parser.add_argument("--windows", type=int, default=8, help="even: fleet, raw, raw, fleet, ...")
    parser.add_argument(
        "--json", help="also write the runs here, with the machine's description and the commit"
    )
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.processes < 1:
        parser.error("--rounds and --processes must be at least 1")
    try:
        alternating(args.windows)  # the windows' schedule refuses a count it cannot pair
    except ValueError as error:
        parser.error(f"--{error}")
    if args.duration_s <= 0 or args.warmup_s < 0:
        parser.error("--duration-s must be positive and --warmup-s not negative")
    settings = {key: value for key, value in vars(args).items() if key != "json"}
    context = machine.context({**settings, "configs": [f"{k}x{g}" for k, g in args.configs]})
    runs = alternate(
        args.env,
        args.processes,
        args.configs,
        args.rounds,
        args.warmup_s,
        args.duration_s,
        args.windows,
    )
    print(table(runs))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({**context, "runs": runs}, out, indent=1)


if __name__ == "__main__":
    main()
