from __future__ import annotations

import numpy as np
import pytest

from seedrl.codec import (
    EnvStep,
    StepCodec,
    WireError,
    encode_actions_message,
    observation_changes_allowed,
    varint,
)
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
    raw = encode_actions_message(np.array([0, 5, 2]), policy_version=7)
    message = seedrl_pb2.LearnerMessage.FromString(raw)
    assert message.actions.policy_version == 7
    np.testing.assert_array_equal(codec.decode_actions(message.actions), [0, 5, 2])
    bad = seedrl_pb2.LearnerMessage.FromString(encode_actions_message(np.array([0, 6, 2]), 1))
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
    with pytest.raises(SpecError, match="unknown dtype 'complex64'; dtypes: bool, float16"):
        TensorSpec("complex64", (1,))
    with pytest.raises(SpecError, match="not positive"):
        TensorSpec("float32", (0,))
    with pytest.raises(SpecError, match="rank 9; the most is 8"):
        TensorSpec("uint8", (1,) * 9)
    with pytest.raises(SpecError, match="more than 67108864 elements"):
        TensorSpec("uint8", (1 << 14, 1 << 13))
    assert TensorSpec(np.dtype(">f4"), (2,)).dtype == "float32"  # any byte order's name


@pytest.mark.parametrize(
    "name",
    # numpy's parser raises ValueError, SyntaxError or TypeError on these, or takes
    # seconds and memory on a long one; none may reach it.
    ["(", "i4,(2", "[('a', 'f4')]", "f4,f4", "S10", "O", "<U3", "float32 ", "x" * 1_000_000, ""],
)
def test_only_the_listed_dtype_names_reach_numpy(name):
    with pytest.raises(SpecError, match="unknown dtype") as caught:
        TensorSpec(name, (1,))
    assert len(str(caught.value)) < 300
    with pytest.raises(SpecError, match="at least 1"):
        ActionSpec(0)


# -- the hand-written wire format of the hot messages ------------------------


def protobuf_step(step: EnvStep) -> bytes:
    """What the generated protobuf code writes for `step`."""
    return seedrl_pb2.ActorMessage(
        step=seedrl_pb2.Step(
            observations=np.ascontiguousarray(step.observations).tobytes(),
            rewards=np.asarray(step.rewards, "<f4").tobytes(),
            terminated=np.asarray(step.terminated, np.uint8).tobytes(),
            truncated=np.asarray(step.truncated, np.uint8).tobytes(),
        )
    ).SerializeToString()


@pytest.mark.parametrize("num_envs", [1, 3, 16])
def test_encode_step_writes_exactly_what_protobuf_writes(num_envs):
    step = make_step(num_envs, np.random.default_rng(num_envs))
    codec = StepCodec(OBS, ACTIONS, num_envs)
    assert codec.encode_step(step) == protobuf_step(step)


@pytest.mark.parametrize("version", [0, 1, 127, 128, 2**40, -1])
def test_actions_message_is_what_protobuf_writes(version):
    actions = np.array([0, 5, 2, 3], np.int32)
    expected = seedrl_pb2.LearnerMessage(
        actions=seedrl_pb2.Actions(actions=actions.tobytes(), policy_version=version)
    ).SerializeToString()
    assert encode_actions_message(actions, version) == expected


def test_fast_decode_is_a_view_onto_the_received_bytes():
    step = make_step(4, np.random.default_rng(1))
    codec = StepCodec(OBS, ACTIONS, 4)
    raw = protobuf_step(step)
    decoded = codec.decode_step_message(raw)
    for original, received in zip(step, decoded, strict=True):
        np.testing.assert_array_equal(original, received)
    assert np.shares_memory(decoded.observations, np.frombuffer(raw, np.uint8))


def test_fast_decode_agrees_with_protobuf_on_unusual_but_valid_encodings():
    step = make_step(2, np.random.default_rng(2))
    codec = StepCodec(OBS, ACTIONS, 2)
    valid = protobuf_step(step)
    # A bytes field repeated: protobuf keeps the last one.
    stale = StepCodec(OBS, ACTIONS, 2).encode_step(make_step(2, np.random.default_rng(3)))
    inner_stale = seedrl_pb2.ActorMessage.FromString(stale).step.SerializeToString()
    inner = seedrl_pb2.ActorMessage.FromString(valid).step.SerializeToString()
    combined = seedrl_pb2.ActorMessage()
    combined.ParseFromString(b"\x12" + varint(len(inner_stale)) + inner_stale)
    combined.MergeFromString(b"\x12" + varint(len(inner)) + inner)
    doubled = (
        b"\x12" + varint(len(inner_stale)) + inner_stale + b"\x12" + varint(len(inner)) + inner
    )
    # The step sent twice, the second without rewards or flags: protobuf merges the two.
    partial = seedrl_pb2.Step(observations=combined.step.observations).SerializeToString()
    merged = seedrl_pb2.ActorMessage()
    merged.ParseFromString(b"\x12" + varint(len(inner)) + inner)
    merged.MergeFromString(b"\x12" + varint(len(partial)) + partial)
    halves = b"\x12" + varint(len(inner)) + inner + b"\x12" + varint(len(partial)) + partial
    for raw, message in ((doubled, combined), (halves, merged)):
        assert codec.decode_step_message(raw) is None  # the fast reader steps aside
        reference = codec.decode_step(message.step)
        for a, b in zip(decode(codec, raw), reference, strict=True):
            np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(decode(codec, halves).rewards, step.rewards)
    # An unknown varint field: the fast reader steps aside, protobuf skips it.
    with_unknown = valid + b"\x28\x01"
    assert codec.decode_step_message(with_unknown) is None
    decoded = decode(codec, with_unknown)
    np.testing.assert_array_equal(decoded.observations, step.observations)


