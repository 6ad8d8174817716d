"""Google Research Football ("football:academy_empty_goal_close", "football:11_vs_11_easy_stochastic").

gfootball is written against the old gym API (reset -> obs, step -> obs, reward,
done, info); `FootballEnv` adapts one game to gymnasium's, and K of them run
in one actor process through gymnasium's SyncVectorEnv (next-step auto-reset,
the wire protocol's convention). Install it with scripts/install_football.sh.

Ids: `football:SCENARIO` or `football:SCENARIO/REPRESENTATION`, where SCENARIO
is any of gfootball's scenarios and REPRESENTATION one of:
  smm          (default) the super mini-map of SEED RL: 4 binary planes of
               72x96 (left team, right team, ball, active player), the last 4
               steps stacked = 16 planes, sent as packed bits: uint8 [72, 96, 2]
               (8x fewer bytes than the planes; SEED's PackedBitsObservation).
               The `smm_cnn` network unpacks them on the learner.
  simple115v2  115 floats (positions, directions, ball, game mode); 11 vs 11.

Episode ends are mapped honestly: a goal, the ball going out of play or a
change of possession (the scenario's rules) are `terminated`; reaching the
scenario's `game_duration` is `truncated`, since neither representation shows
the clock and a value that cannot see time must bootstrap there.

Seeding: reset(seed=s) seeds the adapter's generator and restarts the
scenario's episode count (kick-offs alternate by it), and every episode draws
the engine's `game_engine_random_seed` from the generator, so a seed fixes the
whole sequence of episodes while the episodes differ.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from typing import Any, ClassVar

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode

from envs.base import SeedOnce, first_step, from_gymnasium
from seedrl.codec import EnvStep
from seedrl.specs import ActionSpec, EnvSpec, TensorSpec

REPRESENTATIONS = ("smm", "simple115v2")
SMM_HEIGHT, SMM_WIDTH, SMM_PLANES, SMM_STACK = 72, 96, 4, 4
# The game advances 10 agent steps per second of match time: a video's rate.
STEPS_PER_SECOND = 10
_INSTALL_HINT = (
    "Google Research Football is not installed; run scripts/install_football.sh "
    "(it builds the game engine: minutes, once)"
)


def parse_name(name: str) -> tuple[str, str]:
    """ "academy_empty_goal_close/simple115v2" -> (scenario, representation)."""
    scenario, _, representation = name.partition("/")
    representation = representation or "smm"
    if representation not in REPRESENTATIONS:
        raise ValueError(
            f"football representation {representation!r} is unknown; choose one of "
            f"{', '.join(REPRESENTATIONS)}"
        )
    return scenario, representation


def scenarios() -> list[str]:
    """The scenarios gfootball ships."""
    import importlib.resources

    files = importlib.resources.files("gfootball.scenarios")
    return sorted(
        entry.name[:-3]
        for entry in files.iterdir()
        if entry.name.endswith(".py") and not entry.name.startswith("_")
    )


def _import_gfootball():
    try:
        # gym 0.25 prints a banner about its own age on import; gfootball needs it anyway.
        with contextlib.redirect_stderr(io.StringIO()):
            import gfootball.env as football_env
    except ImportError as error:
        raise ImportError(_INSTALL_HINT) from error
    return football_env


def pack_smm(planes: np.ndarray) -> np.ndarray:
    """uint8 [..., 72, 96, 16] of 0/255 -> uint8 [..., 72, 96, 2], plane c at bit c % 8."""
    return np.packbits(planes > 0, axis=-1, bitorder="little")


def unpack_smm(packed: np.ndarray) -> np.ndarray:
    """The inverse of pack_smm, as 0/1 uint8 planes."""
    return np.unpackbits(packed, axis=-1, bitorder="little")


class FootballEnv(gym.Env):
    """One gfootball game behind gymnasium's API (one controlled player, scoring reward)."""

    metadata: ClassVar[dict] = {"render_modes": ["rgb_array"], "render_fps": STEPS_PER_SECOND}

    def __init__(self, scenario: str, representation: str = "smm", render_mode: str | None = None):
        football_env = _import_gfootball()
        if representation not in REPRESENTATIONS:
            raise ValueError(f"representation must be one of {REPRESENTATIONS}")
        available = scenarios()
        if scenario not in available:
            raise ValueError(
                f"gfootball has no scenario {scenario!r}; scenarios: {', '.join(available)}"
            )
        smm = representation == "smm"
        with warnings.catch_warnings():
            # gfootball's wrappers use the old step API on purpose; we adapt it below.
            warnings.simplefilter("ignore", DeprecationWarning)
            self._env = self._create(football_env, scenario, smm)
        self._core = self._env.unwrapped._env  # the engine's state: steps_left
        self._config = self._env.unwrapped._config
        # Scenarios alternate kick-offs by episode number; a seeded reset restarts it.
        self._first_episode_number = self._config["episode_number"]
        self._smm = smm
        self.render_mode = render_mode
        if smm:
            self.observation_space = gym.spaces.Box(
                0, 255, (SMM_HEIGHT, SMM_WIDTH, SMM_PLANES * SMM_STACK // 8), np.uint8
            )
        else:
            self.observation_space = gym.spaces.Box(-np.inf, np.inf, (115,), np.float32)
        self.action_space = gym.spaces.Discrete(int(self._env.action_space.n))
        self._last: np.ndarray | None = None

    @staticmethod
    def _create(football_env, scenario: str, smm: bool):
        return football_env.create_environment(
            env_name=scenario,
            representation="extracted" if smm else "simple115v2",
            stacked=smm,
            rewards="scoring",
            render=False,  # the engine's renderer needs a display; render() draws the SMM
            logdir="",
            write_goal_dumps=False,
            write_full_episode_dumps=False,
        )

    def _observation(self, raw: Any) -> np.ndarray:
        raw = np.asarray(raw)
        self._last = raw
        if self._smm:
            return pack_smm(raw)
        return raw.astype(np.float32, copy=False)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        if seed is not None:
            self._config["episode_number"] = self._first_episode_number
        # Each episode its own engine seed, drawn from the adapter's generator.
        engine_seed = int(self.np_random.integers(2**31 - 1))
        self._config["game_engine_random_seed"] = engine_seed
        # gfootball derives the teams' processing order from the first episode's seed
        # only; set it per episode, the same way, so that a seed fixes the episode.
        self._config["reverse_team_processing"] = bool(engine_seed % 2)
        observation = self._env.reset()
        return self._observation(observation), {}

    def step(self, action):
        observation, reward, done, info = self._env.step(int(action))
        reward = float(reward)
        truncated = bool(done) and self._core._observation["steps_left"] <= 0 and reward == 0.0
        terminated = bool(done) and not truncated
        info = {"score_reward": float(info.get("score_reward", reward))}
        return self._observation(observation), reward, terminated, truncated, info

    def render(self) -> np.ndarray | None:
        """uint8 [72*4, 96*4, 3]: the newest mini-map, left team red, right blue, ball
        white, the controlled player yellow (the engine's own renderer needs a display)."""
        if self.render_mode != "rgb_array":
            return None
        if self._last is None:
            raise RuntimeError("render() before reset()")
        if not self._smm:
            raise RuntimeError("render() draws the mini-map; use the smm representation")
        planes = self._last[..., -SMM_PLANES:] > 0
        image = np.zeros((SMM_HEIGHT, SMM_WIDTH, 3), np.uint8)
        image[:] = (20, 90, 30)  # the pitch
        for plane, colour in enumerate(
            ((230, 40, 40), (60, 90, 240), (255, 255, 255), (250, 220, 0))
        ):
            image[planes[..., plane]] = colour
        return np.repeat(np.repeat(image, 4, axis=0), 4, axis=1)

    def close(self) -> None:
        self._env.close()


class FootballVectorEnv:
    """K football games in one process, stepped one after another (the engine is serial)."""

    def __init__(self, name: str, num_envs: int, seed: int | None = None, render: bool = False):
        scenario, representation = parse_name(name)
        render_mode = "rgb_array" if render else None
        self._env = gym.vector.SyncVectorEnv(
            [(lambda: FootballEnv(scenario, representation, render_mode)) for _ in range(num_envs)],
            autoreset_mode=AutoresetMode.NEXT_STEP,
        )
        self._seed = SeedOnce(seed)
        self._render = render
        self.num_envs = num_envs
        self.render_fps = STEPS_PER_SECOND
        space = self._env.single_observation_space
        self.spec = EnvSpec(
            env_id=f"football:{name}",
            observation=TensorSpec(space.dtype.name, space.shape),
            action=ActionSpec(int(self._env.single_action_space.n)),
        )

    def reset(self, seed: int | None = None) -> EnvStep:
        observations, _ = self._env.reset(seed=self._seed.take(seed))
        return first_step(observations)

    def step(self, actions: np.ndarray) -> EnvStep:
        return from_gymnasium(self._env.step(np.asarray(actions, np.int64)))

    def render(self) -> np.ndarray:
        """uint8 [H, W, 3]: env 0's newest mini-map (made with render=True)."""
        if not self._render:
            raise RuntimeError("this env was made without render=True")
        return self._env.envs[0].render()

    def close(self) -> None:
        self._env.close()


def make(
    name: str, num_envs: int, seed: int | None = None, render: bool = False
) -> FootballVectorEnv:
    return FootballVectorEnv(name, num_envs, seed=seed, render=render)


# gfootball's default action set: idle, 8 directions, passes, shot, sprint, ...
NUM_ACTIONS = 19


def spec(name: str) -> EnvSpec:
    """Known without the engine, so a learner on a machine without gfootball (a GPU
    host) can serve football actors; actors check theirs against it in the hello."""
    _, representation = parse_name(name)
    if representation == "smm":
        observation = TensorSpec("uint8", (SMM_HEIGHT, SMM_WIDTH, SMM_PLANES * SMM_STACK // 8))
    else:
        observation = TensorSpec("float32", (115,))
    return EnvSpec(
        env_id=f"football:{name}", observation=observation, action=ActionSpec(NUM_ACTIONS)
    )
