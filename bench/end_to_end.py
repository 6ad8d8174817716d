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

import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

from bench.common import CaseResult, Column, Settings, Window, cores, drain_unrolls

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _actors(address: str, env: str, processes: int, num_envs: int, groups: int, log_dir: str):
    actors = []
    for index in range(processes):
        log = open(os.path.join(log_dir, f"actor-{index}.log"), "w")  # noqa: SIM115
        args = [
            sys.executable,
            "-m",
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
        ]
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
    """What watches a live run: the fleet page's poll and a Prometheus scrape."""

    PAGE_POLL_S = 2.0  # the page's own refresh interval
    SCRAPE_S = 5.0

    def __init__(self, url: str):
        self._url = url
        self._stop = threading.Event()
        self.requests = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import urllib.request

        next_scrape = 0.0
        while not self._stop.wait(self.PAGE_POLL_S if self.requests else 0.0):
            paths = ["api/status"]
            if time.monotonic() >= next_scrape:
                paths.append("metrics")
                next_scrape = time.monotonic() + self.SCRAPE_S
            for path in paths:
                with urllib.request.urlopen(self._url + path, timeout=10) as response:
                    response.read()
                self.requests += 1

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.requests


def measure(
    env: str,
    processes: int,
    num_envs: int,
    groups: int,
    warmup_s: float,
    duration_s: float,
    train: bool,
    dashboards: bool | None = None,
    **overrides,
) -> dict:
    """Env frames/s of P actor processes x K envs served by one learner on this machine.

    `dashboards` True: TensorBoard, the HTTP server and a watcher polling it, with a
    log line every second; False: the same logging, none of the three; None: no
    logging (the benchmark's own snapshots only).
    """
    from envs import registry
    from learner.agents.vtrace import learning
    from learner.background import BackgroundLearner
    from learner.config import preset_for
    from learner.learner import Learner
    from learner.metrics import MetricsLogger

    spec = registry.spec(env)
    if dashboards is not None:
        overrides = {
            "log_interval_s": 1.0,
            "http_port": 0 if dashboards else -1,
            "tensorboard": dashboards,
            **overrides,
        }
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
        policy_fn = None if train else learning.make_uniform_policy_fn(spec.action.num_actions)
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
        watcher = _Watcher(learner.telemetry.url) if dashboards else None
        metrics = MetricsLogger(
            os.path.join(run_dir, "bench.jsonl"),
            learner.stats,
            spec.frames_per_step,
            config.total_env_steps,
        )
        try:
            _wait_for(
                lambda: learner.stats.connected_envs == processes * num_envs,
                120,
                "every actor to connect",
            )
            time.sleep(warmup_s)
            metrics.record(learner.unrolls.qsize())  # opens the window
            window = Window()
            time.sleep(duration_s)
            wall, cpu = window.elapsed()
            record = metrics.record(learner.unrolls.qsize())
        finally:
            requests = watcher.stop() if watcher is not None else 0
            _stop_actors(actors)
            served.stop()
            stop_drain.set()
            if drain is not None:
                drain.join()
            metrics.close()
    steps_per_s = record["env_steps_per_s"] or 0.0
    row = {
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
    }
    if dashboards is not None:
        row.update(dashboards="on" if dashboards else "off", http_requests=requests)
    if train:
        row.update(
            network=config.network,
            unroll_length=config.unroll_length,
            batch_size=config.batch_size,
            updates_per_s=record["updates_per_s"],
            time_trainer_waiting=record["time_trainer_waiting"],
            time_training=record["time_training"],
            policy_lag_mean=record["policy_lag_mean"],
        )
    return row


