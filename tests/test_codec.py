from __future__ import annotations

import numpy as np
import pytest

from seedrl.codec import EnvStep, StepCodec, WireError
from seedrl.proto import seedrl_pb2
from seedrl.specs import ActionSpec, SpecError, TensorSpec

OBS = TensorSpec("uint8", (4, 84, 84))
ACTIONS = ActionSpec(6)


def make_step(num_envs: int, rng: np.random.Generator) -> EnvStep:
    return EnvStep(
        observations=rng.integers(0, 256, (num_envs, *OBS.shape), dtype=np.uint8),
        rewards=rng.normal(size=num_envs).astype(np.float32),
        terminated=rng.random(num_envs) < 0.3,
        truncated=rng.random(num_envs) < 0.3,
    )


def decode(codec: StepCodec, raw: bytes) -> EnvStep:
    return codec.decode_step(seedrl_pb2.ActorMessage.FromString(raw).step)


def test_step_round_trip_is_exact():
    rng = np.random.default_rng(0)
    codec = StepCodec(OBS, ACTIONS, num_envs=5)
    step = make_step(5, rng)
    decoded = decode(codec, codec.encode_step(step))
    for original, received in zip(step, decoded, strict=True):
        np.testing.assert_array_equal(original, received)
    assert decoded.terminated.dtype == np.bool_
    assert not decoded.observations.flags.writeable  # a view onto the message, not a copy


def test_float_observations_are_little_endian_on_the_wire():
    codec = StepCodec(TensorSpec("float32", (2,)), ActionSpec(2), num_envs=1)
    step = EnvStep(np.array([[1.0, -2.0]], ">f4"), np.zeros(1), np.zeros(1), np.zeros(1))
    raw = seedrl_pb2.ActorMessage.FromString(codec.encode_step(step)).step.observations
    assert raw == np.array([1.0, -2.0], "<f4").tobytes()


def test_actions_round_trip_and_range_check():
    codec = StepCodec(OBS, ACTIONS, num_envs=3)
    raw = codec.encode_actions(np.array([0, 5, 2]), policy_version=7)
    message = seedrl_pb2.LearnerMessage.FromString(raw)
    assert message.actions.policy_version == 7
    np.testing.assert_array_equal(codec.decode_actions(message.actions), [0, 5, 2])
    bad = seedrl_pb2.LearnerMessage.FromString(codec.encode_actions(np.array([0, 6, 2]), 1))
    with pytest.raises(WireError, match=r"outside 0\.\.5"):
        codec.decode_actions(bad.actions)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("observations", b"\0" * 100, "observations hold 100 bytes, expected 56448"),
        ("rewards", b"\0" * 4, "rewards hold 4 bytes, expected 8"),
        ("rewards", np.array([1.0, np.nan], "<f4").tobytes(), "not all finite"),
        ("terminated", b"\0\2", "terminated flags must be 0 or 1"),
        ("truncated", b"\0", "truncated hold 1 bytes, expected 2"),
    ],
)
def test_malformed_steps_are_named(field, value, message):
    codec = StepCodec(OBS, ACTIONS, num_envs=2)
    proto = seedrl_pb2.ActorMessage.FromString(
        codec.encode_step(make_step(2, np.random.default_rng(1)))
    ).step
    setattr(proto, field, value)
    with pytest.raises(WireError, match=message):
        codec.decode_step(proto)


def test_specs_check_themselves():
    assert str(OBS) == "uint8[4,84,84]"
    assert OBS.nbytes == 4 * 84 * 84
    assert TensorSpec.from_proto(OBS.to_proto()) == OBS
    with pytest.raises(SpecError, match="unknown dtype"):
        TensorSpec("uint7", (1,))
    with pytest.raises(SpecError, match="not a bool, integer or float"):
        TensorSpec("complex64", (1,))
    with pytest.raises(SpecError, match="not positive"):
        TensorSpec("float32", (0,))
    with pytest.raises(SpecError, match="at least 1"):
        ActionSpec(0)
