"""A fleet across three network hosts: namespaces joined by veth links.

The learner host has a bridge (10.77.0.1/24); each actor host is its own
network namespace whose only interface is a veth into that bridge, so its
actors reach the learner over that link alone. launch_fleet.sh starts them
through its netns transport. Then one actor host's link is cut
(`ip link set down`) long enough for both sides to give its connections up,
and restored: the fleet must be whole again within 15 s, the other host's
streams must never break, training must go on throughout, and the learner
must lose nothing but the cut streams' partial unrolls.

A second test runs launch_fleet.sh's default transport, ssh, from the
learner host to real sshd daemons on the actor hosts (key authentication),
and stops the fleet from a second command while the first one watches.

Needs root (CAP_NET_ADMIN) and iproute2; skips saying so otherwise, unless
SEEDRL_REQUIRE_NETNS=1 (scripts/test.sh sets it where namespaces work). The
ssh test also needs sshd (openssh-server, which scripts/test.sh installs).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest

from tests.fleet import ROOT, LoggedProcess
from tests.fleet import wait_until as wait_every_50ms

ENV = "classic:CartPole-v1"
LEARNER_ADDRESS = "10.77.0.1"
GRPC_PORT = 8470
HTTP_PORT = 8471
NUM_ENVS = 4
UNROLL_LENGTH = 20  # the classic preset's T
# Fast dead-peer detection on both sides, so the cut is short.
KEEPALIVE = ["--keepalive-interval-s", "2", "--keepalive-timeout-s", "2"]
RECOVERY_LIMIT_S = 15.0


def wait_until(condition, timeout_s: float, what: str) -> None:
    """Every poll here starts a process: 0.5 s apart, to leave the 2 cores to the fleet."""
    wait_every_50ms(condition, timeout_s, what, interval_s=0.5)


def netns_unavailable() -> str:
    """Why this machine cannot make namespaces here, or ""."""
    if shutil.which("ip") is None:
        return "no `ip` command (Debian package iproute2)"
    if os.geteuid() != 0:
        return "making network namespaces needs root (CAP_NET_ADMIN)"
    probe = f"seedrl-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


REASON = netns_unavailable()
if REASON and os.environ.get("SEEDRL_REQUIRE_NETNS") == "1":
    raise RuntimeError(f"SEEDRL_REQUIRE_NETNS=1 but {REASON}")
pytestmark = pytest.mark.skipif(bool(REASON), reason=REASON or "")


def ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")


class Hosts:
    """A learner host and actor hosts, each a network namespace, on one bridge."""

    def __init__(self, num_actor_hosts: int):
        tag = uuid.uuid4().hex[:6]
        self.learner = f"srl-{tag}-l"
        self.actors = [f"srl-{tag}-a{i + 1}" for i in range(num_actor_hosts)]
        self.addresses = {ns: f"10.77.0.{11 + i}" for i, ns in enumerate(self.actors)}

    def make(self) -> None:
        ip("netns", "add", self.learner)
        ip("-n", self.learner, "link", "set", "lo", "up")
        ip("-n", self.learner, "link", "add", "br0", "type", "bridge")
        ip("-n", self.learner, "addr", "add", f"{LEARNER_ADDRESS}/24", "dev", "br0")
        ip("-n", self.learner, "link", "set", "br0", "up")
        for i, ns in enumerate(self.actors):
            ip("netns", "add", ns)
            ip("-n", ns, "link", "set", "lo", "up")
            port = f"port{i + 1}"  # the bridge's end of this host's cable
            ip(
                "-n",
                self.learner,
                "link",
                "add",
                port,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                ns,
            )
            ip("-n", self.learner, "link", "set", port, "master", "br0", "up")
            ip("-n", ns, "addr", "add", f"{self.addresses[ns]}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")

    def remove(self) -> None:
        for ns in [*self.actors, self.learner]:
            for pid in self.pids(ns):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def pids(self, ns: str, running: str = "") -> list[str]:
        """Processes in namespace `ns` (whose command line holds `running`, if given)."""
        result = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
        found = []
        for pid in result.stdout.split():
            with contextlib.suppress(OSError):
                if running.encode() in pathlib.Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(pid)
        return found


FETCH = (
    "import json, sys, urllib.request\n"
    "get = lambda p: urllib.request.urlopen(sys.argv[1] + p, timeout=5).read().decode()\n"
    "print(json.dumps({'status': json.loads(get('/api/status')), 'metrics': get('/metrics')}))\n"
)


class LearnerView:
    """The learner's HTTP pages, read from inside its namespace."""

    def __init__(self, ns: str):
        self.ns = ns

    def read(self) -> dict:
        url = f"http://127.0.0.1:{HTTP_PORT}"
        command = ["ip", "netns", "exec", self.ns, sys.executable, "-c", FETCH, url]
        result = subprocess.run(command, capture_output=True, text=True, timeout=30)
        if result.returncode != 0:
            return {}
        data = json.loads(result.stdout)
        counters = {}
        for line in data["metrics"].splitlines():
            match = re.match(r"^(seedrl_[a-z_]+_total)(?:\{[^}]*\})? (\S+)$", line)
            if match:
                counters[match[1]] = counters.get(match[1], 0.0) + float(match[2])
        return {"status": data["status"], "counters": counters}

    def counter(self, name: str) -> float:
        """A counter's live value; -1 while the page cannot be read."""
        view = self.read()
        return view["counters"].get(name, -1.0) if view else -1.0

    def actors(self, prefix: str = "") -> dict[str, dict]:
        view = self.read()
        if not view:
            return {}
        return {row["id"]: row for row in view["status"]["actors"] if row["id"].startswith(prefix)}


