"""The torsos: parameter layout of the Nature CNN, and its values and gradients against a reference.

The reference computes the DQN torso from the same parameters in another
formulation (NCHW input, OIHW kernels, the layout PyTorch and ALE use), so a
change of how NatureCNN computes its convolutions (layout, space-to-depth,
patches) must keep both the outputs and the gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from learner.agents.networks import NatureCNN, make_network

OBSERVATION_SHAPE = (4, 84, 84)


def _observations(count: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (count, *OBSERVATION_SHAPE), dtype=np.uint8)


def reference_nature_cnn(params, observations: jax.Array) -> jax.Array:
    """The DQN torso in NCHW with OIHW kernels, from NatureCNN's parameters."""
    x = observations.astype(jnp.float32) / 255.0
    for name, stride in (("Conv_0", 4), ("Conv_1", 2), ("Conv_2", 1)):
        kernel = jnp.transpose(params[name]["kernel"], (3, 2, 0, 1))  # HWIO -> OIHW
        x = lax.conv_general_dilated(
            x,
            kernel,
            (stride, stride),
            "VALID",
            dimension_numbers=("NCHW", "OIHW", "NCHW"),
            precision=lax.Precision.HIGHEST,
        )
        x = jax.nn.relu(x + params[name]["bias"][None, :, None, None])
    # NatureCNN flattens channels-last: [N, H, W, C].
    x = jnp.transpose(x, (0, 2, 3, 1)).reshape(x.shape[0], -1)
    dense = params["Dense_0"]
    return jax.nn.relu(jnp.dot(x, dense["kernel"], precision=lax.Precision.HIGHEST) + dense["bias"])


@pytest.fixture(scope="module")
def torso_params():
    return NatureCNN().init(jax.random.key(0), _observations(1))["params"]


def test_nature_cnn_parameters_keep_their_names_and_shapes(torso_params):
    shapes = jax.tree.map(jnp.shape, torso_params)
    assert shapes == {
        "Conv_0": {"kernel": (8, 8, 4, 32), "bias": (32,)},
        "Conv_1": {"kernel": (4, 4, 32, 64), "bias": (64,)},
        "Conv_2": {"kernel": (3, 3, 64, 64), "bias": (64,)},
        "Dense_0": {"kernel": (7 * 7 * 64, 512), "bias": (512,)},
    }


