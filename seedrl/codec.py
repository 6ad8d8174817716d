"""Per-step messages to and from bytes, checked against the specs of the hello.

The step and actions messages are the hot path: one of each per actor
message, on the learner's event loop for every actor. So they are read and
written here directly in protobuf's wire format, which for these flat
messages of bytes fields is a few tags and lengths: the learner's arrays are
read-only numpy views onto the bytes gRPC handed over (no copy, where the
protobuf runtime copies each bytes field twice), and the actor's message is
built with one copy of the observations. Anything the fast reader does not
expect goes through the generated protobuf classes instead, so every valid
encoding is accepted and every invalid one is reported by name.

On a stream whose hello and welcome agreed on observation changes, a step
may carry, instead of the K observations, the 8-byte words of them that
changed since the stream's previous step (offsets and new values): the actor
keeps what it last sent, the learner what it last received, and both apply
the same changes. An Atari frame changes in about 1% of its pixels per step,
so the step's bytes on the wire fall ~35x (Pong) and gRPC's CPU per message
with them; the actor sends observations whole whenever the changes would be
larger than half of them.

Every check raises WireError with a message that names the fault; the server
turns it into an INVALID_ARGUMENT status for that stream alone.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from seedrl.proto import seedrl_pb2
from seedrl.specs import ActionSpec, TensorSpec

REWARD_DTYPE = np.dtype("<f4")
FLAG_DTYPE = np.dtype("u1")
ACTION_DTYPE = np.dtype("<i4")
WORD_DTYPE = np.dtype("<u8")
"""Observation changes travel as whole 8-byte words of the K observations' bytes."""
OFFSET_DTYPE = np.dtype("<u4")
CHANGES_MIN_BYTES = 1024
"""An actor offers observation changes only for observations at least this large per env
(images); smaller ones cost more to compare than their bytes cost to send."""


def observation_changes_allowed(observation_spec: TensorSpec, num_envs: int) -> bool:
    """Whether a stream of K such observations can carry them as changes (the protocol's
    rule: one env's observation is whole 8-byte words, and uint32 offsets reach them all)."""
    nbytes = observation_spec.nbytes
    return nbytes % WORD_DTYPE.itemsize == 0 and num_envs * nbytes // WORD_DTYPE.itemsize <= 2**32


class WireError(ValueError):
    """A message that does not match what the stream agreed on."""


# Tags (field number << 3 | wire type 2, length-delimited) of the hot messages.
_TAG_STEP = 0x12  # ActorMessage.step = 2
_TAG_OBSERVATIONS, _TAG_REWARDS, _TAG_TERMINATED, _TAG_TRUNCATED = 0x0A, 0x12, 0x1A, 0x22
_TAG_CHANGED_OFFSETS, _TAG_CHANGED_WORDS = 0x2A, 0x32  # Step.changed_offsets = 5, words = 6
_TAG_ACTIONS = 0x12  # LearnerMessage.actions = 2
_TAG_ACTION_BYTES = 0x0A  # Actions.actions = 1
_TAG_POLICY_VERSION = 0x10  # Actions.policy_version = 2, varint


def varint(value: int) -> bytes:
    """A non-negative integer in protobuf's base-128 varint (negative int64s: add 2**64)."""
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(data: bytes, position: int, end: int) -> tuple[int, int]:
    """(value, next position); raises IndexError past `end`."""
    value = shift = 0
    while True:
        if position >= end or shift > 63:
            raise IndexError("truncated varint")
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
        shift += 7


def _length_delimited(data: bytes, start: int, end: int) -> dict[int, tuple[int, int]] | None:
    """{tag: (start, end)} of the length-delimited fields in data[start:end]; None when
    anything else is there, or a tag repeats (protobuf merges a repeated message field and
    keeps the last of a repeated bytes field: the generated classes decode those)."""
    fields: dict[int, tuple[int, int]] = {}
    position = start
    try:
        while position < end:
            tag, position = _read_varint(data, position, end)
            if tag & 7 != 2:
                return None
            length, position = _read_varint(data, position, end)
            if position + length > end or tag in fields:
                return None
            fields[tag] = (position, position + length)
            position += length
    except IndexError:
        return None
    return fields


def step_fields(raw: bytes) -> dict[int, tuple[int, int]] | None:
    """The byte spans of a Step's fields inside a serialised ActorMessage holding one,
    without copying; None when `raw` is anything else (a hello, an odd encoding)."""
    outer = _length_delimited(raw, 0, len(raw))
    if outer is None or set(outer) != {_TAG_STEP}:
        return None
    start, end = outer[_TAG_STEP]
    return _length_delimited(raw, start, end)


