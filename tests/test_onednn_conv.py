"""learner.backends.cpu.onednn_conv: convolutions and their kernel gradients on oneDNN through
XLA's FFI.

The native library is built when the package is installed (hatch_build.py);
on Linux x86_64 these tests require it, so a build that silently failed
fails here instead of leaving the policy on the slower kernels.
"""

from __future__ import annotations

import concurrent.futures
import platform
import re
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import hatch_build
from learner.agents import networks
from learner.backends.cpu import onednn_conv
from learner.backends.cpu.onednn_conv import conv_bias_relu
from learner.inference import policy as policy_fns

BUILT_HERE = sys.platform == "linux" and platform.machine() == "x86_64"
needs_library = pytest.mark.skipif(not BUILT_HERE, reason="oneDNN's wheels are Linux x86_64 only")


def _reference(x, kernel, bias, strides, pads, relu):
    y = (
        lax.conv_general_dilated(
            x,
            kernel,
            strides,
            pads,
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
            precision=lax.Precision.HIGHEST,
        )
        + bias
    )
    return jax.nn.relu(y) if relu else y


def _arrays(rows, height, width, channels, kernel_size, features, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, height, width, channels), dtype=np.float32)
    kernel = rng.standard_normal((*kernel_size, channels, features), dtype=np.float32) * 0.2
    bias = rng.standard_normal((features,), dtype=np.float32)
    return jnp.asarray(x), jnp.asarray(kernel), jnp.asarray(bias)


def _targets(fn, *args, target: str = onednn_conv.TARGET) -> int:
    """How many calls of a oneDNN FFI target (the convolution's by default) the program makes."""
    return _calls(jax.jit(fn).lower(*args).as_text(), target)


def _calls(program: str, target: str) -> int:
    """Custom calls of `target` in a lowered program's text."""
    return len(re.findall(rf"custom_call @{target}\b", program))


@needs_library
def test_the_library_was_built_and_loads():
    assert onednn_conv.unavailable_reason() is None
    assert onednn_conv.LIBRARY.exists()


@needs_library
@pytest.mark.parametrize(
    ("rows", "height", "width", "channels", "kernel_size", "features", "strides", "pads", "relu"),
    [
        (16, 84, 84, 4, (8, 8), 32, (4, 4), ((0, 0), (0, 0)), True),  # Nature CNN, layer 1
        (64, 20, 20, 32, (4, 4), 64, (2, 2), ((0, 0), (0, 0)), True),  # layer 2
        (5, 9, 9, 64, (3, 3), 64, (1, 1), ((0, 0), (0, 0)), True),  # layer 3, uneven slices
        (32, 42, 42, 4, (4, 4), 16, (2, 2), ((0, 0), (0, 0)), True),  # compact CNN, layer 1
        (32, 20, 20, 16, (4, 4), 32, (2, 2), ((0, 0), (0, 0)), True),  # layer 2
        (3, 11, 7, 3, (3, 2), 5, (1, 2), ((1, 1), (0, 1)), False),  # padded, no ReLU
        (2, 12, 12, 16, (3, 3), 8, (2, 2), ((1, 1), (1, 1)), True),
    ],
)
def test_equals_lax_where_it_runs_on_onednn(
    rows, height, width, channels, kernel_size, features, strides, pads, relu
):
    x, kernel, bias = _arrays(rows, height, width, channels, kernel_size, features)

    def fast(x, kernel, bias):
        return conv_bias_relu(x, kernel, bias, strides, pads, relu)

    assert _targets(fast, x, kernel, bias) == 1
    got = jax.jit(fast)(x, kernel, bias)
    want = _reference(x, kernel, bias, strides, pads, relu)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    if relu:
        assert float(jnp.min(got)) == 0.0 and float(jnp.max(got)) > 0.0


@needs_library
def test_lax_for_one_row():
    x, kernel, bias = _arrays(8, 20, 20, 32, (4, 4), 64)

    def one_row(x, kernel, bias):
        return conv_bias_relu(x[:1], kernel, bias, (2, 2))

    assert _targets(one_row, x, kernel, bias) == 0
    np.testing.assert_allclose(
        jax.jit(one_row)(x, kernel, bias),
        _reference(x[:1], kernel, bias, (2, 2), ((0, 0), (0, 0)), True),
        rtol=1e-5,
        atol=1e-5,
    )


