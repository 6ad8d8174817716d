"""Malformed streams end with a status that names the fault; the learner serves on.

A raw gRPC client sends each bad case while a real actor process keeps
training on the same learner; afterwards that actor must still be served.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading

import grpc
import numpy as np
import pytest

from bench.attacks import hello_message as hello
from bench.attacks import step_message as step
from seedrl.proto import seedrl_pb2
from seedrl.specs import TensorSpec
from seedrl.transport import REFUSAL_FINAL, REFUSAL_KEY, REFUSAL_RETRY, STREAM_PATH
from tests.fleet import LearnerThread, learner_config, spawn_actor, wait_until

ENV = "counting:v0"


OFFSET_0 = np.array([0], "<u4").tobytes()
WORD_0 = np.zeros(1, "<u8").tobytes()


def changed_after_a_step(words: list[float]) -> list[bytes]:
    """A stream that agreed on observation changes, sent one step whole, and then a step
    changing the first word to `words` (two float32)."""
    changes = step(
        observations=b"",
        changed_offsets=OFFSET_0,
        changed_words=np.array(words, "<f4").tobytes(),
    )
    return [hello(observation_changes=True), step(), changes]


CASES = {
    "garbage instead of a hello": (
        [b"\xff\xff\xff\xff garbage"],
        grpc.StatusCode.INVALID_ARGUMENT,
        "the first message is not a valid ActorMessage",
    ),
    "empty first message": (
        [b""],
        grpc.StatusCode.INVALID_ARGUMENT,
        "the first message must be a hello, got an empty message",
    ),
    "a step before the hello": (
        [step()],
        grpc.StatusCode.INVALID_ARGUMENT,
        "the first message must be a hello, got step",
    ),
    "unknown protocol version": (
        [hello(protocol_version=99)],
        grpc.StatusCode.FAILED_PRECONDITION,
        "protocol version 99 is not supported",
    ),
    "another env": (
        [hello(env_id="atari:Pong")],
        grpc.StatusCode.FAILED_PRECONDITION,
        "env 'atari:Pong' does not match the learner's env 'counting:v0'",
    ),
    "wrong observation dtype": (
        [hello(observation_spec=TensorSpec("float64", (6,)).to_proto())],
        grpc.StatusCode.FAILED_PRECONDITION,
        "observation spec float64[6] does not match the learner's float32[6]",
    ),
    "an observation dtype numpy cannot parse": (
        [hello(observation_spec=seedrl_pb2.TensorSpec(dtype="[('a', 'f4'", shape=[6]))],
        grpc.StatusCode.INVALID_ARGUMENT,
        "bad spec in hello: unknown dtype \"[('a', 'f4'\"; dtypes: bool,",
    ),
    "an actor id that forges a log line": (
        [hello(actor_id="x\n2026-01-01 00:00:00 INFO forged \x1b[2J")],
        grpc.StatusCode.INVALID_ARGUMENT,
        "the hello's actor_id must be at most 128 printable characters, got 'x\\n2026-01-01",
    ),
    "a host name of a megabyte": (
        [hello(hostname="h" * 1_000_000)],
        grpc.StatusCode.INVALID_ARGUMENT,
        "the first message is 1,000,",
    ),
    "a host name of 60,000 characters": (
        [hello(hostname="h" * 60_000)],
        grpc.StatusCode.INVALID_ARGUMENT,
        "the hello's hostname must be at most 128 printable characters, got 'hhh",
    ),
    "an env id of 60,000 characters": (
        [hello(env_id="e" * 60_000)],
        grpc.StatusCode.FAILED_PRECONDITION,
        "e'... (60000 characters) does not match the learner's env 'counting:v0'",
    ),
    "the id of a connected actor, from another process": (
        [hello(actor_id="honest")],
        grpc.StatusCode.ALREADY_EXISTS,
        "actor 'honest' is connected and stepping, from another process",
    ),
    "zero envs": (
        [hello(num_envs=0)],
        grpc.StatusCode.INVALID_ARGUMENT,
        "num_envs 0 is outside",
    ),
    "observations of the wrong size": (
        [hello(), step(observations=b"\0" * 10)],
        grpc.StatusCode.INVALID_ARGUMENT,
        "step 1: observations hold 10 bytes, expected 48 (2 envs x float32[6])",
    ),
    "observations for the wrong number of envs": (
        [hello(), step(num_envs=3)],
        grpc.StatusCode.INVALID_ARGUMENT,
        "observations hold 72 bytes, expected 48",
    ),
    "a non-finite reward": (
        [hello(), step(rewards=np.array([0.0, np.inf], "<f4").tobytes())],
        grpc.StatusCode.INVALID_ARGUMENT,
        "rewards are not all finite",
    ),
    "a finite but huge reward": (
        [hello(), step(rewards=np.array([0.0, np.finfo(np.float32).max], "<f4").tobytes())],
        grpc.StatusCode.INVALID_ARGUMENT,
        "step 1: rewards reach 3.403e+38, beyond the learner's bound of 1e+06 (--max-abs-reward)",
    ),
    "a finite but huge observation": (
        [hello(), step(observations=np.array([0.0] * 11 + [-2e9], "<f4").tobytes())],
        grpc.StatusCode.INVALID_ARGUMENT,
        "observations reach 2e+09, beyond the learner's bound of 1e+08 (--max-abs-observation)",
    ),
    "a non-finite observation": (
        [hello(), step(observations=np.array([0.0] * 11 + [np.nan], "<f4").tobytes())],
        grpc.StatusCode.INVALID_ARGUMENT,
        "observations are not all finite",
    ),
    "observation changes the stream did not agree on": (
        [hello(), step(changed_offsets=OFFSET_0, changed_words=WORD_0)],
        grpc.StatusCode.INVALID_ARGUMENT,
        "step 1: the step carries observation changes, which this stream did not agree on",
    ),
    "observation changes before whole observations": (
        [hello(observation_changes=True), step(observations=b"", changed_offsets=OFFSET_0)],
        grpc.StatusCode.INVALID_ARGUMENT,
        "step 1: the step carries observation changes before any whole observations",
    ),
    "observation changes beside whole observations": (
        [hello(observation_changes=True), step(changed_offsets=OFFSET_0, changed_words=WORD_0)],
        grpc.StatusCode.INVALID_ARGUMENT,
        "step 1: the step carries both observations and observation changes",
    ),
    "an observation change past the observations": (
        [
            hello(observation_changes=True),
            step(),
            step(
                observations=b"",
                changed_offsets=np.array([6], "<u4").tobytes(),  # 2 envs x 24 bytes: 6 words
                changed_words=WORD_0,
            ),
        ],
        grpc.StatusCode.INVALID_ARGUMENT,
        "step 2: changed offset 6 is past the observations' 6 words",
    ),
    "a non-finite observation change": (
        changed_after_a_step([0.0, np.nan]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "step 2: observation changes are not all finite",
    ),
    "a finite but huge observation change": (
        changed_after_a_step([0.0, 3e38]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "step 2: observation changes reach 3e+38, beyond the learner's bound of 1e+08",
    ),
    "a second hello": (
        [hello(), step(), hello()],
        grpc.StatusCode.INVALID_ARGUMENT,
        "message 2 must be a step, got hello",
    ),
    "garbage after the hello": (
        [hello(), b"\xff\xff\xff"],
        grpc.StatusCode.INVALID_ARGUMENT,
        "message 1 is not a valid ActorMessage",
    ),
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A training learner with one real actor working against it."""
    tmp = tmp_path_factory.mktemp("bad-input")
    fleet = LearnerThread(learner_config(ENV, tmp / "run"), train=True).start()
    actor = spawn_actor(fleet.address, ENV, 2, "honest", tmp / "actors")
    wait_until(lambda: fleet.learner.stats.env_steps > 100, 60, "the honest actor to be served")
    yield fleet
    actor.kill()
    fleet.stop()


