"""What an environment looks like on the wire: observation and action specs.

Both sides of a stream agree on these once, in the hello; every later message
carries only raw bytes whose layout the specs fix.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from seedrl.proto import seedrl_pb2
from seedrl.text import shown

# Bumped on any change a peer of the previous version would misread.
PROTOCOL_VERSION = 1

# Bytes travel little-endian whatever the host's order.
_WIRE_BYTE_ORDER = "<"


class SpecError(ValueError):
    """A spec that cannot be used, with the reason in the message."""


DTYPES = frozenset(
    [
        "bool",
        "int8",
        "uint8",
        "int16",
        "uint16",
        "int32",
        "uint32",
        "int64",
        "uint64",
        "float16",
        "float32",
        "float64",
    ]
)
"""The dtype names a spec may carry. A name is checked against these before numpy parses
anything: numpy's parser takes arbitrary strings (and raises what it likes on them)."""
MAX_RANK = 8
MAX_ELEMENTS = 1 << 26
"""Elements of one observation at most (64 Mi: a 4x1024x1024 float frame stack fits)."""


def wire_dtype(dtype: np.dtype | str) -> np.dtype:
    """The little-endian numpy dtype for a dtype name ("uint8", "float32", ...)."""
    name = dtype.name if isinstance(dtype, np.dtype) else dtype
    if not isinstance(name, str) or name not in DTYPES:
        what = shown(name) if isinstance(name, str) else repr(type(name))
        raise SpecError(f"unknown dtype {what}; dtypes: {', '.join(sorted(DTYPES))}")
    base = np.dtype(name)
    return base.newbyteorder(_WIRE_BYTE_ORDER) if base.itemsize > 1 else base


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """The dtype and shape of one environment's observation (no batch dimension)."""

    dtype: str
    """numpy dtype name, for instance "uint8" or "float32"."""
    shape: tuple[int, ...]
    """Shape of one observation, for instance (4, 84, 84)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", wire_dtype(self.dtype).name)
        if len(self.shape) > MAX_RANK:
            raise SpecError(f"a shape of rank {len(self.shape)}; the most is {MAX_RANK}")
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if any(d <= 0 for d in self.shape):
            raise SpecError(f"shape {self.shape} has a dimension that is not positive")
        if math.prod(self.shape) > MAX_ELEMENTS:
            raise SpecError(f"shape {self.shape} has more than {MAX_ELEMENTS} elements")

    @property
    def np_dtype(self) -> np.dtype:
        return wire_dtype(self.dtype)

    @property
    def num_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of one observation on the wire."""
        return self.num_elements * self.np_dtype.itemsize

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.shape))}]"

    def to_proto(self) -> seedrl_pb2.TensorSpec:
        return seedrl_pb2.TensorSpec(dtype=self.dtype, shape=self.shape)

    @classmethod
    def from_proto(cls, proto: seedrl_pb2.TensorSpec) -> TensorSpec:
        return cls(dtype=proto.dtype, shape=tuple(proto.shape))


@dataclasses.dataclass(frozen=True)
class ActionSpec:
    """Discrete actions 0 .. num_actions - 1."""

    num_actions: int

    def __post_init__(self) -> None:
        if self.num_actions < 1:
            raise SpecError(f"num_actions must be at least 1, got {self.num_actions}")

    def __str__(self) -> str:
        return f"Discrete({self.num_actions})"

    def to_proto(self) -> seedrl_pb2.ActionSpec:
        return seedrl_pb2.ActionSpec(num_actions=self.num_actions)

    @classmethod
    def from_proto(cls, proto: seedrl_pb2.ActionSpec) -> ActionSpec:
        return cls(num_actions=proto.num_actions)


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    """What the learner must know of an environment to build a model for it."""

    env_id: str
    observation: TensorSpec
    action: ActionSpec
    frames_per_step: int = 1
    """Emulator frames per agent step (the frame skip), to report env frames."""
    frame_stack: int = 1
    """Observations the model sees at once: the learner keeps each env's last
    `frame_stack` observations and concatenates them along the first axis, so
    the actor sends one frame per step, not the stack (SEED RL's way)."""

    def __post_init__(self) -> None:
        if self.frame_stack < 1:
            raise SpecError(f"frame_stack must be at least 1, got {self.frame_stack}")
        if self.frame_stack > 1 and len(self.observation.shape) < 1:
            raise SpecError("a stacked observation needs at least one dimension")

    @property
    def model_observation(self) -> TensorSpec:
        """What the network takes for one env: `frame_stack` observations, concatenated."""
        if self.frame_stack == 1:
            return self.observation
        first, *rest = self.observation.shape
        return TensorSpec(self.observation.dtype, (self.frame_stack * first, *rest))
