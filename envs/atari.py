"""Atari 2600 games through ale-py's native vector env ("atari:Pong", "atari:MsPacman").

The settings follow Machado et al. 2018 ("Revisiting the Arcade Learning
Environment"), as gymnasium's ALE v5 envs do, and the usual DQN-style
preprocessing, except that each env sends one frame per step and the learner
stacks the last four (EnvSpec.frame_stack, learner/data/frame_stack.py). Frames are
42x42 by default, as RLlib's fast Atari agents use: on a CPU the learner's
arithmetic decides the minutes to a score. "atari:GAME/84x84" gives the DQN
size (options: `parse_name`).
ale-py's AtariVectorEnv does the preprocessing in C++ threads; its defaults
differ from v5 (no sticky actions, reward clipping, fire on reset), so every
setting below is passed on purpose. Rewards stay raw: the
learner clips them for training and keeps the raw episode return for reports.
"""

from __future__ import annotations

import difflib
import re
from typing import Any

import numpy as np

from envs.base import SeedOnce, first_step, spec_of_one
from seedrl.codec import EnvStep
from seedrl.specs import ActionSpec, EnvSpec, TensorSpec

# One place for the protocol; docs/environments.md lists the same values.
ATARI_SETTINGS: dict[str, Any] = {
    "repeat_action_probability": 0.25,  # sticky actions (Machado et al.)
    "frameskip": 4,  # each agent step repeats the action for 4 frames
    "full_action_space": False,  # the game's minimal action set
    "max_num_frames_per_episode": 108_000,  # 30 minutes of play, then truncation
    "noop_max": 30,  # up to 30 no-op actions after each reset
    "img_height": 42,  # atari:GAME/84x84 for the DQN size; 42x42 trains ~4x cheaper
    "img_width": 42,
    "grayscale": True,
    "maxpool": True,  # max over the last two frames of each skip (flicker)
    "stack_num": 4,  # the model sees the last 4 frames, stacked on the learner
    "episodic_life": False,  # an episode is a whole game, as in v5
    "use_fire_reset": False,  # v5 does not press FIRE on reset
    "reward_clipping": False,  # clipped on the learner; raw returns reported
}


MIN_FRAME_SIZE, MAX_FRAME_SIZE = 36, 210
MIN_FRAME_SKIP, MAX_FRAME_SKIP = 1, 8
NO_STICKY = "no-sticky"


def parse_name(name: str) -> tuple[str, dict[str, Any]]:
    """ "Pong" -> ("Pong", {}); "Pong/84x84/no-sticky" -> ("Pong", the settings it changes).

    After the game, "/"-separated options: SIZExSIZE, square frames of that size (42x42
    without one); no-sticky, no sticky actions (as the v4 "NoFrameskip" envs, for
    comparing with figures that assume none); skipN, each agent step repeating its
    action for N frames (4 without one; sticky actions still act frame by frame)."""
    game, *options = name.split("/")
    settings: dict[str, Any] = {}
    for option in options:
        size = re.fullmatch(r"(\d+)x(\d+)", option)
        if size and size[1] == size[2] and MIN_FRAME_SIZE <= int(size[1]) <= MAX_FRAME_SIZE:
            settings["img_height"] = settings["img_width"] = int(size[1])
        elif option == NO_STICKY:
            settings["repeat_action_probability"] = 0.0
        elif (skip := re.fullmatch(r"skip(\d+)", option)) and (
            MIN_FRAME_SKIP <= int(skip[1]) <= MAX_FRAME_SKIP
        ):
            settings["frameskip"] = int(skip[1])
        else:
            raise ValueError(
                f"unknown Atari option {option[:40]!r} in {name[:80]!r}: options are SIZExSIZE "
                f"(square, {MIN_FRAME_SIZE}..{MAX_FRAME_SIZE}, e.g. {game}/84x84), {NO_STICKY} "
                f"and skipN (frames per agent step, {MIN_FRAME_SKIP}..{MAX_FRAME_SKIP})"
            )
    return game, settings