@pytest.fixture
def hosts():
    made = Hosts(num_actor_hosts=2)
    try:
        made.make()
        yield made
    finally:
        made.remove()


def fleet_start_flags(*actor_flags: str) -> list[str]:
    """launch_fleet.sh's flags to start the test's fleet: 1 actor of NUM_ENVS envs per
    host unless the hosts file says otherwise, a status line every 2 s."""
    return [
        "--learner",
        f"{LEARNER_ADDRESS}:{GRPC_PORT}",
        "--env",
        ENV,
        "--actors-per-host",
        "1",
        "--num-envs",
        str(NUM_ENVS),
        "--status-interval-s",
        "2",
        "--",
        *actor_flags,
    ]


def start_learner(hosts: Hosts, tmp_path) -> tuple[LoggedProcess, LearnerView]:
    """A CartPole learner on the learner host, serving once this returns."""
    learner = LoggedProcess(
        [
            "ip",
            "netns",
            "exec",
            hosts.learner,
            str(ROOT / ".venv" / "bin" / "seedrl-learner"),
            "--env",
            ENV,
            "--preset",
            "classic",
            "--bind-address",
            LEARNER_ADDRESS,
            "--port",
            str(GRPC_PORT),
            "--http-port",
            str(HTTP_PORT),
            "--run-dir",
            str(tmp_path / "run"),
            "--log-interval-s",
            "1",
            "--total-env-steps",
            str(10**9),
            "--no-tensorboard",
            *KEEPALIVE,
        ],
        tmp_path / "learner.log",
    )
    view = LearnerView(hosts.learner)
    try:
        wait_until(
            lambda: bool(view.read()) or learner.process.poll() is not None,
            180,
            "the learner to serve",
        )
        assert learner.process.poll() is None, learner.log()
    except BaseException:
        stop(learner)
        raise
    return learner, view


def stop(process: LoggedProcess) -> None:
    if process.process.poll() is None:
        process.process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout_s=60)
    except subprocess.TimeoutExpired:
        process.kill()


