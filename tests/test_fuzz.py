"""Fuzzing of the learner's decoders: whatever bytes a peer sends as its hello or its steps,
the learner's reading of them ends in a named refusal (StreamRefused, WireError) or a
decoded message, never another exception, and fast.

Random and mutated messages (valid ones with bytes flipped, cut, repeated or inserted)
go through the same calls the stream handler makes. SEEDRL_FUZZ_EXAMPLES sets the
examples per test (a long run: 100000 or more).
"""

from __future__ import annotations

import os
import types

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envs import registry
from learner.serving.hello import StreamRefused, check_hello, parse_message
from learner.serving.server import LearnerService
from seedrl.codec import EnvStep, StepCodec, WireError, observation_changes_allowed
from seedrl.proto import seedrl_pb2
from seedrl.specs import PROTOCOL_VERSION

EXAMPLES = int(os.environ.get("SEEDRL_FUZZ_EXAMPLES", "4000"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=2000,  # ms per example: a decoder that hangs on some input fails here
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=EXAMPLES <= 5000,  # CI's runs are reproducible; long runs explore afresh
    database=None,
)
MAX_ENVS = 256
ENVS = ("counting:v0", "counting:wide", "atari:Pong")


def valid_hello(env_id: str, num_envs: int, changes: bool) -> bytes:
    spec = registry.spec(env_id)
    hello = seedrl_pb2.Hello(
        protocol_version=PROTOCOL_VERSION,
        actor_id="fuzz",
        run_id="r",
        num_envs=num_envs,
        env_id=env_id,
        observation_spec=spec.observation.to_proto(),
        action_spec=spec.action.to_proto(),
        hostname="host",
        pid=1,
        observation_changes=changes,
    )
    return seedrl_pb2.ActorMessage(hello=hello).SerializeToString()


def valid_step(codec: StepCodec, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    spec = codec.observation_spec
    k = codec.num_envs
    observations = rng.integers(0, 255, (k, *spec.shape)).astype(spec.np_dtype)
    return codec.encode_step(
        EnvStep(
            observations,
            rng.normal(size=k).astype(np.float32),
            rng.random(k) < 0.1,
            rng.random(k) < 0.1,
        )
    )


@st.composite
def mutated(draw, base: bytes) -> bytes:
    """`base` with a few edits: bytes changed, a span cut, repeated or inserted."""
    data = bytearray(base)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["set", "cut", "repeat", "insert", "truncate"]))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if kind == "set" and data:
            data[at] = draw(st.integers(0, 255))
        elif kind == "cut":
            del data[at : at + draw(st.integers(1, 16))]
        elif kind == "repeat":
            data[at:at] = data[at : at + draw(st.integers(1, 64))]
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        else:
            del data[at:]
    return bytes(data)


def read_hello(raw: bytes, env_id: str) -> None:
    """What the handler does with a stream's first message."""
    try:
        check_hello(parse_message(raw, "the first message"), registry.spec(env_id), MAX_ENVS)
    except StreamRefused as refusal:
        assert len(str(refusal)) < 1000, str(refusal)[:200]


def read_step(codec: StepCodec, raw: bytes) -> None:
    """What the handler does with a step message."""
    try:
        step = codec.decode_step_message(raw)
        if step is None:
            step = codec.decode_step(LearnerService._step_of(raw, types.SimpleNamespace(steps=0)))
    except (StreamRefused, WireError) as refusal:
        assert len(str(refusal)) < 1000, str(refusal)[:200]
        return
    k = codec.num_envs
    assert step.observations.shape == (k, *codec.observation_spec.shape)
    assert step.rewards.shape == step.terminated.shape == step.truncated.shape == (k,)
    assert np.isfinite(step.rewards).all()


@FUZZ
@given(env_id=st.sampled_from(ENVS), data=st.data())
def test_any_first_message_is_a_hello_or_a_named_refusal(env_id, data):
    base = valid_hello(env_id, data.draw(st.integers(1, 300)), data.draw(st.booleans()))
    raw = data.draw(st.one_of(st.binary(max_size=512), mutated(base)))
    read_hello(raw, env_id)


@FUZZ
@given(
    env_id=st.sampled_from(ENVS),
    dtype=st.one_of(
        st.text(max_size=40),
        st.text(alphabet="fiubUSVM<>|=,:()[]'0123456789 ", max_size=16),  # numpy's syntax
        st.sampled_from(["uint8", "float32", "i4,(2", "f4,f4"]),
    ),
    shape=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=12),
    num_actions=st.integers(-(2**31), 2**31 - 1),
    names=st.lists(st.text(max_size=200), min_size=4, max_size=4),
)
def test_any_hello_fields_are_accepted_or_refused_by_name(env_id, dtype, shape, num_actions, names):
    hello = seedrl_pb2.Hello(
        protocol_version=PROTOCOL_VERSION,
        actor_id=names[0],
        run_id=names[1],
        hostname=names[2],
        env_id=names[3] if len(names[3]) % 2 else env_id,
        num_envs=8,
        observation_spec=seedrl_pb2.TensorSpec(dtype=dtype, shape=shape),
        action_spec=seedrl_pb2.ActionSpec(num_actions=num_actions),
    )
    read_hello(seedrl_pb2.ActorMessage(hello=hello).SerializeToString(), env_id)


@FUZZ
@given(
    env_id=st.sampled_from(ENVS),
    num_envs=st.integers(1, 8),
    changes=st.booleans(),
    data=st.data(),
)
def test_any_step_message_decodes_or_is_refused_by_name(env_id, num_envs, changes, data):
    spec = registry.spec(env_id)
    changes = changes and observation_changes_allowed(spec.observation, num_envs)
    codec = StepCodec(spec.observation, spec.action, num_envs, observation_changes=changes)
    sender = StepCodec(spec.observation, spec.action, num_envs, observation_changes=changes)
    first = valid_step(sender, 0)
    read_step(codec, first)  # primes the stream's copy where it takes changes
    base = valid_step(sender, data.draw(st.integers(1, 2**16)))
    raw = data.draw(st.one_of(st.binary(max_size=2048), mutated(base), mutated(base + base)))
    read_step(codec, raw)
