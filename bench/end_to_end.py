"""Cases (c) and (d): real actor processes, a real learner, env frames/s end to end.

(c) the learner serves a policy that does no network compute (uniform random,
    jitted, fed the observations) and assembles unrolls that a thread drops:
    what the system costs next to the raw env stack of case (a), same P and K.
(d) the learner trains: Nature CNN, V-trace, the Atari preset; where the
    learner's time goes (its inference thread and its trainer thread).
(f) case (c) with the dashboards on and off, alternating in one run: what
    TensorBoard, the fleet page and /metrics cost the learner while a browser
    watches the page and Prometheus scrapes.

Actors are `python -m actors.main` subprocesses, exactly as users start them,
with their K envs in G groups (each group its own stream, stepped while the
other waits for its actions).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

from bench import tethered
from bench.common import (
    CaseResult,
    Column,
    Settings,
    Window,
    alternating,
    cores,
    cpus_of,
    drain_unrolls,
    mean_interval,
    pause_processes,
    pin_processes,
    processes_cpu_seconds,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _actors(address: str, env: str, processes: int, num_envs: int, groups: int, log_dir: str):
    actors = []
    for index in range(processes):
        log = open(os.path.join(log_dir, f"actor-{index}.log"), "w")  # noqa: SIM115
        # Tethered: a killed benchmark's actors would otherwise retry its learner forever.
        args = tethered.command(
            "actors.main",
            "--learner",
            address,
            "--env",
            env,
            "--num-envs",
            str(num_envs),
            "--groups",
            str(groups),
            "--actor-id",
            f"bench-{index}",
            "--backoff-initial-s",
            "0.2",
            "--backoff-max-s",
            "1",
        )
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        actors.append((process, log))
    return actors


def _stop_actors(actors) -> None:
    for process, _ in actors:
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
    for process, log in actors:
        process.wait(timeout=30)
        log.close()


def _wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.05)


class _Watcher:
    """What watches a live run, in its own process as a browser and Prometheus are:
    the fleet page's poll every PAGE_POLL_S and a scrape of /metrics every SCRAPE_S."""

    PAGE_POLL_S = 2.0  # the page's own refresh interval
    SCRAPE_S = 5.0
    _SCRIPT = """
import sys, time, urllib.request
url, poll_s, scrape_s = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
next_scrape = 0.0
while True:
    paths = ["api/status"]
    if time.monotonic() >= next_scrape:
        paths.append("metrics")
        next_scrape = time.monotonic() + scrape_s
    for path in paths:
        with urllib.request.urlopen(url + path, timeout=10) as response:
            response.read()
        print(path, flush=True)
    time.sleep(poll_s)
"""

    def __init__(self, url: str):
        self._process = subprocess.Popen(
            [sys.executable, "-c", self._SCRIPT, url, str(self.PAGE_POLL_S), str(self.SCRAPE_S)],
            stdout=subprocess.PIPE,
            text=True,
        )

    def stop(self) -> int:
        """Stops watching; the number of requests answered."""
        self._process.kill()
        output, _ = self._process.communicate(timeout=30)
        return len(output.split())


