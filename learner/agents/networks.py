"""Torsos and the actor-critic head, in flax.

Image observations arrive as the actors send them: uint8 [B, C, H, W] with the
stacked frames as channels (ale-py's layout). They are scaled to [0, 1] and
moved to channels-last, the layout XLA's convolutions prefer, inside the
network, so the wire and the unroll store keep the compact uint8 form.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple, get_args

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import traverse_util

from learner.backends.cpu.onednn_conv import conv_bias_relu

NetworkName = Literal[
    "nature_cnn", "compact_cnn", "compact_cnn_centered", "impala_resnet", "smm_cnn", "mlp"
]
CONV_RELU_TORSOS: tuple[NetworkName, ...] = (
    "nature_cnn",
    "compact_cnn",
    "compact_cnn_centered",
    "smm_cnn",
)
"""The torsos whose convolutions are `_ConvReLU`s: on oneDNN in the policy on a CPU."""


def _images_to_float(observations: jax.Array) -> jax.Array:
    """uint8 [B, C, H, W] -> float32 [B, H, W, C] in [0, 1]."""
    return jnp.transpose(observations.astype(jnp.float32) / 255.0, (0, 2, 3, 1))


# Orthogonal kernels with ReLU's gain of sqrt 2 (Saxe et al.; PPO's Atari torso): each
# layer keeps the scale of its input, where LeCun's variance halves it at every ReLU
# layer. Atari frames share most of their pixels between states, so a torso's units
# differ between states by a few percent of their mean; Adam's first steps move every
# bias by about the learning rate whatever its gradient, and a torso that starts three
# times smaller can have every unit switched off for every state in its first minute,
# after which it outputs a constant and never learns (docs/learning.md).
# A Python float: a jax value here would start JAX's backend at import, before the entry
# points choose the CPU device count.
_relu_init = nn.initializers.orthogonal(math.sqrt(2.0))


class _ConvReLU(nn.Module):
    """relu(nn.Conv(padding="VALID")(x)) as one op, with nn.Conv's parameters.

    The parameters have nn.Conv's names and shapes, so checkpoints keep the
    tree they had with nn.Conv; the kernel starts as `_relu_init`. The op
    (backends/cpu/onednn_conv.py) runs on oneDNN in the policy on a CPU and otherwise as
    lax's convolution, strided layers taking their input gradient through
    space-to-depth (backends/cpu/strided_conv.py).
    """

    features: int
    kernel_size: tuple[int, int]
    strides: tuple[int, int]

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        shape = (*self.kernel_size, x.shape[-1], self.features)
        kernel = self.param("kernel", _relu_init, shape, jnp.float32)
        bias = self.param("bias", nn.initializers.zeros_init(), (self.features,), jnp.float32)
        return conv_bias_relu(x, kernel, bias, self.strides)


TorsoActivation = Literal["relu", "leaky_relu"]
TORSO_ACTIVATIONS: tuple[TorsoActivation, ...] = get_args(TorsoActivation)

# Under ReLU a unit of an image torso's last layer whose inputs an update pushes below 0 for
# every state gets no gradient again and stays off. Leaky ReLU passes it a hundredth of its
# gradient, and Adam scales each parameter's step by its own gradient's size, so such a
# unit can move back at about the speed of the others (docs/learning.md, "What was tried").
_activations = {"relu": nn.relu, "leaky_relu": nn.leaky_relu}


def _dense_layer(
    x: jax.Array, hidden_size: int, layer_norm: bool, activation: str = "relu", **dense: Any
) -> jax.Array:
    """An image torso's last layer on its flattened features; called inside a module's
    compact __call__. `layer_norm`: LayerNorm on the pre-activations, before the
    activation, so the units' inputs keep one scale however the convolutions' outputs
    drift (docs/learning.md, "What was tried"). `activation`: one of TORSO_ACTIVATIONS."""
    x = nn.Dense(hidden_size, **dense)(x.reshape(x.shape[0], -1))
    return _activations[activation](nn.LayerNorm()(x) if layer_norm else x)


def _nature_layers(x: jax.Array, hidden_size: int, layer_norm: bool, activation: str) -> jax.Array:
    """The DQN layers on float [B, H, W, C]; called inside a module's compact __call__."""
    # Named as nn.Conv layers were, so checkpoints keep their parameter tree.
    x = _ConvReLU(32, (8, 8), (4, 4), name="Conv_0")(x)
    x = _ConvReLU(64, (4, 4), (2, 2), name="Conv_1")(x)
    x = _ConvReLU(64, (3, 3), (1, 1), name="Conv_2")(x)
    return _dense_layer(x, hidden_size, layer_norm, activation, kernel_init=_relu_init)


