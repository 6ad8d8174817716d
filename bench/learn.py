"""`python -m bench.learn`: wall-clock minutes to a score, measured as a user gets them.

Each game runs the README's train command, scripts/run_local.sh with its
default fleet, from the moment the command starts (set-up, compilation and
all) until the learner stops at the target, checked greedily
(--stop-at-return TARGET --stop-eval-episodes 10), or the time limit ends
it. A game without a target runs for the whole limit, its 100-episode mean
read at fixed minutes. --runs N runs each game N times, one after another:
single runs of one setting differ by minutes, so a claim of minutes to a score
rests on several and their median. Writes OUT_DIR/learn.json (per run: minutes
and env frames to the target, the curve, the settings the learner ran with;
per game: each run's minutes and frames and their median; the machine and the
commit) and OUT_DIR/learn-GAME.png (every run's return over minutes and over
env frames). Needs the machine to itself: the figure is wall-clock time.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import tyro

from bench import machine
from learner.tools.plot import read_metrics

# Random and human scores of the usual Atari tables (Mnih et al. 2015, Badia et al.
# 2020): where a score stands between the two.
REFERENCE_SCORES: dict[str, tuple[float, float]] = {
    "Pong": (-20.7, 14.6),
    "Breakout": (1.7, 30.5),
    "SpaceInvaders": (148.0, 1668.7),
    "Qbert": (163.9, 13455.0),
    "Seaquest": (68.4, 42054.7),
    "BeamRider": (363.9, 16926.5),
    "MsPacman": (307.3, 6951.6),
}
DEFAULT_TARGETS: dict[str, float] = {"Pong": 18.0}
READ_AT_MINUTES = (15.0, 30.0, 60.0)
STOP_GRACE_S = 60.0  # run_local's own SIGTERM handling stops the learner and actors
LOG_TAIL_LINES = 20  # of a failed run's log, printed with its summary


@dataclasses.dataclass(frozen=True)
class LearnConfig:
    """Minutes to a score on Atari games with the README's train command."""

    games: tuple[str, ...] = ("Pong",)
    """Atari games (ale-py names, e.g. Pong Breakout SpaceInvaders Qbert), or any env id
    FAMILY:NAME (classic:CartPole-v1)."""
    target: float | None = None
    """Greedy-checked 100-episode mean to stop at; None: the game's default (Pong 18; other
    games none: they run for --time-limit-min)."""
    time_limit_min: float = 60.0
    """Longest wall-clock time a run lasts, set-up and compilation included."""
    runs: int = 1
    """Runs of each game, one after another, run i with the learner's --seed i-1 unless
    --learner-flags sets one; the summary gives each run's minutes and env frames to the
    target and their median."""
    stop_eval_episodes: int = 10
    """Greedy episodes that must also reach the target before the learner stops."""
    env_options: str = ""
    """Options added to each env id, e.g. "no-sticky" for atari:GAME/no-sticky (envs/atari.py)."""
    num_actors: int = 0
    """Actor processes; 0: run_local.sh's default."""
    envs_per_actor: int = 0
    """Envs per actor; 0: run_local.sh's default."""
    learner_flags: tuple[str, ...] = ()
    """Further learner flags, each value split as a shell would, e.g.
    --learner-flags="--learning-rate=1e-3 --batch-passes=1"; none: the preset's."""
    out_dir: str = ""
    """Where the JSON, the plots and each game's run directory go; empty: runs/learn-TIME."""


def file_name(game: str) -> str:
    """A game or env id as a file name: "classic:CartPole-v1" -> "classic-CartPole-v1"."""
    return game.replace(":", "-").replace("/", "-")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def read_records(run_dir: str) -> list[dict[str, Any]]:
    """The learner's metrics.jsonl records; none when it wrote none."""
    try:
        return read_metrics(run_dir)
    except FileNotFoundError:
        return []


def curve(records: list[dict[str, Any]], started: float) -> list[dict[str, Any]]:
    """Per record: wall minutes since the command started, env frames, the 100-episode
    mean, and the greedy check's mean where one finished in that interval."""
    return [
        {
            "minutes": round((record["time"] - started) / 60.0, 3),
            "env_frames": record["env_frames"],
            "episode_return_mean": record.get("episode_return_mean"),
            "stop_check_return": record.get("stop_check_return"),
            "fps": record.get("fps"),
        }
        for record in records
    ]


