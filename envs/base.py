"""The interface every environment family gives the actor: K envs in lock step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from seedrl.codec import EnvStep
from seedrl.specs import EnvSpec


class VectorEnv(Protocol):
    """K environments stepped together, auto-resetting in next-step mode.

    After a step whose observation is flagged terminated or truncated, the
    next `step` ignores that env's action and returns the first observation
    of a new episode with reward 0 and both flags clear. The final
    observation of every episode is therefore seen, which the learner needs
    to bootstrap through truncations.
    """

    spec: EnvSpec
    num_envs: int

    def reset(self, seed: int | None = None) -> EnvStep:
        """Starts a new episode in every env; rewards 0, flags clear.

        With `seed`, env i is seeded with seed + i. Without one, the first reset
        uses the seed the env was made with (if any) and later resets go on from
        each env's random stream, so no two resets replay the same episodes.
        """
        ...

    def step(self, actions: np.ndarray) -> EnvStep:
        """Applies int32 [K] actions and returns what the K envs report."""
        ...

    def close(self) -> None: ...


class SeedOnce:
    """The seed an env was made with, for its first reset only (see VectorEnv.reset).

    Later unseeded resets go on from each env's random stream instead of
    replaying the episodes the seed fixed (and spare ale-py a ROM reload per env).
    """

    def __init__(self, seed: int | None):
        self._seed = seed

    def take(self, seed: int | None) -> int | None:
        """`seed` when one is given; else the construction seed the first time, then None."""
        chosen, self._seed = (self._seed if seed is None else seed), None
        return chosen


def checked_actions(actions: np.ndarray, num_envs: int, num_actions: int) -> np.ndarray:
    """int64 [K] actions, or ValueError when there are not K of them in 0..num_actions-1."""
    actions = np.asarray(actions, np.int64)
    if actions.shape != (num_envs,):
        raise ValueError(f"expected {num_envs} actions, got shape {actions.shape}")
    if ((actions < 0) | (actions >= num_actions)).any():
        raise ValueError(f"actions {actions.tolist()} fall outside 0..{num_actions - 1}")
    return actions


def first_step(observations: np.ndarray) -> EnvStep:
    """The EnvStep of K freshly reset envs."""
    num_envs = observations.shape[0]
    return EnvStep(
        observations=observations,
        rewards=np.zeros(num_envs, np.float32),
        terminated=np.zeros(num_envs, np.bool_),
        truncated=np.zeros(num_envs, np.bool_),
    )


def spec_of_one(make_one: Callable[[], VectorEnv]) -> EnvSpec:
    """The spec of a family's env, read off a single env that is closed at once."""
    env = make_one()
    try:
        return env.spec
    finally:
        env.close()


def from_gymnasium(result: tuple, observation_dtype: np.dtype | None = None) -> EnvStep:
    """The EnvStep of what a gymnasium vector env's `step` returns."""
    observations, rewards, terminated, truncated, _ = result
    if observation_dtype is not None:
        observations = observations.astype(observation_dtype, copy=False)
    return EnvStep(
        observations=observations,
        rewards=np.asarray(rewards, np.float32),
        terminated=np.asarray(terminated, np.bool_),
        truncated=np.asarray(truncated, np.bool_),
    )
