"""Google Research Football: ids, packed mini-map, network, presets, and the real engine.

The engine tests run gfootball itself (scripts/install_football.sh builds it);
where it is not installed they are skipped, saying so. Everything above them
runs everywhere.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from envs import football, registry
from learner.agents.networks import _unpack_bits, make_network
from learner.presets import preset_for
from tests.fleet import learner_argv

HAVE_GFOOTBALL = importlib.util.find_spec("gfootball") is not None
# SEEDRL_REQUIRE_FOOTBALL=1 (a machine that has built the engine) makes a missing engine
# fail these tests instead of skipping them.
needs_engine = pytest.mark.skipif(
    not HAVE_GFOOTBALL and not os.environ.get("SEEDRL_REQUIRE_FOOTBALL"),
    reason="gfootball is not installed (scripts/install_football.sh builds it in minutes)",
)
EMPTY_GOAL = "football:academy_empty_goal_close"


# -- without the engine ----------------------------------------------------------


def test_ids_name_scenario_and_representation():
    assert football.parse_name("academy_empty_goal_close") == ("academy_empty_goal_close", "smm")
    assert football.parse_name("11_vs_11_easy_stochastic/simple115v2") == (
        "11_vs_11_easy_stochastic",
        "simple115v2",
    )
    with pytest.raises(ValueError, match="representation 'pixels' is unknown"):
        football.parse_name("academy_empty_goal_close/pixels")
    assert "football" in registry.families()


def test_the_spec_is_known_without_the_engine():
    smm = registry.spec(EMPTY_GOAL)
    assert (smm.observation.dtype, smm.observation.shape) == ("uint8", (72, 96, 2))
    assert smm.action.num_actions == 19
    vector = registry.spec("football:11_vs_11_easy_stochastic/simple115v2")
    assert (vector.observation.dtype, vector.observation.shape) == ("float32", (115,))


def test_packed_planes_unpack_exactly_in_numpy_and_in_the_network():
    rng = np.random.default_rng(0)
    planes = (rng.random((3, 72, 96, 16)) < 0.1).astype(np.uint8) * 255
    packed = football.pack_smm(planes)
    assert packed.shape == (3, 72, 96, 2) and packed.dtype == np.uint8
    np.testing.assert_array_equal(football.unpack_smm(packed), planes // 255)
    np.testing.assert_array_equal(np.asarray(_unpack_bits(packed)), planes / 255.0)


def test_the_smm_network_takes_packed_planes():
    network = make_network("smm_cnn", 19)
    observations = np.zeros((2, 72, 96, 2), np.uint8)
    params = network.init(jax.random.PRNGKey(0), observations)
    output = network.apply(params, observations)
    assert output.logits.shape == (2, 19) and output.values.shape == (2,)
    # The planes reach the network: one set bit changes its output.
    observations[1, 30, 40, 0] = 1
    changed = network.apply(params, observations)
    assert not np.allclose(changed.values[1], output.values[1])
    np.testing.assert_allclose(changed.values[0], output.values[0])


def test_presets_follow_the_scenario():
    academy = preset_for(EMPTY_GOAL)
    assert (academy.preset, academy.network, academy.env) == ("football", "smm_cnn", EMPTY_GOAL)
    full = preset_for("football:11_vs_11_easy_stochastic")
    assert full.preset == "football_11v11"
    # SEED RL's published settings for the scoring reward.
    assert (full.unroll_length, full.batch_size, full.discount, full.vtrace_lambda) == (
        32,
        32,
        0.997,
        0.9,
    )
    assert (full.learning_rate, full.entropy_cost) == (5.5e-5, 3.2e-5)
    # The 115-float representation takes a vector torso.
    vector = preset_for("football:11_vs_11_easy_stochastic/simple115v2")
    assert (vector.preset, vector.network) == ("football_11v11", "mlp")


def test_without_the_engine_the_error_says_how_to_install_it(monkeypatch):
    # Hidden whether it is installed or not: a None in sys.modules fails its import.
    for name in ("gfootball", "gfootball.env"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match=r"install_football\.sh"):
        registry.make(EMPTY_GOAL, 1)


# -- the real engine -------------------------------------------------------------


@needs_engine
@pytest.mark.parametrize("representation", ["smm", "simple115v2"])
def test_gymnasium_env_checker_passes(representation):
    from gymnasium.utils.env_checker import check_env

    scenario = "academy_empty_goal_close" if representation == "smm" else "11_vs_11_easy_stochastic"
    env = football.FootballEnv(scenario, representation)
    try:
        check_env(env, skip_render_check=True)
    finally:
        env.close()


@needs_engine
def test_a_seed_fixes_the_sequence_of_episodes():
    def play(seed: int) -> list[tuple[int, float, bool]]:
        env = football.FootballEnv("academy_empty_goal_close")
        rng = np.random.default_rng(0)
        env.reset(seed=seed)
        ends, steps = [], 0
        try:
            while len(ends) < 3:
                _, reward, terminated, truncated, _ = env.step(int(rng.integers(19)))
                steps += 1
                if terminated or truncated:
                    ends.append((steps, reward, terminated))
                    steps = 0
                    env.reset()
        finally:
            env.close()
        return ends

    assert play(7) == play(7)


@needs_engine
def test_episode_ends_map_to_terminated_or_truncated():
    """The scenario's rules (a goal, the ball out of play, possession lost) terminate;
    the clock truncates."""
    env = football.FootballEnv("academy_empty_goal_close")
    rng = np.random.default_rng(1)
    try:
        # The clock: shortened on the engine to 25 steps, standing idle outlasts it.
        env.reset(seed=1)
        env._core._env.config.game_duration = 25
        steps = 0
        while steps < 40:
            _, reward, terminated, truncated, _ = env.step(0)
            steps += 1
            if terminated or truncated:
                break
        assert (truncated, terminated, reward) == (True, False, 0.0)
        assert 25 <= steps <= 27 and env._core._observation["steps_left"] <= 0
        # The rules: random play ends episodes long before the 400-step clock.
        env.reset()
        ends, steps, deadline = [], 0, time.monotonic() + 120
        while len(ends) < 8 and time.monotonic() < deadline:
            _, reward, terminated, truncated, _ = env.step(int(rng.integers(19)))
            steps += 1
            if terminated or truncated:
                ends.append((terminated, truncated, steps, reward))
                steps = 0
                env.reset()
    finally:
        env.close()
    assert len(ends) == 8, ends
    for terminated, truncated, length, _ in ends:
        assert terminated != truncated
        assert truncated == (length >= 400), ends


@needs_engine
def test_vector_env_resets_in_next_step_mode():
    env = registry.make(EMPTY_GOAL, 2, seed=3)
    try:
        step = env.reset()
        assert step.observations.shape == (2, 72, 96, 2)
        ended = None
        for _ in range(500):
            step = env.step(np.zeros(2, np.int32))
            if ended is not None:
                # The step after an episode's end is the next episode's first: no flags.
                assert not step.terminated[ended] and not step.truncated[ended]
                assert step.rewards[ended] == 0
                break
            finished = np.flatnonzero(step.terminated | step.truncated)
            if finished.size:
                ended = int(finished[0])
        assert ended is not None
    finally:
        env.close()


@needs_engine
@pytest.mark.slow
def test_academy_empty_goal_close_is_learned_within_1m_env_steps(tmp_path):
    """The football preset, the CLI learner and 2 actor processes over the real gRPC path:
    from the random policy's 0.15 goals per episode to a 100-episode mean of 0.5 or more,
    which 20 greedy episodes of the parameters of that moment reach too (the sampling fleet
    can score while the most likely action does not), and which the run ends with."""
    from tests.test_learning import read_metrics, run_eval, train

    train(
        tmp_path,
        EMPTY_GOAL,
        2,
        8,
        "--total-env-steps",
        "1000000",
        "--stop-at-return",
        "0.5",
        "--stop-eval-episodes",
        "20",
        timeout_s=4800,
    )
    records = read_metrics(tmp_path)
    last = records[-1]
    print(
        f"\nempty goal close: mean {last['episode_return_mean']} goals per episode at "
        f"{last['env_steps']:,} env steps, {last['elapsed_s']:.0f} s"
    )
    assert last["episode_return_mean"] >= 0.5 and last["env_steps"] <= 1_000_000
    # metrics.jsonl counts the fleet's episodes and frames. The last record covers only
    # the moments between the last interval's record and the stop, which may hold no
    # env step, so the rate is read over the run.
    assert max(r["fps"] or 0 for r in records) > 0 and last["episodes"] >= 100
    # The greedy policy of the final checkpoint scores too.
    result = run_eval(tmp_path / "run", "--episodes", "40")
    print(f"greedy: mean {result['mean']} over {result['episodes']} episodes")
    assert result["mean"] >= 0.5


def test_the_learner_refuses_a_network_that_cannot_read_the_mini_map(tmp_path):
    """No engine needed: the learner knows football's spec and says which network fits."""
    result = subprocess.run(
        [*learner_argv(EMPTY_GOAL, tmp_path / "run"), "--network", "nature_cnn"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "use --network smm_cnn" in result.stderr
    assert not (tmp_path / "run").exists()