class NatureCNN(nn.Module):
    """The DQN torso of Mnih et al. 2015: three convolutions and a 512-unit layer."""

    hidden_size: int = 512
    layer_norm: bool = False
    activation: TorsoActivation = "relu"

    @nn.compact
    def __call__(self, observations: jax.Array) -> jax.Array:
        x = _images_to_float(observations)
        return _nature_layers(x, self.hidden_size, self.layer_norm, self.activation)


def _background_shade(x: jax.Array) -> jax.Array:
    """float [B, H, W, C] in [0, 1] -> [B, 1, 1, C]: each frame's median shade, to 1/255.

    The median of every other row and column, found a bit at a time by counting the
    pixels below each candidate shade: eight compares and sums per frame. XLA's sort,
    which jnp.median uses, costs 40x the whole centring on a CPU batch of 640.
    """
    sample = x[:, ::2, ::2] * 255.0
    half = sample.shape[1] * sample.shape[2] / 2
    shade = jnp.zeros((x.shape[0], 1, 1, x.shape[3]), jnp.float32)
    for bit in (128, 64, 32, 16, 8, 4, 2, 1):
        candidate = shade + bit
        below = jnp.sum(sample < candidate - 0.5, axis=(1, 2), keepdims=True)
        shade = jnp.where(below < half, candidate, shade)
    return shade / 255.0


def _centered_frames(x: jax.Array) -> jax.Array:
    """float [B, H, W, C] -> each frame less its median shade (`compact_cnn_centered`).

    Most of an Atari frame is one background shade (Pong's field is 0.34 on 81% of
    it). Uncentered, a first-layer kernel's gradient is mostly that shade times the same
    upstream sum at every input, so Adam moves all its weights by about the learning
    rate in one direction, and the channel's pre-activation everywhere by ~20 such
    steps at once: in Pong runs of the compact CNN 13 to 15 of the 16 first-layer
    channels ended off for every state. Less the median, the background is 0 wherever
    it covers half the frame and moves only the bias; all 16 stay active. The mean
    would miss it where the background is already black (Breakout's: 0 on 60% of the
    frame, mean 0.16) and re-create the coupling there (docs/learning.md).
    """
    return x - jax.lax.stop_gradient(_background_shade(x))


class CompactCNN(nn.Module):
    """Two strided convolutions (16 of 4x4/2, 32 of 4x4/2) and a dense layer (256 units);
    `channels` sets the convolutions' widths.

    Sized for 42x42 frames (atari:GAME/42x42), where it costs about a quarter
    of the Nature CNN's update at 84x84: on a CPU the update's arithmetic
    decides how many frames a minute trains on. `centered`: each frame less its
    median shade first (`_centered_frames`).
    """

    centered: bool = False
    hidden_size: int = 256
    channels: Sequence[int] = (16, 32)
    layer_norm: bool = False
    activation: TorsoActivation = "relu"

    @nn.compact
    def __call__(self, observations: jax.Array) -> jax.Array:
        x = _images_to_float(observations)
        if self.centered:
            x = _centered_frames(x)
        for index, channels in enumerate(self.channels):
            x = _ConvReLU(channels, (4, 4), (2, 2), name=f"Conv_{index}")(x)
        return _dense_layer(
            x, self.hidden_size, self.layer_norm, self.activation, kernel_init=_relu_init
        )


class _ResidualBlock(nn.Module):
    channels: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        y = nn.Conv(self.channels, (3, 3))(nn.relu(x))
        y = nn.Conv(self.channels, (3, 3))(nn.relu(y))
        return x + y


class ImpalaResNet(nn.Module):
    """The deep torso of the IMPALA paper (figure 3, right): 15 convolutions."""

    channels: Sequence[int] = (16, 32, 32)
    hidden_size: int = 256
    layer_norm: bool = False
    activation: TorsoActivation = "relu"

    @nn.compact
    def __call__(self, observations: jax.Array) -> jax.Array:
        x = _images_to_float(observations)
        for channels in self.channels:
            x = nn.Conv(channels, (3, 3))(x)
            x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
            x = _ResidualBlock(channels)(x)
            x = _ResidualBlock(channels)(x)
        return _dense_layer(nn.relu(x), self.hidden_size, self.layer_norm, self.activation)