def run_trivial(settings: Settings, raw: CaseResult | None) -> CaseResult:
    """Case (c), with its ratio to case (a)'s figure for the same env, P and K."""
    from bench import raw_env

    processes = settings.processes or cores()
    num_envs = settings.envs_per_process
    env = "atari:Pong"
    result = CaseResult(
        case="c",
        title="end to end, trivial policy: real actors and learner, no network compute",
        columns=[
            Column("env", "env", "{}"),
            Column("processes", "P", "{}"),
            Column("envs_per_process", "K", "{}"),
            Column("groups", "G", "{}"),
            Column("env_frames_per_s", "env frames/s"),
            Column("raw_env_frames_per_s", "raw (a) frames/s"),
            Column("ratio_to_raw", "ratio to (a)", "{:.3f}"),
            Column("learner_cpu_us_per_step", "learner us/step", "{:.1f}"),
        ],
    )
    raw_fps = None
    if raw is not None:
        for row in raw.rows:
            if (row["env"], row["processes"], row["envs_per_process"]) == (
                env,
                processes,
                num_envs,
            ):
                raw_fps = row["env_frames_per_s"]
    if raw_fps is None:
        # Case (a) was not run: measure the ceiling here, in this same run.
        _, raw_fps = raw_env.measure(
            env, processes, num_envs, settings.warmup_s, settings.duration_s
        )
    # G=1: each actor's K envs in one message; G=2: two groups of K/2, each stepped
    # while the other waits for its actions.
    for groups in (1,) if settings.short else (1, 2):
        row = measure(
            env, processes, num_envs, groups, settings.warmup_s, settings.duration_s, train=False
        )
        row["raw_env_frames_per_s"] = raw_fps
        row["ratio_to_raw"] = row["env_frames_per_s"] / raw_fps
        result.rows.append(row)
    result.notes.append(
        "Actors, learner and gRPC share this machine's cores: the ratio is the share of "
        "the env stack's speed left after transport, batching and unroll assembly."
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
        env, overrides = "atari:Pong", {}
    result.rows.append(
        measure(
            env,
            processes,
            settings.envs_per_process,
            2,
            settings.warmup_s,
            settings.duration_s * (1 if settings.short else 3),
            train=True,
            **overrides,
        )
    )
    result.notes.append(
        "Shares are of the measured window, per thread: the inference thread computing or "
        "blocked on a full unroll queue; the trainer waiting for unrolls or training."
    )
    return result


def run_dashboards(settings: Settings) -> CaseResult:
    """Case (f): case (c) with the dashboards on and off, in the order on, off, off, on."""
    processes = settings.processes or cores()
    env = "counting:v0" if settings.short else "atari:Pong"
    result = CaseResult(
        case="f",
        title="dashboards on and off: case (c) with TensorBoard, fleet page and /metrics",
        columns=[
            Column("env", "env", "{}"),
            Column("dashboards", "dashboards", "{}"),
            Column("env_frames_per_s", "env frames/s"),
            Column("learner_cpu_us_per_step", "learner us/step", "{:.2f}"),
            Column("http_requests", "HTTP requests", "{}"),
        ],
    )
    # ABBA: a drift of the machine's speed over the case weighs on both alike.
    order = (True, False) if settings.short else (True, False, False, True)
    for dashboards in order:
        result.rows.append(
            measure(
                env,
                processes,
                settings.envs_per_process,
                1,
                settings.warmup_s,
                settings.duration_s,
                train=False,
                dashboards=dashboards,
            )
        )

    def mean(state: str, field: str) -> float:
        values = [row[field] for row in result.rows if row["dashboards"] == state]
        return sum(values) / len(values)

    fps_ratio = mean("on", "env_frames_per_s") / max(mean("off", "env_frames_per_s"), 1e-9)
    cpu_ratio = mean("on", "learner_cpu_us_per_step") / max(
        mean("off", "learner_cpu_us_per_step"), 1e-9
    )
    result.summary = {"fps_on_over_off": fps_ratio, "learner_cpu_on_over_off": cpu_ratio}
    result.notes.append(
        f"On/off: env frames/s x{fps_ratio:.3f}, learner CPU per env step x{cpu_ratio:.3f} "
        "(target: the learner no more than 2% slower). On: event files, the HTTP server, "
        f"the page polled every {_Watcher.PAGE_POLL_S:g} s and /metrics scraped every "
        f"{_Watcher.SCRAPE_S:g} s; both: a log line every second."
    )
    return result
