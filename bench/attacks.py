"""`python -m bench.attacks`: a training learner under hostile peers, an honest actor beside.

A learner trains on counting:v0 in this process, with the defaults users run
(no token, every bound and cap at its default). An honest actor process
steps 4 envs against it. Each attack runs from a process of its own, at the
lowest CPU priority (a peer on another machine would not share these
cores), for a window, after a window without it; the honest stream's env steps/s in the
two windows give the attack's ratio (a ratio in one run, since the machine
is noisy). Every attack must leave the learner training (updates go on, it
never exits) and the honest actor at half its undisturbed rate or more.
Writes OUT/attacks.json with each attack's rates, the statuses its streams
ended with, and the learner's RSS after it.

Each attack is bounded in count and in time: it stops at the window's end.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence

import grpc
import numpy as np
import tyro

from bench import machine
from learner.backends.cpu import xla_flags
from seedrl.codec import EnvStep, StepCodec
from seedrl.proto import seedrl_pb2
from seedrl.specs import PROTOCOL_VERSION
from seedrl.transport import STREAM_PATH

ENV = "counting:v0"
HONEST = "honest"
HONEST_ENVS = 4
MIN_RATIO = 0.5


def spec():
    from envs import registry

    return registry.spec(ENV)


def hello_message(**changes) -> bytes:
    """A hello for counting:v0 from a raw client, with `changes` to its fields."""
    env_spec = spec()
    fields = dict(
        protocol_version=PROTOCOL_VERSION,
        actor_id="raw-client",
        run_id="r1",
        num_envs=2,
        env_id=ENV,
        observation_spec=env_spec.observation.to_proto(),
        action_spec=env_spec.action.to_proto(),
    )
    fields.update(changes)
    return seedrl_pb2.ActorMessage(hello=seedrl_pb2.Hello(**fields)).SerializeToString()


def step_message(num_envs: int = 2, **changes) -> bytes:
    """A step of `num_envs` counting:v0 envs (zeros), with `changes` to its fields."""
    env_spec = spec()
    codec = StepCodec(env_spec.observation, env_spec.action, num_envs)
    raw = codec.encode_step(
        EnvStep(
            np.zeros((num_envs, *env_spec.observation.shape), env_spec.observation.dtype),
            np.zeros(num_envs, np.float32),
            np.zeros(num_envs, bool),
            np.zeros(num_envs, bool),
        )
    )
    message = seedrl_pb2.ActorMessage.FromString(raw)
    for name, value in changes.items():
        setattr(message.step, name, value)
    return message.SerializeToString()


# -- the attacks (each in a process of its own, until `deadline`) --------------------


def _stream(channel: grpc.Channel, messages, timeout_s: float = 30.0) -> str:
    """Sends `messages` on one stream, reads every reply; the status it ended with."""
    call = channel.stream_stream(STREAM_PATH)(iter(messages), timeout=timeout_s)
    try:
        for _ in call:
            pass
    except grpc.RpcError as error:
        return error.code().name
    return "OK"


def _repeat(address: str, deadline: float, count: int, messages: Callable[[int], list]) -> dict:
    """Up to `count` streams one after another until `deadline`, each of messages(i)."""
    codes: collections.Counter = collections.Counter()
    with grpc.insecure_channel(address) as channel:
        for index in range(count):
            if time.monotonic() > deadline:
                break
            codes[_stream(channel, messages(index))] += 1
    return dict(codes)


def _in_threads(threads: int, work: Callable[[], dict]) -> dict:
    results: list[dict] = []
    workers = [threading.Thread(target=lambda: results.append(work())) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    total: collections.Counter = collections.Counter()
    for result in results:
        total.update(result)
    return dict(total)


HUGE = np.full(2, np.finfo(np.float32).max, "<f4").tobytes()


def huge_rewards(address: str, deadline: float) -> dict:
    return _repeat(address, deadline, 2000, lambda _: [hello_message(), step_message(rewards=HUGE)])


def non_finite_values(address: str, deadline: float) -> dict:
    bad = np.array([np.nan, np.inf], "<f4").tobytes()
    return _repeat(address, deadline, 2000, lambda _: [hello_message(), step_message(rewards=bad)])


def silent_hellos(address: str, deadline: float) -> dict:
    """200 streams of 64 envs that send their hello and then nothing until the window ends
    (the learner's idle timeout, 300 s by default, is longer than the window)."""
    release = threading.Event()

    def silent(index: int):
        yield hello_message(actor_id=f"silent-{index}", num_envs=64)
        release.wait(max(0.0, deadline - time.monotonic()))

    codes: collections.Counter = collections.Counter()
    with grpc.insecure_channel(address) as channel:
        calls = [channel.stream_stream(STREAM_PATH)(silent(i), timeout=120) for i in range(200)]
        for call in calls:
            try:
                next(call)  # the welcome
                codes["welcomed, then silent"] += 1
            except grpc.RpcError as error:
                codes[error.code().name] += 1
        release.wait(max(0.0, deadline - time.monotonic()))
        release.set()
        for call in calls:
            call.cancel()
    return dict(codes)


def dtype_strings(address: str, deadline: float) -> dict:
    """Four streams at a time, each a hello whose dtype name is 1 MB."""

    def work():
        def messages(_):
            env_spec = spec()
            observation = env_spec.observation.to_proto()
            observation.dtype = "f" * 1_000_000
            return [hello_message(observation_spec=observation)]

        return _repeat(address, deadline, 100, messages)

    return _in_threads(4, work)


def forged_names(address: str, deadline: float) -> dict:
    """Actor ids and host names with a newline and a forged log line, or terminal escapes."""
    names = ["x\n2026-01-01 00:00:00 INFO forged line", "\x1b[2J\x1b[31mred", "y" * 10_000]
    return _repeat(
        address,
        deadline,
        1000,
        lambda i: [hello_message(actor_id=names[i % 3], hostname=names[(i + 1) % 3])],
    )


def huge_env_id(address: str, deadline: float) -> dict:
    return _repeat(address, deadline, 200, lambda _: [hello_message(env_id="E" * 900_000)])


def repeated_fields(address: str, deadline: float) -> dict:
    """A valid encoding with every step's fields sent twice (protobuf merges them): a stream
    that is accepted and steps on until the window ends."""
    once = step_message()
    twice = seedrl_pb2.ActorMessage.FromString(once)
    encoded = twice.SerializeToString() + twice.SerializeToString()

    def messages(_):
        def stream():
            yield hello_message(actor_id="twice")
            while time.monotonic() < deadline:
                yield encoded

        return stream()

    return _repeat(address, deadline, 1, messages)


def id_takeover(address: str, deadline: float) -> dict:
    """Hellos with the honest actor's id from another host and process."""
    return _repeat(
        address,
        deadline,
        500,
        lambda _: [hello_message(actor_id=HONEST, hostname="elsewhere", pid=1), step_message()],
    )


def reconnects(address: str, deadline: float) -> dict:
    """500 streams, each a hello, one step, and a close."""
    return _repeat(
        address, deadline, 500, lambda i: [hello_message(actor_id=f"r{i}"), step_message()]
    )


def oversized(address: str, deadline: float) -> dict:
    """Messages past the learner's 64 MiB limit."""
    big = b"\x0a" + b"\xff" * 70_000_000
    return _repeat(address, deadline, 3, lambda _: [big])


def garbage(address: str, deadline: float) -> dict:
    rng = np.random.default_rng(0)
    return _repeat(
        address,
        deadline,
        2000,
        lambda _: [
            hello_message(),
            rng.integers(0, 256, int(rng.integers(1, 4096)), np.uint8).tobytes(),
        ],
    )


ATTACKS: dict[str, Callable[[str, float], dict]] = {
    "huge rewards": huge_rewards,
    "NaN and inf rewards": non_finite_values,
    "200 silent hellos of 64 envs": silent_hellos,
    "1 MB dtype names, 4 at a time": dtype_strings,
    "forged names (log injection)": forged_names,
    "900 KB env id": huge_env_id,
    "steps with repeated fields": repeated_fields,
    "the honest actor's id from elsewhere": id_takeover,
    "500 reconnects": reconnects,
    "70 MB messages": oversized,
    "garbage after the hello": garbage,
}


def _attack_main(name: str, address: str, window_s: float, connection) -> None:
    # The lowest CPU priority: the attacker stands in for a peer on a machine of its own,
    # so what is measured is what the attack costs the learner, not what the attacker's
    # own loop takes from the cores it shares here with the learner and the honest actor.
    os.nice(19)
    # The window starts once this process is up: at that priority, on cores the learner
    # keeps busy, its start can take longer than a short window.
    connection.send("ready")
    try:
        connection.send(ATTACKS[name](address, time.monotonic() + window_s))
    except BaseException as error:  # reported, not raised: the window goes on
        connection.send({"attacker failed": f"{type(error).__name__}: {error}"[:200]})


# -- the measurement (this process) -----------------------------------------------


@dataclasses.dataclass(frozen=True)
class AttacksConfig:
    """A training learner under each attack in turn, an honest actor beside it."""

    window_s: float = 10.0
    """Length of each attack's window, and of the undisturbed window before it."""
    attacks: tuple[str, ...] = ()
    """Which attacks (names as listed in the output); empty: all."""
    out_dir: str = ""
    """Where attacks.json goes; empty: runs/attacks-TIME."""


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _honest_steps(learner) -> int:
    streams = [s for s in list(learner.service.streams.values()) if s.actor_id == HONEST]
    return sum(s.steps * s.num_envs for s in streams)


class _Rate:
    """The honest actor's env steps over a window (its stream may reconnect meanwhile)."""

    def __init__(self, learner):
        self._learner = learner
        self._steps = 0
        self._last = _honest_steps(learner)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._started = time.monotonic()
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(0.05):
            now = _honest_steps(self._learner)
            # A new stream counts from 0: take its steps whole.
            self._steps += now - self._last if now >= self._last else now
            self._last = now

    def per_s(self) -> float:
        self._stop.set()
        self._thread.join()
        return self._steps / (time.monotonic() - self._started)


def run(config: AttacksConfig) -> dict:
    from learner.learner import Learner
    from learner.presets import preset_for
    from learner.tools.background import BackgroundLearner

    names = list(config.attacks) or list(ATTACKS)
    unknown = [name for name in names if name not in ATTACKS]
    if unknown:
        raise SystemExit(f"unknown attacks {unknown}; known: {list(ATTACKS)}")
    run_dir = tempfile.mkdtemp(prefix="seedrl-attacks-")
    learner = Learner(
        dataclasses.replace(
            preset_for(ENV),
            port=0,
            http_port=0,
            bind_address="127.0.0.1",
            run_dir=run_dir,
            total_env_steps=10**15,
        ),
        console=False,
    )
    learner.compile()
    served = BackgroundLearner(learner, train=True).start()
    actor_log = open(os.path.join(run_dir, "honest.log"), "w")  # noqa: SIM115 - the child's
    honest = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "actors.main",
            "--learner",
            served.address,
            "--env",
            ENV,
            "--num-envs",
            str(HONEST_ENVS),
            "--actor-id",
            HONEST,
        ],
        stdout=actor_log,
        stderr=subprocess.STDOUT,
    )
    context = multiprocessing.get_context("spawn")
    results = []
    try:
        deadline = time.monotonic() + 120
        while learner.stats.updates < 20:
            if time.monotonic() > deadline or honest.poll() is not None:
                raise RuntimeError("the honest actor was not served within 120 s")
            time.sleep(0.1)
        for name in names:
            rate = _Rate(learner)
            time.sleep(config.window_s)
            undisturbed = rate.per_s()
            updates = learner.stats.updates
            mine, theirs = context.Pipe()
            attacker = context.Process(
                target=_attack_main, args=(name, served.address, config.window_s, theirs)
            )
            attacker.start()
            if not mine.poll(120):
                attacker.kill()
                raise RuntimeError(f"the attacker of {name!r} did not start within 120 s")
            mine.recv()
            rate = _Rate(learner)
            ended = mine.recv() if mine.poll(config.window_s + 120) else {"no report": 1}
            attacked = rate.per_s()
            attacker.join(timeout=30)
            if attacker.is_alive():
                attacker.kill()
            result = {
                "attack": name,
                "honest_steps_per_s_undisturbed": round(undisturbed, 1),
                "honest_steps_per_s_attacked": round(attacked, 1),
                "ratio": round(attacked / undisturbed, 3) if undisturbed else None,
                "updates_during": learner.stats.updates - updates,
                "learner_running": served.wait(0) is None,
                "honest_actor_running": honest.poll() is None,
                "streams_ended": ended,
                "learner_rss_mb": round(_rss_mb()),
            }
            results.append(result)
            print(
                f"attacks: {name:38s} honest {undisturbed:7.0f} -> {attacked:7.0f} env steps/s "
                f"({result['ratio']}), {result['updates_during']} updates, ended {ended}, "
                f"RSS {result['learner_rss_mb']} MB",
                flush=True,
            )
    finally:
        honest.kill()
        honest.wait()
        actor_log.close()
        served.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
    return {"attacks": results, "stream_errors": learner.stats.stream_error_counts()}


def held(result: dict) -> bool:
    """Whether the learner held the attack: it trained on, never exited, and the honest
    actor ran at half its undisturbed rate or more."""
    return (
        result["learner_running"]
        and result["honest_actor_running"]
        and result["updates_during"] > 0
        and (result["ratio"] or 0) >= MIN_RATIO
    )


def main(argv: Sequence[str] | None = None) -> int:
    config = tyro.cli(AttacksConfig, args=argv, prog="python -m bench.attacks")
    xla_flags.apply()  # before JAX starts, as seedrl-learner does
    out_dir = os.path.abspath(
        config.out_dir or os.path.join("runs", time.strftime("attacks-%Y%m%d-%H%M%S"))
    )
    os.makedirs(out_dir, exist_ok=True)
    outcome = run(config)
    failed = [r["attack"] for r in outcome["attacks"] if not held(r)]
    with open(os.path.join(out_dir, "attacks.json"), "w") as file:
        json.dump({**machine.context(dataclasses.asdict(config)), **outcome}, file, indent=2)
        file.write("\n")
    print(f"attacks: wrote {os.path.join(out_dir, 'attacks.json')}", flush=True)
    if failed:
        print(f"attacks: NOT held: {failed}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
