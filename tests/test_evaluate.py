"""seedrl-eval's pieces and its refusals (the learning tests play real checkpoints)."""

from __future__ import annotations

import json
import subprocess

import jax
import numpy as np
import pytest

from learner.inference.player import quotas
from learner.tools.evaluate import (
    UNIT_FRAMES,
    EvalConfig,
    FrameSample,
    network_of_run,
    torso_units,
)
from tests.fleet import ROOT

EVAL = str(ROOT / ".venv" / "bin" / "seedrl-eval")


@pytest.mark.parametrize(
    ("episodes", "envs", "expected"),
    [(20, 8, [3, 3, 3, 3, 2, 2, 2, 2]), (3, 3, [1, 1, 1]), (5, 1, [5]), (7, 2, [4, 3])],
)
def test_episodes_are_spread_evenly_over_envs(episodes, envs, expected):
    assert quotas(episodes, envs) == expected
    assert sum(quotas(episodes, envs)) == episodes


def test_config_refuses_nonsense():
    with pytest.raises(ValueError, match="episodes"):
        EvalConfig(run_dir="x", episodes=0)
    with pytest.raises(ValueError, match="num_envs"):
        EvalConfig(run_dir="x", num_envs=-1)
    with pytest.raises(ValueError, match="epsilon"):
        EvalConfig(run_dir="x", epsilon=1.5)


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([EVAL, *args], capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_a_directory_that_is_not_a_run_is_named(tmp_path):
    result = run("--run-dir", str(tmp_path))
    assert result.returncode == 1
    assert "config.json not found" in result.stderr


def test_a_run_without_checkpoints_says_so(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"env": "classic:CartPole-v1", "network": "mlp", "mlp_hidden_sizes": [64, 64]})
    )
    result = run("--run-dir", str(tmp_path), "--episodes", "1")
    assert result.returncode == 1
    assert "no complete checkpoint under" in result.stderr


def test_the_network_is_the_one_the_run_trained():
    """seedrl-eval rebuilds the run's network from its config.json, its sizes included,
    or the checkpoint's parameters would not fit."""
    run = {"env": "atari:Pong", "network": "compact_cnn_centered", "torso_hidden_size": 64}
    network = network_of_run(run, num_actions=6)
    params = network.init(jax.random.key(0), np.zeros((1, 4, 42, 42), np.uint8))
    assert params["params"]["torso"]["Dense_0"]["kernel"].shape == (2592, 64)
    # config.json writes tuples as JSON lists.
    wider = network_of_run({**run, "torso_channels": [32, 64]}, num_actions=6)
    params = wider.init(jax.random.key(0), np.zeros((1, 4, 42, 42), np.uint8))
    assert params["params"]["torso"]["Conv_1"]["kernel"].shape == (4, 4, 32, 64)
    assert params["params"]["torso"]["Dense_0"]["kernel"].shape == (5184, 64)
    normalised = network_of_run({**run, "torso_layer_norm": True}, num_actions=6)
    params = normalised.init(jax.random.key(0), np.zeros((1, 4, 42, 42), np.uint8))
    assert params["params"]["torso"]["LayerNorm_0"]["scale"].shape == (64,)
    assert network_of_run(run, num_actions=6).torso.activation == "relu"
    leaky = network_of_run({**run, "torso_activation": "leaky_relu"}, num_actions=6)
    assert leaky.torso.activation == "leaky_relu"
    older = network_of_run({"env": "atari:Pong", "network": "compact_cnn"}, num_actions=6)
    params = older.init(jax.random.key(0), np.zeros((1, 4, 42, 42), np.uint8))
    assert params["params"]["torso"]["Dense_0"]["kernel"].shape == (2592, 256)


def test_usage_without_a_run_dir():
    result = run()
    assert result.returncode == 2
    assert "--run-dir" in result.stderr


