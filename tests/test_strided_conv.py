"""learner.backends.cpu.strided_conv: lax's values and gradients, without a dilated convolution."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from learner.backends.cpu.strided_conv import conv_general_dilated

NHWC = ("NHWC", "HWIO", "NHWC")


def _value_and_grads(conv, x, kernel, strides, padding, dimension_numbers=NHWC, **options):
    def loss(x, kernel):
        y = conv(x, kernel, strides, padding, dimension_numbers=dimension_numbers, **options)
        return jnp.sum(jnp.sin(y)), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, kernel)
    return y, grads


def _inputs(height, width, kernel_size, channels=3, features=5, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((2, height, width, channels), dtype=np.float32))
    kernel = jnp.asarray(
        rng.standard_normal((*kernel_size, channels, features), dtype=np.float32) * 0.3
    )
    return x, kernel


@pytest.mark.parametrize(
    ("height", "width", "kernel_size", "strides", "padding"),
    [
        (84, 84, (8, 8), (4, 4), "VALID"),  # the Nature CNN's first layer
        (20, 20, (4, 4), (2, 2), "VALID"),  # its second
        (21, 19, (3, 3), (2, 2), "SAME"),  # odd sizes: blocks padded
        (17, 17, (5, 5), (3, 3), "VALID"),  # kernel not a multiple of the stride
        (16, 15, (4, 3), (2, 3), ((1, 2), (0, 1))),  # explicit, uneven padding
        (12, 12, (2, 2), (2, 1), "VALID"),  # stride 1 along one axis
    ],
)
def test_values_and_both_gradients_equal_lax(height, width, kernel_size, strides, padding):
    x, kernel = _inputs(height, width, kernel_size)
    want_y, (want_dx, want_dk) = _value_and_grads(
        lax.conv_general_dilated, x, kernel, strides, padding
    )
    got_y, (got_dx, got_dk) = _value_and_grads(conv_general_dilated, x, kernel, strides, padding)
    np.testing.assert_array_equal(got_y, want_y)  # the forward pass is lax's own
    np.testing.assert_array_equal(got_dk, want_dk)  # and so is the kernel's gradient
    scale = float(jnp.max(jnp.abs(want_dx)))
    assert scale > 0.0
    np.testing.assert_allclose(got_dx, want_dx, rtol=0, atol=2e-6 * scale)


def _convolutions(hlo: str) -> list[str]:
    return [line for line in hlo.splitlines() if re.search(r"\bconvolution\(", line)]


def test_the_input_gradient_has_no_dilated_convolution():
    """What makes it fast: lax's input gradient convolves a stride-dilated gradient."""
    x, kernel = _inputs(20, 20, (4, 4), channels=8, features=8)

    def input_gradient(conv):
        def loss(x):
            return jnp.sum(conv(x, kernel, (2, 2), "VALID", dimension_numbers=NHWC) ** 2)

        return jax.jit(jax.grad(loss)).lower(x).compile().as_text()

    plain = _convolutions(input_gradient(lax.conv_general_dilated))
    ours = _convolutions(input_gradient(conv_general_dilated))
    assert any("lhs_dilate=" in line for line in plain), plain
    assert ours and not any("lhs_dilate=" in line for line in ours), ours


@pytest.mark.parametrize(
    ("strides", "options", "dimension_numbers"),
    [
        ((1, 1), {}, NHWC),  # nothing to gain: lax's
        ((2, 2), {"rhs_dilation": (2, 2)}, NHWC),
        ((2, 2), {"feature_group_count": 3}, NHWC),
        ((2, 2), {}, ("NCHW", "OIHW", "NCHW")),
    ],
)
def test_what_it_does_not_cover_is_lax_unchanged(strides, options, dimension_numbers):
    x, kernel = _inputs(12, 12, (3, 3), channels=3, features=6)
    if dimension_numbers[0] == "NCHW":
        x, kernel = jnp.transpose(x, (0, 3, 1, 2)), jnp.transpose(kernel, (3, 2, 0, 1))
    if options.get("feature_group_count"):
        kernel = kernel[..., :1, :] if dimension_numbers == NHWC else kernel
    args = (x, kernel, strides, "VALID", dimension_numbers)
    want = _value_and_grads(lax.conv_general_dilated, *args, **options)
    got = _value_and_grads(conv_general_dilated, *args, **options)
    for got_leaf, want_leaf in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(got_leaf, want_leaf)
