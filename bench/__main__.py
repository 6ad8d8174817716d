"""`python -m bench`: runs the benchmark cases, prints a table, writes JSON and plots.

Cases: (a) raw env, (b) serving capacity, (c) end to end with a trivial
policy, (d) end to end training, (e) network compute vs a PyTorch yardstick,
(f) case (c) with the dashboards on and off.
`--short` runs every case for seconds (the test suite does, so nothing rots).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from collections.abc import Sequence

import tyro

from bench import machine, report
from bench.common import CaseResult, Settings
from learner.backends.cpu import xla_flags

CASES = "abcdef"


@dataclasses.dataclass(frozen=True)
class BenchConfig(Settings):
    """Measures seedrl's throughput on this machine; see docs/benchmarks.md."""

    cases: str = CASES
    """Which cases to run, e.g. "ac": a raw env, b serving, c end to end trivial, d training,
    e network compute, f dashboards on and off."""


def run_cases(config: BenchConfig) -> dict[str, CaseResult]:
    unknown = set(config.cases) - set(CASES)
    if unknown:
        raise SystemExit(f"unknown cases {sorted(unknown)}; choose from {CASES}")
    out_dir = config.out_dir or os.path.join("runs", time.strftime("bench-%Y%m%d-%H%M%S"))
    os.makedirs(out_dir, exist_ok=True)
    settings = Settings(
        short=config.short,
        out_dir=out_dir,
        duration_s=2.0 if config.short else config.duration_s,
        serving_duration_s=2.0 if config.short else config.serving_duration_s,
        warmup_s=1.0 if config.short else config.warmup_s,
        processes=config.processes,
        envs_per_process=8 if config.short else config.envs_per_process,
    )

    def runner(case: str):
        # Imported when run, so one case's dependencies never stop another's.
        if case == "a":
            from bench.raw_env import run
        elif case == "b":
            from bench.serving import run
        elif case == "c":
            from bench.end_to_end import run_trivial as run
        elif case == "d":
            from bench.end_to_end import run_training as run
        elif case == "f":
            from bench.end_to_end import run_dashboards as run
        else:
            from bench.network import run
        return run(settings)

    context = machine.context(dataclasses.asdict(settings))
    results: dict[str, CaseResult] = {}
    for case in CASES:
        if case not in config.cases:
            continue
        before, started = machine.cpu_times(), time.monotonic()
        result = runner(case)
        result.rows = [
            {**row, "steal": machine.steal_share(before, machine.cpu_times())}
            for row in result.rows
        ]
        results[case] = result
        print(report.table(result), flush=True)
        print(f"  ({time.monotonic() - started:.0f} s)\n", flush=True)
    json_path = os.path.join(out_dir, "results.json")
    report.write_json(json_path, list(results.values()), context)
    plots = report.write_plots(out_dir, results)
    print(f"wrote {json_path}" + "".join(f"\nwrote {path}" for path in plots))
    return results


def main(argv: Sequence[str] | None = None) -> None:
    config = tyro.cli(BenchConfig, args=argv, prog="python -m bench")
    xla_flags.apply()  # before JAX starts, as seedrl-learner does
    # The learner's own progress lines are noise here: the benchmark prints the figures.
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    run_cases(config)


if __name__ == "__main__":
    main()