def send_raw(address: str, messages: list[bytes]) -> grpc.RpcError:
    with grpc.insecure_channel(address) as channel:
        call = channel.stream_stream(STREAM_PATH)(iter(messages), timeout=30)
        with pytest.raises(grpc.RpcError) as caught:
            for _ in call:
                pass
    return caught.value


@pytest.mark.parametrize("case", list(CASES))
def test_a_malformed_stream_is_ended_with_a_named_fault(served, case):
    messages, code, text = CASES[case]
    stats = served.learner.stats
    steps_before = stats.env_steps
    counted_before = stats.stream_error_counts().get(code.name, 0)
    error = send_raw(served.address, messages)
    assert error.code() == code, error.details()
    assert text in error.details()
    assert len(error.details()) < 400  # never the peer's input at length
    # The actor exits on a final refusal; a taken id may free up, so that one is retried.
    verdict = REFUSAL_RETRY if code == grpc.StatusCode.ALREADY_EXISTS else REFUSAL_FINAL
    assert dict(error.trailing_metadata())[REFUSAL_KEY] == verdict
    # Counted in the metrics under its status code.
    assert stats.stream_error_counts()[code.name] == counted_before + 1
    # The honest actor is still served, and the learner still trains.
    updates_before = stats.updates
    wait_until(lambda: stats.env_steps > steps_before + 50, 30, "the honest actor to go on")
    wait_until(lambda: stats.updates > updates_before, 30, "training to go on")
    assert [s.actor_id for s in served.learner.service.streams.values()] == ["honest"]


