"""The V-trace agent: alignment of a [T+1, B] batch, the loss, one update, acting."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import uniform_policy
from learner.agents.agent import make_agent, stack_frames
from learner.agents.networks import NetworkMismatch, check_network_fits, make_network
from learner.agents.vtrace import learning
from learner.agents.vtrace.returns import vtrace
from learner.data.rewards import training_rewards
from learner.inference import policy as policy_fns
from learner.telemetry.metrics import explained_variance_of

SETTINGS = learning.LossSettings(
    discount=0.9,
    lambda_=1.0,
    clip_rho_threshold=1.0,
    clip_pg_rho_threshold=1.0,
    baseline_cost=0.5,
    entropy_cost=0.01,
    reward_clipping="none",
)


def episode_end_batch(end: str) -> learning.Trajectories:
    """x0 -> x1 (reward 2, ends by `end`) -> x2 (first of a new episode, reward 0)."""
    return learning.Trajectories(
        observations=jnp.zeros((3, 1, 1)),
        actions=jnp.zeros((3, 1), jnp.int32),
        behaviour_log_probs=jnp.zeros((3, 1)),
        rewards=jnp.array([[0.0], [2.0], [0.0]]),
        terminated=jnp.array([[False], [end == "terminated"], [False]]),
        truncated=jnp.array([[False], [end == "truncated"], [False]]),
    )


def targets(end: str):
    values = jnp.array([[1.0], [5.0], [7.0]])
    inputs = learning.vtrace_inputs(episode_end_batch(end), jnp.zeros((2, 1)), values, SETTINGS)
    result = vtrace(
        inputs.log_rhos, inputs.discounts, inputs.rewards, inputs.values, inputs.bootstrap_value
    )
    return inputs, result


def test_truncation_bootstraps_from_the_final_observation():
    inputs, result = targets("truncated")
    # v0 = r + gamma V(x1) = 2 + 0.9 * 5; never V(x2), which is another episode.
    np.testing.assert_allclose(result.vs[0, 0], 2.0 + 0.9 * 5.0)
    np.testing.assert_allclose(result.pg_advantages[0, 0], 2.0 + 0.9 * 5.0 - 1.0)
    np.testing.assert_array_equal(inputs.mask[:, 0], [1.0, 0.0])


def test_termination_does_not_bootstrap():
    inputs, result = targets("terminated")
    np.testing.assert_allclose(result.vs[0, 0], 2.0)
    np.testing.assert_allclose(result.pg_advantages[0, 0], 2.0 - 1.0)
    np.testing.assert_array_equal(inputs.mask[:, 0], [1.0, 0.0])
    np.testing.assert_array_equal(inputs.discounts[:, 0], [0.0, 0.0])


@pytest.mark.parametrize("end", ["truncated", "terminated"])
def test_auto_reset_transition_carries_no_target(end):
    _, result = targets(end)
    # Its value target is V(x1) itself and its advantage 0: it teaches nothing,
    # and V(x2), the next episode's first value, reaches no target of this one.
    np.testing.assert_allclose(result.vs[1, 0], 5.0)
    np.testing.assert_allclose(result.pg_advantages[1, 0], 0.0)


def test_rewards_are_clipped_only_when_asked():
    rewards = jnp.array([-3.0, 0.5, 7.0])
    np.testing.assert_array_equal(training_rewards(rewards, "abs_one"), [-1.0, 0.5, 1.0])
    np.testing.assert_array_equal(training_rewards(rewards, "none"), rewards)


@pytest.mark.parametrize(
    ("clipping", "scale", "expected"),
    [
        ("none", 1.0, [-30.0, 0.5, 7.0]),
        ("none", 0.1, [-3.0, 0.05, 0.7]),
        # Scaled first, then clipped: 0.1 x 7 = 0.7 stays, 0.1 x -30 = -3 is clipped.
        ("abs_one", 0.1, [-1.0, 0.05, 0.7]),
        ("abs_one", 1.0, [-1.0, 0.5, 1.0]),
    ],
)
def test_training_rewards_are_scaled_then_clipped(clipping, scale, expected):
    batch = learning.Trajectories(
        observations=jnp.zeros((4, 3, 1)),
        actions=jnp.zeros((4, 3), jnp.int32),
        behaviour_log_probs=jnp.zeros((4, 3)),
        rewards=jnp.array([[0.0] * 3, [-30.0, 0.5, 7.0], [0.0] * 3, [0.0] * 3]),
        terminated=jnp.zeros((4, 3), bool),
        truncated=jnp.zeros((4, 3), bool),
    )
    settings = SETTINGS._replace(reward_clipping=clipping, reward_scale=scale)
    inputs = learning.vtrace_inputs(batch, jnp.zeros((3, 3)), jnp.zeros((4, 3)), settings)
    np.testing.assert_allclose(inputs.rewards[0], expected, rtol=1e-6)


def random_batch(rng, steps=6, batch=4, obs=3, actions=2):
    return learning.Trajectories(
        observations=rng.normal(size=(steps, batch, obs)).astype(np.float32),
        actions=rng.integers(0, actions, (steps, batch)).astype(np.int32),
        behaviour_log_probs=np.full((steps, batch), np.log(0.5), np.float32),
        rewards=rng.normal(size=(steps, batch)).astype(np.float32),
        terminated=rng.random((steps, batch)) < 0.1,
        truncated=rng.random((steps, batch)) < 0.1,
    )


def mlp_update(make=learning.make_update_fn, **options):
    """A jitted V-trace update of a small MLP agent (`make`'s, with `options`), and its
    initial state."""
    network = make_network("mlp", num_actions=2, mlp_hidden_sizes=(16,))
    params = network.init(jax.random.key(0), np.zeros((1, 3), np.float32))
    optimizer = learning.make_optimizer("adam", 1e-2, max_grad_norm=40.0, epsilon=1e-8)
    update = make(make_agent(network), optimizer, SETTINGS, **options)
    state = learning.TrainState(params, optimizer.init(params), jnp.int32(0))
    return update, state


def test_updates_fit_the_values_of_a_fixed_batch():
    rng = np.random.default_rng(0)
    update, state = mlp_update()
    batch = random_batch(rng)
    value_losses = []
    for _ in range(30):
        state, metrics = update(state, batch)
        value_losses.append(float(metrics["baseline_loss"]))
    assert int(state.updates) == 30
    # The policy loss has no fixed target (V-trace's targets move with the values);
    # the value loss on one fixed batch must fall.
    assert value_losses[-1] < 0.5 * value_losses[0]
    assert set(metrics) >= {"loss", "policy_loss", "baseline_loss", "entropy", "grad_norm"}
    # One compiled program serves every call of the same shapes.
    assert update._cache_size() == 1


def test_a_batch_in_one_call_takes_the_same_steps_as_one_by_one():
    """make_batch_update_fn: 2 passes over 2 minibatches of consecutive unrolls, in the order
    first, second, first, second, with each step's metrics in that order."""
    rng = np.random.default_rng(1)
    step, state = mlp_update()
    network = make_network("mlp", num_actions=2, mlp_hidden_sizes=(16,))
    optimizer = learning.make_optimizer("adam", 1e-2, max_grad_norm=40.0, epsilon=1e-8)
    fused = learning.make_batch_update_fn(make_agent(network), optimizer, SETTINGS, None, 2, 2)
    batch = random_batch(rng)
    fused_state, fused_metrics = fused(state, batch)
    columns = learning.minibatch_columns(4, 2)
    assert [c.tolist() for c in columns] == [[0, 1], [2, 3]]
    losses = []
    for index in (0, 1, 0, 1):
        state, metrics = step(state, jax.tree.map(lambda x, c=columns[index]: x[:, c], batch))
        losses.append(float(metrics["loss"]))
    assert int(fused_state.updates) == int(state.updates) == 4
    np.testing.assert_allclose(fused_metrics["loss"], losses, rtol=1e-5)
    for fused_leaf, leaf in zip(
        jax.tree.leaves(fused_state.params), jax.tree.leaves(state.params), strict=True
    ):
        np.testing.assert_allclose(fused_leaf, leaf, rtol=1e-4, atol=1e-6)


def test_minibatch_columns_follow_the_devices_shares():
    """On 2 devices each takes half the batch and cuts its own half: minibatch m is the m-th
    run of each half."""
    columns = learning.minibatch_columns(8, 2, devices=2)
    assert [c.tolist() for c in columns] == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_an_update_with_a_nan_leaves_the_state_as_it_was():
    rng = np.random.default_rng(1)
    update, state = mlp_update()
    state, metrics = update(state, random_batch(rng))
    assert bool(metrics["finite"]) and int(state.updates) == 1
    poisoned = random_batch(rng)
    observations = np.array(poisoned.observations)
    observations[3, 1, 0] = np.nan
    after, metrics = update(state, poisoned._replace(observations=observations))
    assert not bool(metrics["finite"])
    assert int(after.updates) == 1
    for before, kept in zip(jax.tree.leaves(state), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(np.asarray(before), np.asarray(kept))


def test_an_unguarded_update_with_a_nan_says_so_and_steps_anyway():
    """guarded=False leaves keeping the state to the caller (the trainer): the step comes
    back stepped, with `finite` False, and is the guarded one's wherever it is finite."""
    rng = np.random.default_rng(1)
    guarded, state = mlp_update()
    unguarded, _ = mlp_update(guarded=False)
    batch = random_batch(rng)
    (stepped, metrics), (kept, _) = unguarded(state, batch), guarded(state, batch)
    assert bool(metrics["finite"])
    for a, b in zip(jax.tree.leaves(stepped), jax.tree.leaves(kept), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    observations = np.array(batch.observations)
    observations[3, 1, 0] = np.nan
    stepped, metrics = unguarded(state, batch._replace(observations=observations))
    assert not bool(metrics["finite"]) and int(stepped.updates) == 1


def test_the_sampled_kl_update_measures_the_kl_on_every_kth_step_only():
    """SampledKlUpdate: kl_update on calls 0, k, 2k...; every call the same step as
    make_update_fn's (the KL's forward pass changes no parameter)."""
    rng = np.random.default_rng(2)
    update, state = mlp_update()
    sampled, _ = mlp_update(learning.SampledKlUpdate, every=3)
    sampled_state, measured = state, []
    for _ in range(7):
        batch = random_batch(rng)
        state, metrics = update(state, batch)
        sampled_state, sampled_metrics = sampled(sampled_state, batch)
        measured.append("kl_update" in sampled_metrics)
        if "kl_update" in sampled_metrics:
            assert float(sampled_metrics["kl_update"]) == pytest.approx(
                float(metrics["kl_update"]), rel=1e-4, abs=1e-9
            )
        for a, b in zip(jax.tree.leaves(sampled_state), jax.tree.leaves(state), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    assert measured == [True, False, False, True, False, False, True]


@pytest.mark.parametrize(
    ("name", "observation"),
    [
        ("mlp", np.zeros((5, 4), np.float32)),
        ("nature_cnn", np.zeros((5, 4, 84, 84), np.uint8)),
        ("compact_cnn", np.zeros((5, 4, 42, 42), np.uint8)),
        ("impala_resnet", np.zeros((5, 4, 84, 84), np.uint8)),
    ],
)
def test_networks_give_logits_and_values(name, observation):
    network = make_network(name, num_actions=6)
    params = network.init(jax.random.key(0), observation[:1])
    output = network.apply(params, observation)
    assert output.logits.shape == (5, 6)
    assert output.values.shape == (5,)
    policy = policy_fns.make_policy_fn(network.apply)
    key = jax.random.key(1)
    step, next_key = policy(params, observation, key)
    assert step.actions.shape == (5,) and step.actions.dtype == jnp.int32
    assert ((step.actions >= 0) & (step.actions < 6)).all()
    # Near-uniform initial policy: log-probabilities close to log(1/6).
    np.testing.assert_allclose(step.log_probs, np.log(1 / 6), atol=0.05)
    assert not np.array_equal(jax.random.key_data(next_key), jax.random.key_data(key))


def traced_rows(apply_fn, seen: list[int], axis: int = 0):
    """apply_fn, recording the rows (the observations' `axis`) of every call traced
    through it."""

    def apply(params, observations, *rest):
        seen.append(observations.shape[axis])
        return apply_fn(params, observations, *rest)

    return apply


def test_a_batch_over_the_temporaries_budget_runs_in_chunks_with_the_same_result():
    """On a CPU the learner's policy keeps its scratch memory within a budget
    (policy_fns.CPU_CALL_TEMP_BYTES): over it, the network runs on equal chunks of rows
    (the last overlapping the one before where they do not divide evenly), and
    samples the same actions with the same log-probabilities as the batch run whole."""
    network = make_network("nature_cnn", num_actions=6)
    observations = np.random.default_rng(0).integers(0, 256, (5, 4, 84, 84), np.uint8)
    params = network.init(jax.random.key(0), observations[:1])
    whole_rows, chunk_rows = [], []
    whole = policy_fns.make_policy_fn(traced_rows(network.apply, whole_rows))
    one_row = whole.lower(params, observations[:1], jax.random.key(0)).compile()
    per_row = one_row.memory_analysis().temp_size_in_bytes
    budget = int(2.5 * per_row)  # room for 2 rows: rows 0-1, 2-3 and 3-4
    chunked = policy_fns.make_policy_fn(traced_rows(network.apply, chunk_rows), budget)
    key = jax.random.key(3)
    expected, _ = whole(params, observations, key)
    got, _ = chunked(params, observations, key)
    np.testing.assert_array_equal(got.actions, expected.actions)
    np.testing.assert_allclose(got.log_probs, expected.log_probs, rtol=1e-6)
    assert whole_rows[-1] == 5
    assert sorted(set(chunk_rows)) == [1, 2]  # the one-row estimate, the chunks
    temps = [
        fn.lower(params, observations, key).compile().memory_analysis().temp_size_in_bytes
        for fn in (whole, chunked)
    ]
    assert temps[1] <= budget < temps[0], temps
    # Within the budget, or with none: the batch runs whole.
    within_rows: list[int] = []
    within = policy_fns.make_policy_fn(traced_rows(network.apply, within_rows), 5 * per_row)
    within(params, observations, key)
    assert within_rows[-1] == 5


def test_the_learner_on_a_cpu_serves_every_batch_size_within_the_budget(tmp_path):
    """The learner builds its policy with its inference device's budget: with Pong and
    batches of up to 200 (31 MiB of temporaries whole; 200 is no multiple of a chunk),
    every padded batch size compiles to a program within it."""
    from learner.inference.loop import padded_sizes
    from learner.learner import Learner
    from tests.fleet import learner_config

    learner = Learner(
        learner_config("atari:Pong/84x84", tmp_path / "run", inference_batch_size=200)
    )
    params, _ = learner.parameters.latest()
    for size in padded_sizes(200):
        observations = np.zeros((size, 4, 84, 84), np.uint8)
        program = learner.inference.policy_fn.lower(params, observations, jax.random.key(0))
        temp = program.compile().memory_analysis().temp_size_in_bytes
        assert temp <= policy_fns.CPU_CALL_TEMP_BYTES, (size, temp / 2**20)


def test_the_temporaries_budget_is_for_cpus_only():
    class Device:
        def __init__(self, platform: str) -> None:
            self.platform = platform

    assert policy_fns.policy_temp_budget(jax.devices("cpu")[0]) == policy_fns.CPU_CALL_TEMP_BYTES
    assert policy_fns.policy_temp_budget(Device("gpu")) is None
    assert policy_fns.policy_temp_budget(Device("tpu")) is None


def test_unknown_network_is_refused():
    with pytest.raises(ValueError, match="unknown network"):
        make_network("transformer", 2)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "dtype", "shape", "hint"),
    [
        ("smm_cnn", "float32", (115,), "use --network mlp"),
        ("nature_cnn", "uint8", (72, 96, 2), "use --network smm_cnn"),
        ("nature_cnn", "float32", (4,), "use --network mlp"),
        ("smm_cnn", "uint8", (4, 84, 84), "use --network nature_cnn, compact_cnn or impala_resnet"),
        (
            "nature_cnn",
            "uint8",
            (4, 20, 20),
            "use --network nature_cnn, compact_cnn or impala_resnet",
        ),
    ],
)
def test_a_network_that_cannot_read_the_observations_is_refused_clearly(name, dtype, shape, hint):
    with pytest.raises(NetworkMismatch, match=hint):
        check_network_fits(name, dtype, shape)


@pytest.mark.parametrize(
    ("name", "dtype", "shape"),
    [
        ("nature_cnn", "uint8", (4, 84, 84)),
        ("impala_resnet", "uint8", (4, 84, 84)),
        ("smm_cnn", "uint8", (72, 96, 2)),
        ("mlp", "float32", (115,)),
        ("mlp", "uint8", (4, 84, 84)),
    ],
)
def test_networks_accept_what_they_read(name, dtype, shape):
    check_network_fits(name, dtype, shape)


def test_the_uniform_policy_draws_every_action_evenly_and_moves_its_key_on():
    """The serving benchmarks' stand-in policy: uniform over the actions, a fresh draw
    per call."""
    policy = uniform_policy.make_uniform_policy_fn(6)
    observations = np.zeros((6000, 2), np.float32)
    step, key = policy({}, observations, jax.random.key(0))
    counts = np.bincount(np.asarray(step.actions), minlength=6)
    assert counts.shape == (6,)
    # Chi-square with 5 degrees of freedom: 20.5 is its 0.999 quantile.
    assert ((counts - 1000) ** 2 / 1000).sum() < 20.5, counts
    np.testing.assert_allclose(step.log_probs, -np.log(6), rtol=1e-6)
    again, _ = policy({}, observations, key)
    assert (np.asarray(again.actions) != np.asarray(step.actions)).mean() > 0.7


def test_the_uniform_policy_takes_the_observations_to_the_device():
    """As a real policy does: its program has the batch as an input, though it reads only
    the batch's size (jit would otherwise drop it, and serving benchmarks on an accelerator
    would leave out the transfer)."""
    policy = uniform_policy.make_uniform_policy_fn(6)
    lowered = policy.lower({}, np.zeros((64, 4, 84, 84), np.uint8), jax.random.key(0))
    main = next(line for line in lowered.as_text().splitlines() if "@main(" in line)
    assert "tensor<64x4x84x84xui8>" in main, main


def health(values, targets, log_rhos=None, mask=None):
    values = jnp.asarray(values, jnp.float32)
    targets = jnp.asarray(targets, jnp.float32)
    zeros = jnp.zeros_like(values)
    inputs = learning.VTraceInputs(
        log_rhos=zeros if log_rhos is None else jnp.asarray(log_rhos, jnp.float32),
        discounts=zeros,
        rewards=zeros,
        values=values,
        bootstrap_value=zeros[0],
        mask=jnp.ones_like(values) if mask is None else jnp.asarray(mask, jnp.float32),
    )
    returns = learning.VTraceReturns(vs=targets, pg_advantages=targets - values)
    return {
        k: float(v) for k, v in learning.learning_health(inputs, returns, targets - values).items()
    }


def explained(values, targets):
    figures = health(values, targets)
    return explained_variance_of(
        figures["baseline_error_variance"], figures["value_target_variance"]
    )


def test_explained_variance_says_how_much_of_the_targets_the_baseline_predicts():
    targets = [[1.0, 3.0], [-2.0, 6.0]]
    assert explained(targets, targets) == pytest.approx(1.0)
    # A constant baseline at the targets' mean explains nothing.
    assert explained(np.full((2, 2), 2.0), targets) == pytest.approx(0.0)
    # Half the spread predicted: residuals of half the size leave a quarter of the variance.
    half = np.asarray(targets) / 2 + 1.0
    assert explained(half, targets) == pytest.approx(0.75)
    # Targets that do not vary have nothing to explain.
    assert explained([[0.5, 1.0]], [[1.0, 1.0]]) is None
    # Masked (auto-reset) transitions count for nothing.
    masked = health([[1.0, 100.0]], [[1.0, -50.0]], mask=[[1.0, 0.0]])
    assert masked["advantage_variance"] == 0.0 and masked["value_target_variance"] == 0.0


def test_the_scales_are_the_variances_of_the_real_transitions():
    figures = health(np.zeros((2, 2)), [[2.0, -2.0], [2.0, -2.0]])
    assert figures["value_target_variance"] == pytest.approx(4.0)
    assert figures["advantage_variance"] == pytest.approx(4.0)


def test_kl_of_behaviour_is_zero_on_policy_and_matches_the_estimator_off_it():
    assert health(np.zeros((2, 2)), np.ones((2, 2)))["kl_behaviour"] == 0.0
    log_rhos = np.log([[0.5, 2.0], [1.0, 1.5]])
    expected = np.mean(np.exp(log_rhos) - 1 - log_rhos)
    figures = health(np.zeros((2, 2)), np.ones((2, 2)), log_rhos=log_rhos)
    assert figures["kl_behaviour"] == pytest.approx(expected, rel=1e-5) and expected > 0


def test_the_update_reports_the_kl_between_the_policies_before_and_after_it():
    rng = np.random.default_rng(2)
    batch = random_batch(rng)
    network = make_network("mlp", num_actions=2, mlp_hidden_sizes=(16,))
    params = network.init(jax.random.key(0), np.zeros((1, 3), np.float32))
    kls = {}
    for rate in (0.0, 1e-2):
        optimizer = learning.make_optimizer("adam", rate, max_grad_norm=40.0, epsilon=1e-8)
        update = learning.make_update_fn(make_agent(network), optimizer, SETTINGS)
        state = learning.TrainState(params, optimizer.init(params), jnp.int32(0))
        after, metrics = update(state, batch)
        kls[rate] = float(metrics["kl_update"])
        # The same figure from the two parameter sets directly.
        columns = min(learning.KL_UNROLLS, batch.actions.shape[1])
        rows = batch.observations[:: learning.KL_STEP_STRIDE, :columns].reshape(-1, 3)
        before = jax.nn.log_softmax(network.apply(params, rows).logits)
        later = jax.nn.log_softmax(network.apply(after.params, rows).logits)
        direct = np.mean(np.sum(np.exp(before) * (before - later), axis=-1))
        assert kls[rate] == pytest.approx(float(direct), abs=1e-7)
    assert kls[0.0] == pytest.approx(0.0, abs=1e-9)
    assert kls[1e-2] > 1e-6


def test_a_decaying_entropy_bonus_weighs_less_as_the_updates_count_up():
    rng = np.random.default_rng(3)
    batch = random_batch(rng)
    network = make_network("mlp", num_actions=2, mlp_hidden_sizes=(16,))
    params = network.init(jax.random.key(0), np.zeros((1, 3), np.float32))
    optimizer = learning.make_optimizer("adam", 0.0, max_grad_norm=40.0, epsilon=1e-8)
    decaying = SETTINGS._replace(entropy_decay_updates=100)
    weights = {}
    for settings, updates in ((SETTINGS, 75), (decaying, 0), (decaying, 75), (decaying, 200)):
        update = learning.make_update_fn(make_agent(network), optimizer, settings)
        state = learning.TrainState(params, optimizer.init(params), jnp.int32(updates))
        _, metrics = update(state, batch)
        weights[settings.entropy_decay_updates, updates] = float(
            -metrics["entropy_loss"] / metrics["entropy"]
        )
    assert weights[0, 75] == pytest.approx(0.01)  # constant unless asked to decay
    assert weights[100, 0] == pytest.approx(0.01)
    assert weights[100, 75] == pytest.approx(0.0025)
    assert weights[100, 200] == 0.0  # not below 0 past the end


def one_action_pays_batch(rng, steps=21, batch=8):
    """Random actions of 2, no episode ends, and a reward of 1 for every transition that
    took action 0."""
    batch = random_batch(rng, steps, batch)
    rewards = np.zeros_like(batch.rewards)
    rewards[1:] = batch.actions[:-1] == 0  # the reward of transition t is stored at t + 1
    no_end = np.zeros_like(batch.terminated)
    return batch._replace(rewards=rewards, terminated=no_end, truncated=no_end)


def test_the_entropy_floor_holds_a_policy_that_one_action_pays_off_collapsing():
    network = make_network("mlp", num_actions=2, mlp_hidden_sizes=(16,))
    params = network.init(jax.random.key(0), np.zeros((1, 3), np.float32))
    optimizer = learning.make_optimizer("adam", 3e-2, max_grad_norm=40.0, epsilon=1e-8)
    uniform = float(np.log(2))
    entropies = {}
    # A weight of 5, not the default 0.05: this batch's advantages are about 1, a hundred
    # times Pong's, so the policy gradient's pull is too.
    for floor in (0.0, 0.8):
        settings = SETTINGS._replace(entropy_cost=0.0, entropy_floor=floor, entropy_floor_cost=5.0)
        update = learning.make_update_fn(make_agent(network), optimizer, settings)
        state = learning.TrainState(params, optimizer.init(params), jnp.int32(0))
        rng = np.random.default_rng(5)
        for _ in range(300):
            state, metrics = update(state, one_action_pays_batch(rng))
        entropies[floor] = float(metrics["entropy"])
    assert entropies[0.0] < 0.3 * uniform  # the policy gradient alone collapses it
    assert entropies[0.8] == pytest.approx(0.8 * uniform, abs=0.05 * uniform)


def test_above_its_floor_the_entropy_weighs_only_its_bonus():
    rng = np.random.default_rng(6)
    batch = one_action_pays_batch(rng)
    network = make_network("mlp", num_actions=2, mlp_hidden_sizes=(16,))
    fresh = network.init(jax.random.key(0), np.zeros((1, 3), np.float32))
    # The logits' kernel and bias (the leaves with one column per action) scaled up: a
    # sharper policy than a fresh one, whose logits start near 0.
    params = jax.tree.map(lambda x: 150.0 * x if x.shape[-1:] == (2,) else x, fresh)
    agent = make_agent(network)
    plain = learning.loss_fn(params, agent, batch, SETTINGS)[1][0]
    entropy = float(plain["entropy"])  # every transition is real: no episode ends here
    assert 0.3 * np.log(2) < entropy < 0.9 * np.log(2)
    below = learning.loss_fn(params, agent, batch, SETTINGS._replace(entropy_floor=0.3))[1][0]
    assert float(below["entropy_loss"]) == float(plain["entropy_loss"])
    # A floor above the policy's entropy adds its shortfall, in nats, times its weight.
    above = SETTINGS._replace(entropy_floor=0.95, entropy_floor_cost=2.0)
    raised = learning.loss_fn(params, agent, batch, above)[1][0]
    shortfall = 0.95 * np.log(2) - entropy
    assert float(raised["entropy_loss"]) == pytest.approx(
        float(plain["entropy_loss"]) + 2.0 * shortfall, rel=1e-5
    )


def test_the_entropy_floor_is_a_share_of_the_uniform_policys_entropy():
    import dataclasses

    from learner.config import LearnerConfig
    from learner.training.settings import loss_settings

    config = LearnerConfig(entropy_floor=0.6, entropy_floor_cost=0.1)
    settings = loss_settings(config)
    assert (settings.entropy_floor, settings.entropy_floor_cost) == (0.6, 0.1)
    for floor in (-0.1, 1.0):
        with pytest.raises(ValueError, match="entropy_floor is a share"):
            dataclasses.replace(config, entropy_floor=floor)
    with pytest.raises(ValueError, match="entropy_floor_cost"):
        dataclasses.replace(config, entropy_floor_cost=-1.0)


def test_the_entropy_bonus_decays_over_the_updates_the_env_steps_buy():
    import dataclasses

    from learner.config import LearnerConfig
    from learner.training.settings import learning_rate_schedule, loss_settings, total_updates

    config = LearnerConfig(total_env_steps=64_000, unroll_length=20, batch_size=16)
    assert loss_settings(config).entropy_decay_updates == 0
    decaying = loss_settings(dataclasses.replace(config, entropy_cost_decay=True))
    assert decaying.entropy_decay_updates == total_updates(config, 16) == 200
    # The same count as the learning rate's decay: both reach 0 together.
    assert float(learning_rate_schedule(config)(200)) == 0.0
    assert float(learning_rate_schedule(config)(199)) > 0.0
    # Its own horizon, when given: the bonus reaches 0 first, the learning rate later.
    sooner = dataclasses.replace(config, entropy_cost_decay=True, entropy_decay_env_steps=16_000)
    assert loss_settings(sooner).entropy_decay_updates == 50
    assert float(learning_rate_schedule(sooner)(50)) > 0.0
    # A horizon past the run's end ends with the run.
    later = dataclasses.replace(config, entropy_cost_decay=True, entropy_decay_env_steps=640_000)
    assert loss_settings(later).entropy_decay_updates == 200
    with pytest.raises(ValueError, match="entropy_decay_env_steps"):
        dataclasses.replace(config, entropy_decay_env_steps=-1)


def test_the_learning_rate_decays_to_its_floor_over_its_own_horizon_and_holds_there():
    import dataclasses

    from learner.config import LearnerConfig
    from learner.training.settings import learning_rate_schedule

    config = LearnerConfig(
        total_env_steps=64_000, unroll_length=20, batch_size=16, learning_rate=1e-3
    )  # 200 updates
    floor = dataclasses.replace(
        config, learning_rate_decay_env_steps=16_000, learning_rate_final=0.25
    )  # 50 updates
    schedule = learning_rate_schedule(floor)
    assert float(schedule(0)) == pytest.approx(1e-3)
    assert float(schedule(25)) == pytest.approx(0.625e-3)
    for step in (50, 120, 199, 400):
        assert float(schedule(step)) == pytest.approx(0.25e-3)
    # A floor with the default horizon is reached at the run's end.
    late = learning_rate_schedule(dataclasses.replace(config, learning_rate_final=0.5))
    assert float(late(100)) == pytest.approx(0.75e-3)
    assert float(late(200)) == pytest.approx(0.5e-3)
    # A horizon past the run's end ends with the run.
    past = dataclasses.replace(config, learning_rate_decay_env_steps=640_000)
    assert float(learning_rate_schedule(past)(200)) == 0.0
    for bad, field in (
        ({"learning_rate_decay_env_steps": -1}, "learning_rate_decay_env_steps"),
        ({"learning_rate_final": 1.5}, "learning_rate_final"),
        ({"learning_rate_final": -0.1}, "learning_rate_final"),
    ):
        with pytest.raises(ValueError, match=field):
            dataclasses.replace(config, **bad)


def test_the_update_kl_of_stacked_frames_runs_the_policy_on_the_strided_steps():
    """Atari's batches hold frames and stack them in the update: the KL after it is the
    policy's on every KL_STEP_STRIDE-th stacked step of the first KL_UNROLLS unrolls."""
    from learner.data.frame_stack import frame_indices

    rng = np.random.default_rng(4)
    steps, unrolls, stack = 20, 6, 4
    starts = np.zeros((steps + stack, unrolls), bool)  # per frame
    starts[0] = starts[7, 2] = True
    batch = learning.Trajectories(
        observations=rng.integers(0, 256, (steps + stack, unrolls, 1, 42, 42), np.uint8),
        frame_index=frame_indices(starts, stack),
        actions=rng.integers(0, 6, (steps + 1, unrolls)).astype(np.int32),
        behaviour_log_probs=np.full((steps + 1, unrolls), np.log(1 / 6), np.float32),
        rewards=rng.normal(size=(steps + 1, unrolls)).astype(np.float32),
        terminated=np.zeros((steps + 1, unrolls), bool),
        truncated=np.zeros((steps + 1, unrolls), bool),
    )
    network = make_network("compact_cnn", num_actions=6)
    stacked = stack_frames(batch.observations, batch.frame_index)
    params = network.init(jax.random.key(0), stacked[0, :1])
    optimizer = learning.make_optimizer("adam", 1e-3, max_grad_norm=40.0, epsilon=1e-5)
    update = learning.make_update_fn(make_agent(network), optimizer, SETTINGS)
    after, metrics = update(
        learning.TrainState(params, optimizer.init(params), jnp.int32(0)), batch
    )
    rows = stacked[:: learning.KL_STEP_STRIDE, : learning.KL_UNROLLS]
    rows = rows.reshape(-1, *rows.shape[2:])
    before = jax.nn.log_softmax(network.apply(params, rows).logits)
    later = jax.nn.log_softmax(network.apply(after.params, rows).logits)
    direct = np.mean(np.sum(np.exp(before) * (before - later), axis=-1))
    assert direct > 1e-7
    assert float(metrics["kl_update"]) == pytest.approx(float(direct), rel=1e-3)


def test_the_clipped_surrogate_stops_pushing_where_the_ratio_left_the_clip():
    """With --policy-clip, an action whose probability already rose past 1 + clip times the
    behaviour's (for a positive advantage) gets no further push; inside the clip it does."""
    network = make_network("mlp", num_actions=2, mlp_hidden_sizes=(8,))
    params = network.init(jax.random.key(3), np.zeros((1, 3), np.float32))
    rng = np.random.default_rng(3)
    batch = random_batch(rng, steps=3, batch=1)
    batch = batch._replace(
        actions=np.zeros((3, 1), np.int32),
        rewards=np.array([[0.0], [10.0], [10.0]], np.float32),  # advantages > 0
        terminated=np.zeros((3, 1), bool),
        truncated=np.zeros((3, 1), bool),
    )
    settings = SETTINGS._replace(policy_clip=0.2, baseline_cost=0.0, entropy_cost=0.0)
    pi = jax.nn.log_softmax(learning.policy_outputs(params, make_agent(network), batch).logits)[
        :-1, 0, 0
    ]

    def policy_gradient_norm(behaviour_log_probs):
        trial = batch._replace(behaviour_log_probs=behaviour_log_probs)
        grads, _ = jax.grad(learning.loss_fn, has_aux=True)(
            params, make_agent(network), trial, settings
        )
        return float(optax_norm(grads))

    inside = np.concatenate([np.asarray(pi)[:, None], np.zeros((1, 1))]).astype(np.float32)
    outside = inside - np.log(1.5)  # pi / mu = 1.5 > 1.2
    outside[-1] = 0.0
    assert policy_gradient_norm(inside) > 1e-4
    assert policy_gradient_norm(outside) == pytest.approx(0.0, abs=1e-7)


def optax_norm(tree):
    return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)))