def _nonzero_biases(params):
    """Small random biases, so the reference's bias placement is tested too."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    return jax.tree.unflatten(
        treedef,
        [
            leaf + 0.01 * jax.random.normal(key, leaf.shape) if leaf.ndim == 1 else leaf
            for leaf, key in zip(leaves, keys, strict=True)
        ],
    )


def test_nature_cnn_matches_the_reference(torso_params):
    params = _nonzero_biases(torso_params)
    observations = jnp.asarray(_observations(3, seed=1))
    got = NatureCNN().apply({"params": params}, observations)
    want = reference_nature_cnn(params, observations)
    assert got.shape == (3, 512)
    assert float(jnp.max(jnp.abs(want))) > 0.0
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_nature_cnn_gradients_match_the_reference(torso_params):
    params = _nonzero_biases(torso_params)
    observations = jnp.asarray(_observations(3, seed=2))
    weights = jax.random.normal(jax.random.key(3), (3, 512))

    def loss(apply):
        return lambda p: jnp.sum(apply(p) * weights)

    got = jax.grad(loss(lambda p: NatureCNN().apply({"params": p}, observations)))(params)
    want = jax.grad(loss(lambda p: reference_nature_cnn(p, observations)))(params)
    for path, got_leaf in jax.tree_util.tree_leaves_with_path(got):
        want_leaf = want
        for key in path:
            want_leaf = want_leaf[key.key]
        scale = float(jnp.max(jnp.abs(want_leaf)))
        assert scale > 0.0, path
        np.testing.assert_allclose(
            got_leaf, want_leaf, rtol=0, atol=1e-4 * scale, err_msg=jax.tree_util.keystr(path)
        )


def test_actor_critic_heads_have_the_expected_shapes():
    network = make_network("nature_cnn", num_actions=6)
    observations = _observations(2)
    params = network.init(jax.random.key(0), observations)
    output = network.apply(params, observations)
    assert output.logits.shape == (2, 6)
    assert output.values.shape == (2,)


@pytest.mark.parametrize(
    ("name", "shape", "own_size"),
    [
        ("compact_cnn_centered", (1, 4, 42, 42), 256),
        ("nature_cnn", (1, 4, 84, 84), 512),
        ("impala_resnet", (1, 4, 42, 42), 256),
        ("smm_cnn", (1, 72, 96, 2), 256),
    ],
)
def test_torso_hidden_size_sizes_the_image_torsos_last_layer(name, shape, own_size):
    observation = np.zeros(shape, np.uint8)

    def last_layer_units(torso_hidden_size: int) -> int:
        network = make_network(name, num_actions=6, torso_hidden_size=torso_hidden_size)
        params = network.init(jax.random.key(0), observation)
        dense = [leaves for layer, leaves in params["params"]["torso"].items() if "Dense" in layer]
        assert len(dense) == 1, params["params"]["torso"].keys()
        output = network.apply(params, observation)
        assert output.logits.shape == (1, 6)
        return dense[0]["kernel"].shape[-1]

    assert last_layer_units(0) == own_size
    assert last_layer_units(96) == 96


@pytest.mark.parametrize(
    ("name", "channels"),
    [("compact_cnn_centered", (32, 64)), ("compact_cnn", (8, 24)), ("impala_resnet", (8, 16))],
)
def test_torso_channels_set_the_convolutions_widths(name, channels):
    observation = np.zeros((1, 4, 42, 42), np.uint8)

    def conv_widths(torso_channels: tuple[int, ...]) -> list[int]:
        network = make_network(name, num_actions=6, torso_channels=torso_channels)
        params = network.init(jax.random.key(0), observation)
        assert network.apply(params, observation).logits.shape == (1, 6)
        torso = params["params"]["torso"]
        # impala_resnet's stage convolutions (its residual blocks keep each stage's width).
        convolutions = sorted(layer for layer in torso if layer.startswith("Conv_"))
        return [torso[layer]["kernel"].shape[-1] for layer in convolutions]

    own = conv_widths(())
    assert own == ([16, 32] if name.startswith("compact") else [16, 32, 32])
    assert conv_widths(channels) == list(channels)


@pytest.mark.parametrize(
    ("name", "channels", "message"),
    [
        ("nature_cnn", (32, 64, 64), "not of nature_cnn"),
        ("mlp", (16, 32), "not of mlp"),
        ("compact_cnn", (16, 32, 32), "takes 2 torso_channels, got 3"),
        ("compact_cnn", (16, 0), "must be positive"),
    ],
)
def test_torso_channels_are_refused_where_they_cannot_apply(name, channels, message):
    with pytest.raises(ValueError, match=message):
        make_network(name, num_actions=6, torso_channels=channels)


def test_torso_hidden_size_is_refused_for_the_mlp():
    with pytest.raises(ValueError, match="mlp_hidden_sizes"):
        make_network("mlp", num_actions=2, torso_hidden_size=32)


# Each image torso with a batch of the observations it is built for.
IMAGE_TORSOS = [
    ("compact_cnn_centered", np.zeros((2, 4, 42, 42), np.uint8)),
    ("compact_cnn", np.zeros((2, 4, 42, 42), np.uint8)),
    ("nature_cnn", np.zeros((2, 4, 84, 84), np.uint8)),
    ("impala_resnet", np.zeros((2, 4, 42, 42), np.uint8)),
    ("smm_cnn", np.zeros((2, 72, 96, 2), np.uint8)),
]


@pytest.mark.parametrize(("name", "observation"), IMAGE_TORSOS)
def test_torso_layer_norm_makes_the_last_layer_blind_to_its_weights_scale(name, observation):
    """With torso_layer_norm the last layer's pre-activations are normalised before the
    ReLU: its kernel and bias scaled by 10 leave the policy as it was; without, they do not."""
    observation = observation + np.arange(observation.size, dtype=np.uint8).reshape(
        observation.shape
    )

    def logits_scaled(layer_norm: bool, scale: float) -> np.ndarray:
        network = make_network(name, 6, torso_hidden_size=16, torso_layer_norm=layer_norm)
        params = network.init(jax.random.key(0), observation)
        torso = params["params"]["torso"]
        assert ("LayerNorm_0" in torso) == layer_norm
        if layer_norm:
            assert torso["LayerNorm_0"]["scale"].shape == (16,)
        dense = jax.tree.map(lambda w: w * scale, torso["Dense_0"])
        params = {"params": {**params["params"], "torso": {**torso, "Dense_0": dense}}}
        return np.asarray(network.apply(params, observation).logits)

    np.testing.assert_allclose(logits_scaled(True, 10.0), logits_scaled(True, 1.0), atol=1e-5)
    assert not np.allclose(logits_scaled(False, 10.0), logits_scaled(False, 1.0), atol=1e-5)


def test_torso_layer_norm_is_refused_for_the_mlp():
    with pytest.raises(ValueError, match="torso_layer_norm"):
        make_network("mlp", num_actions=2, torso_layer_norm=True)


@pytest.mark.parametrize(("name", "observation"), IMAGE_TORSOS)
@pytest.mark.parametrize("layer_norm", [False, True])
def test_a_last_layer_unit_switched_off_for_every_state_learns_again_under_leaky_relu(
    name, observation, layer_norm
):
    """A last-layer unit pushed far below 0 for every input gets no gradient under relu, so
    it stays off for good; under leaky_relu its incoming weights still get one."""
    observation = observation + np.arange(observation.size, dtype=np.uint8).reshape(
        observation.shape
    )

    def off_unit_gradient(activation: str) -> float:
        network = make_network(
            name, 6, torso_hidden_size=8, torso_layer_norm=layer_norm, torso_activation=activation
        )
        params = network.init(jax.random.key(0), observation)
        torso = params["params"]["torso"]
        # Unit 0 off for every input: its bias (LayerNorm's, where there is one) at -1000.
        last = "LayerNorm_0" if layer_norm else "Dense_0"
        bias = torso[last]["bias"].at[0].set(-1000.0)
        torso = {**torso, last: {**torso[last], "bias": bias}}
        params = {"params": {**params["params"], "torso": torso}}

        def loss(params):
            output = network.apply(params, observation)
            return jnp.sum(output.logits**2) + jnp.sum(output.values**2)

        gradient = jax.grad(loss)(params)["params"]["torso"]
        return float(jnp.abs(gradient[last]["bias"][0]))

    assert off_unit_gradient("relu") == 0.0
    assert off_unit_gradient("leaky_relu") > 0.0


@pytest.mark.parametrize(
    ("name", "activation", "message"),
    [
        ("mlp", "leaky_relu", "the mlp network's is tanh"),
        ("compact_cnn", "gelu", "unknown torso_activation 'gelu'; choose one of relu, leaky_relu"),
    ],
)
def test_torso_activation_is_refused_where_it_cannot_apply(name, activation, message):
    with pytest.raises(ValueError, match=message):
        make_network(name, num_actions=2, torso_activation=activation)


@pytest.mark.parametrize("name", ["nature_cnn", "compact_cnn", "smm_cnn"])
def test_relu_torso_kernels_start_orthogonal_with_relus_gain(name):
    """Each ReLU layer of the convolutional torsos starts with W^T W = 2 I (fan-in rows
    by fan-out columns): it keeps its input's scale, where LeCun's variance halves it
    at every layer and lets the first updates' bias steps switch whole torsos off."""
    observation = {
        "nature_cnn": np.zeros((1, 4, 84, 84), np.uint8),
        "compact_cnn": np.zeros((1, 4, 42, 42), np.uint8),
        "smm_cnn": np.zeros((1, 72, 96, 2), np.uint8),
    }[name]
    params = make_network(name, num_actions=6).init(jax.random.key(0), observation)
    torso = params["params"]["torso"]
    assert len(torso) >= 3, torso.keys()
    for layer, leaves in torso.items():
        kernel = np.asarray(leaves["kernel"], np.float64)
        kernel = kernel.reshape(-1, kernel.shape[-1])
        fan_in, fan_out = kernel.shape
        assert fan_in >= fan_out, (layer, kernel.shape)
        np.testing.assert_allclose(
            kernel.T @ kernel, 2.0 * np.eye(fan_out), atol=1e-4, err_msg=f"{name} {layer}"
        )


