"""gymnasium's registered envs with discrete actions ("classic:CartPole-v1").

Envs with a native vector implementation (CartPole) use it; the others run K
copies in one process with gymnasium's SyncVectorEnv. Both auto-reset in
next-step mode, the convention of the wire protocol.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode

from envs.base import SeedOnce, first_step, from_gymnasium, spec_of_one
from seedrl.codec import EnvStep
from seedrl.specs import ActionSpec, EnvSpec, TensorSpec


def _observation_dtype(space: gym.Space) -> np.dtype:
    # float64 observations travel and train as float32.
    return np.dtype(np.float32) if space.dtype == np.float64 else np.dtype(space.dtype)


class ClassicVectorEnv:
    """K gymnasium envs of one id, stepped together."""

    def __init__(self, name: str, num_envs: int, seed: int | None = None, render: bool = False):
        """`render`: `render()` returns env 0's picture (gymnasium's renderer, pygame)."""
        if name not in gym.registry:
            raise ValueError(f"gymnasium has no env {name!r}")
        options = {"render_mode": "rgb_array"} if render else {}
        if gym.registry[name].vector_entry_point is not None:
            env = gym.make_vec(
                name, num_envs=num_envs, vectorization_mode="vector_entry_point", **options
            )
        else:
            env = gym.make_vec(
                name,
                num_envs=num_envs,
                vectorization_mode="sync",
                vector_kwargs={"autoreset_mode": AutoresetMode.NEXT_STEP},
                **options,
            )
        if env.metadata.get("autoreset_mode", AutoresetMode.NEXT_STEP) != AutoresetMode.NEXT_STEP:
            raise ValueError(f"{name}: its vector env does not auto-reset in next-step mode")
        if not isinstance(env.single_action_space, gym.spaces.Discrete):
            raise ValueError(f"{name}: only discrete action spaces are supported")
        if not isinstance(env.single_observation_space, gym.spaces.Box):
            raise ValueError(f"{name}: only Box observation spaces are supported")
        self._env = env
        self._render = render
        self.render_fps = int(env.metadata.get("render_fps") or 30)
        self._seed = SeedOnce(seed)
        self._obs_dtype = _observation_dtype(env.single_observation_space)
        self.num_envs = num_envs
        self.spec = EnvSpec(
            env_id=f"classic:{name}",
            observation=TensorSpec(self._obs_dtype.name, env.single_observation_space.shape),
            action=ActionSpec(int(env.single_action_space.n)),
        )

    def reset(self, seed: int | None = None) -> EnvStep:
        observations, _ = self._env.reset(seed=self._seed.take(seed))
        return first_step(observations.astype(self._obs_dtype, copy=False))

    def step(self, actions: np.ndarray) -> EnvStep:
        return from_gymnasium(self._env.step(np.asarray(actions, np.int64)), self._obs_dtype)

    def render(self) -> np.ndarray:
        """uint8 [H, W, 3]: env 0 as it is now (made with render=True)."""
        if not self._render:
            raise RuntimeError("this env was made without render=True")
        frames = self._env.render()
        return np.asarray(frames[0], np.uint8)

    def close(self) -> None:
        self._env.close()


def make(
    name: str, num_envs: int, seed: int | None = None, render: bool = False
) -> ClassicVectorEnv:
    return ClassicVectorEnv(name, num_envs, seed=seed, render=render)


def spec(name: str) -> EnvSpec:
    return spec_of_one(lambda: ClassicVectorEnv(name, num_envs=1))
