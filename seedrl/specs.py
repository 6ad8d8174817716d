"""What an environment looks like on the wire: observation and action specs.

Both sides of a stream agree on these once, in the hello; every later message
carries only raw bytes whose layout the specs fix.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from seedrl.proto import seedrl_pb2

# Bumped on any change a peer of the previous version would misread.
PROTOCOL_VERSION = 1

# Bytes travel little-endian whatever the host's order.
_WIRE_BYTE_ORDER = "<"


class SpecError(ValueError):
    """A spec that cannot be used, with the reason in the message."""


def wire_dtype(dtype: np.dtype | str) -> np.dtype:
    """The little-endian numpy dtype for a dtype name ("uint8", "float32", ...)."""
    try:
        base = np.dtype(dtype)
    except TypeError as error:
        raise SpecError(f"unknown dtype {dtype!r}") from error
    if base.kind not in "biuf":
        raise SpecError(f"dtype {base.name!r} is not a bool, integer or float type")
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
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if any(d <= 0 for d in self.shape):
            raise SpecError(f"shape {self.shape} has a dimension that is not positive")

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
