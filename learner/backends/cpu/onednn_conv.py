"""Convolutions on oneDNN on a CPU, through XLA FFI calls: the policy's, and the train step's
forward pass and kernel gradients.

jaxlib 0.10.2 (the newest for Python 3.11) runs CPU convolutions on Eigen's
kernels, which trail oneDNN's (PyTorch's) on the Nature CNN at the batches
inference serves: the policy read 0.95-0.99x PyTorch at batches 16 and 64
(docs/benchmarks.md, case e). XLA:CPU also computes a convolution's kernel
gradient as a convolution of the input and the output gradient with their batch
and feature dimensions swapped, and the transposes that takes cost several times
the convolution: they were a third of the Atari preset's train step. jaxlib 0.12
can hand convolutions to oneDNN itself, but needs Python 3.12. Until then
`native/onednn_conv.cc`, built when the package is installed (hatch_build.py),
does it: a convolution with its bias and ReLU in one oneDNN primitive, and a
convolution's kernel and bias gradients in another, the batch cut into one slice
per thread of XLA's intra-op pool, each slice single-threaded, so the calls run
on XLA's own threads. The input's gradient stays XLA's (strided_conv.py), which
is as fast there.

A batch of one row stays on Eigen, where oneDNN is no faster. Off a CPU, without
the native library (another platform, no compiler at install), or with
SEEDRL_ONEDNN=0, every convolution and gradient is lax's, with the same results
to float32 rounding.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import importlib.metadata
import logging
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from learner.backends.cpu.strided_conv import LAYOUT, conv_general_dilated

log = logging.getLogger(__name__)

TARGET = "seedrl_onednn_conv"
GRADIENT_TARGET = "seedrl_onednn_conv_kernel_grad"
LIBRARY = Path(__file__).parent / "native" / "libseedrl_onednn.so"
"""Built from native/onednn_conv.cc by hatch_build.py when the package is installed."""
ONEDNN_DISTRIBUTION = "onednn-cpu-gomp"
MIN_ROWS = 2
"""Fewer rows run on Eigen: at one row the oneDNN call is no faster."""
DISABLE_VARIABLE = "SEEDRL_ONEDNN"
"""Set to 0 to keep every convolution on XLA's own kernels."""

Pads = tuple[tuple[int, int], ...]


def _libdnnl() -> Path:
    """libdnnl.so.3 as the onednn-cpu-gomp wheel installed it (under the environment's lib/)."""
    files = importlib.metadata.distribution(ONEDNN_DISTRIBUTION).files or []
    for file in files:
        if file.name == "libdnnl.so.3":
            return Path(file.locate()).resolve()
    raise FileNotFoundError(f"{ONEDNN_DISTRIBUTION} lists no libdnnl.so.3")


@functools.cache
def _register() -> None:
    # Global, so that the FFI library's own reference to libdnnl.so.3 resolves to it.
    ctypes.CDLL(str(_libdnnl()), mode=ctypes.RTLD_GLOBAL)
    library = ctypes.CDLL(str(LIBRARY))
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.SeedrlOnednnConv), platform="cpu")
    jax.ffi.register_ffi_target(
        GRADIENT_TARGET, jax.ffi.pycapsule(library.SeedrlOnednnConvKernelGrad), platform="cpu"
    )


def _self_check() -> None:
    """One small call against lax's convolution: a library that loads but computes
    wrong, or fails when called, is refused here rather than in a network."""
    rng = np.random.default_rng(0)
    cpu = jax.devices("cpu")[0]
    arrays = [
        jax.device_put(rng.standard_normal(shape, dtype=np.float32), cpu)
        for shape in ((3, 9, 9, 4), (4, 4, 4, 8), (8,))
    ]
    args = ((2, 2), ((1, 0), (0, 1)), True)
    got = np.asarray(jax.jit(lambda *a: _ffi(*a, *args))(*arrays))
    want = np.asarray(jax.jit(lambda *a: _reference(*a, *args))(*arrays))
    error = float(np.max(np.abs(got - want)))
    if not error <= 1e-4:
        raise RuntimeError(f"differs from lax's convolution by {error}")
    x, kernel, _ = arrays
    grad = jax.device_put(rng.standard_normal(want.shape, dtype=np.float32), cpu)
    got = jax.jit(lambda x, g: _kernel_gradient_ffi(x, g, kernel, *args[:2]))(x, grad)
    want = jax.jit(lambda x, g: _kernel_gradient_lax(x, g, kernel, *args[:2]))(x, grad)
    error = max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(got, want, strict=True)
    )
    if not error <= 1e-4:
        raise RuntimeError(f"its kernel gradient differs from lax's by {error}")


