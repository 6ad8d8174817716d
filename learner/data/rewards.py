"""Rewards as training sees them: scaled, then clipped.

One rule for the three places that apply it: the V-trace loss (JAX), the
unroll store's training-side episode returns (numpy) and the PyTorch
yardstick of the benchmark (bench/network.py).
"""

from __future__ import annotations

from typing import TypeVar

REWARD_CLIPPINGS = ("abs_one", "none")

Rewards = TypeVar("Rewards")


def training_rewards(rewards: Rewards, clipping: str, scale: float = 1.0) -> Rewards:
    """`rewards` times `scale`, then clipped to [-1, 1] when `clipping` is "abs_one".

    Any array with `*` and `.clip` will do: numpy, JAX (traced too) or PyTorch."""
    if clipping not in REWARD_CLIPPINGS:
        raise ValueError(f"unknown reward clipping {clipping!r}")
    if scale != 1.0:
        rewards = rewards * scale
    return rewards.clip(-1.0, 1.0) if clipping == "abs_one" else rewards
