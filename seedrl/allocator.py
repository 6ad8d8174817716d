"""glibc's allocator, set to keep freed memory for processes that move large messages.

An actor handles a few blocks of megabytes per step: the envs' new
observations, the step message built from them, gRPC's copy of it. With
glibc's default, adaptive thresholds those blocks are mapped and unmapped
again, or handed back at the top of the heap, so every step faults them in
afresh, page by page: ~590 page faults per 256-env Pong message, ~7,000 a
second per actor process (docs/benchmarks.md, case (c)). Fixed thresholds keep
freed blocks in the heap for the next step instead: blocks up to
`MMAP_THRESHOLD_BYTES` come from the heap, and up to `TRIM_THRESHOLD_BYTES`
of free memory at its top stays mapped.

`SEEDRL_MALLOPT=0` in the environment leaves the allocator as it is.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

logger = logging.getLogger(__name__)

DISABLE_VARIABLE = "SEEDRL_MALLOPT"
"""Set to 0, it leaves the allocator as glibc sets it."""
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
"""The largest mmap threshold glibc accepts on 64-bit: blocks below it come from the heap."""
TRIM_THRESHOLD_BYTES = 64 * 1024 * 1024
"""Free memory at the heap's top kept mapped: a couple of the largest blocks."""


def keep_freed_memory() -> bool:
    """Sets glibc's thresholds (above) for this process; whether they were set. Leaves
    other C libraries, and processes with SEEDRL_MALLOPT=0, as they are. Call it early:
    it holds for every thread, but blocks mapped before it stay mapped."""
    if os.environ.get(DISABLE_VARIABLE, "1") == "0" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # Setting either turns off glibc's adaptive thresholds, so both are set (both calls
    # made: the list is built before all() reads it).
    done = all(
        [
            mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1,
            mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1,
        ]
    )
    if not done:
        logger.warning("glibc refused the allocator's thresholds; they stay adaptive")
    return done