@needs_library
@pytest.mark.parametrize(
    ("rows", "height", "width", "channels", "kernel_size", "features", "strides", "pads", "relu"),
    [
        (42, 42, 42, 4, (4, 4), 16, (2, 2), ((0, 0), (0, 0)), True),  # compact CNN, layer 1
        (42, 20, 20, 16, (4, 4), 32, (2, 2), ((0, 0), (0, 0)), True),  # layer 2
        (5, 9, 9, 64, (3, 3), 64, (1, 1), ((0, 0), (0, 0)), True),  # Nature, layer 3
        (3, 11, 7, 3, (3, 2), 5, (1, 2), ((1, 1), (0, 1)), False),  # padded, no ReLU
        (7, 17, 17, 3, (5, 5), 4, (3, 3), ((0, 0), (0, 0)), True),  # kernel not a stride multiple
    ],
)
def test_gradients_through_the_onednn_path_are_laxs(
    rows, height, width, channels, kernel_size, features, strides, pads, relu
):
    """The kernel's and the bias's gradients from oneDNN's call, the input's from XLA's."""
    x, kernel, bias = _arrays(rows, height, width, channels, kernel_size, features, seed=2)

    def loss(fast):
        def f(x, kernel, bias):
            if fast:
                y = conv_bias_relu(x, kernel, bias, strides, pads, relu)
            else:
                y = _reference(x, kernel, bias, strides, pads, relu)
            return jnp.sum(jnp.sin(y))

        return f

    grads = jax.grad(loss(True), argnums=(0, 1, 2))
    assert _targets(grads, x, kernel, bias, target=onednn_conv.GRADIENT_TARGET) == 1
    got = jax.jit(grads)(x, kernel, bias)
    want = jax.jit(jax.grad(loss(False), argnums=(0, 1, 2)))(x, kernel, bias)
    for name, got_leaf, want_leaf in zip(("input", "kernel", "bias"), got, want, strict=True):
        scale = float(jnp.max(jnp.abs(want_leaf)))
        assert scale > 0.0, name
        np.testing.assert_allclose(got_leaf, want_leaf, rtol=0, atol=1e-5 * scale, err_msg=name)


