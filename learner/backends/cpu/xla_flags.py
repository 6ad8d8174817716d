"""XLA settings the learner applies before JAX starts its backend.

XLA reads the XLA_FLAGS environment variable once, when JAX creates its first
backend (the first computation or device query), so `apply` must run before
that; importing jax alone is fine. Flags the user already put in XLA_FLAGS
win: a flag of ours whose name the user's XLA_FLAGS already sets is left out.

The flags, with the measurements that chose them (Nature CNN, 2-core AMD EPYC
CPU, jax 0.10.2; `python -m bench` case e has the figures):

--xla_cpu_experimental_ynn_fusion_type=-individual_convolution
    XLA:CPU hands convolutions to YNNPACK by default. For the Nature CNN its
    kernels are slow, above all for the first convolution (8x8, stride 4) and
    its weight gradient: the V-trace step (T=20 x B=32) took 1.2-1.7 s, of
    which ~0.6 s was that weight gradient, against 0.41 s with convolutions
    left to XLA's Eigen kernels; the policy at batch 64 went from ~280 to
    ~125 us/sample. The leading "-" removes only convolutions from the
    default set, so dots and reductions stay with YNNPACK.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

CPU_FLAGS: tuple[str, ...] = ("--xla_cpu_experimental_ynn_fusion_type=-individual_convolution",)


def _flag_name(flag: str) -> str:
    return flag.split("=", 1)[0].lstrip("-")


def merged_flags(user_flags: str, ours: tuple[str, ...] = CPU_FLAGS) -> str:
    """`user_flags` with each of `ours` appended unless the user sets that flag already."""
    user_names = {_flag_name(flag) for flag in user_flags.split()}
    extra = [flag for flag in ours if _flag_name(flag) not in user_names]
    return " ".join([*user_flags.split(), *extra])


def backend_started() -> bool:
    """Whether JAX has created a backend already, so XLA_FLAGS is no longer read."""
    import sys

    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge
    except ImportError:  # pragma: no cover - a jax without this module
        return False
    started = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(started()) if started is not None else False


def apply() -> bool:
    """Adds the learner's XLA flags to XLA_FLAGS; True when they can still take effect."""
    os.environ["XLA_FLAGS"] = merged_flags(os.environ.get("XLA_FLAGS", ""))
    return not backend_started()


def ensure_applied() -> None:
    """Applies the flags unless XLA_FLAGS has them already, and says so when JAX started
    without them: they cannot take effect any more."""
    flags = os.environ.get("XLA_FLAGS", "")
    if merged_flags(flags) != flags and not apply():
        logger.warning(
            "JAX started before the learner could set its XLA flags (%s): call "
            "learner.backends.cpu.xla_flags.apply() before JAX's first computation, or "
            "CPU convolutions may run several times slower",
            " ".join(CPU_FLAGS),
        )