def _unpack_bits(packed: jax.Array) -> jax.Array:
    """uint8 [B, H, W, C/8] packed planes (plane c at bit c % 8) -> float32 [B, H, W, C]."""
    bits = jnp.arange(8, dtype=jnp.uint8)
    planes = (packed[..., None] >> bits) & jnp.uint8(1)
    return planes.reshape(*packed.shape[:-1], packed.shape[-1] * 8).astype(jnp.float32)


class SMMCNN(nn.Module):
    """A small CNN for Google Research Football's super mini-map.

    Input: the 72x96 binary planes (4 per step, 4 steps) as packed bits, uint8
    [B, 72, 96, 2], unpacked here: the wire and the unroll store carry 8x fewer
    bytes than the planes. Nature-CNN shaped (three convolutions, one dense
    layer) so that it trains at env speed on CPU; `impala_resnet` is SEED's
    deeper choice on accelerators.
    """

    hidden_size: int = 256
    layer_norm: bool = False
    activation: TorsoActivation = "relu"

    @nn.compact
    def __call__(self, observations: jax.Array) -> jax.Array:
        x = _unpack_bits(observations)
        return _nature_layers(x, self.hidden_size, self.layer_norm, self.activation)


class MLP(nn.Module):
    """A torso for vector observations [B, D] (any float or int dtype)."""

    hidden_sizes: Sequence[int] = (64, 64)

    @nn.compact
    def __call__(self, observations: jax.Array) -> jax.Array:
        x = observations.reshape(observations.shape[0], -1).astype(jnp.float32)
        for size in self.hidden_sizes:
            x = nn.tanh(nn.Dense(size)(x))
        return x


class PolicyOutput(NamedTuple):
    logits: jax.Array
    """[B, num_actions] unnormalised log-probabilities."""
    values: jax.Array
    """[B] state values V(x)."""


class ActorCritic(nn.Module):
    """A torso followed by a policy head and a value head.

    With `value_torso`, the value head has a torso of its own. Vector tasks
    use that: their unclipped returns make value gradients far larger than
    policy gradients, and a shared torso would be shaped by the value alone.
    """

    torso: nn.Module
    num_actions: int
    value_torso: nn.Module | None = None

    @nn.compact
    def __call__(self, observations: jax.Array) -> PolicyOutput:
        features = self.torso(observations)
        value_features = features if self.value_torso is None else self.value_torso(observations)
        # Small initial logits: the first policy is near uniform.
        logits = nn.Dense(self.num_actions, kernel_init=nn.initializers.orthogonal(0.01))(features)
        values = nn.Dense(1, kernel_init=nn.initializers.orthogonal(1.0))(value_features)
        return PolicyOutput(logits=logits, values=values[:, 0])


class _ResettingLSTM(nn.Module):
    """One LSTM step whose state is zeroed first where an episode starts."""

    size: int

    @nn.compact
    def __call__(self, state: jax.Array, inputs: tuple[jax.Array, jax.Array]):
        features, first = inputs
        state = jnp.where(first[:, None, None], 0.0, state)
        (c, h), out = nn.OptimizedLSTMCell(self.size)((state[:, 0], state[:, 1]), features)
        return jnp.stack([c, h], axis=1), out


class RecurrentActorCritic(nn.Module):
    """A torso, an LSTM core, and the policy and value heads (SEED's and IMPALA's agent).

    The core state is one array [B, 2, size] (the LSTM's c and h). It is
    zeroed where an observation starts an episode (`first`), so an env's
    memory never crosses episodes, whatever state came in.
    """

    torso: nn.Module
    num_actions: int
    core_size: int

    @nn.compact
    def __call__(
        self, observations: jax.Array, first: jax.Array, state: jax.Array
    ) -> tuple[PolicyOutput, jax.Array]:
        """observations [T, B, ...], first bool [T, B], state [B, 2, size] ->
        (PolicyOutput with [T, B] leading dimensions, the state after step T-1)."""
        steps, batch = first.shape
        features = self.torso(observations.reshape(steps * batch, *observations.shape[2:]))
        features = features.reshape(steps, batch, -1)
        core = nn.scan(
            _ResettingLSTM,
            variable_broadcast="params",
            split_rngs={"params": False},
            in_axes=0,
            out_axes=0,
        )(self.core_size)
        state, outputs = core(state, (features, first))
        logits = nn.Dense(self.num_actions, kernel_init=nn.initializers.orthogonal(0.01))(outputs)
        values = nn.Dense(1, kernel_init=nn.initializers.orthogonal(1.0))(outputs)
        return PolicyOutput(logits=logits, values=values[..., 0]), state

    def initial_state(self, batch: int) -> jax.Array:
        return jnp.zeros((batch, *core_state_shape(self.core_size)), jnp.float32)