@pytest.mark.parametrize(
    ("env_id", "network_name"),
    [("atari:Pong", "nature_cnn"), ("atari:Pong/42x42", "compact_cnn_centered")],
)
def test_an_update_on_real_atari_frames_moves_the_policy_to_a_planted_reward(env_id, network_name):
    """Real Pong frames, stacked as the learner stacks them; each round the current policy acts
    on them, only action 2 is rewarded, and the Atari preset's update trains on that batch,
    as the learner trains on what its latest parameters did. 30 rounds must make action 2
    the likeliest. (The batch's behaviour is the current policy: with one fixed uniform
    behaviour, PPO's clip stops every gradient once pi/mu passes 1.2, so p(2) would hover
    near the clip rather than measure the update.)"""
    from envs import registry
    from learner.data.frame_stack import frame_indices
    from learner.presets import preset_for
    from learner.training.settings import loss_settings

    steps, envs, stack = 8, 8, 4
    env = registry.make(env_id, envs, seed=0)
    rng = np.random.default_rng(0)
    first = env.reset()
    frames, starts = [first.observations], [np.ones(envs, bool)]
    for _ in range(steps + stack - 1):
        step = env.step(rng.integers(0, 6, envs))
        frames.append(step.observations)
        starts.append(np.zeros(envs, bool))
    env.close()
    frames_only = learning.Trajectories(
        observations=np.stack(frames),  # [T+S, B, 1, H, W]
        frame_index=frame_indices(np.stack(starts), stack),
        actions=np.zeros((steps + 1, envs), np.int32),
        behaviour_log_probs=np.zeros((steps + 1, envs), np.float32),
        rewards=np.zeros((steps + 1, envs), np.float32),
        terminated=np.zeros((steps + 1, envs), bool),
        truncated=np.zeros((steps + 1, envs), bool),
    )
    config = preset_for(env_id)
    network = make_network(network_name, num_actions=6)
    stacked = stack_frames(frames_only.observations, frames_only.frame_index)
    params = network.init(jax.random.key(0), stacked[0, :1])
    optimizer = learning.make_optimizer("adam", 1e-3, max_grad_norm=40.0, epsilon=1e-5)
    update = learning.make_update_fn(make_agent(network), optimizer, loss_settings(config))
    state = learning.TrainState(params, optimizer.init(params), jnp.int32(0))

    def policy(params) -> np.ndarray:
        logits = learning.policy_outputs(params, make_agent(network), frames_only).logits
        return np.asarray(jax.nn.softmax(logits), np.float64)

    def acted_on(probabilities: np.ndarray) -> learning.Trajectories:
        cumulative = np.cumsum(probabilities, axis=-1)
        draws = rng.random((*cumulative.shape[:-1], 1)) * cumulative[..., -1:]
        actions = np.minimum((draws > cumulative).sum(-1), 5).astype(np.int32)
        taken = np.take_along_axis(probabilities, actions[..., None], -1)[..., 0]
        rewards = np.zeros((steps + 1, envs), np.float32)
        rewards[1:] = actions[:-1] == 2  # the reward of a_t arrives with x_{t+1}
        return frames_only._replace(
            actions=actions, behaviour_log_probs=np.log(taken).astype(np.float32), rewards=rewards
        )

    assert policy(state.params)[..., 2].mean() == pytest.approx(1 / 6, abs=0.02)
    for _ in range(30):
        state, metrics = update(state, acted_on(policy(state.params)))
        assert bool(metrics["finite"])
    assert policy(state.params)[..., 2].mean() > 0.5