def test_centered_compact_cnn_sees_each_frame_less_its_median_shade():
    """A shade added to a whole frame changes nothing `compact_cnn_centered` computes: its
    first layer works on frames less their median shade, so Atari's uniform backgrounds
    do not switch its channels off (networks._centered_frames). The same parameters in
    `compact_cnn` do see the shade."""
    network = make_network("compact_cnn_centered", num_actions=6)
    rng = np.random.default_rng(3)
    frames = rng.integers(0, 100, (2, 4, 42, 42), dtype=np.uint8)
    params = network.init(jax.random.key(1), frames)
    shaded = frames.copy()
    shaded[:, 1] += 80  # one of the four stacked frames, brighter all over
    shaded[1, 3] += 40
    out, shaded_out = network.apply(params, frames), network.apply(params, shaded)
    np.testing.assert_allclose(shaded_out.logits, out.logits, atol=1e-5)
    np.testing.assert_allclose(shaded_out.values, out.values, atol=1e-5)
    # Not blind to the frames: moving one bright square changes the outputs.
    moved = frames.copy()
    moved[:, 0, 10:14, 10:14] = 255
    assert not np.allclose(network.apply(params, moved).values, out.values, atol=1e-5)
    plain = make_network("compact_cnn", num_actions=6)
    assert not np.allclose(
        plain.apply(params, shaded).values, plain.apply(params, frames).values, atol=1e-5
    )