@pytest.mark.parametrize(
    "raw",
    [
        b"",  # empty message
        b"\x12\x05\x0a\x10abc",  # a field longer than its message
        b"\x12",  # truncated length
        b"\x0a\x00",  # a hello, not a step
        b"\x12\x02\x08\x01",  # a varint where bytes are expected
    ],
)
def test_fast_decode_declines_what_it_does_not_know(raw):
    assert StepCodec(OBS, ACTIONS, 1).decode_step_message(raw) is None


def test_fast_decode_checks_sizes_and_values_like_the_slow_path():
    codec = StepCodec(OBS, ACTIONS, 2)
    step = make_step(2, np.random.default_rng(4))
    short = StepCodec(OBS, ACTIONS, 1).encode_step(EnvStep(*(array[:1] for array in step)))
    with pytest.raises(WireError, match="observations hold"):
        codec.decode_step_message(short)
    bad_reward = step._replace(rewards=np.array([np.nan, 0.0], np.float32))
    with pytest.raises(WireError, match="rewards are not all finite"):
        codec.decode_step_message(protobuf_step(bad_reward))
    bad_flag = protobuf_step(step._replace(terminated=np.array([2, 0], np.uint8)))
    with pytest.raises(WireError, match="terminated flags must be 0 or 1"):
        codec.decode_step_message(bad_flag)


def test_fast_decode_reads_fields_by_their_tags_not_by_where_they_usually_are():
    """A message of the usual length whose fields come in another order (valid protobuf)
    must not be read as if they were in the usual places."""
    step = make_step(3, np.random.default_rng(5))
    step = step._replace(terminated=np.array([1, 0, 0], bool), truncated=np.array([0, 1, 1], bool))
    codec = StepCodec(OBS, ACTIONS, 3)
    usual = codec.encode_step(step)
    fields = seedrl_pb2.ActorMessage.FromString(usual).step
    # Truncated before terminated: the same bytes in all, the flags' headers swapped.
    inner = b"".join(
        bytes((tag,)) + varint(len(value)) + value
        for tag, value in (
            (0x0A, fields.observations),
            (0x12, fields.rewards),
            (0x22, fields.truncated),
            (0x1A, fields.terminated),
        )
    )
    swapped = b"\x12" + varint(len(inner)) + inner
    assert len(swapped) == len(usual) and swapped != usual
    decoded = codec.decode_step_message(swapped)
    for original, received in zip(step, decoded, strict=True):
        np.testing.assert_array_equal(original, received)
    for original, received in zip(step, codec.decode_step_message(usual), strict=True):
        np.testing.assert_array_equal(original, received)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_non_finite_observations_are_refused_whatever_their_float_width(dtype):
    spec = TensorSpec(dtype, (3,))
    codec = StepCodec(spec, ACTIONS, 2)
    finfo = np.finfo(dtype)
    flags = np.zeros(2, bool)
    # The largest finite values are valid observations.
    big = np.full((2, 3), finfo.max, dtype)
    ok = codec.decode_step_message(codec.encode_step(EnvStep(big, np.ones(2), flags, flags)))
    np.testing.assert_array_equal(ok.observations, big)
    for bad in (np.nan, np.inf, -np.inf):
        observations = big.copy()
        observations[1, 2] = bad
        with pytest.raises(WireError, match="observations are not all finite"):
            codec.decode_step_message(
                codec.encode_step(EnvStep(observations, np.ones(2), flags, flags))
            )
    infinite_pair = np.array([[np.inf, -np.inf, 0]] * 2, dtype)
    with pytest.raises(WireError, match="observations are not all finite"):
        codec.decode_step_message(
            codec.encode_step(EnvStep(infinite_pair, np.ones(2), flags, flags))
        )


# -- observation changes -----------------------------------------------------

FRAME = TensorSpec("uint8", (1, 84, 84))


def frames_moving(num_envs: int, steps: int, seed: int) -> list[np.ndarray]:
    """Frames of K envs in which a few pixels change per step, as in Atari."""
    rng = np.random.default_rng(seed)
    frame = rng.integers(0, 256, (num_envs, *FRAME.shape), dtype=np.uint8)
    frames = [frame]
    for _ in range(steps):
        frame = frame.copy()
        pixels = rng.integers(0, frame.size, size=rng.integers(0, 60))
        frame.reshape(-1)[pixels] = rng.integers(0, 256, size=pixels.size, dtype=np.uint8)
        frames.append(frame)
    return frames


