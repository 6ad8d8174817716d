"""A policy with no network compute, for the serving benchmarks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from learner.inference.policy import PolicyStep


def make_uniform_policy_fn(
    num_actions: int,
) -> Callable[[Any, jax.Array, jax.Array], tuple[PolicyStep, jax.Array]]:
    """A policy with no network compute: uniform random actions (serving benchmarks).

    Same signature and outputs as `make_policy_fn`'s, so the learner serves it
    unchanged; the observations still reach the device, as a real policy's do (jit
    would drop an argument the program does not read, and with it the transfer).
    """
    log_prob = -float(np.log(num_actions))

    def policy(
        params: Any, observations: jax.Array, key: jax.Array
    ) -> tuple[PolicyStep, jax.Array]:
        del params
        key, sample_key = jax.random.split(key)
        # 32 random bits modulo A: a bias below A / 2**32, and a third of randint's cost
        # at a batch of 256 on CPU (its exact range reduction draws twice the bits).
        bits = jax.random.bits(sample_key, observations.shape[:1], jnp.uint32)
        actions = (bits % num_actions).astype(jnp.int32)
        return PolicyStep(actions, jnp.full(actions.shape, log_prob, jnp.float32)), key

    return jax.jit(policy, keep_unused=True)
