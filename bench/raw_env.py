"""Case (a): the env stack alone, random actions, every core busy. The ceiling.

P processes each step K envs of one vector env in lock step, as an actor
does, but with random actions and no learner. All processes start their
measured window together (a barrier), so the figure is the machine's.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import time

import numpy as np

from bench.common import CaseResult, Column, Settings, cores, pause_processes
from bench.tethered import tether

ENVS = ("atari:Pong/84x84", "counting:v0")


def _random_env(env_id: str, num_envs: int):
    """K envs of `env_id`, reset, and a function that steps them all once with random
    actions: (env, step).

    Unseeded, as case (c)'s actors start theirs: a seeded first reset makes ale-py load
    every env's ROM a second time (~90 ms per env), which only lengthens the set-up."""
    from envs import registry

    env = registry.make(env_id, num_envs)
    rng = np.random.default_rng(0)
    num_actions = env.spec.action.num_actions
    env.reset()

    def step() -> None:
        env.step(rng.integers(0, num_actions, num_envs, dtype=np.int32))

    return env, step


def _worker(env_id: str, num_envs: int, warmup_s: float, duration_s: float, barrier, results):
    env, step = _random_env(env_id, num_envs)

    def run_for(seconds: float) -> int:
        steps, deadline = 0, time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            step()
            steps += 1
        return steps

    run_for(warmup_s)
    barrier.wait()
    started = time.perf_counter()
    steps = run_for(duration_s)
    results.put((steps * num_envs, time.perf_counter() - started, env.spec.frames_per_step))
    env.close()


def measure(env_id: str, processes: int, num_envs: int, warmup_s: float, duration_s: float):
    """(env steps/s, env frames/s) of P processes x K envs with random actions."""
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(processes)
    results = context.Queue()
    workers = [
        context.Process(
            target=_worker, args=(env_id, num_envs, warmup_s, duration_s, barrier, results)
        )
        for _ in range(processes)
    ]
    for worker in workers:
        worker.start()
    outcomes = []
    deadline = time.monotonic() + warmup_s + duration_s + 120
    while len(outcomes) < processes:
        try:
            outcomes.append(results.get(timeout=0.5))
        except queue.Empty:
            failed = [w.exitcode for w in workers if w.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                for worker in workers:
                    worker.kill()
                raise RuntimeError(f"env processes failed (exit codes {failed})") from None
    for worker in workers:
        worker.join()
    steps_per_s = sum(steps / seconds for steps, seconds, _ in outcomes)
    return steps_per_s, steps_per_s * outcomes[0][2]


def _stepper(env_id: str, num_envs: int, parent: int, counter, ready, go) -> None:
    tether(parent)  # a killed benchmark's envs, stepping or paused, end with it
    _, step = _random_env(env_id, num_envs)
    ready.set()
    go.wait()
    while True:
        step()
        counter.value += num_envs  # one writer, read between pauses: no lock needed


class PausableEnvs:
    """Case (a)'s P processes x K envs, stepping until closed, paused and resumed at will.

    Case (c) alternates them with its fleet in short windows (one paused while
    the other runs), so that both figures of a ratio come from the same minutes
    of a machine whose speed drifts. Env steps are counted in shared memory.
    """

    def __init__(
        self,
        env_id: str,
        processes: int,
        num_envs: int,
        ready_timeout_s: float = 120,
        held: bool = False,
        wait: bool = True,
    ):
        """Starts the processes. `held`: once made, the envs wait for the first `resume`
        instead of stepping at once. `wait=False` returns while the envs are still being
        made (call `wait_ready`), so their making can overlap other set-up, as case (c)'s
        fleet's."""
        from envs import registry

        context = multiprocessing.get_context("spawn")
        self.frames_per_step = registry.spec(env_id).frames_per_step
        self._ready_timeout_s = ready_timeout_s
        self._counters = [context.Value("q", 0, lock=False) for _ in range(processes)]
        self._readies = [context.Event() for _ in range(processes)]
        self._go = context.Event()
        if not held:
            self._go.set()
        self._workers = [
            context.Process(
                target=_stepper,
                args=(env_id, num_envs, os.getpid(), counter, ready, self._go),
                daemon=True,
            )
            for counter, ready in zip(self._counters, self._readies, strict=True)
        ]
        for worker in self._workers:
            worker.start()
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Returns once every process has made its envs; within `ready_timeout_s` of this
        call, or closes them all and raises."""
        deadline = time.monotonic() + self._ready_timeout_s
        try:
            for ready in self._readies:
                while not ready.wait(0.5):
                    failed = [w.exitcode for w in self._workers if w.exitcode is not None]
                    if failed or time.monotonic() > deadline:
                        raise RuntimeError(f"env processes failed to start (exit codes {failed})")
        except BaseException:
            self.close()
            raise

    def steps(self) -> int:
        """Env steps taken so far, all processes."""
        return sum(counter.value for counter in self._counters)

    def pids(self) -> list[int]:
        ended = [worker.exitcode for worker in self._workers if worker.exitcode is not None]
        if ended:
            raise RuntimeError(f"env processes ended (exit codes {ended})")
        return [worker.pid for worker in self._workers]

    def pause(self) -> None:
        pause_processes(self.pids(), True)

    def resume(self) -> None:
        pause_processes(self.pids(), False)
        # Held envs step from their first resume on. After SIGCONT: setting an event waits
        # for its waiters to wake, and a stopped one never would.
        self._go.set()

    def close(self) -> None:
        for worker in self._workers:
            if worker.is_alive():
                worker.kill()  # SIGKILL ends a stopped process too
        for worker in self._workers:
            worker.join(timeout=30)


def run(settings: Settings) -> CaseResult:
    processes = settings.processes or cores()
    result = CaseResult(
        case="a",
        title="raw env: the env stack alone, random actions",
        columns=[
            Column("env", "env", "{}"),
            Column("processes", "P", "{}"),
            Column("envs_per_process", "K", "{}"),
            Column("env_steps_per_s", "env steps/s"),
            Column("env_frames_per_s", "env frames/s"),
        ],
    )
    for env_id in ENVS:
        steps_per_s, frames_per_s = measure(
            env_id, processes, settings.envs_per_process, settings.warmup_s, settings.duration_s
        )
        result.rows.append(
            {
                "env": env_id,
                "processes": processes,
                "envs_per_process": settings.envs_per_process,
                "env_steps_per_s": steps_per_s,
                "env_frames_per_s": frames_per_s,
            }
        )
    result.notes.append(
        "Bound by the env's own CPU cost: ALE emulation and preprocessing in ale-py's C++ "
        "for Pong; Python for the counting env."
    )
    return result
