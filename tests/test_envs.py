"""The env registry and its families, with the real ALE ROMs and gymnasium."""

from __future__ import annotations

import numpy as np
import pytest

from envs import counting, registry
from envs.atari import ATARI_SETTINGS, rom_name


def test_ids_name_their_family():
    assert registry.split_env_id("atari:Pong") == ("atari", "Pong")
    with pytest.raises(registry.UnknownEnvError, match="not FAMILY:NAME"):
        registry.split_env_id("Pong")
    with pytest.raises(registry.UnknownEnvError, match="family 'mujoco'"):
        registry.split_env_id("mujoco:Ant")


def test_atari_names_map_to_shipped_roms():
    assert rom_name("Pong") == "pong"
    assert rom_name("MsPacman") == "ms_pacman"
    assert rom_name("space_invaders") == "space_invaders"
    with pytest.raises(ValueError, match="did you mean pong"):
        rom_name("Pongg")


def test_atari_spec_and_settings_follow_machado_v5():
    spec = registry.spec("atari:Pong")
    assert str(spec.observation) == "uint8[1,42,42]"  # one frame on the wire
    assert spec.frame_stack == 4
    assert str(spec.model_observation) == "uint8[4,42,42]"  # four on the learner
    assert str(registry.spec("atari:Pong/84x84").observation) == "uint8[1,84,84]"
    assert spec.action.num_actions == 6  # Pong's minimal action set
    assert spec.frames_per_step == 4
    assert ATARI_SETTINGS["repeat_action_probability"] == 0.25
    assert ATARI_SETTINGS["max_num_frames_per_episode"] == 108_000
    assert ATARI_SETTINGS["noop_max"] == 30
    assert ATARI_SETTINGS["reward_clipping"] is False
    assert ATARI_SETTINGS["episodic_life"] is False


def test_atari_vector_env_truncates_then_resets_in_the_next_step():
    from envs.atari import AtariVectorEnv

    # A 40-frame limit: truncation after 10 agent steps of 4 frames.
    env = AtariVectorEnv("Pong", num_envs=2, seed=3, settings={"max_num_frames_per_episode": 40})
    first = env.reset(seed=3)
    assert first.observations.shape == (2, 1, 42, 42)
    assert first.observations.dtype == np.uint8
    for step_index in range(1, 11):
        step = env.step(np.zeros(2, np.int32))
        assert step.rewards.dtype == np.float32
        if step_index < 10:
            assert not step.truncated.any() and not step.terminated.any()
    assert step.truncated.all() and not step.terminated.any()
    after = env.step(np.zeros(2, np.int32))
    assert not after.truncated.any() and not after.terminated.any()
    np.testing.assert_array_equal(after.rewards, [0.0, 0.0])
    env.close()


def test_unknown_atari_settings_are_refused():
    with pytest.raises(ValueError, match="unknown Atari settings"):
        registry.make("atari:Pong", 1, settings={"sticky": 0.0})


def test_cartpole_uses_gymnasium_in_next_step_mode():
    env = registry.make("classic:CartPole-v1", num_envs=3, seed=0)
    assert str(env.spec.observation) == "float32[4]" and env.spec.action.num_actions == 2
    step = env.reset()
    assert step.observations.shape == (3, 4)
    ended_at = None
    for index in range(200):
        step = env.step(np.zeros(3, np.int32))  # always push left: falls within ~10 steps
        if step.terminated[0]:
            ended_at = index
            break
    assert ended_at is not None
    reset = env.step(np.zeros(3, np.int32))
    assert reset.rewards[0] == 0.0 and not reset.terminated[0]
    assert np.abs(reset.observations[0]).max() <= 0.05  # a fresh start state
    env.close()


def test_counting_env_reports_where_each_observation_comes_from():
    env = registry.make("counting:v0", num_envs=2, seed=7)
    first = env.reset()
    obs = first.observations
    assert obs[0, counting.NONCE] != obs[1, counting.NONCE]
    assert obs[:, counting.ENV_INDEX].tolist() == [0, 1]
    length = int(counting.episode_length(np.array([0]), np.array([0]))[0])
    for t in range(1, length + 1):
        step = env.step(np.array([(t - 1) % 3, 0]))
        assert step.observations[0, counting.TOTAL] == t
        assert step.observations[0, counting.LAST_ACTION] == (t - 1) % 3
        assert step.rewards[0] == 1.0  # the action matched the previous STEP mod 3
    assert step.terminated[0] or step.truncated[0]
    restart = env.step(np.array([2, 0]))
    assert restart.observations[0, counting.STEP] == 0
    assert restart.observations[0, counting.EPISODE] == 1
    assert restart.observations[0, counting.LAST_ACTION] == -1
    assert restart.rewards[0] == 0.0