def test_a_silent_stream_is_ended_at_the_hello_timeout(tmp_path):
    config = dataclasses.replace(learner_config(ENV, tmp_path / "run"), hello_timeout_s=0.5)
    fleet = LearnerThread(config, train=False).start()
    try:
        with grpc.insecure_channel(fleet.address) as channel:
            blocker = threading.Event()

            def silent():
                blocker.wait(10)  # sends nothing, holds the stream open
                return
                yield

            call = channel.stream_stream(STREAM_PATH)(silent(), timeout=30)
            with pytest.raises(grpc.RpcError) as caught:
                for _ in call:
                    pass
            blocker.set()
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "no hello within 0.5 s" in caught.value.details()
        assert fleet.learner.stats.rejected_streams == 1
    finally:
        fleet.stop()


def test_a_hello_after_training_finished_ends_with_ok(tmp_path):
    fleet = LearnerThread(learner_config(ENV, tmp_path / "run"), train=False).start()
    try:
        fleet.learner.service.stop_serving(finished=True)
        with grpc.insecure_channel(fleet.address) as channel:
            call = channel.stream_stream(STREAM_PATH)(iter([hello()]), timeout=30)
            replies = list(call)  # raises on any status but OK
        assert replies == []
        assert call.code() == grpc.StatusCode.OK
        assert fleet.learner.stats.rejected_streams == 0
    finally:
        fleet.stop()


@pytest.mark.parametrize("steps", [0, 1])
def test_a_stream_that_goes_silent_after_a_reply_is_ended(served_small_timeout, steps):
    """After the welcome (steps 0: a hello and nothing more) or after actions."""
    fleet = served_small_timeout
    blocker = threading.Event()

    def silence_after_the_steps():
        yield hello()
        for _ in range(steps):
            yield step()
        blocker.wait(30)  # holds the stream open, owing its next step

    with grpc.insecure_channel(fleet.address) as channel:
        call = channel.stream_stream(STREAM_PATH)(silence_after_the_steps(), timeout=60)
        replies = []
        with pytest.raises(grpc.RpcError) as caught:
            for reply in call:
                replies.append(reply)
        blocker.set()
    assert len(replies) == 1 + steps  # the welcome, and the actions of each step
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "no step for 1 s after the learner's last reply" in caught.value.details()
    stats = fleet.learner.stats
    assert stats.stream_error_counts()["DEADLINE_EXCEEDED"] == 1
    # Its slots are freed (just after the status left); the honest actor is served on.
    wait_until(
        lambda: [s.actor_id for s in fleet.learner.service.streams.values()] == ["honest"],
        10,
        "the silent stream to be released",
    )
    steps = stats.env_steps
    wait_until(lambda: stats.env_steps > steps + 50, 30, "the honest actor to go on")


def test_an_oversized_message_is_refused_before_it_is_buffered(served_small_timeout):
    fleet = served_small_timeout
    oversized = step(observations=b"\0" * 200_000)  # the limit here is 0.1 MiB
    error = send_raw(fleet.address, [hello(), oversized])
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
    assert "larger than max" in error.details()
    stats = fleet.learner.stats
    steps = stats.env_steps
    wait_until(lambda: stats.env_steps > steps + 50, 30, "the honest actor to go on")


@pytest.fixture
def served_small_timeout(tmp_path):
    """A learner with a 1 s idle timeout and a 0.1 MiB message limit, one honest actor."""
    config = learner_config(ENV, tmp_path / "run", stream_idle_timeout_s=1.0, max_message_mb=0.1)
    fleet = LearnerThread(config, train=False).start()
    drain = threading.Event()

    def drain_unrolls():
        while not drain.is_set():
            with contextlib.suppress(queue.Empty):
                fleet.learner.unrolls.get(timeout=0.1)

    drainer = threading.Thread(target=drain_unrolls)
    drainer.start()
    actor = spawn_actor(fleet.address, ENV, 2, "honest", tmp_path / "actors")
    wait_until(lambda: fleet.learner.stats.env_steps > 100, 60, "the honest actor to be served")
    yield fleet
    actor.kill()
    fleet.stop()
    drain.set()
    drainer.join()


def test_hellos_past_the_caps_on_streams_and_env_slots_are_refused(tmp_path):
    config = learner_config(ENV, tmp_path / "run", max_streams=2, max_env_slots=5)
    fleet = LearnerThread(config, train=False).start()
    release = threading.Event()
    service = fleet.learner.service
    try:
        with grpc.insecure_channel(fleet.address) as channel:
            open_stream = channel.stream_stream(STREAM_PATH)

            def held(actor_id: str):
                yield hello(actor_id=actor_id, num_envs=2)
                release.wait(30)

            calls = [open_stream(held("held-1"), timeout=60)]
            wait_until(lambda: len(service.streams) == 1, 10, "the first stream")
            error = send_raw(fleet.address, [hello(actor_id="wide", num_envs=4)])
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert error.details() == (
                "4 envs more would pass the learner's cap of 5 env slots (--max-env-slots); "
                "2 are taken"
            )
            calls.append(open_stream(held("held-2"), timeout=60))
            wait_until(lambda: len(service.streams) == 2, 10, "the second stream")
            error = send_raw(fleet.address, [hello(actor_id="third", num_envs=1)])
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert error.details() == "the learner serves 2 streams, its cap (--max-streams)"
            assert fleet.learner.stats.stream_error_counts()["RESOURCE_EXHAUSTED"] == 2
            release.set()
            for call in calls:
                call.cancel()
        wait_until(lambda: not service.streams, 10, "the held streams to end")
        assert fleet.learner.stats.connected_envs == 0  # the slots counted are given back
    finally:
        release.set()
        fleet.stop()


