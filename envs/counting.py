"""A deterministic env whose observations say exactly where they come from.

"counting:v0" exists to test the system, not an agent: each observation
carries the env's identity and position, so a test can check from the
learner's unrolls alone that no step was lost, repeated, reordered or mixed
across runs, and that every action reached the env it was meant for.

Observation: float32 [6] (all values exact integers), indexed by the
constants below. NONCE is random per env instance, so two runs of one actor
never share it. Episode e of env i lasts 3 + (5e + 3i) mod 9 steps and ends by
truncation when (e + i) mod 4 == 3, by termination otherwise. The reward of
a step is 1 when the action taken equals (STEP of the previous observation)
mod NUM_ACTIONS, else 0: a policy that reads the observation can earn the
episode's full length. Auto-reset is next-step: the action after a final
observation is ignored (LAST_ACTION becomes -1) and a new episode begins.

"counting:wide" is the same env with a 1 KiB observation, float32 [256]: the
six values, then `padding(ENV_INDEX)`, the same in every episode and run. It
is large enough for actors to send its steps as observation changes
(seedrl.codec), and the padding lets a test check that every value arrived.
"""

from __future__ import annotations

import numpy as np

from envs.base import checked_actions, first_step
from seedrl.codec import EnvStep
from seedrl.specs import ActionSpec, EnvSpec, TensorSpec

NONCE, ENV_INDEX, EPISODE, STEP, TOTAL, LAST_ACTION = range(6)
OBSERVATION_SIZE = 6
WIDE_SIZE = 256
NUM_ACTIONS = 3
SIZES = {"v0": OBSERVATION_SIZE, "wide": WIDE_SIZE}
NAMES = tuple(SIZES)


def padding(env_index: np.ndarray) -> np.ndarray:
    """float32 [N, WIDE_SIZE - OBSERVATION_SIZE]: a wide observation's values after the six,
    distinct per env index and exact in float32 (below 2**24)."""
    column = np.arange(1, WIDE_SIZE - OBSERVATION_SIZE + 1, dtype=np.int64)
    seed = 7919 * (np.asarray(env_index, np.int64)[:, None] + 1)
    return ((seed * column) % 2**20).astype(np.float32)


def episode_length(env_index: np.ndarray, episode: np.ndarray) -> np.ndarray:
    return 3 + (5 * episode + 3 * env_index) % 9


def ends_by_truncation(env_index: np.ndarray, episode: np.ndarray) -> np.ndarray:
    return (episode + env_index) % 4 == 3


class CountingVectorEnv:
    """K counting envs; pure numpy, microseconds per step."""

    def __init__(self, num_envs: int, seed: int | None = None, name: str = "v0"):
        self.num_envs = num_envs
        self.spec = spec(name)
        self._size = SIZES[name]
        self._rng = np.random.default_rng(seed)
        self._index = np.arange(num_envs, dtype=np.int64)
        self._padding = padding(self._index)[:, : self._size - OBSERVATION_SIZE]
        self.reset()

    def _observation(self) -> np.ndarray:
        observation = np.empty((self.num_envs, self._size), np.float32)
        observation[:, OBSERVATION_SIZE:] = self._padding
        observation[:, NONCE] = self._nonce
        observation[:, ENV_INDEX] = self._index
        observation[:, EPISODE] = self._episode
        observation[:, STEP] = self._step
        observation[:, TOTAL] = self._total
        observation[:, LAST_ACTION] = self._last_action
        return observation

    def reset(self, seed: int | None = None) -> EnvStep:
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        # Below 2**24, so float32 holds it exactly.
        self._nonce = self._rng.integers(1, 2**24, size=self.num_envs)
        self._episode = np.zeros(self.num_envs, np.int64)
        self._step = np.zeros(self.num_envs, np.int64)
        self._total = np.zeros(self.num_envs, np.int64)
        self._last_action = np.full(self.num_envs, -1, np.int64)
        self._ended = np.zeros(self.num_envs, np.bool_)
        return first_step(self._observation())

    def step(self, actions: np.ndarray) -> EnvStep:
        actions = checked_actions(actions, self.num_envs, NUM_ACTIONS)
        restart = self._ended
        rewards = np.where(restart, 0.0, actions == self._step % NUM_ACTIONS).astype(np.float32)
        self._episode = np.where(restart, self._episode + 1, self._episode)
        self._step = np.where(restart, 0, self._step + 1)
        self._last_action = np.where(restart, -1, actions)
        self._total += 1
        over = self._step >= episode_length(self._index, self._episode)
        truncated = over & ends_by_truncation(self._index, self._episode)
        terminated = over & ~truncated
        self._ended = over
        return EnvStep(self._observation(), rewards, terminated, truncated)

    def close(self) -> None:
        pass


def make(name: str, num_envs: int, seed: int | None = None) -> CountingVectorEnv:
    return CountingVectorEnv(num_envs, seed=seed, name=name)


def spec(name: str) -> EnvSpec:
    if name not in NAMES:
        raise ValueError(f"counting env {name!r} is unknown; names: {', '.join(NAMES)}")
    return EnvSpec(
        env_id=f"counting:{name}",
        observation=TensorSpec("float32", (SIZES[name],)),
        action=ActionSpec(NUM_ACTIONS),
    )