def rom_name(name: str) -> str:
    """ "MsPacman" or "ms_pacman" -> "ms_pacman", checked against the ROMs ale-py ships."""
    from ale_py import roms

    snake = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()
    available = roms.get_all_rom_ids()
    if snake not in available:
        close = difflib.get_close_matches(snake, available, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ValueError(f"ale-py has no Atari ROM {snake!r} (from {name!r}){hint}")
    return snake


class AtariVectorEnv:
    """K Atari games in one process, preprocessed by ale-py's C++ threads."""

    def __init__(
        self,
        name: str,
        num_envs: int,
        seed: int | None = None,
        num_threads: int = 1,
        settings: dict[str, Any] | None = None,
    ):
        """`settings` overrides entries of ATARI_SETTINGS (departing from the protocol)."""
        from ale_py.vector_env import AtariVectorEnv as AleVectorEnv

        unknown = set(settings or {}) - set(ATARI_SETTINGS)
        if unknown:
            raise ValueError(f"unknown Atari settings {sorted(unknown)}")
        self.num_envs = num_envs
        self._seed = SeedOnce(seed)
        self._last: np.ndarray | None = None
        game, options = parse_name(name)
        chosen = {**ATARI_SETTINGS, **options, **(settings or {})}
        # The actor sends one frame per step; the learner keeps the stack (SEED RL's
        # way, 4x fewer bytes on the wire), zero-padded at episode starts as ale-py's.
        frame_stack = int(chosen.pop("stack_num"))
        self._env = AleVectorEnv(
            rom_name(game),
            num_envs,
            num_threads=num_threads,
            autoreset_mode="NextStep",
            stack_num=1,
            **chosen,
        )
        self.spec = EnvSpec(
            env_id=f"atari:{name}",
            observation=TensorSpec("uint8", self._env.single_observation_space.shape),
            action=ActionSpec(int(self._env.single_action_space.n)),
            frames_per_step=chosen["frameskip"],
            frame_stack=frame_stack,
        )

    def reset(self, seed: int | None = None) -> EnvStep:
        observations, _ = self._env.reset(seed=self._seed.take(seed))
        self._last = observations
        return first_step(observations)

    def step(self, actions: np.ndarray) -> EnvStep:
        observations, rewards, terminated, truncated, _ = self._env.step(
            np.asarray(actions, np.int32)
        )
        self._last = observations
        return EnvStep(
            observations=observations,
            rewards=rewards.astype(np.float32, copy=False),
            terminated=terminated,
            truncated=truncated,
        )

    # Agent steps per second of game time (60 frames/s, frame skip 4): a video's rate.
    render_fps = 60 // ATARI_SETTINGS["frameskip"]

    def render(self, scale: int = 4) -> np.ndarray:
        """uint8 [H*scale, W*scale, 3]: env 0's newest frame as the agent sees it.

        The C++ vector env keeps no RGB screen, so this is the preprocessed
        frame (grey, max-pooled), enlarged; what the policy acted on.
        """
        if self._last is None:
            raise RuntimeError("render() before reset()")
        frame = self._last[0, -1]
        frame = np.repeat(np.repeat(frame, scale, axis=0), scale, axis=1)
        return np.repeat(frame[:, :, None], 3, axis=2)

    def close(self) -> None:
        self._env.close()


def make(
    name: str,
    num_envs: int,
    seed: int | None = None,
    num_threads: int = 1,
    settings: dict[str, Any] | None = None,
    render: bool = False,
) -> AtariVectorEnv:
    """`render` is accepted for the registry's sake: render() always works here."""
    del render
    return AtariVectorEnv(name, num_envs, seed=seed, num_threads=num_threads, settings=settings)


def spec(name: str) -> EnvSpec:
    return spec_of_one(lambda: AtariVectorEnv(name, num_envs=1))