def core_state_shape(core_size: int) -> tuple[int, int]:
    """One env's core state: the LSTM's c and h."""
    return (2, core_size)


FORGET_BIAS = 1.0
"""The LSTM's forget-gate bias at initialisation, as Keras's LSTM cell (SEED's agent) starts
it, where flax's starts at 0: the gate starts mostly open (sigmoid(1) = 0.73 instead of 0.5),
so what the cell holds fades over tens of steps instead of a few, and the gradient reaches
the step that wrote it (docs/architecture.md, "Recurrent agents")."""


def _forget_bias(params, value: float):
    """`params` with `value` added to every LSTM forget gate's bias (flax names it hf)."""
    flat = traverse_util.flatten_dict(params)
    return traverse_util.unflatten_dict(
        {path: leaf + value if path[-2:] == ("hf", "bias") else leaf for path, leaf in flat.items()}
    )


def init_params(
    network: ActorCritic | RecurrentActorCritic, key: jax.Array, observation: jax.Array
) -> dict:
    """The network's initial parameters from one example observation [1, ...] (a recurrent
    network takes it as one step of one env, with its first flag and zero state).

    One compiled program: flax's init run op by op compiles each of its ops apart (40
    programs for the CartPole MLP), each too short for the persistent cache to keep."""
    if isinstance(network, RecurrentActorCritic):

        def recurrent_init(key, observation):
            first = jnp.ones((1, 1), jnp.bool_)
            params = network.init(key, observation[None], first, network.initial_state(1))
            return _forget_bias(params, FORGET_BIAS)

        return jax.jit(recurrent_init)(key, observation)
    return jax.jit(network.init)(key, observation)


class NetworkMismatch(ValueError):
    """A network that cannot read the env's observations, with what would."""


# Smallest height and width the DQN layers take (8x8/4, 4x4/2, 3x3/1, all VALID).
_NATURE_MIN_SIZE = 36
# ... and the compact torso's (4x4/2 twice, VALID).
_COMPACT_MIN_SIZE = 10
# The image torsos and the smallest frame side each takes.
_IMAGE_MIN_SIZE: dict[str, int] = {
    "nature_cnn": _NATURE_MIN_SIZE,
    "compact_cnn": _COMPACT_MIN_SIZE,
    "compact_cnn_centered": _COMPACT_MIN_SIZE,
    "impala_resnet": 1,
}


def check_network_fits(name: NetworkName, dtype: str, shape: Sequence[int]) -> None:
    """Raises NetworkMismatch when network `name` cannot take observations dtype[shape]
    (one observation, no batch dimension), saying which network fits instead."""
    observation = f"{dtype}[{','.join(map(str, shape))}]"
    if name == "mlp":
        return
    if name in _IMAGE_MIN_SIZE:
        wanted = "uint8 images [C, H, W] (stacked frames as channels)"
        minimum = _IMAGE_MIN_SIZE[name]
        fits = dtype == "uint8" and len(shape) == 3 and min(shape[1:]) >= minimum
    elif name == "smm_cnn":
        wanted = "football's packed mini-map, uint8 [H, W, planes/8]"
        fits = dtype == "uint8" and len(shape) == 3 and min(shape[:2]) >= _NATURE_MIN_SIZE
    else:
        return  # not a network of ours: make_network names the choices
    if fits:
        return
    if len(shape) == 1:
        hint = "mlp"
    elif dtype == "uint8" and len(shape) == 3 and shape[-1] < shape[0]:
        hint = "smm_cnn"  # channels last: the packed mini-map
    elif dtype == "uint8" and len(shape) == 3:
        hint = "nature_cnn, compact_cnn or impala_resnet"
    else:
        hint = "mlp (it flattens any observation)"
    raise NetworkMismatch(
        f"--network {name} takes {wanted}, but this env's observations are {observation}; "
        f"use --network {hint}"
    )