def constant_policy(env_id: str, network_name: str):
    """A network whose parameters are all zero: equal logits, so its most likely action is
    always action 0 (NOOP on Atari), and the env's spec."""
    import jax
    import numpy as np

    from envs import registry
    from learner.agents.networks import init_params, make_network

    spec = registry.spec(env_id)
    network = make_network(network_name, spec.action.num_actions, (16,))
    model = spec.model_observation
    params = init_params(network, jax.random.key(0), np.zeros((1, *model.shape), model.np_dtype))
    return network, jax.tree.map(jax.numpy.zeros_like, params), spec


def constant_run(run_dir, env_id: str, network_name: str = "compact_cnn_centered"):
    """A run directory as the learner leaves it, its one checkpoint constant_policy's."""
    from learner.training.checkpoint import Checkpointer

    _, params, _ = constant_policy(env_id, network_name)
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps({"env": env_id, "network": network_name}))
    checkpointer = Checkpointer(str(run_dir), interval_s=0.0, keep=1)
    checkpointer.save(1, params, {}, {"env_steps": 0, "episodes": 0})
    checkpointer.close()
    return run_dir


@pytest.mark.parametrize(("epsilon", "explored"), [(0.0, 0.0), (0.2, 0.1), (1.0, 0.5)])
def test_an_epsilon_greedy_player_takes_a_uniform_action_that_often(epsilon, explored):
    import jax
    import numpy as np

    from learner.agents.agent import make_agent
    from learner.inference.player import Player

    network, params, spec = constant_policy("classic:CartPole-v1", "mlp")
    player = Player(make_agent(network), spec, sample=False, epsilon=epsilon)
    assert player.policy == ("greedy" if not epsilon else f"epsilon-greedy ({epsilon:g})")
    rows = 20_000
    observations = np.zeros((rows, *spec.model_observation.shape), np.float32)
    first = np.ones(rows, np.bool_)
    actions, _, key = player._act(params, observations, first, None, jax.random.key(1))
    # Action 0 is the greedy one; a uniform draw over CartPole's 2 picks 1 half the time.
    assert np.mean(np.asarray(actions) != 0) == pytest.approx(explored, abs=0.015)
    again, _, _ = player._act(params, observations, first, None, key)
    assert epsilon == 0.0 or not np.array_equal(actions, again)  # the key moves on


def test_the_atari_stop_check_ends_episodes_of_a_policy_that_never_presses_fire():
    """Breakout waits for FIRE after every lost life: a greedy policy that never picks it
    plays on to the 108k-frame limit. The Atari presets' check acts epsilon-greedily, so
    its episodes end as the game's do."""
    from learner.agents.agent import make_agent
    from learner.presets import preset_for
    from learner.training.stop_check import StopCheck

    config = preset_for("atari:Breakout")
    assert config.stop_eval_epsilon == 0.01
    network, params, _ = constant_policy("atari:Breakout", config.network)
    check = StopCheck(
        "atari:Breakout", make_agent(network), episodes=2, seed=5, epsilon=config.stop_eval_epsilon
    )
    try:
        returns, lengths = check._player.play(check._env, params, 2, seed=5)
    finally:
        check.close()
    assert len(returns) == 2
    # Full episodes last 27,000 agent steps (108k frames) at the limit; these end far sooner.
    assert max(lengths) < 10_000, lengths
    print(f"epsilon-greedy NOOP on Breakout: {returns} in {lengths} steps")


def test_another_env_must_observe_and_act_as_the_runs(tmp_path):
    """--env plays a run's checkpoint on another env id, one its network can take: 84x84
    frames or another action set are refused before anything is loaded."""
    (tmp_path / "config.json").write_text(
        json.dumps({"env": "atari:Pong/no-sticky", "network": "compact_cnn_centered"})
    )
    larger = run("--run-dir", str(tmp_path), "--env", "atari:Pong/84x84")
    assert larger.returncode == 1
    assert "observes uint8 (4, 84, 84)" in larger.stderr, larger.stderr
    assert "atari:Pong/no-sticky, which observes uint8 (4, 42, 42)" in larger.stderr
    actions = run("--run-dir", str(tmp_path), "--env", "atari:Breakout")
    assert actions.returncode == 1
    assert "has 4 actions" in actions.stderr and "which has 6" in actions.stderr, actions.stderr
    unknown = run("--run-dir", str(tmp_path), "--env", "nosuch:thing")
    assert unknown.returncode == 1
    assert "--env nosuch:thing" in unknown.stderr, unknown.stderr


