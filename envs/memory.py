"""A memory task: a cue at the first step, the question at the last ("memory:cue-N").

Each episode shows one of two cues at its first step, then N-1 blank steps,
then a query step, where the action must name the cue seen N steps earlier:
reward 1 if it does, 0 otherwise, and the episode terminates. Actions at the
other steps do nothing. Only a policy with memory can beat chance (a mean
return of 0.5): at the query step the observation says nothing of the cue.
The mean return is the success rate.

Observation: float32 [4] = (cue 0 shown, cue 1 shown, query, steps left / N).
The countdown lets a feed-forward policy know when it is asked (so that its
failure is for want of memory, not of timing), never what. Auto-reset is
next-step, as every family's.
"""

from __future__ import annotations

import re

import numpy as np

from envs.base import checked_actions, first_step
from seedrl.codec import EnvStep
from seedrl.specs import ActionSpec, EnvSpec, TensorSpec

NUM_CUES = 2
OBSERVATION_SIZE = NUM_CUES + 2
QUERY = NUM_CUES
COUNTDOWN = NUM_CUES + 1
DEFAULT_DELAY = 5


def delay_of(name: str) -> int:
    """ "cue-5" -> 5 (steps from the cue to the query); "cue" -> the default."""
    match = re.fullmatch(r"cue(?:-(\d+))?", name)
    if not match or (match.group(1) is not None and int(match.group(1)) < 1):
        raise ValueError(f"memory env {name!r} is unknown; names: cue, cue-N with N >= 1")
    return int(match.group(1) or DEFAULT_DELAY)


class MemoryVectorEnv:
    """K cue-recall episodes stepped together (numpy, microseconds per step)."""

    def __init__(self, delay: int, num_envs: int, seed: int | None = None):
        self.delay = delay
        self.num_envs = num_envs
        self.spec = spec(f"cue-{delay}")
        self._rng = np.random.default_rng(seed)
        self._cue = np.zeros(num_envs, np.int64)
        self._step = np.zeros(num_envs, np.int64)
        self._ended = np.zeros(num_envs, np.bool_)

    def _observation(self) -> np.ndarray:
        observation = np.zeros((self.num_envs, OBSERVATION_SIZE), np.float32)
        at_cue = self._step == 0
        observation[at_cue, self._cue[at_cue]] = 1.0
        observation[:, QUERY] = self._step == self.delay
        observation[:, COUNTDOWN] = (self.delay - self._step) / self.delay
        return observation

    def _new_episodes(self, which: np.ndarray) -> None:
        self._cue[which] = self._rng.integers(0, NUM_CUES, int(which.sum()))
        self._step[which] = 0

    def reset(self, seed: int | None = None) -> EnvStep:
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        self._new_episodes(np.ones(self.num_envs, np.bool_))
        self._ended[:] = False
        return first_step(self._observation())

    def step(self, actions: np.ndarray) -> EnvStep:
        actions = checked_actions(actions, self.num_envs, NUM_CUES)
        restart = self._ended
        asked = (self._step == self.delay) & ~restart
        rewards = (asked & (actions == self._cue)).astype(np.float32)
        self._step += 1
        self._new_episodes(restart)
        self._ended = asked
        return EnvStep(
            self._observation(), rewards, terminated=asked.copy(), truncated=np.zeros_like(asked)
        )

    def close(self) -> None:
        pass


def make(name: str, num_envs: int, seed: int | None = None) -> MemoryVectorEnv:
    return MemoryVectorEnv(delay_of(name), num_envs, seed=seed)


def spec(name: str) -> EnvSpec:
    delay_of(name)
    return EnvSpec(
        env_id=f"memory:{name}",
        observation=TensorSpec("float32", (OBSERVATION_SIZE,)),
        action=ActionSpec(NUM_CUES),
    )
