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
from learner.backends.cpu import xla_flags
from learner.presets import PRESETS

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


def _compared(
    what: str, jitted: Callable, args: tuple, output: int, unit_s: float, timing: tuple
) -> dict:
    """`jitted` on `args` compiled both ways, compared on its `output`-th result and timed
    in interleaved rounds (`timing`: window seconds, least rounds): one row."""
    shipped, onednn, rewritten = _both_ways(jitted, *args)
    # The same inputs (the policy's key among them): the same actions, unless the logits
    # moved across a sampling boundary.
    difference = _max_difference(shipped(*args)[output], onednn(*args)[output])
    calls = {"shipped": _timed(shipped, *args), "onednn": _timed(onednn, *args)}
    timings = _interleaved(calls, *timing, unit_s=unit_s)
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
    timing = (window_s, min_rounds)
    rows = []
    for rows_in_batch in batches:
        args = (jax_side.params, jax.device_put(_observations(rows_in_batch, rng)), key)
        what = f"policy, {rows_in_batch} rows"
        rows.append(_compared(what, jax_side.policy_fn, args, 0, 0.2, timing))
    if step:
        update_fn, state, batch = jax_side.update(_trajectories(*TRAIN_SHAPE, rng))
        steps, unrolls = TRAIN_SHAPE
        what = f"V-trace step, T={steps} x B={unrolls}"
        # Output 1: the step's metrics (loss terms, gradient norm).
        rows.append(_compared(what, update_fn, (state, batch), 1, 1.0, timing))
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
