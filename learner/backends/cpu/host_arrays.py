"""Host arrays that XLA on a CPU reads in place.

A jitted call given a numpy array uses the array's own memory, with no copy,
only when its data is aligned to `XLA_CPU_ALIGNMENT` bytes; otherwise JAX
first copies it into a buffer of its own. numpy allocates with malloc, which
promises 16 bytes: a large array (mapped memory) starts 16 bytes past a page,
a smaller one anywhere. So numpy's buffers would be copied on almost every
inference call and every update: a copy that costs a training batch about
30 times what handing it over in place does (docs/benchmarks.md, "What was
tried").

Arrays made here are aligned, so a CPU learner's batches reach the policy
and the update without that copy. On a GPU or TPU the batch is transferred
either way and alignment changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# What XLA:CPU asks of a host buffer to use it in place (tests/test_host_arrays.py checks
# it against the installed jaxlib).
XLA_CPU_ALIGNMENT = 64


def aligned_zeros(shape: int | Sequence[int], dtype) -> np.ndarray:
    """Like np.zeros, with the data aligned to `XLA_CPU_ALIGNMENT` bytes."""
    return _aligned(shape, dtype, np.zeros)


def aligned_empty(shape: int | Sequence[int], dtype) -> np.ndarray:
    """Like np.empty, with the data aligned to `XLA_CPU_ALIGNMENT` bytes."""
    return _aligned(shape, dtype, np.empty)


def is_aligned(array: np.ndarray) -> bool:
    return array.ctypes.data % XLA_CPU_ALIGNMENT == 0


def _aligned(shape, dtype, allocate) -> np.ndarray:
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = allocate(nbytes + XLA_CPU_ALIGNMENT, np.uint8)
    # An array over `raw` from the first aligned byte (a slice would drop the offset
    # of an empty array).
    return np.ndarray(shape, dtype, buffer=raw, offset=-raw.ctypes.data % XLA_CPU_ALIGNMENT)