def test_an_unforeseen_failure_ends_its_stream_with_internal_and_no_repr(tmp_path, monkeypatch):
    import learner.serving.server

    def broken_check(*args, **kwargs):
        raise KeyError("x" * 10_000)  # stands in for a path no check foresaw

    monkeypatch.setattr(learner.serving.server, "check_hello", broken_check)
    fleet = LearnerThread(learner_config(ENV, tmp_path / "run"), train=False).start()
    try:
        error = send_raw(fleet.address, [hello()])
        assert error.code() == grpc.StatusCode.INTERNAL
        assert error.details() == "the learner failed on this stream (KeyError)"
        assert fleet.learner.stats.stream_error_counts()["INTERNAL"] == 1
        # A real actor takes the learner's verdict, final, over its own view of INTERNAL
        # (which it would retry): it exits instead of reconnecting for ever.
        actor = spawn_actor(fleet.address, ENV, 2, "doomed", tmp_path / "actors")
        try:
            assert actor.wait(timeout_s=60) == 2, actor.log()
        finally:
            actor.kill()
        assert "INTERNAL: the learner failed on this stream (KeyError)" in actor.log()
    finally:
        fleet.stop()


def test_a_stream_whose_data_makes_updates_non_finite_ends_and_training_goes_on(tmp_path):
    """With the reward bound lifted, float32's largest rewards pass the step check and make
    the loss overflow. The skipped updates name that stream, it ends, and neither the
    honest actor nor training stops (without the check the learner exits after 10)."""
    config = learner_config(ENV, tmp_path / "run", max_abs_reward=float(np.finfo(np.float32).max))
    fleet = LearnerThread(config, train=True).start()
    actor = spawn_actor(fleet.address, ENV, 2, "honest", tmp_path / "actors")
    try:
        stats = fleet.learner.stats
        wait_until(lambda: stats.updates > 0, 60, "the honest actor's first update")
        huge = np.full(2, np.finfo(np.float32).max, "<f4").tobytes()
        # Far more steps than the unrolls that can be trained on before the stream ends.
        error = send_raw(fleet.address, [hello(actor_id="hostile"), *[step(rewards=huge)] * 20_000])
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
        assert error.details().startswith("the data of this stream made update "), error.details()
        assert error.details().endswith(" non-finite")
        assert stats.skipped_updates > 0
        steps, updates = stats.env_steps, stats.updates
        wait_until(lambda: stats.updates > updates + 20, 60, "training to go on")
        wait_until(lambda: stats.env_steps > steps + 50, 30, "the honest actor to go on")
        assert [s.actor_id for s in fleet.learner.service.streams.values()] == ["honest"]
        assert fleet.wait(0) is None  # still running
    finally:
        actor.kill()
        fleet.stop()


def test_silent_streams_do_not_hold_batches_back(served):
    """Streams that send a hello and nothing more, or one step and then nothing, are not
    waited for: the batcher counts on the honest actor's stream alone (otherwise every
    batch waits out the batcher's timeout, and the honest actor's round trips with it)."""
    service = served.learner.service
    batcher = served.learner.batcher
    release = threading.Event()
    try:
        with grpc.insecure_channel(served.address) as channel:
            open_stream = channel.stream_stream(STREAM_PATH)

            def silent(actor_id: str, steps: int):
                yield hello(actor_id=actor_id)
                yield from [step()] * steps
                release.wait(30)

            calls = [open_stream(silent(f"silent-{i}", 0), timeout=60) for i in range(20)]
            calls.append(open_stream(silent("stalled", 1), timeout=60))
            wait_until(lambda: len(service.streams) == 22, 30, "the silent streams")
            # The stalled one is counted from its step until it has owed the next for 1 s.
            wait_until(lambda: batcher.streams == 1, 10, "the batcher to count one stream")
            assert [s.actor_id for s in service.streams.values() if s.stepping] == ["honest"]
            release.set()
            for call in calls:
                call.cancel()
        wait_until(lambda: len(service.streams) == 1, 30, "the silent streams to end")
        assert batcher.streams == 1
    finally:
        release.set()
