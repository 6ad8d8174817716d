"""Per-step messages to and from bytes, checked against the specs of the hello.

The decode side runs on the learner for every message of every actor, so it
does no copies: arrays are read-only numpy views onto the message's bytes.
Every check raises WireError with a message that names the fault; the server
turns it into an INVALID_ARGUMENT status for that stream alone.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from seedrl.proto import seedrl_pb2
from seedrl.specs import ActionSpec, TensorSpec

REWARD_DTYPE = np.dtype("<f4")
FLAG_DTYPE = np.dtype("u1")
ACTION_DTYPE = np.dtype("<i4")


class WireError(ValueError):
    """A message that does not match what the stream agreed on."""


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

    def __init__(self, observation_spec: TensorSpec, action_spec: ActionSpec, num_envs: int):
        if num_envs < 1:
            raise ValueError(f"num_envs must be at least 1, got {num_envs}")
        self.observation_spec = observation_spec
        self.action_spec = action_spec
        self.num_envs = num_envs
        self._obs_dtype = observation_spec.np_dtype
        self._obs_shape = (num_envs, *observation_spec.shape)
        self._obs_nbytes = num_envs * observation_spec.nbytes

    # -- actor side ---------------------------------------------------------

    def encode_step(self, step: EnvStep) -> bytes:
        """Serialises K env results as one ActorMessage."""
        observations = np.asarray(step.observations)
        if observations.shape != self._obs_shape:
            raise WireError(
                f"observations have shape {observations.shape}, expected {self._obs_shape}"
            )
        message = seedrl_pb2.ActorMessage(
            step=seedrl_pb2.Step(
                observations=observations.astype(self._obs_dtype, copy=False).tobytes(),
                rewards=np.asarray(step.rewards, REWARD_DTYPE).tobytes(),
                terminated=np.asarray(step.terminated, FLAG_DTYPE).tobytes(),
                truncated=np.asarray(step.truncated, FLAG_DTYPE).tobytes(),
            )
        )
        return message.SerializeToString()

    def decode_actions(self, actions: seedrl_pb2.Actions) -> np.ndarray:
        """int32 [K] actions from the learner, checked against the action spec."""
        values = self._read(actions.actions, ACTION_DTYPE, (self.num_envs,), "actions")
        if values.size and (values.min() < 0 or values.max() >= self.action_spec.num_actions):
            raise WireError(
                f"actions {values.tolist()} fall outside 0..{self.action_spec.num_actions - 1}"
            )
        return values

    # -- learner side -------------------------------------------------------

    def decode_step(self, step: seedrl_pb2.Step) -> EnvStep:
        """K env results as read-only views onto the message's bytes."""
        # Each read of a bytes field makes a new copy with upb: read every field once.
        data = step.observations
        if len(data) != self._obs_nbytes:
            raise WireError(
                f"observations hold {len(data)} bytes, expected "
                f"{self._obs_nbytes} ({self.num_envs} envs x {self.observation_spec})"
            )
        observations = np.frombuffer(data, self._obs_dtype).reshape(self._obs_shape)
        if self._obs_dtype.kind == "f" and not np.isfinite(observations).all():
            # One NaN would reach the gradients and spoil the parameters for everyone.
            raise WireError("observations are not all finite")
        rewards = self._read(step.rewards, REWARD_DTYPE, (self.num_envs,), "rewards")
        if not np.isfinite(rewards).all():
            raise WireError(f"rewards are not all finite: {rewards.tolist()}")
        terminated = self._read_flags(step.terminated, "terminated")
        truncated = self._read_flags(step.truncated, "truncated")
        return EnvStep(observations, rewards, terminated, truncated)

    def encode_actions(self, actions: np.ndarray, policy_version: int) -> bytes:
        message = seedrl_pb2.LearnerMessage(
            actions=seedrl_pb2.Actions(
                actions=np.asarray(actions, ACTION_DTYPE).tobytes(),
                policy_version=policy_version,
            )
        )
        return message.SerializeToString()

    # -- helpers ------------------------------------------------------------

    def _read(self, data: bytes, dtype: np.dtype, shape: tuple[int, ...], name: str) -> np.ndarray:
        expected = int(np.prod(shape)) * dtype.itemsize
        if len(data) != expected:
            raise WireError(
                f"{name} hold {len(data)} bytes, expected {expected} "
                f"({self.num_envs} envs x {dtype.name})"
            )
        return np.frombuffer(data, dtype).reshape(shape)

    def _read_flags(self, data: bytes, name: str) -> np.ndarray:
        flags = self._read(data, FLAG_DTYPE, (self.num_envs,), name)
        if flags.size and flags.max() > 1:
            raise WireError(f"{name} flags must be 0 or 1, got {flags.tolist()}")
        return flags.view(np.bool_)
