"""V-trace against the IMPALA paper's definition, written as a plain loop."""

from __future__ import annotations

import itertools

import jax
import numpy as np
import pytest

from learner.agents.vtrace.returns import vtrace

jax.config.update("jax_enable_x64", False)


def naive_vtrace(
    log_rhos, discounts, rewards, values, bootstrap_value, lambda_, clip_rho, clip_pg_rho
):
    """Equation (1) of the paper, term by term, for one trajectory per column:

    v_s = V(x_s) + sum_{t=s}^{T-1} (prod_{i=s}^{t-1} gamma_i c_i) delta_t,
    delta_t = rho_t (r_t + gamma_t V(x_{t+1}) - V(x_t)),
    rho_t = min(rho_bar, pi/mu), c_i = lambda min(1, pi/mu),
    and the advantage rho^pg_s (r_s + gamma_s v_{s+1} - V(x_s)).
    """
    num_steps, batch = log_rhos.shape
    ratios = np.exp(log_rhos.astype(np.float64))
    values_ext = np.concatenate([values, bootstrap_value[None]]).astype(np.float64)
    vs = np.zeros((num_steps, batch))
    advantages = np.zeros((num_steps, batch))
    for b in range(batch):
        for s in range(num_steps):
            total = values_ext[s, b]
            trace = 1.0
            for t in range(s, num_steps):
                rho_t = ratios[t, b] if clip_rho is None else min(clip_rho, ratios[t, b])
                delta = rho_t * (
                    rewards[t, b] + discounts[t, b] * values_ext[t + 1, b] - values_ext[t, b]
                )
                total += trace * delta
                trace *= discounts[t, b] * lambda_ * min(1.0, ratios[t, b])
            vs[s, b] = total
        for s in range(num_steps):
            next_vs = vs[s + 1, b] if s + 1 < num_steps else bootstrap_value[b]
            rho_pg = ratios[s, b] if clip_pg_rho is None else min(clip_pg_rho, ratios[s, b])
            advantages[s, b] = rho_pg * (
                rewards[s, b] + discounts[s, b] * next_vs - values_ext[s, b]
            )
    return vs, advantages


SETTINGS = list(
    itertools.product(
        (1.0, 0.95, 0.5),  # lambda
        ((1.0, 1.0), (None, None), (2.0, 0.5), (0.7, None)),  # rho-bar, pg rho-bar
        ("constant", "with_terminals"),  # discounts
    )
)


@pytest.mark.parametrize(("lambda_", "clips", "discount_kind"), SETTINGS)
def test_vtrace_matches_paper_loop(lambda_, clips, discount_kind):
    assert len(SETTINGS) >= 20
    rng = np.random.default_rng(SETTINGS.index((lambda_, clips, discount_kind)))
    num_steps, batch = 9, 5
    log_rhos = rng.normal(0.0, 1.0, (num_steps, batch)).astype(np.float32)
    discounts = np.full((num_steps, batch), 0.97, np.float32)
    if discount_kind == "with_terminals":
        discounts *= rng.random((num_steps, batch)) > 0.3
    rewards = rng.normal(0.0, 1.0, (num_steps, batch)).astype(np.float32)
    values = rng.normal(0.0, 1.0, (num_steps, batch)).astype(np.float32)
    bootstrap_value = rng.normal(0.0, 1.0, batch).astype(np.float32)
    clip_rho, clip_pg_rho = clips

    result = vtrace(
        log_rhos,
        discounts,
        rewards,
        values,
        bootstrap_value,
        lambda_=lambda_,
        clip_rho_threshold=clip_rho,
        clip_pg_rho_threshold=clip_pg_rho,
    )
    expected_vs, expected_advantages = naive_vtrace(
        log_rhos, discounts, rewards, values, bootstrap_value, lambda_, clip_rho, clip_pg_rho
    )
    np.testing.assert_allclose(result.vs, expected_vs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(result.pg_advantages, expected_advantages, rtol=1e-5, atol=1e-5)


def _two_step_inputs(rhos):
    return dict(
        log_rhos=np.log(np.array([[rhos[0]], [rhos[1]]], np.float32)),
        discounts=np.array([[0.9], [0.9]], np.float32),
        rewards=np.array([[1.0], [2.0]], np.float32),
        values=np.array([[0.5], [1.0]], np.float32),
        bootstrap_value=np.array([3.0], np.float32),
    )


def test_on_policy_values_are_bootstrapped_returns():
    # rho = 1: v_1 = 2 + 0.9 * 3 = 4.7, v_0 = 1 + 0.9 * 4.7 = 5.23;
    # advantages: 1 + 0.9 * 4.7 - 0.5 = 4.73 and 2 + 0.9 * 3 - 1 = 3.7.
    result = vtrace(**_two_step_inputs((1.0, 1.0)))
    np.testing.assert_allclose(result.vs[:, 0], [5.23, 4.7], rtol=1e-6)
    np.testing.assert_allclose(result.pg_advantages[:, 0], [4.73, 3.7], rtol=1e-6)


def test_off_policy_hand_computed():
    # rhos (2, 0.5) clip to (1, 0.5); c = (1, 0.5).
    # delta_1 = 0.5 (2 + 2.7 - 1) = 1.85 -> v_1 = 2.85;
    # delta_0 = 1 (1 + 0.9 - 0.5) = 1.4 -> v_0 = 0.5 + 1.4 + 0.9 * 1 * 1.85 = 3.565.
    # advantages: 1 (1 + 0.9 * 2.85 - 0.5) = 3.065 and 0.5 (2 + 2.7 - 1) = 1.85.
    result = vtrace(**_two_step_inputs((2.0, 0.5)))
    np.testing.assert_allclose(result.vs[:, 0], [3.565, 2.85], rtol=1e-6)
    np.testing.assert_allclose(result.pg_advantages[:, 0], [3.065, 1.85], rtol=1e-6)
    # lambda = 0.5 halves the trace: v_0 = 0.5 + 1.4 + 0.9 * 0.5 * 1.85 = 2.7325.
    result = vtrace(**_two_step_inputs((2.0, 0.5)), lambda_=0.5)
    np.testing.assert_allclose(result.vs[:, 0], [2.7325, 2.85], rtol=1e-6)
    # Without clipping the first rho is 2: delta_0 = 2.8, v_0 = 0.5 + 2.8 + 0.9 * 1.85 = 4.965.
    result = vtrace(**_two_step_inputs((2.0, 0.5)), clip_rho_threshold=None)
    np.testing.assert_allclose(result.vs[:, 0], [4.965, 2.85], rtol=1e-6)


def test_targets_carry_no_gradient():
    inputs = _two_step_inputs((1.0, 1.0))

    def total(values):
        return vtrace(**{**inputs, "values": values}).vs.sum()

    np.testing.assert_array_equal(jax.grad(total)(inputs["values"]), np.zeros((2, 1)))


def test_shape_mismatch_is_refused():
    inputs = _two_step_inputs((1.0, 1.0))
    with pytest.raises(ValueError, match="bootstrap_value has shape"):
        vtrace(**{**inputs, "bootstrap_value": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match="rewards has shape"):
        vtrace(**{**inputs, "rewards": np.zeros((3, 1), np.float32)})