def return_at(points: list[dict[str, Any]], minutes: float, lasted: float) -> float | None:
    """The 100-episode mean of the last point at or before `minutes`; None when the run
    did not last that long. `lasted` is the run's own length in minutes, not its last
    point's: the learner logs every few seconds, so a run of exactly an hour has its
    last point just before 60."""
    if lasted < minutes:
        return None
    before = [p for p in points if p["minutes"] <= minutes and p["episode_return_mean"] is not None]
    return before[-1]["episode_return_mean"] if before else None


def human_normalized(game: str, score: float | None) -> float | None:
    if score is None or game not in REFERENCE_SCORES:
        return None
    random_score, human = REFERENCE_SCORES[game]
    return round((score - random_score) / (human - random_score), 3)


class StopRequested(Exception):
    """SIGTERM to the benchmark: stop the running game as its time limit would."""


def _request_stop(signum: int, frame: Any) -> None:
    raise StopRequested


def run_name(config: LearnConfig, game: str, run: int) -> str:
    """The file name of a game's run: "Pong", or "Pong-2" for the second of several."""
    return file_name(game) if config.runs == 1 else f"{file_name(game)}-{run}"


def run_seed(flags: list[str], run: int) -> list[str]:
    """The learner flags of run `run`: its own seed (run 1 the learner's default, 0), so
    several runs sample the initialisation's spread as well as the asynchrony's, unless the
    flags name a seed, which every run then shares."""
    if any(flag == "--seed" or flag.startswith("--seed=") for flag in flags):
        return flags
    return flags if run == 1 else [*flags, "--seed", str(run - 1)]


def run_game(config: LearnConfig, game: str, out_dir: str, run: int = 1) -> dict[str, Any]:
    """Runs scripts/run_local.sh on `game` to its target or the time limit."""
    target = config.target if config.target is not None else DEFAULT_TARGETS.get(game)
    env_id = game if ":" in game else f"atari:{game}"
    if config.env_options:
        env_id += f"/{config.env_options}"
    name = run_name(config, game, run)
    run_dir = os.path.join(out_dir, f"run-{name}")
    command = [os.path.join(machine.ROOT, "scripts", "run_local.sh"), env_id]
    if config.num_actors or config.envs_per_actor:
        # An empty argument takes run_local.sh's own default for the one not given.
        command += [str(config.num_actors or ""), str(config.envs_per_actor or "")]
    flags = run_seed([flag for value in config.learner_flags for flag in shlex.split(value)], run)
    if target is not None:
        flags += [
            "--stop-at-return",
            str(target),
            "--stop-eval-episodes",
            str(config.stop_eval_episodes),
        ]
    command += ["--", *flags]
    environment = {
        **os.environ,
        "SEEDRL_RUN_DIR": run_dir,
        "SEEDRL_PORT": str(free_port()),
        "SEEDRL_HTTP_PORT": "0",
    }
    print(f"learn: {name}: {' '.join(command)}", flush=True)
    log_path = os.path.join(out_dir, f"run-{name}.log")
    started = time.time()
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command,
            cwd=machine.ROOT,
            env=environment,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        interrupted = False
        try:
            exit_code: int | None = process.wait(timeout=config.time_limit_min * 60.0)
        except (subprocess.TimeoutExpired, KeyboardInterrupt, StopRequested) as stop:
            # Out of time, or the user stopped the benchmark (Ctrl-C, SIGTERM): either
            # way run_local stops its learner and actors and the curve so far is kept.
            exit_code = None
            interrupted = not isinstance(stop, subprocess.TimeoutExpired)
            if interrupted:  # a second request must not cut the stop short
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                signal.signal(signal.SIGINT, signal.SIG_IGN)
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        except BaseException:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait()
            raise
    lasted = (time.time() - started) / 60.0
    points = curve(read_records(run_dir), started)
    reached = target is not None and exit_code == 0 and _stopped_at_return(log_path)
    settings = None
    if os.path.exists(os.path.join(run_dir, "config.json")):
        with open(os.path.join(run_dir, "config.json")) as file:
            settings = json.load(file)
    checks = [p["stop_check_return"] for p in points if p["stop_check_return"] is not None]
    final = points[-1] if points else {}
    random_score, human = REFERENCE_SCORES.get(game, (None, None))
    return {
        "game": game,
        "run": run,
        "env_id": env_id,
        "target": target,
        "reached": reached,
        "minutes_to_target": round(lasted, 2) if reached else None,
        "env_frames_to_target": final.get("env_frames") if reached else None,
        "greedy_check_returns": checks,
        "minutes_run": round(lasted, 2),
        "env_frames_run": final.get("env_frames"),
        "final_return_mean": final.get("episode_return_mean"),
        "returns_at_minutes": {f"{m:g}": return_at(points, m, lasted) for m in READ_AT_MINUTES},
        "random_score": random_score,
        "human_score": human,
        "exit_code": exit_code,
        "interrupted": interrupted,
        "command": command,
        "learner_settings": settings,
        "curve": points,
        "log": log_path,
    }