def encode_actions_message(actions: np.ndarray, policy_version: int) -> bytes:
    """A serialised LearnerMessage{actions}, as protobuf writes it."""
    data = np.ascontiguousarray(actions, ACTION_DTYPE)
    body = [_TAG_ACTION_BYTES.to_bytes(1, "little"), varint(data.nbytes), data]
    if policy_version:
        if policy_version < 0:
            policy_version += 1 << 64  # int64 as protobuf writes it: ten bytes
        body += [_TAG_POLICY_VERSION.to_bytes(1, "little"), varint(policy_version)]
    inner = b"".join(body)
    return b"".join((_TAG_ACTIONS.to_bytes(1, "little"), varint(len(inner)), inner))


def _canonical_layout(
    fields: tuple[tuple[int, int], ...],
) -> tuple[int, tuple[tuple[int, int, bytes], ...], tuple[tuple[int, int], ...]]:
    """Where an ActorMessage{step} of these (tag, size) fields, written in order, puts
    things: (its length, (start, end, expected bytes) of each header, (start, end) of
    each field's data). Every field must be non-empty (proto3 leaves empty ones out)."""
    headers = [bytes((tag,)) + varint(size) for tag, size in fields]
    body = sum(len(header) + size for header, (_, size) in zip(headers, fields, strict=True))
    headers[0] = bytes((_TAG_STEP,)) + varint(body) + headers[0]  # the message's own
    checks, spans, position = [], [], 0
    for header, (_, size) in zip(headers, fields, strict=True):
        checks.append((position, position + len(header), header))
        position += len(header)
        spans.append((position, position + size))
        position += size
    return position, tuple(checks), tuple(spans)


class EnvStep(NamedTuple):
    """What K environments report after one step; arrays have K as leading dim."""

    observations: np.ndarray
    """[K, *observation_shape] of the observation dtype."""
    rewards: np.ndarray
    """float32 [K], raw reward of the transition into each observation."""
    terminated: np.ndarray
    """bool [K], the observation ends its episode; no bootstrap from it."""
    truncated: np.ndarray
    """bool [K], a time limit ends the episode here; bootstrap from it."""