# The torsos whose convolution widths `torso_channels` sets, and how many widths each takes
# (None: any number of stages).
_CHANNEL_COUNTS: dict[str, int | None] = {
    "compact_cnn": len(CompactCNN.channels),
    "compact_cnn_centered": len(CompactCNN.channels),
    "impala_resnet": None,
}


def check_torso_channels(name: str, torso_channels: Sequence[int]) -> None:
    """ValueError unless `name` is a torso `torso_channels` can size, in as many widths."""
    if name not in _CHANNEL_COUNTS:
        raise ValueError(
            f"torso_channels sets the widths of {', '.join(_CHANNEL_COUNTS)}; not of {name}"
        )
    count = _CHANNEL_COUNTS[name]
    if count is not None and len(torso_channels) != count:
        raise ValueError(f"{name} takes {count} torso_channels, got {len(torso_channels)}")
    if min(torso_channels, default=1) < 1:
        raise ValueError(f"torso_channels must be positive, got {torso_channels}")


def check_torso_options(
    name: str, torso_hidden_size: int, torso_layer_norm: bool, torso_activation: str = "relu"
) -> None:
    """ValueError where the image torsos' last-layer options are given to the mlp, or the
    activation is not one of TORSO_ACTIVATIONS."""
    if torso_activation not in TORSO_ACTIVATIONS:
        raise ValueError(
            f"unknown torso_activation {torso_activation!r}; choose one of "
            + ", ".join(TORSO_ACTIVATIONS)
        )
    if name != "mlp":
        return
    if torso_hidden_size:
        raise ValueError(
            "torso_hidden_size sizes an image torso; the mlp network's layers are mlp_hidden_sizes"
        )
    if torso_layer_norm:
        raise ValueError(
            "torso_layer_norm normalises an image torso's last layer; not the mlp network's"
        )
    if torso_activation != "relu":
        raise ValueError(
            "torso_activation is an image torso's last layer's; the mlp network's is tanh"
        )


def make_network(
    name: NetworkName,
    num_actions: int,
    mlp_hidden_sizes: Sequence[int] = (64, 64),
    lstm_size: int = 0,
    torso_hidden_size: int = 0,
    torso_channels: Sequence[int] = (),
    torso_layer_norm: bool = False,
    torso_activation: TorsoActivation = "relu",
) -> ActorCritic | RecurrentActorCritic:
    """The torso `name` and the heads; with `lstm_size`, an LSTM core between them.
    `torso_hidden_size`: units of an image torso's last layer (0: the torso's own);
    `torso_channels`: the compact CNNs' or impala_resnet's convolution widths (empty: their own);
    `torso_layer_norm`: LayerNorm on an image torso's last layer, before its activation;
    `torso_activation`: that layer's activation (TORSO_ACTIVATIONS)."""
    hidden = tuple(mlp_hidden_sizes)
    torso_channels = tuple(torso_channels)
    if torso_channels:
        check_torso_channels(name, torso_channels)
    # The last layer's options, passed only where given, so each torso keeps its own defaults.
    last_layer: dict[str, Any] = {"hidden_size": torso_hidden_size} if torso_hidden_size else {}
    if torso_layer_norm:
        last_layer["layer_norm"] = True
    if torso_activation != "relu":
        last_layer["activation"] = torso_activation
    widened = {**last_layer, "channels": torso_channels} if torso_channels else last_layer
    torsos = {
        "nature_cnn": lambda: NatureCNN(**last_layer),
        "compact_cnn": lambda: CompactCNN(**widened),
        "compact_cnn_centered": lambda: CompactCNN(centered=True, **widened),
        "impala_resnet": lambda: ImpalaResNet(**widened),
        "smm_cnn": lambda: SMMCNN(**last_layer),
        "mlp": lambda: MLP(hidden),
    }
    if name not in torsos:
        raise ValueError(f"unknown network {name!r}; choose one of {', '.join(torsos)}")
    check_torso_options(name, torso_hidden_size, torso_layer_norm, torso_activation)
    if lstm_size:
        return RecurrentActorCritic(torsos[name](), num_actions, lstm_size)
    # The feed-forward mlp has a value torso of its own (see ActorCritic).
    value_torso = MLP(hidden) if name == "mlp" else None
    return ActorCritic(torso=torsos[name](), num_actions=num_actions, value_torso=value_torso)
