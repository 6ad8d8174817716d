"""Host batches aligned for XLA on a CPU, measured (docs/benchmarks.md, "Batches read in place").

The learner's policy (Nature CNN, built as the learner builds it for a CPU)
on a numpy batch aligned to 64 bytes, as the inference thread's buffers are,
against the same batch 16 bytes off, where numpy's own allocation puts a
large array; and a training batch's frames (T+S = 24 x B = 32) handed to a
jitted call both ways. One process, interleaved rounds (case e's timing),
medians of ms per call:

    .venv/bin/python -m bench.aligned [--window-s 10] [--batches 16 64]
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import jax
import numpy as np

from bench.network import OBSERVATION_SHAPE, _interleaved, _Jax
from learner.backends.cpu.host_arrays import XLA_CPU_ALIGNMENT, aligned_zeros, is_aligned
from learner.presets import PRESETS

TRAINING_FRAMES = (24, 32, 1, 84, 84)
"""A Pong training batch's frames: T+S = 20+4 steps x B = 32 unrolls."""


def sixteen_bytes_off(array: np.ndarray) -> np.ndarray:
    """A copy of `array` whose data starts 16 bytes past a 64-byte boundary."""
    storage = aligned_zeros(array.nbytes + XLA_CPU_ALIGNMENT, np.uint8)
    copy = storage[16 : 16 + array.nbytes].view(array.dtype).reshape(array.shape)
    copy[...] = array
    return copy


def measure(batches: Sequence[int], window_s: float, min_rounds: int) -> list[dict]:
    rng = np.random.default_rng(0)
    jax_side = _Jax(PRESETS["atari"])  # case (e)'s network and policy, as the learner's
    key = [jax.random.key(1)]

    def policy_call(observations: np.ndarray):
        def call() -> None:
            step, key[0] = jax_side.policy_fn(jax_side.params, observations, key[0])
            np.asarray(step.actions)  # the inference thread's wait

        return call

    rows = []
    for rows_in_batch in batches:
        aligned = aligned_zeros((rows_in_batch, *OBSERVATION_SHAPE), np.uint8)
        aligned[...] = rng.integers(0, 256, aligned.shape, np.uint8)
        timings = _interleaved(
            {
                "aligned": policy_call(aligned),
                "off": policy_call(sixteen_bytes_off(aligned)),
            },
            window_s,
            min_rounds,
            unit_s=0.2,
        )
        rows.append(_row(f"policy, {rows_in_batch} rows", timings))

    read = jax.jit(lambda frames: frames[-1, -1, 0, -1, -1])
    frames = aligned_zeros(TRAINING_FRAMES, np.uint8)
    off = sixteen_bytes_off(frames)
    assert is_aligned(frames) and not is_aligned(off)
    timings = _interleaved(
        {
            "aligned": lambda: read(frames).block_until_ready(),
            "off": lambda: read(off).block_until_ready(),
        },
        window_s,
        min_rounds,
        unit_s=0.05,
    )
    rows.append(_row("a training batch's frames (5.2 MB) into a jitted call", timings))
    return rows


def _row(what: str, timings: dict[str, tuple[float, float]]) -> dict:
    aligned, off = timings["aligned"][0], timings["off"][0]
    return {"what": what, "off_ms": off * 1e3, "aligned_ms": aligned * 1e3, "gain": off / aligned}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window-s", type=float, default=10.0, help="timing per row")
    parser.add_argument("--min-rounds", type=int, default=7)
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    args = parser.parse_args(argv)
    print("| what | 16 bytes off, ms | aligned, ms | off / aligned |")
    print("| --- | --- | --- | --- |")
    for row in measure(args.batches, args.window_s, args.min_rounds):
        print(
            f"| {row['what']} | {row['off_ms']:.3f} | {row['aligned_ms']:.3f} | {row['gain']:.3f} |"
        )


if __name__ == "__main__":
    main()
