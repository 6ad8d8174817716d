"""oneDNN's convolutions in XLA:CPU, measured (docs/benchmarks.md, "oneDNN's
convolutions in jaxlib 0.12").

XLA:CPU can hand convolutions to oneDNN (`xla_cpu_experimental_onednn_custom_call`),
but only where the installed jaxlib carries that rewriter: jaxlib 0.10.2, the
newest for Python 3.11 and the one this project pins, does not, and the option
changes nothing; jaxlib 0.12 does. XLA takes debug options per compiled program,
so one process compiles the same program twice, with and without the option,
and times them in interleaved rounds (case e's timing, medians of ms per call):

- the learner's policy (Nature CNN, as the learner builds it for a CPU) at each
  of `--batches`;
- with `--step`, case e's V-trace train step (T=20 x B=32).

Each row says whether any convolution became a oneDNN custom call, and how far
the two programs' outputs differ:

    .venv/bin/python -m bench.onednn [--window-s 10] [--batches 16 64] [--step]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from bench.network import TRAIN_SHAPE, _interleaved, _Jax, _observations, _trajectories
from learner import xla_flags
from learner.config import PRESETS

ONEDNN_OPTION = "xla_cpu_experimental_onednn_custom_call"
ONEDNN_CALL_TARGET = "__onednn$convolution"
"""How XLA names a convolution it handed to oneDNN in the compiled program."""


def _both_ways(jitted: Callable, *args: Any) -> tuple[Callable, Callable, bool]:
    """(as shipped, with oneDNN's convolutions, whether oneDNN took any convolution)."""
    lowered = jitted.lower(*args)
    shipped = lowered.compile()
    onednn = lowered.compile(compiler_options={ONEDNN_OPTION: True})
    return shipped, onednn, ONEDNN_CALL_TARGET in onednn.as_text()


def _timed(compiled: Callable, *args: Any) -> Callable[[], None]:
    return lambda: jax.block_until_ready(compiled(*args))


def _max_difference(a: Any, b: Any) -> float:
    """The largest absolute difference between two outputs of the same structure."""
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return max(
        (float(np.max(np.abs(np.subtract(x, y, dtype=np.float64)), initial=0.0)) for x, y in pairs),
        default=0.0,
    )


def _row(what: str, rewritten: bool, difference: float, timings: dict) -> dict:
    shipped_s, onednn_s = timings["shipped"][0], timings["onednn"][0]
    return {
        "what": what,
        "onednn_convolutions": rewritten,
        "max_difference": difference,
        "shipped_ms": shipped_s * 1e3,
        "onednn_ms": onednn_s * 1e3,
        "speedup": shipped_s / onednn_s,
    }


def measure(batches: Sequence[int], step: bool, window_s: float, min_rounds: int) -> list[dict]:
    rng = np.random.default_rng(0)
    jax_side = _Jax(PRESETS["atari"])  # case (e)'s network and policy, as the learner's
    key = jax.random.key(1)
    rows = []
    for rows_in_batch in batches:
        observations = jax.device_put(_observations(rows_in_batch, rng))
        args = (jax_side.params, observations, key)
        shipped, onednn, rewritten = _both_ways(jax_side.policy_fn, *args)
        # The same key: the same actions, unless the logits moved across a sampling boundary.
        difference = _max_difference(shipped(*args)[0], onednn(*args)[0])
        timings = _interleaved(
            {
                "shipped": _timed(shipped, *args),
                "onednn": _timed(onednn, *args),
            },
            window_s,
            min_rounds,
            unit_s=0.2,
        )
        rows.append(_row(f"policy, {rows_in_batch} rows", rewritten, difference, timings))
    if step:
        update_fn, state, batch = jax_side.update(_trajectories(*TRAIN_SHAPE, rng))
        shipped, onednn, rewritten = _both_ways(update_fn, state, batch)
        difference = _max_difference(shipped(state, batch)[1], onednn(state, batch)[1])
        timings = _interleaved(
            {
                "shipped": _timed(shipped, state, batch),
                "onednn": _timed(onednn, state, batch),
            },
            window_s,
            min_rounds,
            unit_s=1.0,
        )
        steps, unrolls = TRAIN_SHAPE
        rows.append(_row(f"V-trace step, T={steps} x B={unrolls}", rewritten, difference, timings))
    return rows


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m bench.onednn", description=__doc__)
    parser.add_argument("--window-s", type=float, default=10.0, help="seconds of rounds per row")
    parser.add_argument("--min-rounds", type=int, default=7)
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--step", action="store_true", help="also the V-trace train step")
    args = parser.parse_args(argv)
    xla_flags.apply()  # convolutions kept from YNNPACK, as the learner runs them
    rows = measure(args.batches, args.step, args.window_s, args.min_rounds)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; medians, ms per call")
    print(
        f"{'':<28} {'oneDNN convs':>12} {'max diff':>9} {'as shipped':>10} "
        f"{'oneDNN':>8} {'speedup':>7}"
    )
    for row in rows:
        print(
            f"{row['what']:<28} {'yes' if row['onednn_convolutions'] else 'no':>12} "
            f"{row['max_difference']:>9.1e} {row['shipped_ms']:>10.3f} "
            f"{row['onednn_ms']:>8.3f} {row['speedup']:>6.2f}x"
        )
    return rows


if __name__ == "__main__":
    main()