@pytest.mark.slow
def test_fleet_over_network_hosts_survives_a_cut_link(hosts, tmp_path):
    cut_host, other_host = hosts.actors
    fleet_name = f"netns-{uuid.uuid4().hex[:6]}"
    state_root = ROOT / "runs" / "fleets" / fleet_name
    learner, view = start_learner(hosts, tmp_path)
    hosts_file = tmp_path / "hosts"
    # Hosts differ in their actor counts: 2 on the host to be cut, 1 on the other.
    hosts_file.write_text(f"# the test's namespaces\n{cut_host} 2\n{other_host}   # default\n")
    fleet = None
    try:
        fleet = LoggedProcess(
            [
                str(ROOT / "scripts" / "launch_fleet.sh"),
                "--hosts",
                str(hosts_file),
                "--transport",
                "netns",
                "--name",
                fleet_name,
                *fleet_start_flags(*KEEPALIVE, "--log-interval-s", "2"),
            ],
            tmp_path / "fleet.log",
        )
        wait_until(lambda: len(view.actors()) == 3, 120, "3 actors from 2 hosts")
        before = view.read()
        actors = {row["id"]: row for row in before["status"]["actors"]}
        # Each reached the learner over its own host's link, from its own address.
        for name, row in actors.items():
            ns = cut_host if name.startswith(cut_host) else other_host
            assert row["peer"].startswith(f"ipv4:{hosts.addresses[ns]}:"), row
        assert sorted(actors) == [f"{cut_host}-0", f"{cut_host}-1", f"{other_host}-0"]
        other = actors[f"{other_host}-0"]
        learner_id = before["status"]["run"]["learner_id"]
        # Training progresses before the cut.
        updates_at_start = before["counters"]["seedrl_updates_total"]
        wait_until(
            lambda: view.counter("seedrl_updates_total") >= updates_at_start + 5,
            60,
            "5 updates",
        )

        # Cut the actor host's cable.
        before_cut = view.read()["counters"]
        ip("-n", cut_host, "link", "set", "eth0", "down")
        cut_at = time.monotonic()
        wait_until(lambda: not view.actors(cut_host), 30, "the learner to drop the cut streams")
        dropped_after_s = time.monotonic() - cut_at
        # Both sides have given the connections up: the cut host's actors retry.
        wait_until(
            lambda: "reconnecting=2" in fleet_lines(fleet, cut_host),
            30,
            "launch_fleet's status to show the cut host's actors reconnecting",
        )
        # Held until both actors' backoff is at its cap (waits of 4-8 s), so the
        # recovery below includes the longest wait an actor makes by default.
        actor_logs = [state_root / cut_host / "actors" / f"actor-{i}.log" for i in (0, 1)]
        wait_until(
            lambda: all(last_retry_s(path) >= 4.0 for path in actor_logs),
            60,
            "the cut host's actors to back off to 4 s or more",
        )
        cut_s = time.monotonic() - cut_at
        during = view.read()["counters"]
        cut_updates = during["seedrl_updates_total"] - before_cut["seedrl_updates_total"]

        ip("-n", cut_host, "link", "set", "eth0", "up")
        restored_at = time.monotonic()
        wait_until(
            lambda: (
                len(back := view.actors(cut_host)) == 2
                and all(row["env_steps"] > 0 for row in back.values())
            ),
            60,
            "the cut host's actors to stream again",
        )
        recovery_s = time.monotonic() - restored_at
        print(
            f"\nlink cut for {cut_s:.1f} s; "
            f"learner dropped the cut streams {dropped_after_s:.1f} s after the cut; "
            f"{cut_updates:.0f} updates during the cut; "
            f"the cut host's 2 actors streamed again {recovery_s:.1f} s after the link came back"
        )
        assert recovery_s <= RECOVERY_LIMIT_S

        after = view.read()
        rows = {row["id"]: row for row in after["status"]["actors"]}
        # The other host never noticed: same stream, steps only grew.
        assert rows[f"{other_host}-0"]["run_id"] == other["run_id"]
        assert rows[f"{other_host}-0"]["env_steps"] > other["env_steps"]
        # The cut host came back as new runs (the learner had dropped the old ones).
        for name in (f"{cut_host}-0", f"{cut_host}-1"):
            assert rows[name]["run_id"] != actors[name]["run_id"]
        # The same learner trained on through the cut.
        assert after["status"]["run"]["learner_id"] == learner_id
        assert learner.process.poll() is None
        assert cut_updates >= 1
        # Lost: the cut streams' partial unrolls, at most one per env slot, each
        # shorter than an unroll; nothing refused or failed.
        counters = after["counters"]
        dropped = (
            counters["seedrl_dropped_unrolls_total"] - before_cut["seedrl_dropped_unrolls_total"]
        )
        transitions = (
            counters["seedrl_dropped_transitions_total"]
            - before_cut["seedrl_dropped_transitions_total"]
        )
        print(f"dropped: {dropped:.0f} partial unrolls, {transitions:.0f} transitions")
        # A stream's envs step together, so its slots hold equally long partial
        # unrolls: each cut stream dropped all NUM_ENVS of its slots' or none.
        assert dropped in (0, NUM_ENVS, 2 * NUM_ENVS)
        assert (transitions > 0) == (dropped > 0)
        assert transitions <= dropped * UNROLL_LENGTH
        assert counters.get("seedrl_stream_errors_total", 0.0) == 0
        assert counters["seedrl_rejected_streams_total"] == 0
        assert counters["seedrl_skipped_updates_total"] == 0
        updates_back = counters["seedrl_updates_total"]
        wait_until(
            lambda: view.counter("seedrl_updates_total") >= updates_back + 5,
            60,
            "5 more updates after the recovery",
        )

        # Ctrl-C's path: the foreground launch_fleet stops every host's actors.
        fleet.process.send_signal(signal.SIGTERM)
        assert fleet.wait(timeout_s=60) == 130
        for ns in hosts.actors:
            assert hosts.pids(ns) == [], f"processes left on {ns}"
        log = fleet.log()
        assert f"{cut_host}" in log and "stopped" in log
    finally:
        if fleet is not None and fleet.process.poll() is None:
            fleet.kill()
        stop(learner)
        shutil.rmtree(state_root, ignore_errors=True)