def test_counting_env_ends_episodes_both_ways():
    env = registry.make("counting:v0", num_envs=4, seed=0)
    env.reset()
    terminations = truncations = 0
    for _ in range(200):
        step = env.step(np.zeros(4, np.int64))
        terminations += int(step.terminated.sum())
        truncations += int(step.truncated.sum())
    assert terminations > 0 and truncations > 0


def test_a_family_registered_from_outside_is_made_by_id():
    registry.register_family("plugin", "envs.counting")
    try:
        env = registry.make("plugin:v0", num_envs=2, seed=0)
        assert env.reset().observations.shape == (2, counting.OBSERVATION_SIZE)
        assert "plugin" in registry.families()
    finally:
        registry._FAMILIES.pop("plugin")


def _episode_start(env, steps: int) -> np.ndarray:
    """A reset and `steps` steps of fixed pseudo-random actions: every observation."""
    actions = np.random.default_rng(0).integers(0, env.spec.action.num_actions, (steps, 2))
    frames = [env.reset().observations]
    frames += [env.step(actions[t].astype(np.int32)).observations for t in range(steps)]
    return np.stack(frames)


@pytest.mark.parametrize("env_id", ["atari:Pong", "classic:CartPole-v1"])
def test_the_construction_seed_fixes_the_first_episode_and_only_the_first(env_id):
    # The actor resets on every reconnection: a reset must not replay the episodes the
    # seed fixed (and reseeding ale-py costs a ROM reload per env).
    first, second = (registry.make(env_id, num_envs=2, seed=11) for _ in range(2))
    episode = _episode_start(first, 60)
    np.testing.assert_array_equal(_episode_start(second, 60), episode)  # reproducible
    assert not np.array_equal(_episode_start(first, 60), episode)  # the next one differs
    first.close()
    second.close()


def test_atari_options_set_the_frame_size_and_sticky_actions():
    from envs.atari import parse_name

    assert parse_name("Pong") == ("Pong", {})
    assert parse_name("Pong/84x84") == ("Pong", {"img_height": 84, "img_width": 84})
    assert parse_name("Breakout/no-sticky/42x42") == (
        "Breakout",
        {"repeat_action_probability": 0.0, "img_height": 42, "img_width": 42},
    )
    spec = registry.spec("atari:Pong/42x42")
    assert spec.env_id == "atari:Pong/42x42"
    assert (
        str(spec.observation) == "uint8[1,42,42]"
        and str(spec.model_observation) == "uint8[4,42,42]"
    )
    env = registry.make("atari:Pong/42x42/no-sticky", 2, seed=0)
    assert env.reset().observations.shape == (2, 1, 42, 42)
    env.close()
    assert parse_name("Pong/skip5") == ("Pong", {"frameskip": 5})
    assert registry.spec("atari:Pong").frames_per_step == 4
    assert registry.spec("atari:Pong/skip5").frames_per_step == 5


def test_a_frame_skip_of_n_advances_the_game_n_frames_a_step():
    """With NOOP only (sticky actions then change nothing) the game is deterministic:
    25 steps of 4 frames and 20 of 5 reach the same frame, 25 of 5 another."""

    def frame_after(skip: int, steps: int) -> np.ndarray:
        env = registry.make(f"atari:Pong/skip{skip}", 1, seed=0, settings={"noop_max": 0})
        env.reset()
        for _ in range(steps):
            observations = env.step(np.zeros(1, np.int32)).observations
        env.close()
        return observations

    np.testing.assert_array_equal(frame_after(4, 25), frame_after(5, 20))
    assert not np.array_equal(frame_after(5, 25), frame_after(5, 20))


@pytest.mark.parametrize(
    "name",
    ["Pong/42x43", "Pong/8x8", "Pong/999x999", "Pong/sticky", "Pong/", "Pong/skip0", "Pong/skip9"],
)
def test_unknown_or_out_of_range_atari_options_are_refused_by_name(name):
    with pytest.raises(ValueError, match="options are SIZExSIZE"):
        registry.spec(f"atari:{name}")
