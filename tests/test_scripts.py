"""The shell entry points: argument checks, a whole local run, signals, restarts."""

from __future__ import annotations

import json
import os
import shutil
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
    written_records,
)

RUN_LOCAL = str(ROOT / "scripts" / "run_local.sh")
LAUNCH_ACTORS = str(ROOT / "scripts" / "launch_actors.sh")
LAUNCH_FLEET = str(ROOT / "scripts" / "launch_fleet.sh")


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
        return any(record["env_steps"] > 0 for record in written_records(metrics))

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


def read_status(path) -> dict[str, str]:
    return dict(field.split("=", 1) for field in path.read_text().split())


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
            "--status-file",
            str(tmp_path / "state" / "status"),
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
        status = read_status(tmp_path / "state" / "status")
        assert status["state"] == "running" and status["pid"] == str(launcher.pid)
        assert (status["actors"], status["alive"], status["restarts"]) == ("2", "2", "1")
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=60) == 130
        status = read_status(tmp_path / "state" / "status")
        assert (status["state"], status["alive"], status["restarts"]) == ("stopped", "0", "1")
        wait_until(lambda: not processes_matching(fleet.address), 30, "the actors to stop")
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        fleet.stop()


def test_launch_actors_backs_off_an_actor_that_keeps_dying_at_its_start(tmp_path):
    """An actor that fails within seconds of each start (an env it cannot build) is retried
    after 1 s, then 2 s, then 4 s: a crash loop does not spin."""
    log = tmp_path / "launcher.log"
    launcher = subprocess.Popen(
        [
            LAUNCH_ACTORS,
            "--learner",
            "127.0.0.1:1",
            "--num-actors",
            "1",
            "--env",
            "atari:NoSuchGame",
            "--num-envs",
            "1",
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        stderr=open(log, "w"),  # noqa: SIM115 - the child owns it
        start_new_session=True,
    )
    try:
        wait_until(lambda: "restarting in 4 s" in log.read_text(), 90, "a third restart")
        delays = [
            line.rsplit("restarting in ", 1)[1]
            for line in log.read_text().splitlines()
            if "restarting in" in line
        ]
        assert delays == ["1 s", "2 s", "4 s"], delays
        assert "ale-py has no Atari ROM" in (tmp_path / "logs" / "actor-0.log").read_text()
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=60) == 130
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)