def test_a_checkpoint_plays_on_the_env_it_is_given(tmp_path):
    """A run trained without sticky actions, played with them: the result names the env
    played, not the run's."""
    run_dir = constant_run(tmp_path / "run", "atari:Pong/no-sticky")
    result = run("--run-dir", str(run_dir), "--env", "atari:Pong", "--episodes", "1")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["env"] == "atari:Pong"
    assert summary["episodes"] == 1
    # NOOP for ever: the opponent scores 21 and the agent nothing.
    assert summary["mean"] == -21.0


def test_frames_for_the_unit_count_spread_over_the_whole_play():
    """However long the play, at most `limit` frames are kept, from its start to its end
    at an even stride."""
    sample = FrameSample(limit=64)
    for step in range(10_000):
        sample(np.full((8, 1), step, np.int32))
    steps = sample.frames()[:, 0]
    assert len(steps) == 64
    assert steps[0] == 0 and steps[-1] >= 9_000
    gaps = np.diff(np.unique(steps))
    assert gaps.max() <= 2 * gaps.min()  # about one stride between the steps kept
    short = FrameSample(limit=64)
    short(np.zeros((3, 1), np.int32))
    assert short.frames().shape == (3, 1)


def test_the_unit_count_finds_a_unit_switched_off_for_every_frame():
    from learner.agents.networks import make_network

    network = make_network("compact_cnn_centered", 6, torso_hidden_size=32)
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (64, 4, 42, 42), dtype=np.uint8)
    params = network.init(jax.random.key(0), frames[:1])

    def with_dense_bias(bias) -> dict:
        torso = params["params"]["torso"]
        dense = {**torso["Dense_0"], "bias": bias}
        return {"params": {**params["params"], "torso": {**torso, "Dense_0": dense}}}

    on = torso_units(network, with_dense_bias(jax.numpy.full((32,), 1000.0)), frames)
    assert on == {"units": 32, "off": 0, "active_fraction": 1.0, "frames": 64}
    one_off = jax.numpy.full((32,), 1000.0).at[5].set(-1000.0)
    counted = torso_units(network, with_dense_bias(one_off), frames)
    assert counted["off"] == 1
    assert counted["active_fraction"] == pytest.approx(31 / 32, abs=1e-4)


def test_units_are_counted_on_the_frames_played(tmp_path):
    """--units on a checkpoint whose parameters are all zero: every unit outputs 0 on every
    frame, so all of them are counted as never firing."""
    run_dir = constant_run(tmp_path / "run", "atari:Pong")
    result = run("--run-dir", str(run_dir), "--episodes", "1", "--units")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    units = summary["torso_units"]
    assert units["units"] == 256 and units["off"] == 256 and units["active_fraction"] == 0.0
    # One env, one episode shorter than UNIT_FRAMES steps: every frame it saw.
    assert units["frames"] == summary["lengths"][0] < UNIT_FRAMES
    assert "256 of 256 units never fire" in result.stdout
    plain = run("--run-dir", str(run_dir), "--episodes", "1")
    assert json.loads(plain.stdout.strip().splitlines()[-1])["torso_units"] is None


def test_units_are_refused_for_the_mlp(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"env": "classic:CartPole-v1", "network": "mlp", "mlp_hidden_sizes": [64, 64]})
    )
    result = run("--run-dir", str(tmp_path), "--episodes", "1", "--units")
    assert result.returncode == 1
    assert "--units counts an image torso's last-layer ReLU units" in result.stderr