def _stopped_at_return(log_path: str) -> bool:
    """Whether the learner's log says it stopped because the return reached the target."""
    with open(log_path, errors="replace") as log:
        return any("training finished" in line and "mean return" in line for line in log)


def plot(results: list[dict[str, Any]], path: str) -> None:
    """The 100-episode mean over wall minutes and over env frames, one line per run of a
    game, with the target and the random and human scores."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = results[0]
    figure, (by_time, by_frames) = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    colours = plt.get_cmap("tab10")
    all_returns: list[float] = []
    for index, result in enumerate(results):
        points = [p for p in result["curve"] if p["episode_return_mean"] is not None]
        minutes = [p["minutes"] for p in points]
        frames = [p["env_frames"] / 1e6 for p in points]
        returns = [p["episode_return_mean"] for p in points]
        all_returns += returns
        name = "100-episode mean" if len(results) == 1 else f"run {result['run']}"
        colour = "#4878a8" if len(results) == 1 else colours(index % 10)
        for axes, xs in ((by_time, minutes), (by_frames, frames)):
            axes.plot(xs, returns, color=colour, label=name)
            checks = [
                (x, p["stop_check_return"])
                for x, p in zip(xs, points, strict=True)
                if p["stop_check_return"] is not None
            ]
            if checks:
                axes.scatter(
                    *zip(*checks, strict=True),
                    color="#c4723c",
                    s=14,
                    label="greedy check" if index == 0 else None,
                    zorder=3,
                )
    for axes, label in ((by_time, "wall-clock minutes"), (by_frames, "env frames (millions)")):
        for value, style, name in (
            (first["target"], "--", "target"),
            (first["random_score"], ":", "random"),
            (first["human_score"], "-.", "human"),
        ):
            if value is not None and (
                name != "human" or value <= max(all_returns, default=value) * 1.5
            ):
                axes.axhline(value, color="grey", linestyle=style, linewidth=1, label=name)
        axes.set_xlabel(label)
        axes.grid(alpha=0.3)
    by_time.set_ylabel("return")
    by_time.legend(fontsize=8)
    figure.suptitle(f"{first['env_id']}: {plot_status(results)}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_status(results: list[dict[str, Any]]) -> str:
    """The plot's title after the env id: the time to the target, or the runs' length."""
    if len(results) > 1:
        summary = summarize(results)
        if summary["target"] is None:
            return f"{summary['runs']} runs"
        reached = f"{summary['reached']} of {summary['runs']} runs reached {summary['target']:g}"
        if summary["median_minutes_to_target"] is None:
            return reached
        return f"{reached}, median {summary['median_minutes_to_target']:.1f} min"
    (result,) = results
    if result["reached"]:
        return (
            f"{result['target']:g} in {result['minutes_to_target']:.1f} min, "
            f"{result['env_frames_to_target'] / 1e6:.1f}M frames"
        )
    return f"{result['minutes_run']:.0f} min run"


def median_reached(values: list[float | None]) -> float | None:
    """The median of runs' figures to a target, a run that did not reach it (None) counting
    as longer than any that did; None when the median falls on such a run."""
    ordered = sorted(values, key=lambda value: (value is None, value or 0.0))
    middle = ordered[(len(ordered) - 1) // 2 : len(ordered) // 2 + 1]
    if not middle or any(value is None for value in middle):
        return None
    return sum(middle) / len(middle)


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One game's runs: each run's minutes and env frames to the target, and their median."""
    minutes = [r["minutes_to_target"] for r in results]
    frames = [r["env_frames_to_target"] for r in results]
    median_frames = median_reached(frames)
    return {
        "game": results[0]["game"],
        "env_id": results[0]["env_id"],
        "target": results[0]["target"],
        "runs": len(results),
        "reached": sum(r["reached"] for r in results),
        "minutes_to_target": minutes,
        "env_frames_to_target": frames,
        "median_minutes_to_target": median_reached(minutes),
        "median_env_frames_to_target": None if median_frames is None else round(median_frames),
        "final_return_means": [r["final_return_mean"] for r in results],
        "median_returns_at_minutes": {
            mark: median_of([r["returns_at_minutes"][mark] for r in results])
            for mark in results[0]["returns_at_minutes"]
        },
    }


def median_of(values: list[float | None]) -> float | None:
    """The median of the runs that have a value (a run that ended before a mark has none)."""
    present = [value for value in values if value is not None]
    return statistics.median(present) if present else None


