"""The shell entry points: argument checks, a whole local run, signals, restarts."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from tests.fleet import (
    ROOT,
    LearnerThread,
    free_port,
    learner_config,
    processes_matching,
    wait_until,
)

RUN_LOCAL = str(ROOT / "scripts" / "run_local.sh")
LAUNCH_ACTORS = str(ROOT / "scripts" / "launch_actors.sh")


@pytest.mark.parametrize(
    ("command", "message"),
    [
        ([RUN_LOCAL, "Pong"], "is not FAMILY:NAME"),
        ([RUN_LOCAL, "atari:Pong", "0"], "NUM_ACTORS must be a positive integer"),
        ([RUN_LOCAL, "atari:Pong", "2", "x"], "ENVS_PER_ACTOR must be a positive integer"),
        ([RUN_LOCAL, "a:b", "1", "1", "extra"], "too many arguments"),
        ([RUN_LOCAL, "--fast"], "unknown option '--fast'"),
        ([LAUNCH_ACTORS, "--num-actors", "2"], "--learner HOST:PORT is required"),
        ([LAUNCH_ACTORS, "--learner", "nohost", "--num-actors", "2"], "is not HOST:PORT"),
        ([LAUNCH_ACTORS, "--learner", "h:1", "--num-actors", "-3"], "positive integer"),
        ([LAUNCH_ACTORS, "--learner", "h:1", "--num-actors", "1", "--bogus"], "unknown argument"),
    ],
)
def test_bad_arguments_print_usage(command, message):
    result = subprocess.run(command, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Usage:" in result.stderr


def test_help_prints_usage():
    result = subprocess.run([RUN_LOCAL, "--help"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "ENVS_PER_ACTOR" in result.stderr


def run_local(tmp_path, port: int, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [RUN_LOCAL, *args],
        stdout=open(tmp_path / "run_local.log", "w"),
        stderr=subprocess.STDOUT,
        env={
            **os.environ,
            "SEEDRL_PORT": str(port),
            "SEEDRL_HTTP_PORT": "0",
            "SEEDRL_RUN_DIR": str(tmp_path / "run"),
        },
        start_new_session=True,
    )


def test_run_local_trains_to_the_end_and_leaves_nothing_running(tmp_path):
    port = free_port()
    script = run_local(tmp_path, port, "counting:v0", "2", "2", "--", "--total-env-steps", "4000")
    assert script.wait(timeout=300) == 0, (tmp_path / "run_local.log").read_text()[-3000:]
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["env_steps"] >= 4000
    # Both actor processes were started and pointed at this learner (whether both
    # connected before the 4,000 steps were done depends on their backoff timing).
    logs = sorted((tmp_path / "run" / "actors").iterdir())
    assert [p.name for p in logs] == ["actor-0.log", "actor-1.log"]
    assert all(f"127.0.0.1:{port}" in p.read_text() for p in logs)
    output = (tmp_path / "run_local.log").read_text()
    assert "fps" in output and "learner exited with 0" in output
    wait_until(lambda: not processes_matching(f"127.0.0.1:{port}"), 30, "the actors to exit")


def test_run_local_stops_every_process_on_sigterm(tmp_path):
    port = free_port()
    script = run_local(tmp_path, port, "counting:v0", "2", "1")
    metrics = tmp_path / "run" / "metrics.jsonl"

    def serving() -> bool:
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        return any(json.loads(x)["env_steps"] > 0 for x in lines)

    try:
        wait_until(serving, 180, "the local run to train")
        assert len(processes_matching(f"seedrl-actor --learner 127.0.0.1:{port}")) == 2
        script.send_signal(signal.SIGTERM)
        assert script.wait(timeout=60) == 130
    finally:
        if script.poll() is None:
            os.killpg(script.pid, signal.SIGKILL)
    wait_until(
        lambda: (
            not processes_matching(f"127.0.0.1:{port}")
            and not processes_matching(str(tmp_path / "run"))
        ),
        30,
        "every process of the run to stop",
    )


def test_launch_actors_restarts_a_killed_actor(tmp_path):
    fleet = LearnerThread(learner_config("counting:v0", tmp_path / "run"), train=True).start()
    launcher = subprocess.Popen(
        [
            LAUNCH_ACTORS,
            "--learner",
            fleet.address,
            "--num-actors",
            "2",
            "--env",
            "counting:v0",
            "--num-envs",
            "2",
            "--actor-prefix",
            "fleet",
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        stderr=open(tmp_path / "launcher.log", "w"),  # noqa: SIM115 - the child owns it
        start_new_session=True,
    )
    service = fleet.learner.service
    try:
        wait_until(lambda: len(service.streams) == 2, 120, "two actors")
        victim = next(s for s in service.streams.values() if s.actor_id == "fleet-1")
        os.kill(victim.pid, signal.SIGKILL)
        wait_until(
            lambda: any(
                s.actor_id == "fleet-1" and s.run_id != victim.run_id
                for s in service.streams.values()
            ),
            60,
            "fleet-1 to come back as a new run",
        )
        assert (
            "actor fleet-1 exited with 137; restarting" in (tmp_path / "launcher.log").read_text()
        )
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=60) == 130
        wait_until(lambda: not processes_matching(fleet.address), 30, "the actors to stop")
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        fleet.stop()
