"""V-trace off-policy targets (Espeholt et al. 2018, "IMPALA", section 4).

All arrays are time-major. Index t of `rewards`, `discounts` and `log_rhos`
describes the transition from state x_t to x_{t+1}; `values[t]` is V(x_t) and
`bootstrap_value` is V(x_T), the state after the last transition.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class VTraceReturns(NamedTuple):
    vs: jax.Array
    """[T, B] V-trace value targets v_s."""
    pg_advantages: jax.Array
    """[T, B] advantages for the policy gradient, rho_s (r_s + gamma_s v_{s+1} - V(x_s))."""


def vtrace(
    log_rhos: jax.Array,
    discounts: jax.Array,
    rewards: jax.Array,
    values: jax.Array,
    bootstrap_value: jax.Array,
    *,
    lambda_: float = 1.0,
    clip_rho_threshold: float | None = 1.0,
    clip_pg_rho_threshold: float | None = 1.0,
) -> VTraceReturns:
    """V-trace targets and policy-gradient advantages.

    Args:
      log_rhos: [T, B] log(pi(a_t|x_t) / mu(a_t|x_t)), target over behaviour policy.
      discounts: [T, B] discount of each transition (0 where the episode terminated).
      rewards: [T, B] reward of each transition.
      values: [T, B] V(x_t) under the current value function.
      bootstrap_value: [B] V(x_T).
      lambda_: mixes V-trace with TD(0) as in the paper's remark 2: c_t = lambda min(1, rho_t).
      clip_rho_threshold: rho-bar, the clip of the rhos in the value targets; None: no clip.
      clip_pg_rho_threshold: the clip of the rhos in the advantages; None: no clip.

    Returns:
      VTraceReturns with `vs` and `pg_advantages`, both [T, B], as targets:
      no gradient flows through them.
    """
    log_rhos = jnp.asarray(log_rhos)
    if log_rhos.ndim != 2:
        raise ValueError(f"log_rhos must be [T, B], got shape {log_rhos.shape}")
    for name, array in (("discounts", discounts), ("rewards", rewards), ("values", values)):
        if jnp.shape(array) != log_rhos.shape:
            raise ValueError(f"{name} has shape {jnp.shape(array)}, expected {log_rhos.shape}")
    if jnp.shape(bootstrap_value) != log_rhos.shape[1:]:
        raise ValueError(
            f"bootstrap_value has shape {jnp.shape(bootstrap_value)}, expected {log_rhos.shape[1:]}"
        )

    rhos = jnp.exp(log_rhos)
    clipped_rhos = rhos if clip_rho_threshold is None else jnp.minimum(clip_rho_threshold, rhos)
    cs = lambda_ * jnp.minimum(1.0, rhos)
    values_tp1 = jnp.concatenate([values[1:], bootstrap_value[None]], axis=0)
    deltas = clipped_rhos * (rewards + discounts * values_tp1 - values)

    # v_s - V(x_s) = delta_s + gamma_s c_s (v_{s+1} - V(x_{s+1})), from the end backwards.
    def backward(acc_tp1, inputs):
        delta_t, discount_t, c_t = inputs
        acc_t = delta_t + discount_t * c_t * acc_tp1
        return acc_t, acc_t

    _, vs_minus_values = jax.lax.scan(
        backward, jnp.zeros_like(bootstrap_value), (deltas, discounts, cs), reverse=True
    )
    vs = vs_minus_values + values

    vs_tp1 = jnp.concatenate([vs[1:], bootstrap_value[None]], axis=0)
    pg_rhos = rhos if clip_pg_rho_threshold is None else jnp.minimum(clip_pg_rho_threshold, rhos)
    pg_advantages = pg_rhos * (rewards + discounts * vs_tp1 - values)
    return VTraceReturns(
        vs=jax.lax.stop_gradient(vs), pg_advantages=jax.lax.stop_gradient(pg_advantages)
    )