@needs_library
def test_the_kernel_gradient_sums_every_slice_and_vmaps_call_by_call():
    """Rows cut over XLA's threads add up to the whole batch's gradient, and a vmapped
    gradient is each mapped element's own, not their sum."""
    x, kernel, _ = _arrays(9, 12, 12, 4, (4, 4), 8, seed=3)
    grad = jnp.asarray(np.random.default_rng(5).standard_normal((9, 5, 5, 8), dtype=np.float32))
    geometry = ((2, 2), ((0, 0), (0, 0)))

    def on_onednn(x, g):
        return onednn_conv._kernel_gradient_ffi(x, g, kernel, *geometry)

    def on_lax(x, g):
        return onednn_conv._kernel_gradient_lax(x, g, kernel, *geometry)

    for got, want in zip(jax.jit(on_onednn)(x, grad), jax.jit(on_lax)(x, grad), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    stacked_x, stacked_g = x.reshape(3, 3, 12, 12, 4), grad.reshape(3, 3, 5, 5, 8)
    got = jax.jit(jax.vmap(on_onednn))(stacked_x, stacked_g)
    want = jax.jit(jax.vmap(on_lax))(stacked_x, stacked_g)
    assert got[0].shape == (3, 4, 4, 4, 8) and got[1].shape == (3, 8)
    for got_leaf, want_leaf in zip(got, want, strict=True):
        np.testing.assert_allclose(got_leaf, want_leaf, rtol=1e-5, atol=1e-4)


@needs_library
def test_the_handler_rejects_inconsistent_shapes():
    x, kernel, _ = _arrays(2, 9, 9, 4, (3, 3), 8)
    wrong_bias = jnp.zeros((7,), jnp.float32)
    call = jax.ffi.ffi_call(onednn_conv.TARGET, jax.ShapeDtypeStruct((2, 7, 7, 8), jnp.float32))
    attrs = {name: np.int64(v) for name, v in (("stride_h", 1), ("stride_w", 1))}
    attrs |= {name: np.int64(0) for name in ("pad_top", "pad_bottom", "pad_left", "pad_right")}
    with pytest.raises(Exception, match="seedrl_onednn_conv: expects"):
        jax.block_until_ready(
            jax.jit(lambda *a: call(*a, **attrs, relu=True))(x, kernel, wrong_bias)
        )


@needs_library
def test_the_kernel_gradient_handler_rejects_inconsistent_shapes():
    x, _, _ = _arrays(2, 9, 9, 4, (3, 3), 8)
    grad = jnp.zeros((2, 7, 7, 8), jnp.float32)
    wrong_kernel = jax.ShapeDtypeStruct((3, 3, 5, 8), jnp.float32)  # 5 input channels, not 4
    call = jax.ffi.ffi_call(
        onednn_conv.GRADIENT_TARGET, (wrong_kernel, jax.ShapeDtypeStruct((8,), jnp.float32))
    )
    attrs = {name: np.int64(v) for name, v in (("stride_h", 1), ("stride_w", 1))}
    attrs |= {name: np.int64(0) for name in ("pad_top", "pad_bottom", "pad_left", "pad_right")}
    with pytest.raises(Exception, match="seedrl_onednn_conv_kernel_grad: expects"):
        jax.block_until_ready(jax.jit(lambda *a: call(*a, **attrs))(x, grad))


@needs_library
def test_concurrent_calls_from_two_threads():
    """Two policies' calls at once share the primitives and the kernel reorder."""
    x, kernel, bias = _arrays(16, 20, 20, 32, (4, 4), 64, seed=4)
    want = np.asarray(_reference(x, kernel, bias, (2, 2), ((0, 0), (0, 0)), True))

    @jax.jit
    def fast(x, kernel, bias):
        return conv_bias_relu(x, kernel, bias, (2, 2))

    fast(x, kernel, bias).block_until_ready()

    def calls(_):
        return max(
            float(np.max(np.abs(np.asarray(fast(x, kernel, bias)) - want))) for _ in range(30)
        )

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        errors = list(pool.map(calls, range(2)))
    assert max(errors) < 1e-4


@needs_library
def test_zero_rows():
    x, kernel, bias = _arrays(2, 9, 9, 4, (3, 3), 8)
    out = jax.jit(lambda *a: onednn_conv._ffi(*a, (1, 1), ((0, 0), (0, 0)), True))(
        x[:0], kernel, bias
    )
    assert out.shape == (0, 7, 7, 8)


@needs_library
@pytest.mark.parametrize(
    ("function", "wrong", "says"),
    [
        ("_ffi", lambda *args: onednn_conv._reference(*args) + 1.0, "differs from lax"),
        (
            "_kernel_gradient_ffi",
            lambda x, g, *_: (jnp.zeros((4, 4, 4, 8), jnp.float32), jnp.sum(g, axis=(0, 1, 2))),
            "kernel gradient differs from lax",
        ),
    ],
)
def test_a_library_that_computes_wrong_is_refused(monkeypatch, function, wrong, says):
    onednn_conv.unavailable_reason.cache_clear()
    monkeypatch.setattr(onednn_conv, function, wrong)
    try:
        reason = onednn_conv.unavailable_reason()
        assert reason is not None and says in reason
    finally:
        monkeypatch.undo()
        onednn_conv.unavailable_reason.cache_clear()
    assert onednn_conv.unavailable_reason() is None


def test_disabled_by_the_environment(monkeypatch):
    onednn_conv.unavailable_reason.cache_clear()
    monkeypatch.setenv(onednn_conv.DISABLE_VARIABLE, "0")
    try:
        assert onednn_conv.unavailable_reason() == f"{onednn_conv.DISABLE_VARIABLE}=0"
        x, kernel, bias = _arrays(8, 9, 9, 4, (3, 3), 8)

        def fast(x, kernel, bias):
            return jnp.sum(conv_bias_relu(x, kernel, bias, (1, 1)))

        assert _targets(fast, x, kernel, bias) == 0
        grads = jax.grad(fast, argnums=(0, 1, 2))
        assert _targets(grads, x, kernel, bias, target=onednn_conv.GRADIENT_TARGET) == 0
    finally:
        monkeypatch.delenv(onednn_conv.DISABLE_VARIABLE)
        onednn_conv.unavailable_reason.cache_clear()


class _NatureWithFlaxConv(nn.Module):
    """The Nature CNN as it was written with nn.Conv, for the parameter tree's sake."""

    @nn.compact
    def __call__(self, observations):
        x = jnp.transpose(observations.astype(jnp.float32) / 255.0, (0, 2, 3, 1))
        for features, size, stride in ((32, 8, 4), (64, 4, 2), (64, 3, 1)):
            x = nn.relu(nn.Conv(features, (size, size), (stride, stride), padding="VALID")(x))
        x = x.reshape(x.shape[0], -1)
        return nn.relu(nn.Dense(512)(x))


def test_nature_cnn_keeps_nn_convs_parameter_tree():
    """Names, shapes and dtypes as nn.Conv's, and the same function of the same values, so
    checkpoints of either restore into the other (the initial values differ: the torso
    starts orthogonal, tests/test_networks.py)."""
    observations = jnp.zeros((1, 4, 84, 84), jnp.uint8)
    key = jax.random.PRNGKey(3)
    ours = networks.NatureCNN().init(key, observations)
    theirs = _NatureWithFlaxConv().init(key, observations)
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        assert (a.shape, a.dtype) == (b.shape, b.dtype)
    frames = jnp.asarray(np.random.default_rng(0).integers(0, 256, (3, 4, 84, 84), np.uint8))
    np.testing.assert_allclose(
        networks.NatureCNN().apply(ours, frames),
        _NatureWithFlaxConv().apply(ours, frames),
        rtol=1e-5,
        atol=1e-5,
    )


@needs_library
def test_the_policy_and_the_train_step_use_it():
    network = networks.ActorCritic(networks.NatureCNN(), num_actions=6)
    frames = jnp.asarray(np.random.default_rng(1).integers(0, 256, (16, 4, 84, 84), np.uint8))
    params = network.init(jax.random.PRNGKey(0), frames[:1])
    policy = policy_fns.make_policy_fn(network.apply)
    key = jax.random.PRNGKey(7)
    assert _calls(policy.lower(params, frames, key).as_text(), onednn_conv.TARGET) == 3
    step, _ = policy(params, frames, key)
    # The same draws from the network's logits on XLA's kernels.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(onednn_conv.DISABLE_VARIABLE, "0")
        onednn_conv.unavailable_reason.cache_clear()
        logits = jax.jit(network.apply)(params, frames).logits

        def xla_loss(params):
            return jnp.sum(network.apply(params, frames).values)

        want_grads = jax.jit(jax.grad(xla_loss))(params)
    onednn_conv.unavailable_reason.cache_clear()
    _, sample_key = jax.random.split(key)
    want = policy_fns._sample(logits, sample_key)
    np.testing.assert_array_equal(step.actions, want.actions)
    np.testing.assert_allclose(step.log_probs, want.log_probs, rtol=1e-5, atol=1e-6)

    def loss(params):
        return jnp.sum(network.apply(params, frames).values)

    text = jax.jit(jax.grad(loss)).lower(params).as_text()
    assert _calls(text, onednn_conv.TARGET) == 3
    assert _calls(text, onednn_conv.GRADIENT_TARGET) == 3
    got_grads = jax.jit(jax.grad(loss))(params)
    for got, want_leaf in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        scale = float(jnp.max(jnp.abs(want_leaf)))
        np.testing.assert_allclose(got, want_leaf, rtol=0, atol=1e-4 * max(scale, 1e-6))


def test_the_build_hook_says_why_without_a_compiler(tmp_path, monkeypatch):
    source = tmp_path / hatch_build.SOURCE
    source.parent.mkdir(parents=True)
    source.write_text((Path(hatch_build.__file__).parent / hatch_build.SOURCE).read_text())
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    why_not = hatch_build.build(tmp_path)
    if BUILT_HERE:
        assert why_not is not None and "compiler" in why_not
    else:
        assert why_not is not None and "Linux x86_64" in why_not
    assert not (tmp_path / hatch_build.LIBRARY).exists()