# -- launch_fleet.sh ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("hosts", "args", "message"),
    [
        ("a 2\n", [], "--learner HOST:PORT is required"),
        ("a 2\n", ["--learner", "h:1", "--transport", "rsh"], "must be ssh, netns or local"),
        ("a 2\n", ["--learner", "h:1", "--name", "a/b"], "may hold only letters"),
        ("a 2\n", ["--learner", "h:1", "--actors-per-host", "0"], "positive integer or auto"),
        ("# only a comment\n\n", ["--learner", "h:1"], "no hosts in"),
        ("a two\n", ["--learner", "h:1"], "hosts:1: ACTORS 'two'"),
        ("a 1\nb 1 0\n", ["--learner", "h:1"], "hosts:2: ENVS '0'"),
        ("a 1 2 3\n", ["--learner", "h:1"], "more than HOST ACTORS ENVS"),
        ("a\nb\nroot@a 3\n", ["--learner", "h:1"], "hosts:3: host 'root@a' is 'a' again"),
    ],
)
def test_launch_fleet_checks_its_arguments_and_hosts_file(tmp_path, hosts, args, message):
    (tmp_path / "hosts").write_text(hosts)
    result = subprocess.run(
        [LAUNCH_FLEET, "--hosts", str(tmp_path / "hosts"), "--transport", "local", *args],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Usage:" in result.stderr


def test_launch_fleet_reads_a_hosts_file_with_crlf_line_ends(tmp_path):
    (tmp_path / "hosts").write_bytes(b"h1 2 3\r\nh2\r\n")
    result = subprocess.run(
        fleet_command(tmp_path / "hosts", f"crlf-{os.getpid()}", "--status"),
        capture_output=True,
        text=True,
        timeout=30,
    )
    # Parsed (no complaint about ACTORS '2\r'); nothing started there yet: exit 1.
    assert result.returncode == 1, result.stderr
    assert host_lines(result.stdout) == {"h1": "absent", "h2": "absent"}


def fleet_command(hosts_file, name: str, *args: str) -> list[str]:
    return [LAUNCH_FLEET, "--hosts", str(hosts_file), "--transport", "local", "--name", name, *args]


def host_lines(output: str) -> dict[str, str]:
    """launch_fleet's per-host lines: host -> the rest of its first line."""
    lines: dict[str, str] = {}
    for line in output.splitlines():
        host, _, rest = line.partition(" ")
        if host in ("h1", "h2"):
            lines.setdefault(host, rest.strip())
    return lines


def test_launch_fleet_starts_reports_and_stops_a_fleet(tmp_path):
    fleet = LearnerThread(learner_config("counting:v0", tmp_path / "run"), train=True).start()
    name = f"test-{os.getpid()}"
    hosts_file = tmp_path / "hosts"
    # h1 brings its own counts; h2 takes --actors-per-host and --num-envs.
    hosts_file.write_text("h1 2 3   # two actors of 3 envs\nh2\n")
    service = fleet.learner.service
    try:
        start = [
            "--learner",
            fleet.address,
            "--env",
            "counting:v0",
            "--actors-per-host",
            "1",
            "--num-envs",
            "2",
            "--detach",
            "--",
            "--log-interval-s",
            "1",
        ]
        started = subprocess.run(
            fleet_command(hosts_file, name, *start), capture_output=True, text=True, timeout=60
        )
        assert started.returncode == 0, started.stdout + started.stderr
        lines = host_lines(started.stdout)
        assert lines["h1"].startswith("started 2 actors x 3 envs of counting:v0")
        assert lines["h2"].startswith("started 1 actors x 2 envs of counting:v0")
        wait_until(lambda: len(service.streams) == 3, 120, "3 actors")
        envs = sorted((s.actor_id, s.num_envs) for s in service.streams.values())
        assert envs == [("h1-0", 3), ("h1-1", 3), ("h2-0", 2)]

        def status(code: int = 0) -> dict[str, str]:
            result = subprocess.run(
                fleet_command(hosts_file, name, "--status"),
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert result.returncode == code, result.stdout + result.stderr
            return host_lines(result.stdout)

        # Every actor has reported its rate (every second) to its log.
        wait_until(
            lambda: "streaming=2" in status()["h1"] and "streaming=1" in status()["h2"],
            60,
            "both hosts streaming",
        )
        report = status()
        assert report["h1"].startswith("running alive=2/2 restarts=0")
        assert report["h2"].startswith("running alive=1/1 restarts=0")
        # A second start into the same fleet is refused and stops nothing.
        again = subprocess.run(
            fleet_command(hosts_file, name, *start), capture_output=True, text=True, timeout=60
        )
        assert again.returncode == 1 and "a fleet already runs" in again.stdout
        assert len(service.streams) == 3

        stopped = subprocess.run(
            fleet_command(hosts_file, name, "--stop"), capture_output=True, text=True, timeout=60
        )
        assert stopped.returncode == 0
        assert host_lines(stopped.stdout) == {"h1": "stopped", "h2": "stopped"}
        wait_until(lambda: not processes_matching(fleet.address), 30, "the actors to stop")
        report = status(code=130)
        assert report["h1"].startswith("stopped alive=0/2")
        assert report["h2"].startswith("stopped alive=0/1")
    finally:
        subprocess.run(fleet_command(hosts_file, name, "--stop"), capture_output=True, timeout=60)
        fleet.stop()
        shutil.rmtree(ROOT / "runs" / "fleets" / name, ignore_errors=True)
