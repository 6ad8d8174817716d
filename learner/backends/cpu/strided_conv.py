"""A strided convolution whose input gradient runs as a stride-1 convolution.

The gradient of a strided convolution with respect to its input is, as XLA
writes it, a convolution over the output gradient dilated by the stride: with
stride 2 three of every four input elements are inserted zeros, and XLA:CPU's
Eigen kernels multiply them all. For the Nature CNN's second layer (4x4,
stride 2) that one gradient is about a third of a V-trace step on a CPU.

Space-to-depth removes the stride: folding each s x s block of the input into
channels turns a k x k stride-s convolution into a (k/s) x (k/s) stride-1 one
with s*s times the channels (the kernel is rearranged the same way, padded
with zeros where k is not a multiple of s). The result is the same sum over
the same products, so the forward pass and the weight gradient stay XLA's
plain convolution, which is fastest for them here, and only the input
gradient is taken through the stride-1 form, whose gradient needs no
dilation: about a third of the time (docs/benchmarks.md, case e).

`conv_general_dilated` has lax's signature; the torsos' `_ConvReLU` layers
take it off oneDNN, and their gradient takes its input gradient on oneDNN too
(onednn_conv.py); it can be given to flax's `nn.Conv(conv_general_dilated=...)`. What it does not
cover (dilation, feature groups, layouts other than NHWC/HWIO) goes to lax
unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

LAYOUT = ("NHWC", "HWIO", "NHWC")

Pads = tuple[tuple[int, int], ...]


def _direct(x: jax.Array, kernel: jax.Array, strides: tuple[int, ...], pads: Pads, precision):
    return lax.conv_general_dilated(
        x, kernel, strides, pads, dimension_numbers=LAYOUT, precision=precision
    )


def _space_to_depth(
    x: jax.Array, kernel: jax.Array, strides: tuple[int, ...], pads: Pads, precision
) -> jax.Array:
    """The same convolution as `_direct`, computed as a stride-1 one on folded blocks."""
    (sh, sw), (kh, kw) = strides, kernel.shape[:2]
    x = jnp.pad(x, ((0, 0), *pads, (0, 0)))
    n, h, w, c = x.shape
    out_h, out_w = (h - kh) // sh + 1, (w - kw) // sw + 1
    # Round the input and the kernel up to whole blocks; the zeros add nothing.
    x = jnp.pad(x, ((0, 0), (0, -h % sh), (0, -w % sw), (0, 0)))
    kernel = jnp.pad(kernel, ((0, -kh % sh), (0, -kw % sw), (0, 0), (0, 0)))
    bh, bw = x.shape[1] // sh, x.shape[2] // sw
    x = x.reshape(n, bh, sh, bw, sw, c).transpose(0, 1, 3, 2, 4, 5).reshape(n, bh, bw, -1)
    qh, qw = kernel.shape[0] // sh, kernel.shape[1] // sw
    out = kernel.shape[3]
    kernel = kernel.reshape(qh, sh, qw, sw, c, out).transpose(0, 2, 1, 3, 4, 5)
    y = _direct(x, kernel.reshape(qh, qw, sh * sw * c, out), (1, 1), ((0, 0), (0, 0)), precision)
    return y[:, :out_h, :out_w]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def strided_conv(
    x: jax.Array, kernel: jax.Array, strides: tuple[int, ...], pads: Pads, precision=None
) -> jax.Array:
    """NHWC x HWIO -> NHWC convolution with explicit `pads`; see the module's docstring."""
    return _direct(x, kernel, strides, pads, precision)


def _forward(x, kernel, strides, pads, precision):
    return _direct(x, kernel, strides, pads, precision), (x, kernel)


def _backward(strides, pads, precision, residuals, grad):
    x, kernel = residuals
    _, kernel_vjp = jax.vjp(lambda k: _direct(x, k, strides, pads, precision), kernel)

    def input_gradient(conv):
        return lambda g: jax.vjp(lambda v: conv(v, kernel, strides, pads, precision), x)[1](g)[0]

    # Only XLA:CPU gains: GPU and TPU libraries run the strided gradient natively.
    # Under jit, XLA drops the input gradient where nothing uses it (a network's input).
    x_grad = lax.platform_dependent(
        grad, cpu=input_gradient(_space_to_depth), default=input_gradient(_direct)
    )
    return x_grad, kernel_vjp(grad)[0]


strided_conv.defvjp(_forward, _backward)


def conv_general_dilated(
    lhs: jax.Array,
    rhs: jax.Array,
    window_strides: Sequence[int],
    padding: str | Sequence[tuple[int, int]],
    lhs_dilation: Sequence[int] | None = None,
    rhs_dilation: Sequence[int] | None = None,
    dimension_numbers=None,
    feature_group_count: int = 1,
    batch_group_count: int = 1,
    precision=None,
    preferred_element_type=None,
) -> jax.Array:
    """lax.conv_general_dilated, with 2-D strided NHWC convolutions as `strided_conv`."""
    strides = tuple(window_strides)
    plain = (
        lhs.ndim == 4
        and max(strides) > 1
        and all(d == 1 for d in (lhs_dilation or (1,)) + tuple(rhs_dilation or (1,)))
        and feature_group_count == 1
        and batch_group_count == 1
        and preferred_element_type is None
        and dimension_numbers is not None
        and lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
        == lax.conv_dimension_numbers(lhs.shape, rhs.shape, LAYOUT)
    )
    if plain:
        if isinstance(padding, str):
            padding = lax.padtype_to_pads(lhs.shape[1:3], rhs.shape[:2], strides, padding)
        pads = tuple((int(low), int(high)) for low, high in padding)
        if min(min(pair) for pair in pads) >= 0:
            return strided_conv(lhs, rhs, strides, pads, precision)
    return lax.conv_general_dilated(
        lhs,
        rhs,
        window_strides,
        padding,
        lhs_dilation=lhs_dilation,
        rhs_dilation=rhs_dilation,
        dimension_numbers=dimension_numbers,
        feature_group_count=feature_group_count,
        batch_group_count=batch_group_count,
        precision=precision,
        preferred_element_type=preferred_element_type,
    )