def failed(result: dict[str, Any]) -> bool:
    """Whether the run ended on its own with an error, not at its target or time limit."""
    return result["exit_code"] not in (0, None)


def read_at_marks(returns: dict[str, float | None]) -> str:
    """{"15": 5.6, "30": None} -> "15 min 5.6, 30 min -"."""
    return ", ".join(f"{m} min {'-' if v is None else f'{v:.1f}'}" for m, v in returns.items())


def summary_line(result: dict[str, Any], runs: int = 1) -> str:
    reads = read_at_marks(result["returns_at_minutes"])
    if result["reached"]:
        head = (
            f"{result['target']:g} reached in {result['minutes_to_target']:.1f} min, "
            f"{result['env_frames_to_target']:,} env frames"
        )
    elif result["interrupted"]:
        head = f"stopped by the user after {result['minutes_run']:.1f} min"
    elif failed(result):
        head = (
            f"the run failed (exit {result['exit_code']}) after "
            f"{result['minutes_run']:.1f} min; its log: {result['log']}"
        )
    elif result["target"] is not None:
        head = f"{result['target']:g} not reached in {result['minutes_run']:.1f} min"
    else:
        head = f"{result['minutes_run']:.1f} min"
    run = f" (run {result['run']} of {runs})" if runs > 1 else ""
    return f"{result['env_id']}{run}: {head}; 100-episode mean at {reads}"


def summary_of_runs(summary: dict[str, Any]) -> str:
    """A game's several runs in one line: how many reached the target, each one's minutes,
    and the median; without a target, the median 100-episode mean at each mark."""
    if summary["target"] is None:
        reads = read_at_marks(summary["median_returns_at_minutes"])
        return f"{summary['env_id']}: {summary['runs']} runs; median 100-episode mean at {reads}"
    each = ", ".join("-" if m is None else f"{m:.1f}" for m in summary["minutes_to_target"])
    median = summary["median_minutes_to_target"]
    if median is None:
        middle = "median: not reached"
    else:
        middle = f"median {median:.1f} min, {summary['median_env_frames_to_target']:,} env frames"
    return (
        f"{summary['env_id']}: {summary['target']:g} reached in {summary['reached']} of "
        f"{summary['runs']} runs; minutes to it per run: {each}; {middle}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    config = tyro.cli(LearnConfig, args=argv, prog="python -m bench.learn")
    if config.runs < 1:
        print(f"learn: --runs must be 1 or more, not {config.runs}", file=sys.stderr)
        return 2
    out_dir = os.path.abspath(
        config.out_dir or os.path.join("runs", time.strftime("learn-%Y%m%d-%H%M%S"))
    )
    os.makedirs(out_dir, exist_ok=True)
    context = machine.context(dataclasses.asdict(config))
    signal.signal(signal.SIGTERM, _request_stop)
    results: list[dict[str, Any]] = []
    summaries: list[dict[str, Any]] = []
    interrupted = False
    for game in config.games:
        runs = []
        for run in range(1, config.runs + 1):
            result = run_game(config, game, out_dir, run)
            runs.append(result)
            results.append(result)
            plot(runs, os.path.join(out_dir, f"learn-{file_name(game)}.png"))
            if failed(result):
                # A run that failed rather than ran out of time shows why, here.
                with open(result["log"], errors="replace") as log:
                    print("".join(log.readlines()[-LOG_TAIL_LINES:]), end="", flush=True)
            print(f"learn: {summary_line(result, config.runs)}", flush=True)
            interrupted = result["interrupted"]
            write_report(out_dir, context, results, summaries)
            if interrupted:
                break
        if config.runs > 1:
            summaries.append(summarize(runs))
            print(f"learn: {summary_of_runs(summaries[-1])}", flush=True)
            write_report(out_dir, context, results, summaries)
        if interrupted:
            break
    print(f"learn: wrote {os.path.join(out_dir, 'learn.json')}", flush=True)
    targets = [r for r in results if r["target"] is not None]
    return 0 if all(r["reached"] for r in targets) else 1


def write_report(
    out_dir: str,
    context: dict[str, Any],
    results: list[dict[str, Any]],
    summaries: list[dict[str, Any]],
) -> None:
    """learn.json as it stands: rewritten after every run, so a stopped benchmark keeps
    what it measured."""
    with open(os.path.join(out_dir, "learn.json"), "w") as file:
        json.dump({**context, "games": results, "summaries": summaries}, file, indent=2)
        file.write("\n")


if __name__ == "__main__":
    sys.exit(main())