@contextlib.contextmanager
def serving_fleet(
    env: str, processes: int, num_envs: int, groups: int, train: bool, **overrides
) -> Iterator[tuple[Any, Any, list[int]]]:
    """A learner serving P actor processes x K envs, every actor connected:
    (learner, config, the actor processes' pids).

    Without training, a thread takes the unrolls where the trainer would.
    """
    from bench import uniform_policy
    from envs import registry
    from learner.learner import Learner
    from learner.presets import preset_for
    from learner.tools.background import BackgroundLearner

    spec = registry.spec(env)
    with tempfile.TemporaryDirectory() as run_dir:
        config = dataclasses.replace(
            preset_for(env),
            **{
                "port": 0,
                "http_port": 0,
                "bind_address": "127.0.0.1",
                "run_dir": run_dir,
                "log_interval_s": 1e9,  # the benchmark takes its own snapshots
                "total_env_steps": 10**15,  # the benchmark decides when to stop
                **overrides,
            },
        )
        policy_fn = (
            None if train else uniform_policy.make_uniform_policy_fn(spec.action.num_actions)
        )
        learner = Learner(config, policy_fn=policy_fn, console=False)
        learner.compile()
        served = BackgroundLearner(learner, train=train).start()
        stop_drain = threading.Event()
        drain = None
        if not train:
            drain = threading.Thread(
                target=drain_unrolls, args=(learner.unrolls, stop_drain, learner.store.recycle)
            )
            drain.start()
        actors = _actors(served.address, env, processes, num_envs, groups, run_dir)
        try:
            # Connected is not yet stepping (an actor resets its envs after its hello):
            # the window opens once every stream has been answered. Building and resetting
            # an Atari env takes 0.2-0.4 s of a core, so a fleet of 512-env actors needs
            # minutes to start; the deadline grows with each core's share of the envs.
            share = num_envs * -(-processes // cores())
            _wait_for(
                lambda: (
                    learner.stats.connected_envs == processes * num_envs
                    and all(stream.steps for stream in list(learner.service.streams.values()))
                ),
                120 + 1.0 * share,
                "every actor to connect and step",
            )
            yield learner, config, [process.pid for process, _ in actors]
        finally:
            _stop_actors(actors)
            served.stop()
            stop_drain.set()
            if drain is not None:
                drain.join()


def _metrics(learner: Any, config: Any) -> Any:
    """A metrics logger on the learner's counters; the benchmark takes its own records."""
    from learner.telemetry.metrics import MetricsLogger

    return MetricsLogger(
        os.path.join(config.run_dir, "bench.jsonl"),
        learner.stats,
        learner.env_spec.frames_per_step,
        config.total_env_steps,
    )


def measure_training(
    env: str,
    processes: int,
    num_envs: int,
    groups: int,
    warmup_s: float,
    duration_s: float,
    **overrides,
) -> dict:
    """Env frames/s of P actor processes x K envs served by one training learner on this
    machine, and where its threads' time goes."""
    with serving_fleet(env, processes, num_envs, groups, True, **overrides) as (
        learner,
        config,
        _,
    ):
        metrics = _metrics(learner, config)
        time.sleep(warmup_s)
        metrics.record(learner.unrolls.qsize())  # opens the window
        window = Window()
        time.sleep(duration_s)
        wall, cpu = window.elapsed()
        record = metrics.record(learner.unrolls.qsize())
        metrics.close()
    steps_per_s = record["env_steps_per_s"] or 0.0
    return {
        "env": env,
        "processes": processes,
        "envs_per_process": num_envs,
        "groups": groups,
        "env_steps_per_s": steps_per_s,
        "env_frames_per_s": record["fps"] or 0.0,
        "learner_cores": cpu / wall,
        "learner_cpu_us_per_step": 1e6 * cpu / max(steps_per_s * wall, 1.0),
        "inference_batch_mean": record["inference_batch_mean"],
        "inference_latency_ms": record["inference_latency_ms"],
        "time_inference": record["time_inference"],
        "time_inference_blocked": record["time_inference_blocked"],
        "network": config.network,
        "unroll_length": config.unroll_length,
        "batch_size": config.batch_size,
        "updates_per_s": record["updates_per_s"],
        "time_trainer_waiting": record["time_trainer_waiting"],
        "time_training": record["time_training"],
        "policy_lag_mean": record["policy_lag_mean"],
    }


SETTLE_S = 1.0
"""After each switch between the fleet and the raw envs, unmeasured: what the side just
paused had in flight (round trips, batches) finishes before the window opens."""


def measure_against_raw(
    env: str,
    processes: int,
    num_envs: int,
    groups: int,
    warmup_s: float,
    duration_s: float,
    windows: int,
    learner_cpus: set[int] | None = None,
) -> dict:
    """Case (c) for one configuration: the fleet's env frames/s and case (a)'s at the same
    P and K, in alternating windows (fleet, raw, raw, fleet, ...; the side not measured
    is stopped with SIGSTOP), `duration_s` in all for each, so that both figures of the
    ratio come from the same minutes of the machine.

    With `learner_cpus`, the learner (this process) runs on those cores and the actors
    and the raw envs on the others, as a fleet with a learner of its own runs. The
    learner's inference batch takes a whole message (`message_sized_batch`)."""
    from bench import raw_env

    fleet_on = alternating(windows)
    batch_overrides = message_sized_batch(env, num_envs // groups)
    usable = os.sched_getaffinity(0)
    env_cpus = usable
    if learner_cpus is not None:
        env_cpus = usable - set(learner_cpus)
        if not learner_cpus <= usable or not env_cpus:
            raise ValueError(
                f"learner cores {sorted(learner_cpus)} must be some, not all, of the "
                f"usable cores {sorted(usable)}"
            )
    window_s = 2 * duration_s / windows
    # The raw envs are made while the fleet starts (ale-py takes ~90 ms of CPU per Pong
    # env; their making overlaps the learner's start-up), and wait for their first window.
    raw = raw_env.PausableEnvs(env, processes, num_envs, held=True, wait=False)
    try:
        with (
            contextlib.ExitStack() as pinned,
            serving_fleet(env, processes, num_envs, groups, train=False, **batch_overrides) as (
                learner,
                config,
                actor_pids,
            ),
        ):
            raw.wait_ready()
            if learner_cpus is not None:
                pin_processes(raw.pids(), env_cpus)
                pin_processes(actor_pids, env_cpus)
                pin_processes([os.getpid()], learner_cpus)
                pinned.callback(pin_processes, [os.getpid()], usable)
            # Where each side's threads may run, read back from the kernel.
            placement = {
                "learner_cpus": cpus_of([os.getpid()]),
                "env_cpus": cpus_of([*actor_pids, *raw.pids()]),
            }
            metrics = _metrics(learner, config)
            time.sleep(warmup_s)
            metrics.record(learner.unrolls.qsize())  # opens the per-request figures' span
            measured = []  # per window: the fleet's or not, env steps, wall s, learner CPU s
            for index, on in enumerate(fleet_on):
                if index and on != fleet_on[index - 1]:
                    # The side about to be measured goes on after the other has stopped.
                    if on:
                        raw.pause()
                        pause_processes(actor_pids, False)
                    else:
                        pause_processes(actor_pids, True)
                        raw.resume()
                    time.sleep(SETTLE_S)
                read = (lambda: learner.stats.counters()["env_steps"]) if on else raw.steps
                envs = actor_pids if on else raw.pids()  # the processes that step the envs
                before, envs_before = read(), processes_cpu_seconds(envs)
                window = Window()
                time.sleep(window_s)
                wall, cpu = window.elapsed()
                measured.append(
                    {
                        "on": on,
                        "steps": read() - before,
                        "wall": wall,
                        "cpu": cpu,
                        "envs_cpu": processes_cpu_seconds(envs) - envs_before,
                    }
                )
            record = metrics.record(learner.unrolls.qsize())
            metrics.close()
            streams = list(learner.service.streams.values())
            # What an env step costs the actors' link (observation changes included).
            wire_bytes_per_step = sum(s.received_bytes for s in streams) / max(
                sum(s.steps * s.num_envs for s in streams), 1
            )
    finally:
        raw.close()
    frames = raw.frames_per_step
    rates = [frames * window["steps"] / window["wall"] for window in measured]

    def summed(key: str, on: bool) -> float:
        return sum(window[key] for window in measured if window["on"] == on)

    def per_step_us(key: str, on: bool) -> float:
        return 1e6 * summed(key, on) / max(summed("steps", on), 1)

    learner_us, actors_us, raw_us = (
        per_step_us("cpu", True),
        per_step_us("envs_cpu", True),
        per_step_us("envs_cpu", False),
    )
    fleet_fps = frames * summed("steps", True) / summed("wall", True)
    raw_fps = frames * summed("steps", False) / summed("wall", False)
    # Each fleet window against the raw window beside it (0-1, 3-2, 4-5, 7-6, ...):
    # the spread of these is the machine's noise on one ratio.
    beside = {0: 1, 3: -1}
    pairs = [
        rates[i] / max(rates[i + beside[i % 4]], 1e-9) for i in range(windows) if i % 4 in beside
    ]
    # How far one run's ratio can be trusted: the pairs' mean with its 95% interval.
    pairs_mean, pairs_half = mean_interval(pairs)
    return {
        "env": env,
        "processes": processes,
        "envs_per_process": num_envs,
        "groups": groups,
        "learner_placement": "shared" if learner_cpus is None else "own cores",
        **placement,
        "inference_batch_size": config.inference_batch_size,
        "windows": windows,
        "window_s": window_s,
        "env_steps_per_s": fleet_fps / frames,
        "env_frames_per_s": fleet_fps,
        "raw_env_frames_per_s": raw_fps,
        "ratio_to_raw": fleet_fps / max(raw_fps, 1e-9),
        "ratio_to_raw_per_pair": [round(ratio, 4) for ratio in pairs],
        "ratio_to_raw_ci95": None
        if pairs_half is None
        else [round(pairs_mean - pairs_half, 4), round(pairs_mean + pairs_half, 4)],
        "learner_cores": summed("cpu", True) / summed("wall", True),
        "learner_cpu_us_per_step": learner_us,
        "actors_cpu_us_per_step": actors_us,
        "raw_cpu_us_per_step": raw_us,
        # With every core busy, env steps/s go as the inverse of the CPU each costs on the
        # envs' cores (the learner's too where it shares them).
        "cpu_ratio_to_raw": raw_us
        / max(actors_us + (learner_us if learner_cpus is None else 0.0), 1e-9),
        "wire_bytes_per_step": round(wire_bytes_per_step, 1),
        "inference_batch_mean": record["inference_batch_mean"],
        "inference_latency_ms": record["inference_latency_ms"],
        "per_window": [
            {"side": "fleet" if window["on"] else "raw", "env_frames_per_s": round(rate, 1)}
            for window, rate in zip(measured, rates, strict=True)
        ],
    }


def message_sized_batch(env: str, envs_per_message: int) -> dict[str, int]:
    """The learner settings that let one inference batch take a whole message of
    `envs_per_message` envs, where the env's preset would refuse it (a message is never
    split across batches); {} where the preset takes it already."""
    from learner.presets import preset_for

    preset = preset_for(env)
    if envs_per_message <= preset.max_envs_per_stream:
        return {}
    return {
        "inference_batch_size": max(preset.inference_batch_size, envs_per_message),
        "max_envs_per_actor": max(preset.max_envs_per_actor, envs_per_message),
    }


def trivial_configurations(num_envs: int, short: bool, env: str) -> list[tuple[int, int]]:
    """Case (c)'s (K, G) rows for actors of `num_envs` envs, the learner sharing the cores.

    K envs in one message, the actor waiting out each round trip; actors whose two
    groups each fill the env preset's inference batch, so that one group steps while
    the other waits; and actors four times that size, whose messages fill a batch four
    times the preset's (the learner's batch is raised to take them:
    `message_sized_batch`), so that the learner's and the actors' costs per message
    are spread over four times the env steps. Rows that repeat one before are left out."""
    from learner.presets import preset_for

    if short:
        return [(num_envs, 1)]
    largest = preset_for(env).max_envs_per_stream
    rows = []
    for envs, groups in ((num_envs, 1), (2 * largest, 2), (8 * largest, 2)):
        if (envs, groups) not in rows:
            rows.append((envs, groups))
    return rows


def own_core_configuration(rows: list[tuple[int, int]], env: str) -> tuple[int, int]:
    """The (K, G) of case (c)'s row with the learner on cores of its own: the last of
    `rows` whose messages the env's preset takes as it is (the preset's own batch), or
    the last row where none does."""
    fitting = [row for row in rows if not message_sized_batch(env, row[0] // row[1])]
    return fitting[-1] if fitting else rows[-1]


def run_trivial(settings: Settings) -> CaseResult:
    """Case (c), each row with its ratio to case (a)'s figure for the same env, P and K,
    measured in windows alternating with the fleet's."""
    processes = settings.processes or cores()
    num_envs = settings.envs_per_process
    env = "atari:Pong/84x84"
    result = CaseResult(
        case="c",
        title="end to end, trivial policy: real actors and learner, no network compute",
        columns=[
            Column("env", "env", "{}"),
            Column("processes", "P", "{}"),
            Column("envs_per_process", "K", "{}"),
            Column("groups", "G", "{}"),
            Column("learner_placement", "learner", "{}"),
            Column("inference_batch_size", "batch", "{}"),
            Column("env_frames_per_s", "env frames/s"),
            Column("raw_env_frames_per_s", "raw (a) frames/s"),
            Column("ratio_to_raw", "ratio to (a)", "{:.3f}"),
            Column("ratio_to_raw_ci95", "pairs 95% CI", "{0[0]:.3f}-{0[1]:.3f}"),
            Column("learner_cpu_us_per_step", "learner us/step", "{:.1f}"),
            Column("actors_cpu_us_per_step", "actors us/step", "{:.0f}"),
            Column("raw_cpu_us_per_step", "raw us/step", "{:.0f}"),
            Column("cpu_ratio_to_raw", "CPU ratio", "{:.3f}"),
            Column("learner_cores", "learner cores", "{:.2f}"),
            Column("wire_bytes_per_step", "bytes/step", "{:.0f}"),
        ],
    )
    configurations = trivial_configurations(num_envs, settings.short, env)
    windows = 2 if settings.short else 8
    for envs, groups in configurations:
        result.rows.append(
            measure_against_raw(
                env, processes, envs, groups, settings.warmup_s, settings.duration_s, windows
            )
        )
    usable = sorted(os.sched_getaffinity(0))
    if len(usable) >= 2:
        # The learner on cores of its own (a quarter, at least one) and one actor process
        # per remaining core, as fleets run with a learner machine; with the preset's batch.
        learner_cpus = set(usable[-max(1, len(usable) // 4) :])
        envs, groups = own_core_configuration(configurations, env)
        result.rows.append(
            measure_against_raw(
                env,
                len(usable) - len(learner_cpus),
                envs,
                groups,
                settings.warmup_s,
                settings.duration_s,
                windows,
                learner_cpus=learner_cpus,
            )
        )
    result.notes.append(
        f"Each row: the fleet and case (a)'s env stack at the same P and K, alternating in "
        f"{windows} windows (fleet, raw, raw, fleet, ...; the other side stopped), "
        f"{settings.duration_s:g} s of each in all; 'ratio_to_raw_per_pair' in the JSON gives "
        f"each fleet window against the raw one beside it, and 'pairs 95% CI' the interval "
        f"their mean lies in at 95% confidence (Student's t over the pairs; with one pair, "
        f"none): how much of a ratio one run resolves on this machine."
    )
    result.notes.append(
        "learner 'shared': actors, learner and gRPC share every core, and the ratio is the "
        "share of the env stack's speed left after transport, batching and unroll assembly. "
        "'own cores': the learner runs on cores of its own, the actors and case (a)'s envs "
        "(one process per core) on the rest, and the ratio is the actors' side of that cost."
    )
    result.notes.append(
        "Where a ratio goes, in CPU per env step over the same windows: 'learner' (this "
        "process, every thread), 'actors' (the actor processes) and 'raw' (case (a)'s env "
        "processes, counted by the kernel in clock ticks). With every core busy, 'CPU ratio' "
        "= raw / (actors + learner), or raw / actors with the learner on cores of its own, "
        "is the ratio those costs alone allow; a ratio below it is the envs' cores left "
        "idle (round trips not hidden)."
    )
    return result


def run_training(settings: Settings) -> CaseResult:
    """Case (d)."""
    processes = settings.processes or cores()
    result = CaseResult(
        case="d",
        title="end to end, real training: Nature CNN and V-trace",
        columns=[
            Column("env", "env", "{}"),
            Column("processes", "P", "{}"),
            Column("envs_per_process", "K", "{}"),
            Column("env_frames_per_s", "env frames/s"),
            Column("updates_per_s", "updates/s", "{:.3f}"),
            Column("time_inference", "inference", "{:.0%}"),
            Column("time_inference_blocked", "inference blocked", "{:.0%}"),
            Column("time_trainer_waiting", "trainer waiting", "{:.0%}"),
            Column("time_training", "training", "{:.0%}"),
        ],
    )
    if settings.short:
        # Seconds, not minutes: a small network on the counting env, the same code path.
        env, overrides = "counting:v0", {"network": "mlp", "batch_size": 4, "unroll_length": 5}
    else:
        env, overrides = "atari:Pong/84x84", {}
    result.rows.append(
        measure_training(
            env,
            processes,
            settings.envs_per_process,
            2,
            settings.warmup_s,
            settings.duration_s * (1 if settings.short else 3),
            **overrides,
        )
    )
    result.notes.append(
        "Shares are of the measured window, per thread: the inference thread computing or "
        "blocked on a full unroll queue; the trainer waiting for unrolls or training."
    )
    return result


def run_dashboards(settings: Settings) -> CaseResult:
    """Case (f): case (c)'s fleet, windows with the dashboards on and off alternating.

    One learner and one set of actors throughout, so that only the dashboards
    differ between windows: on, TensorBoard writes and a watcher polls the page
    and scrapes /metrics; off, neither (the idle HTTP server stays up). The
    learner logs a line every second in both. Windows go on, off, off, on, ...
    so that a drift of the machine's speed weighs on both alike.
    """
    processes = settings.processes or cores()
    env = "counting:v0" if settings.short else "atari:Pong/84x84"
    windows = 2 if settings.short else 8
    window_s = settings.duration_s if settings.short else settings.duration_s / 2
    result = CaseResult(
        case="f",
        title="dashboards on and off: case (c) with TensorBoard, fleet page and /metrics",
        columns=[
            Column("env", "env", "{}"),
            Column("dashboards", "dashboards", "{}"),
            Column("windows", "windows", "{}"),
            Column("env_frames_per_s", "env frames/s"),
            Column("learner_cpu_us_per_step", "learner us/step", "{:.2f}"),
            Column("dashboards_cpu_share", "dashboards' share of learner CPU", "{:.2%}"),
            Column("http_requests", "HTTP requests", "{}"),
        ],
    )
    totals = {
        state: {"steps": 0, "wall": 0.0, "cpu": 0.0, "dashboards_cpu": 0.0, "requests": 0}
        for state in (1, 0)
    }
    per_window: list[dict[str, Any]] = []
    with serving_fleet(
        env, processes, settings.envs_per_process, 1, train=False, log_interval_s=1.0
    ) as (learner, config, _):
        metrics = _metrics(learner, config)
        frames_per_step = learner.env_spec.frames_per_step
        time.sleep(settings.warmup_s)
        for on in alternating(windows):
            learner.telemetry.enable_tensorboard(on)
            watcher = _Watcher(learner.telemetry.url) if on else None
            steps = learner.stats.counters()["env_steps"]
            dashboards_cpu = learner.telemetry.cpu_seconds
            window = Window()
            time.sleep(window_s)
            wall, cpu = window.elapsed()
            steps = learner.stats.counters()["env_steps"] - steps
            dashboards_cpu = learner.telemetry.cpu_seconds - dashboards_cpu
            requests = watcher.stop() if watcher is not None else 0
            total = totals[on]
            total["steps"] += steps
            total["wall"] += wall
            total["cpu"] += cpu
            total["dashboards_cpu"] += dashboards_cpu
            total["requests"] += requests
            per_window.append(
                {
                    "dashboards": "on" if on else "off",
                    "env_steps_per_s": round(steps / wall, 1),
                    "learner_cpu_us_per_step": round(1e6 * cpu / max(steps, 1), 2),
                    "dashboards_cpu_share": round(dashboards_cpu / max(cpu, 1e-9), 5),
                }
            )
        learner.telemetry.enable_tensorboard(True)
        metrics.close()
    for on, total in totals.items():
        result.rows.append(
            {
                "env": env,
                "processes": processes,
                "envs_per_process": settings.envs_per_process,
                "dashboards": "on" if on else "off",
                "windows": windows // 2,
                "window_s": window_s,
                "env_frames_per_s": frames_per_step * total["steps"] / total["wall"],
                "learner_cpu_us_per_step": 1e6 * total["cpu"] / max(total["steps"], 1),
                "dashboards_cpu_share": total["dashboards_cpu"] / max(total["cpu"], 1e-9),
                "http_requests": total["requests"],
            }
        )
    on_row, off_row = result.rows
    fps_ratio = on_row["env_frames_per_s"] / max(off_row["env_frames_per_s"], 1e-9)
    cpu_ratio = on_row["learner_cpu_us_per_step"] / max(off_row["learner_cpu_us_per_step"], 1e-9)
    result.summary = {
        "fps_on_over_off": fps_ratio,
        "learner_cpu_on_over_off": cpu_ratio,
        "dashboards_cpu_share_on": on_row["dashboards_cpu_share"],
        "windows": per_window,
    }
    result.notes.append(
        f"The dashboards took {on_row['dashboards_cpu_share']:.2%} of the learner's CPU while "
        f"on (target: at most 2%); on/off: env frames/s x{fps_ratio:.3f}, learner CPU per env "
        f"step x{cpu_ratio:.3f}, ratios within this machine's window-to-window noise. On: event "
        f"files written, the page polled every {_Watcher.PAGE_POLL_S:g} s and /metrics "
        f"scraped every {_Watcher.SCRAPE_S:g} s by another process; both: a log line a second."
    )
    return result