def fleet_lines(fleet: LoggedProcess, host: str) -> str:
    """launch_fleet's status lines about `host`."""
    return "\n".join(line for line in fleet.log().splitlines() if line.startswith(host))


def last_retry_s(actor_log) -> float:
    """The actor's latest reconnection wait, from its log; 0 before any."""
    waits = re.findall(
        r"retrying in ([0-9.]+) s", actor_log.read_text() if actor_log.exists() else ""
    )
    return float(waits[-1]) if waits else 0.0


# -- the ssh transport, against real sshd on the actor hosts ----------------------

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


def start_sshd(ns: str, address: str, keys, log_path) -> subprocess.Popen:
    """sshd on `address`:22 inside `ns`, taking only the test's key (for root)."""
    config = keys / f"sshd-{ns}.conf"
    config.write_text(
        f"ListenAddress {address}\n"
        f"HostKey {keys / 'host_key'}\n"
        f"AuthorizedKeysFile {keys / 'authorized_keys'}\n"
        f"PidFile {keys / f'sshd-{ns}.pid'}\n"
        "PermitRootLogin prohibit-password\n"
        "PasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\n"
        "UsePAM no\n"
        "StrictModes no\n"
    )
    os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, SSHD, "-D", "-e", "-f", str(config)],
        stdout=open(log_path, "w"),
        stderr=subprocess.STDOUT,
    )


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(SSHD), reason="no sshd (Debian package openssh-server)")
def test_launch_fleet_over_ssh_starts_watches_and_stops_the_hosts(hosts, tmp_path):
    keys = tmp_path / "keys"
    keys.mkdir()
    for name in ("host_key", "client_key"):
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / name)], check=True
        )
    (keys / "authorized_keys").write_text((keys / "client_key.pub").read_text())
    first, second = (hosts.addresses[ns] for ns in hosts.actors)
    daemons = [
        start_sshd(ns, hosts.addresses[ns], keys, tmp_path / f"sshd-{ns}.log")
        for ns in hosts.actors
    ]
    learner, view = start_learner(hosts, tmp_path)
    fleet_name = f"ssh-{uuid.uuid4().hex[:6]}"
    hosts_file = tmp_path / "hosts"
    hosts_file.write_text(f"root@{first} 2\n{second}\n")
    ssh_options = (
        f"-i {keys / 'client_key'} -o StrictHostKeyChecking=no "
        "-o UserKnownHostsFile=/dev/null -o LogLevel=ERROR"
    )
    # The operator's machine is the learner host: launch_fleet runs there.
    command = [
        "ip",
        "netns",
        "exec",
        hosts.learner,
        str(ROOT / "scripts" / "launch_fleet.sh"),
        "--hosts",
        str(hosts_file),
        "--ssh-options",
        ssh_options,
        "--name",
        fleet_name,
    ]
    fleet = None
    try:
        fleet = LoggedProcess(
            [
                *command,
                *fleet_start_flags("--log-interval-s", "1"),
            ],
            tmp_path / "fleet.log",
        )
        wait_until(lambda: len(view.actors()) == 3, 120, "3 actors started over ssh")
        rows = view.actors()
        assert sorted(rows) == [f"{first}-0", f"{first}-1", f"{second}-0"]
        for name, row in rows.items():
            address = first if name.startswith(first) else second
            assert row["peer"].startswith(f"ipv4:{address}:"), row
        wait_until(
            lambda: f"root@{first}" in fleet.log() and "streaming=2" in fleet.log(),
            60,
            "launch_fleet's status (over ssh) to show both actors of the first host streaming",
        )
        # Stopped from another shell: the watching launch_fleet sees every host
        # stopped and exits as stopped (130), not as finished (0).
        stopped = subprocess.run([*command, "--stop"], capture_output=True, text=True, timeout=120)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert stopped.stdout.count(" stopped") == 2, stopped.stdout
        assert fleet.wait(timeout_s=60) == 130, fleet.log()
        for ns in hosts.actors:
            assert hosts.pids(ns, running="seedrl-actor") == [], f"actors left on {ns}"
    finally:
        if fleet is not None and fleet.process.poll() is None:
            fleet.kill()
        for daemon in daemons:
            daemon.kill()
            daemon.wait(timeout=30)
        stop(learner)
        shutil.rmtree(ROOT / "runs" / "fleets" / fleet_name, ignore_errors=True)