@functools.cache
def unavailable_reason() -> str | None:
    """Why the oneDNN convolution cannot be used in this process, or None when it can.

    The first call loads the libraries, registers the FFI target with XLA and
    checks one small call against lax's convolution.
    """
    if os.environ.get(DISABLE_VARIABLE, "1") == "0":
        return f"{DISABLE_VARIABLE}=0"
    if not LIBRARY.exists():
        return f"{LIBRARY.name} was not built (see hatch_build.py)"
    try:
        _register()
        # On a thread of its own: JAX's tracing state is per thread, and this is
        # usually first asked while a network is being traced.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pool.submit(_self_check).result()
    except Exception as error:
        reason = f"{LIBRARY.name} is not usable: {type(error).__name__}: {error}"
        log.warning("convolutions stay on XLA's kernels: %s", reason)
        return reason
    return None


def available() -> bool:
    return unavailable_reason() is None


def _reference(x, kernel, bias, strides: tuple[int, int], pads: Pads, relu: bool) -> jax.Array:
    y = conv_general_dilated(x, kernel, strides, pads, dimension_numbers=LAYOUT) + bias
    return jax.nn.relu(y) if relu else y


def _geometry(strides: tuple[int, int], pads: Pads) -> dict[str, np.int64]:
    """The strides and pads as both FFI calls take them."""
    (sh, sw), ((top, bottom), (left, right)) = strides, pads
    names = ("stride_h", "stride_w", "pad_top", "pad_bottom", "pad_left", "pad_right")
    return {
        name: np.int64(v) for name, v in zip(names, (sh, sw, top, bottom, left, right), strict=True)
    }


def _ffi(x, kernel, bias, strides: tuple[int, int], pads: Pads, relu: bool) -> jax.Array:
    # The result's shape is lax's for the same convolution.
    out = jax.eval_shape(lambda *a: _reference(*a, strides, pads, relu), x, kernel, bias)
    # Rows are independent: a vmapped call runs once per mapped element.
    return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(
        x, kernel, bias, **_geometry(strides, pads), relu=bool(relu)
    )


def _kernel_gradient_ffi(
    x, output_grad, kernel, strides: tuple[int, int], pads: Pads
) -> tuple[jax.Array, jax.Array]:
    """The kernel's and the bias's gradients of a convolution of `x` whose output (before any
    ReLU) has the gradient `output_grad`, summed over this call's rows only, on oneDNN."""
    # lax's shapes carry the manual axes the partial sums vary over (in shard_map).
    shapes = jax.eval_shape(
        lambda *a: _kernel_gradient_lax(*a, strides, pads), x, output_grad, kernel
    )
    # The gradient sums over a call's rows: a vmapped call runs once per mapped element.
    return jax.ffi.ffi_call(GRADIENT_TARGET, shapes, vmap_method="sequential")(
        x, output_grad, **_geometry(strides, pads)
    )


def _kernel_gradient_lax(
    x, output_grad, kernel, strides: tuple[int, int], pads: Pads
) -> tuple[jax.Array, jax.Array]:
    """The same partial sums through lax."""
    # A kernel replicated over manual axes that the rows vary over would get its
    # gradient all-reduced by the transpose of its broadcast; made varying, it stays this
    # call's partial sum, as the FFI's is, and _to_primal_axes reduces both alike.
    kernel = _varying_like(kernel, x)
    _, vjp = jax.vjp(
        lambda k: conv_general_dilated(x, k, strides, pads, dimension_numbers=LAYOUT), kernel
    )
    return vjp(output_grad)[0], jnp.sum(output_grad, axis=(0, 1, 2))


