"""Real learners and real actor processes for system tests.

The learner runs in this process (on a thread with its own event loop) so a
test can read its unroll queue and stream table; actors are subprocesses
started through their console entry point, exactly as users start them.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

from learner.config import LearnerConfig
from learner.learner import Learner
from learner.presets import preset_for
from learner.tools.background import BackgroundLearner

ROOT = pathlib.Path(__file__).resolve().parent.parent


def wait_until(
    condition: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.05
) -> None:
    """Polls `condition` every `interval_s` until it holds; fails the test after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


class LearnerThread(BackgroundLearner):
    """A compiled Learner of `config` serving from a background thread."""

    def __init__(self, config: LearnerConfig, train: bool = True):
        learner = Learner(config)
        learner.compile()
        super().__init__(learner, train)


def learner_config(env: str, run_dir: pathlib.Path, **overrides) -> LearnerConfig:
    """The env's preset on a free loopback port, with `overrides`."""
    settings = {
        "port": 0,
        "http_port": 0,
        "bind_address": "127.0.0.1",
        "run_dir": str(run_dir),
        **overrides,
    }
    return dataclasses.replace(preset_for(env), **settings)


def learner_argv(env: str, run_dir: pathlib.Path, *flags: str, port: int = 0) -> list[str]:
    """seedrl-learner's command line as users type it, on loopback, with no HTTP port."""
    return [
        str(ROOT / ".venv" / "bin" / "seedrl-learner"),
        "--env",
        env,
        "--port",
        str(port),
        "--http-port",
        "-1",
        "--bind-address",
        "127.0.0.1",
        "--run-dir",
        str(run_dir),
        *flags,
    ]


class LoggedProcess:
    """A command of the project run from the repository root, its output in `log_path`."""

    def __init__(self, argv: Sequence[str], log_path: pathlib.Path):
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in wait/kill
        self.process = subprocess.Popen(
            list(argv),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        return self.log_path.read_text()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)
        self._log.close()

    def wait(self, timeout_s: float) -> int:
        code = self.process.wait(timeout=timeout_s)
        self._log.close()
        return code


class ActorProcess(LoggedProcess):
    def __init__(self, args: Sequence[str], log_path: pathlib.Path):
        actor = ROOT / ".venv" / "bin" / "seedrl-actor"
        command = [str(actor)] if actor.exists() else [sys.executable, "-m", "actors.main"]
        super().__init__([*command, *args], log_path)


def spawn_actor(
    address: str,
    env: str,
    num_envs: int,
    actor_id: str,
    log_dir: pathlib.Path,
    *extra: str,
) -> ActorProcess:
    args = [
        "--learner",
        address,
        "--env",
        env,
        "--num-envs",
        str(num_envs),
        "--actor-id",
        actor_id,
        "--backoff-initial-s",
        "0.2",
        "--backoff-max-s",
        "2",
        *extra,
    ]
    log_dir.mkdir(parents=True, exist_ok=True)
    index = len(list(log_dir.glob(f"{actor_id}*.log")))
    return ActorProcess(args, log_dir / f"{actor_id}-{index}.log")


def train_to_the_end(
    env: str,
    run_dir: pathlib.Path,
    log_dir: pathlib.Path,
    *learner_flags: str,
    actors: int = 2,
    num_envs: int = 16,
    timeout_s: float = 1200.0,
) -> str:
    """seedrl-learner (on loopback) and its actor processes, run until training finishes:
    the learner exits 0 and ends the streams with OK, so every actor exits 0 by itself.
    Returns the learner's log."""
    log_dir.mkdir(parents=True, exist_ok=True)
    learner = LoggedProcess(
        learner_argv(env, run_dir, *learner_flags), log_dir / f"learner-{run_dir.name}.log"
    )
    fleet: list[ActorProcess] = []
    try:
        port = port_from_log(learner.log_path, timeout_s=300)
        fleet = [
            spawn_actor(f"127.0.0.1:{port}", env, num_envs, f"{run_dir.name}-{i}", log_dir)
            for i in range(actors)
        ]
        assert learner.wait(timeout_s=timeout_s) == 0, learner.log()[-3000:]
        assert [actor.wait(timeout_s=60) for actor in fleet] == [0] * actors
    finally:
        learner.kill()
        for actor in fleet:
            actor.kill()
    return learner.log()


def first_solved(run_dir: pathlib.Path, target: float) -> dict:
    """The first metrics.jsonl record whose 100-episode mean return reached `target`;
    fails the test, saying the best mean, when none did."""
    import json

    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    solved = [
        r
        for r in records
        if r["episode_return_mean"] is not None
        and r["episode_return_mean"] >= target
        and r["episodes"] >= 100
    ]
    assert solved, f"best mean return {max(r['episode_return_mean'] or 0 for r in records)}"
    return solved[0]


def port_from_log(path: pathlib.Path, timeout_s: float) -> int:
    """The port a CLI learner reports in its log ("... on port N; ...")."""
    found: list[int] = []

    def has_port() -> bool:
        match = re.search(r"serving \S+ on port (\d+)", path.read_text() if path.exists() else "")
        if match:
            found.append(int(match.group(1)))
        return bool(found)

    wait_until(has_port, timeout_s, f"the learner to report its port in {path}")
    return found[0]


def free_port() -> int:
    """A TCP port nothing listens on right now (for CLIs that need one up front)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def processes_matching(text: str) -> list[int]:
    """Pids of live processes whose command line contains `text`."""
    pids = []
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().split()[2]
        except OSError:
            continue
        if text in command and state != "Z":
            pids.append(int(entry.name))
    return pids


def written_records(path) -> list[dict]:
    """The records of a metrics.jsonl a live learner may be writing: only lines whose
    newline has been written (a long record can reach the file in two writes)."""
    import json
    import pathlib

    path = pathlib.Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().split("\n")[:-1] if line]