class StepCodec:
    """Encodes and decodes the per-step messages of one stream of K envs."""

    def __init__(
        self,
        observation_spec: TensorSpec,
        action_spec: ActionSpec,
        num_envs: int,
        observation_changes: bool = False,
        max_abs_reward: float = math.inf,
        max_abs_observation: float = math.inf,
    ):
        """A decoded step's rewards, and its observations if they are floats, must lie
        within +-max_abs_reward and +-max_abs_observation: finite but huge values (float32's
        maximum) would overflow the loss, and one peer would spoil training for all."""
        if num_envs < 1:
            raise ValueError(f"num_envs must be at least 1, got {num_envs}")
        self.observation_spec = observation_spec
        self.action_spec = action_spec
        self.num_envs = num_envs
        self._max_abs_reward = max_abs_reward
        self._max_abs_observation = max_abs_observation
        self._obs_dtype = observation_spec.np_dtype
        self._obs_shape = (num_envs, *observation_spec.shape)
        self._obs_nbytes = num_envs * observation_spec.nbytes
        self._layout = _canonical_layout(
            (
                (_TAG_OBSERVATIONS, self._obs_nbytes),
                (_TAG_REWARDS, num_envs * REWARD_DTYPE.itemsize),
                (_TAG_TERMINATED, num_envs * FLAG_DTYPE.itemsize),
                (_TAG_TRUNCATED, num_envs * FLAG_DTYPE.itemsize),
            )
        )
        self.start_stream(observation_changes)

    def start_stream(self, observation_changes: bool) -> None:
        """Begins a new stream: with `observation_changes` (both sides agreed), steps may
        carry observation changes against this side's copy of the stream's last
        observations, which starts empty (the first step must carry them whole)."""
        if observation_changes and not observation_changes_allowed(
            self.observation_spec, self.num_envs
        ):
            raise ValueError(f"{self.observation_spec} observations cannot travel as changes")
        # The actor's copy of what it last sent, or the learner's of what it last received.
        self._words: np.ndarray | None = None
        if observation_changes:
            self._words = np.zeros(self._obs_nbytes // WORD_DTYPE.itemsize, WORD_DTYPE)
            view = self._words.view(self._obs_dtype).reshape(self._obs_shape)
            view.flags.writeable = False
            self._words_view = view
        self._primed = False
        """The copy holds the stream's last observations (a step has gone by)."""

    # -- actor side ---------------------------------------------------------

    def encode_step(self, step: EnvStep) -> bytes:
        """Serialises K env results as one ActorMessage{step}, as protobuf would."""
        observations = np.asarray(step.observations)
        if observations.shape != self._obs_shape:
            raise WireError(
                f"observations have shape {observations.shape}, expected {self._obs_shape}"
            )
        observations = np.ascontiguousarray(observations, self._obs_dtype)
        changes = self._changes(observations) if self._words is not None else None
        # In field-number order, as protobuf writes them.
        fields = (
            *(((_TAG_OBSERVATIONS, observations),) if changes is None else ()),
            (_TAG_REWARDS, np.ascontiguousarray(step.rewards, REWARD_DTYPE)),
            (_TAG_TERMINATED, np.ascontiguousarray(step.terminated, FLAG_DTYPE)),
            (_TAG_TRUNCATED, np.ascontiguousarray(step.truncated, FLAG_DTYPE)),
            *(
                zip((_TAG_CHANGED_OFFSETS, _TAG_CHANGED_WORDS), changes, strict=True)
                if changes
                else ()
            ),
        )
        parts: list = []
        for tag, array in fields:
            if array.nbytes:  # proto3 leaves empty bytes fields out
                parts += [tag.to_bytes(1, "little"), varint(array.nbytes), array]
        body_length = sum(len(part) if isinstance(part, bytes) else part.nbytes for part in parts)
        # One copy of the observations: join reads the arrays' buffers directly.
        return b"".join((_TAG_STEP.to_bytes(1, "little"), varint(body_length), *parts))

    def _changes(self, observations: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """(offsets, new words) of what changed since the last step sent, or None to send
        the observations whole; either way the copy of what was sent follows."""
        assert self._words is not None
        words = observations.reshape(-1).view(WORD_DTYPE)
        if not self._primed:
            self._words[...] = words
            self._primed = True
            return None
        offsets = np.flatnonzero(words != self._words)
        if offsets.size * (OFFSET_DTYPE.itemsize + WORD_DTYPE.itemsize) * 2 > self._obs_nbytes:
            self._words[...] = words  # more than half as large as the observations
            return None
        values = words[offsets]
        self._words[offsets] = values
        return offsets.astype(OFFSET_DTYPE), values

    def decode_actions(self, actions: seedrl_pb2.Actions) -> np.ndarray:
        """int32 [K] actions from the learner, checked against the action spec."""
        values = self._read(actions.actions, ACTION_DTYPE, "actions")
        if values.size and (values.min() < 0 or values.max() >= self.action_spec.num_actions):
            raise WireError(
                f"actions {values.tolist()} fall outside 0..{self.action_spec.num_actions - 1}"
            )
        return values

    # -- learner side -------------------------------------------------------

    def decode_step_message(self, raw: bytes) -> EnvStep | None:
        """A serialised ActorMessage{step} as views onto `raw` (no copy); None when `raw`
        is not a step as the fast reader knows it (parse it with protobuf instead)."""
        view = memoryview(raw)
        length, headers, spans = self._layout
        if len(raw) == length and all(raw[start:end] == header for start, end, header in headers):
            # The bytes every encoder writes for K envs (encode_step's, protobuf's): each
            # field's header where this stream's sizes put it, so nothing to scan.
            return self._decode(*(view[start:end] for start, end in spans), b"", b"")
        fields = step_fields(raw)
        if fields is None:
            return None
        empty = (0, 0)
        return self._decode(
            *(
                view[slice(*fields.get(tag, empty))]
                for tag in (
                    _TAG_OBSERVATIONS,
                    _TAG_REWARDS,
                    _TAG_TERMINATED,
                    _TAG_TRUNCATED,
                    _TAG_CHANGED_OFFSETS,
                    _TAG_CHANGED_WORDS,
                )
            )
        )

    def decode_step(self, step: seedrl_pb2.Step) -> EnvStep:
        """K env results from a parsed Step, as read-only views onto its bytes."""
        # Each read of a bytes field makes a new copy with upb: read every field once.
        return self._decode(
            step.observations,
            step.rewards,
            step.terminated,
            step.truncated,
            step.changed_offsets,
            step.changed_words,
        )

    def _decode(self, observations, rewards, terminated, truncated, offsets, words) -> EnvStep:
        if self._words is None:
            if len(offsets) or len(words):
                raise WireError(
                    "the step carries observation changes, which this stream did not agree on"
                )
            observations = self._observations(observations)
        else:
            observations = self._apply_changes(observations, offsets, words)
        rewards = self._read(rewards, REWARD_DTYPE, "rewards")
        _check_within(rewards, self._max_abs_reward, "rewards", "--max-abs-reward")
        terminated = self._read_flags(terminated, "terminated")
        truncated = self._read_flags(truncated, "truncated")
        return EnvStep(observations, rewards, terminated, truncated)

    def _observations(self, data) -> np.ndarray:
        """The K observations sent whole, as a read-only view onto `data`."""
        if len(data) != self._obs_nbytes:
            raise WireError(
                f"observations hold {len(data)} bytes, expected "
                f"{self._obs_nbytes} ({self.num_envs} envs x {self.observation_spec})"
            )
        observations = np.frombuffer(data, self._obs_dtype).reshape(self._obs_shape)
        if self._obs_dtype.kind == "f":
            # One NaN would reach the gradients and spoil the parameters for everyone.
            _check_within(
                observations, self._max_abs_observation, "observations", "--max-abs-observation"
            )
        return observations

    def _apply_changes(self, observations, offsets, words) -> np.ndarray:
        """The stream's K observations after this step: sent whole, or the last ones with
        the step's changes applied (checked in full before any is). A read-only view of
        the stream's copy, valid until its next step is decoded, which the stream's
        lock step (no next step before the reply to this one) puts after its use."""
        assert self._words is not None
        if len(observations):
            if len(offsets) or len(words):
                raise WireError("the step carries both observations and observation changes")
            self._words[...] = self._observations(observations).reshape(-1).view(WORD_DTYPE)
            self._primed = True
            return self._words_view
        if not self._primed:
            raise WireError(
                "the step carries observation changes before any whole observations "
                "(the stream's first step must carry them)"
            )
        if len(offsets) % OFFSET_DTYPE.itemsize:
            raise WireError(
                f"changed_offsets hold {len(offsets)} bytes, not a whole number of uint32"
            )
        offsets = np.frombuffer(offsets, OFFSET_DTYPE)
        if len(words) != offsets.size * WORD_DTYPE.itemsize:
            raise WireError(
                f"changed_words hold {len(words)} bytes, expected "
                f"{offsets.size * WORD_DTYPE.itemsize} (8 per changed offset)"
            )
        if offsets.size:
            last = int(offsets.max())
            if last >= self._words.size:
                raise WireError(
                    f"changed offset {last} is past the observations' {self._words.size} words"
                )
            values = np.frombuffer(words, WORD_DTYPE)
            if self._obs_dtype.kind == "f":
                _check_within(
                    values.view(self._obs_dtype),
                    self._max_abs_observation,
                    "observation changes",
                    "--max-abs-observation",
                )
            self._words[offsets] = values
        return self._words_view

    # -- helpers ------------------------------------------------------------

    def _read(self, data: bytes, dtype: np.dtype, name: str) -> np.ndarray:
        """[K] values of `dtype`, one per env."""
        expected = self.num_envs * dtype.itemsize
        if len(data) != expected:
            raise WireError(
                f"{name} hold {len(data)} bytes, expected {expected} "
                f"({self.num_envs} envs x {dtype.name})"
            )
        return np.frombuffer(data, dtype)

    def _read_flags(self, data: bytes, name: str) -> np.ndarray:
        flags = self._read(data, FLAG_DTYPE, name)
        if np.maximum.reduce(flags) > 1:  # K >= 1: never empty
            raise WireError(f"{name} flags must be 0 or 1, got {flags.tolist()}")
        return flags.view(np.bool_)


def _check_within(values: np.ndarray, bound: float, name: str, flag: str) -> None:
    """Refuses `values` unless all are finite and within +-bound. The refusal names the
    largest magnitude, not the values: a peer's input is not echoed back at length."""
    limit = min(bound, float(np.finfo(values.dtype).max))  # infinities fail, as NaN does
    if not values.size or (-limit <= values.min() and values.max() <= limit):
        return
    if not np.isfinite(values).all():
        raise WireError(f"{name} are not all finite")
    largest = float(np.abs(values).max())
    raise WireError(f"{name} reach {largest:.4g}, beyond the learner's bound of {bound:g} ({flag})")