def _varying_like(a: jax.Array, like: jax.Array) -> jax.Array:
    missing = tuple(sorted(_varying_axes(like) - _varying_axes(a)))
    return lax.pcast(a, missing, to="varying") if missing else a


def _varying_axes(a: jax.Array) -> frozenset[str]:
    """The manual axes (shard_map's) over which `a` differs from device to device."""
    aval = jax.typeof(a)
    manual = getattr(aval, "manual_axis_type", None)
    return manual.varying if manual is not None else frozenset(getattr(aval, "vma", ()))


def _to_primal_axes(grad: jax.Array, primal: jax.Array) -> jax.Array:
    """A partial gradient summed over the manual axes (shard_map's) that it varies over and
    its primal does not: the data-parallel all-reduce. Outside shard_map, itself."""
    extra = tuple(sorted(_varying_axes(grad) - _varying_axes(primal)))
    return lax.psum(grad, extra) if extra else grad


def _on_onednn_or_lax(x, kernel, bias, strides, pads, relu) -> jax.Array:
    return lax.platform_dependent(
        x,
        kernel,
        bias,
        cpu=lambda *args: _ffi(*args, strides, pads, relu),
        default=lambda *args: _reference(*args, strides, pads, relu),
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _on_onednn(x, kernel, bias, strides, pads, relu) -> jax.Array:
    return _on_onednn_or_lax(x, kernel, bias, strides, pads, relu)


def _on_onednn_forward(x, kernel, bias, strides, pads, relu):
    y = _on_onednn_or_lax(x, kernel, bias, strides, pads, relu)
    return y, (x, kernel, bias, y)


def _on_onednn_backward(strides, pads, relu, residuals, grad):
    x, kernel, bias, y = residuals
    if relu:
        grad = jnp.where(y > 0, grad, 0.0)
    # The input's gradient stays XLA's (strided_conv's space-to-depth for a strided
    # convolution); under jit XLA drops it where nothing uses it (a network's input).
    _, input_vjp = jax.vjp(
        lambda v: conv_general_dilated(v, kernel, strides, pads, dimension_numbers=LAYOUT), x
    )
    kernel_grad, bias_grad = lax.platform_dependent(
        x,
        grad,
        kernel,
        cpu=lambda *args: _kernel_gradient_ffi(*args, strides, pads),
        default=lambda *args: _kernel_gradient_lax(*args, strides, pads),
    )
    return (
        input_vjp(grad)[0],
        _to_primal_axes(kernel_grad, kernel),
        _to_primal_axes(bias_grad, bias),
    )


_on_onednn.defvjp(_on_onednn_forward, _on_onednn_backward)


def conv_bias_relu(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array,
    strides: tuple[int, int],
    pads: Pads = ((0, 0), (0, 0)),
    relu: bool = True,
) -> jax.Array:
    """relu(conv(x, kernel) + bias): NHWC x HWIO -> NHWC, explicit non-negative `pads`.

    On oneDNN, with the kernel's and the bias's gradients on oneDNN too, where the
    program runs on a CPU, the arrays are float32, the batch has at least MIN_ROWS
    rows and the library is available; otherwise lax's convolution
    (`strided_conv.conv_general_dilated`) and its gradients.
    """
    strides = (int(strides[0]), int(strides[1]))
    pads = tuple((int(low), int(high)) for low, high in pads)
    usable = (
        x.ndim == 4
        and x.shape[0] >= MIN_ROWS
        and all(a.dtype == jnp.float32 for a in (x, kernel, bias))
        and available()
    )
    if not usable:
        return _reference(x, kernel, bias, strides, pads, relu)
    return _on_onednn(x, kernel, bias, strides, pads, relu)
