from __future__ import annotations

import dataclasses

import jax
import pytest

from learner.backends.devices import Placement
from learner.config import LearnerConfig
from learner.main import parse_cli
from learner.presets import PRESETS, preset_for
from learner.training.settings import fused_batch_update


def test_the_env_family_picks_the_preset():
    config = parse_cli(["--env", "classic:CartPole-v1"])
    assert config.preset == "classic" and config.network == "mlp"
    assert config.reward_clipping == "none"
    atari = parse_cli(["--env", "atari:Breakout"])
    assert atari.preset == "atari" and atari.network == "compact_cnn_centered"
    assert atari.env == "atari:Breakout"
    # The DQN frame size takes the Nature CNN's preset.
    dqn = parse_cli(["--env", "atari:Breakout/no-sticky/84x84"])
    assert dqn.preset == "atari_84" and dqn.network == "nature_cnn"
    assert parse_cli(["--env", "atari:Pong/48x48"]).preset == "atari"


def test_flags_override_the_preset():
    config = parse_cli(
        ["--env", "classic:CartPole-v1", "--learning-rate", "0.01", "--clip-rho-threshold", "None"]
    )
    assert config.learning_rate == 0.01
    assert config.clip_rho_threshold is None
    assert config.unroll_length == PRESETS["classic"].unroll_length


def test_an_explicit_preset_wins_over_the_family():
    config = parse_cli(["--env", "classic:Acrobot-v1", "--preset", "counting"])
    assert config.preset == "counting" and config.env == "classic:Acrobot-v1"


def test_unknown_preset_is_a_clear_error():
    with pytest.raises(SystemExit, match="no preset 'mujoco'"):
        parse_cli(["--env", "mujoco:Ant"])
    with pytest.raises(ValueError, match="no preset"):
        preset_for("atari:Pong", "fast")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("unroll_queue_size", 4, "must hold at least one batch"),
        ("discount", 1.5, "outside"),
        ("port", 70000, "outside 0..65535"),
        ("clip_rho_threshold", 0.0, "positive or None"),
        ("inference_timeout_ms", -1.0, "must not be negative"),
        ("reward_scale", 0.0, "reward_scale 0.0 must be positive and finite"),
        ("reward_scale", -0.1, "must be positive and finite"),
        ("reward_scale", float("nan"), "must be positive and finite"),
        ("reward_scale", float("inf"), "must be positive and finite"),
        ("stop_eval_episodes", -1, "stop_eval_episodes must not be negative"),
        ("stop_eval_episodes", 20, "give --stop-at-return too"),
        ("batch_passes", 0, "batch_passes must be at least 1"),
        ("minibatches", 3, "must divide batch_size"),
        ("minibatches", 0, "must divide batch_size"),
        ("policy_clip", 1.5, "must be in \\(0, 1\\)"),
        ("policy_clip", 0.0, "must be in \\(0, 1\\)"),
        ("torso_hidden_size", -1, "torso_hidden_size must not be negative"),
        ("torso_channels", (32, 64), "not of nature_cnn"),
    ],
)
def test_bad_values_say_why(field, value, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(LearnerConfig(), **{field: value})


def test_torso_hidden_size_is_refused_for_the_mlp_network():
    with pytest.raises(ValueError, match="mlp_hidden_sizes"):
        LearnerConfig(network="mlp", torso_hidden_size=128)
    assert LearnerConfig(network="compact_cnn", torso_hidden_size=128).torso_hidden_size == 128


def test_torso_activation_is_checked():
    with pytest.raises(ValueError, match="unknown torso_activation 'swish'"):
        LearnerConfig(torso_activation="swish")
    with pytest.raises(ValueError, match="the mlp network's is tanh"):
        LearnerConfig(network="mlp", torso_activation="leaky_relu")
    assert LearnerConfig(torso_activation="leaky_relu").torso_activation == "leaky_relu"


def test_torso_layer_norm_is_refused_for_the_mlp_network():
    with pytest.raises(ValueError, match="torso_layer_norm normalises an image torso"):
        LearnerConfig(network="mlp", torso_layer_norm=True)
    assert LearnerConfig(network="compact_cnn_centered", torso_layer_norm=True).torso_layer_norm


def test_torso_channels_fit_the_torso():
    with pytest.raises(ValueError, match="takes 2 torso_channels, got 3"):
        LearnerConfig(network="compact_cnn_centered", torso_channels=(16, 32, 32))
    with pytest.raises(ValueError, match="must be positive"):
        LearnerConfig(network="impala_resnet", torso_channels=(16, 0, 32))
    assert LearnerConfig(network="impala_resnet", torso_channels=(8, 16, 16, 32)).torso_channels
    assert LearnerConfig(network="compact_cnn", torso_channels=(32, 64)).torso_channels == (32, 64)


def test_every_field_has_a_flag(capsys):
    with pytest.raises(SystemExit):
        parse_cli(["--help"])
    help_text = capsys.readouterr().out
    for field in dataclasses.fields(LearnerConfig):
        assert "--" + field.name.replace("_", "-") in help_text


def test_batch_update_is_stepped_on_a_cpu_unless_asked():
    """--batch-update auto trains a CPU's batches step by step (XLA:CPU runs one program of
    many steps slower) and other devices' in one call; a value names either outright."""
    cpu = Placement(jax.devices("cpu")[:1])
    assert not fused_batch_update(parse_cli(["--env", "atari:Pong"]), cpu)
    assert fused_batch_update(parse_cli(["--env", "atari:Pong", "--batch-update", "fused"]), cpu)
    stepped = parse_cli(["--env", "atari:Pong", "--batch-update", "stepped"])
    assert not fused_batch_update(stepped, cpu)
    with pytest.raises(SystemExit):
        parse_cli(["--env", "atari:Pong", "--batch-update", "sometimes"])