@pytest.mark.parametrize("game", ["Pong", "Breakout"])
def test_centring_puts_a_real_atari_background_at_zero(game):
    """On real 42x42 frames the shade taken off is the background's, whatever it is (Pong's
    field is grey, Breakout's black): at least half of each frame is exactly 0 after, and the
    shade is the median of the sampled pixels, as numpy computes it."""
    from envs import registry
    from learner.agents.networks import _background_shade, _centered_frames

    env = registry.make(f"atari:{game}/42x42", 4, seed=0)
    rng = np.random.default_rng(0)
    frames = [env.reset().observations]
    for _ in range(60):
        frames.append(env.step(rng.integers(0, 4, 4)).observations)
    env.close()
    pixels = np.concatenate(frames)[:, 0]  # [N, H, W] uint8
    x = jnp.asarray(pixels[..., None], jnp.float32) / 255.0
    shade = np.asarray(_background_shade(x))[:, 0, 0, 0] * 255.0
    np.testing.assert_allclose(shade, np.median(pixels[:, ::2, ::2], axis=(1, 2)), atol=1e-3)
    zero = np.mean(np.asarray(_centered_frames(x)) == 0.0, axis=(1, 2, 3))
    assert zero.min() >= 0.5, zero.min()
    if game == "Breakout":
        assert shade.max() == 0.0  # black already: nothing to take off
    else:
        assert shade.min() > 50  # the field's grey, to be taken off