def step_of(observations: np.ndarray) -> EnvStep:
    num_envs = len(observations)
    flags = np.zeros(num_envs, bool)
    return EnvStep(observations, np.ones(num_envs, np.float32), flags, flags)


def agreed_pair(spec: TensorSpec, num_envs: int) -> tuple[StepCodec, StepCodec]:
    actor, learner = StepCodec(spec, ACTIONS, num_envs), StepCodec(spec, ACTIONS, num_envs)
    actor.start_stream(observation_changes=True)
    learner.start_stream(observation_changes=True)
    return actor, learner


def test_observation_changes_reproduce_every_step_from_a_fraction_of_the_bytes():
    actor, learner = agreed_pair(FRAME, num_envs=4)
    frames = frames_moving(4, steps=30, seed=0)
    frames.append(np.random.default_rng(1).integers(0, 256, frames[0].shape, dtype=np.uint8))
    frames.append(frames[-1].copy())  # nothing changed at all
    sizes = []
    for index, frame in enumerate(frames):
        raw = actor.encode_step(step_of(frame))
        sizes.append(len(raw))
        # The fast reader and protobuf's parse read the same step.
        fast = learner.decode_step_message(raw)
        np.testing.assert_array_equal(fast.observations, frame, f"step {index}")
        assert not fast.observations.flags.writeable
        step = seedrl_pb2.ActorMessage.FromString(raw).step
        assert bool(step.observations) == (index in (0, 31)), index
    whole = frames[0].nbytes
    assert sizes[0] > whole and sizes[31] > whole  # the first step, and a new scene
    assert max(sizes[1:31]) < whole // 20 and sizes[32] < 40  # 60 pixels at most; none


def test_protobuf_reads_and_writes_observation_changes_as_the_codec_does():
    actor, learner = agreed_pair(FRAME, num_envs=2)
    first, second = frames_moving(2, steps=1, seed=2)
    actor.encode_step(step_of(first))
    learner.decode_step_message(protobuf_step(step_of(first)))  # written by protobuf
    raw = actor.encode_step(step_of(second))
    step = seedrl_pb2.ActorMessage.FromString(raw).step
    offsets = np.frombuffer(step.changed_offsets, "<u4")
    words = first.reshape(-1).view("<u8").copy()
    words[offsets] = np.frombuffer(step.changed_words, "<u8")
    np.testing.assert_array_equal(words, second.reshape(-1).view("<u8"))
    assert seedrl_pb2.ActorMessage(step=step).SerializeToString() == raw
    np.testing.assert_array_equal(learner.decode_step(step).observations, second)


def test_a_new_stream_starts_again_from_whole_observations():
    actor, learner = agreed_pair(FRAME, num_envs=1)
    first, second = frames_moving(1, steps=1, seed=3)
    actor.encode_step(step_of(first))
    actor.start_stream(observation_changes=True)  # a reconnection
    assert seedrl_pb2.ActorMessage.FromString(actor.encode_step(step_of(second))).step.observations
    actor.start_stream(observation_changes=False)
    raw = actor.encode_step(step_of(first))
    assert raw == protobuf_step(step_of(first))
    with pytest.raises(WireError, match="before any whole observations"):
        learner.decode_step(seedrl_pb2.Step(rewards=b"\0" * 4, terminated=b"\0", truncated=b"\0"))


def test_float_observation_changes_are_checked_before_any_is_applied():
    spec = TensorSpec("float32", (256,))
    actor, learner = agreed_pair(spec, num_envs=1)
    observation = np.arange(256, dtype=np.float32)[None]
    learner.decode_step_message(actor.encode_step(step_of(observation)))
    bad = seedrl_pb2.Step(
        rewards=b"\0" * 4,
        terminated=b"\0",
        truncated=b"\0",
        changed_offsets=np.array([0, 5], "<u4").tobytes(),
        changed_words=np.array([7, 7, np.inf, 7], "<f4").tobytes(),
    )
    with pytest.raises(WireError, match="observation changes are not all finite"):
        learner.decode_step(bad)
    bad.changed_words = b"\0" * 8
    with pytest.raises(WireError, match="changed_words hold 8 bytes, expected 16"):
        learner.decode_step(bad)
    bad.changed_offsets = b"\0" * 6
    with pytest.raises(WireError, match="6 bytes, not a whole number of uint32"):
        learner.decode_step(bad)
    # Nothing of the refused steps was applied.
    unchanged = seedrl_pb2.Step(rewards=b"\0" * 4, terminated=b"\0", truncated=b"\0")
    np.testing.assert_array_equal(learner.decode_step(unchanged).observations, observation)


def test_only_whole_8_byte_words_travel_as_changes():
    assert observation_changes_allowed(FRAME, 4)
    assert observation_changes_allowed(TensorSpec("float32", (6,)), 1)
    assert not observation_changes_allowed(TensorSpec("float32", (3,)), 2)
    with pytest.raises(ValueError, match="cannot travel as changes"):
        StepCodec(TensorSpec("uint8", (5,)), ACTIONS, 8).start_stream(observation_changes=True)
