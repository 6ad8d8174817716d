"""The V-trace agent's pure functions: acting, the loss, one update.

Trajectories are time-major [T+1, B]: step t holds observation x_t, the
action a_t the behaviour policy took in it, that action's log-probability,
and the reward, `terminated` and `truncated` flags of the transition that
led to x_t (the wire protocol's convention). Consecutive unrolls overlap by
one step, so the last step of an unroll only bootstraps.

Auto-reset is next-step: when x_t ends an episode, the transition t -> t+1
goes to the first observation of a new episode, whatever a_t was. Such a
transition is masked out of every loss term, and V-trace is told to treat
x_t as the end of its trace (see `vtrace_inputs`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from learner.agents.agent import Agent, Params
from learner.agents.networks import PolicyOutput
from learner.agents.vtrace.returns import VTraceReturns, vtrace
from learner.backends.devices import Placement
from learner.data.rewards import training_rewards

ApplyFn = Callable[[Params, jax.Array], PolicyOutput]


class Trajectories(NamedTuple):
    """A training batch, time-major [T+1, B]."""

    observations: jax.Array
    """[T+1, B, *observation_shape], or with frame stacking the frames [T+S, B, ...]."""
    actions: jax.Array
    """int32 [T+1, B]: action taken at step t."""
    behaviour_log_probs: jax.Array
    """float32 [T+1, B]: log mu(a_t | x_t) of the policy that acted."""
    rewards: jax.Array
    """float32 [T+1, B]: raw reward of the transition into x_t."""
    terminated: jax.Array
    """bool [T+1, B]: x_t ends its episode; no bootstrapping from it."""
    truncated: jax.Array
    """bool [T+1, B]: x_t ends its episode by a time limit; bootstrap from V(x_t)."""
    frame_index: jax.Array | None = None
    """int32 [T+1, B, S]: the frames of each step's stack (learner/data/frame_stack.py),
    or None when the observations are what the model sees."""
    first: jax.Array | None = None
    """bool [T+1, B]: x_t starts an episode (the core state is zeroed there); recurrent
    agents only."""
    core_state: jax.Array | None = None
    """[1, B, 2, size]: the core state before step 0 of each unroll, as inference had it
    (batch on axis 1, as every field); recurrent agents only."""


class LossSettings(NamedTuple):
    discount: float
    lambda_: float
    clip_rho_threshold: float | None
    clip_pg_rho_threshold: float | None
    baseline_cost: float
    entropy_cost: float
    reward_clipping: Literal["abs_one", "none"]
    reward_scale: float = 1.0
    """Rewards are multiplied by this before clipping."""
    policy_clip: float | None = None
    """PPO's clip of pi/mu in the policy loss (with V-trace's advantages); None: V-trace's
    policy gradient."""
    normalize_advantages: bool = False
    """Advantages scaled to zero mean and unit variance over each batch."""
    entropy_decay_updates: int = 0
    """Updates over which entropy_cost decays linearly to 0; 0: constant."""
    entropy_floor: float = 0.0
    """The floor under the mean entropy, as a share of the uniform policy's; 0: none."""
    entropy_floor_cost: float = 0.0
    """Weight of the floor's hinge, per nat under it."""


class TrainState(NamedTuple):
    params: Params
    opt_state: optax.OptState
    updates: jax.Array
    """int32 scalar: updates applied so far (the policy version)."""


class VTraceInputs(NamedTuple):
    log_rhos: jax.Array
    discounts: jax.Array
    rewards: jax.Array
    values: jax.Array
    bootstrap_value: jax.Array
    mask: jax.Array
    """[T, B] 1 where transition t is real, 0 where it is an auto-reset."""


def vtrace_inputs(
    batch: Trajectories,
    target_log_probs: jax.Array,
    values: jax.Array,
    settings: LossSettings,
) -> VTraceInputs:
    """Aligns a [T+1, B] batch into the [T, B] transitions V-trace takes.

    `target_log_probs` is [T, B] (steps 0..T-1), `values` is [T+1, B].
    """
    episode_ends = jnp.logical_or(batch.terminated, batch.truncated)[:-1]
    mask = 1.0 - episode_ends.astype(jnp.float32)
    values_t, bootstrap_value = values[:-1], values[-1]
    rewards = training_rewards(batch.rewards[1:], settings.reward_clipping, settings.reward_scale)
    # No bootstrapping past a termination; an auto-reset transition has no future at all.
    discounts = settings.discount * (1.0 - batch.terminated[1:].astype(jnp.float32)) * mask
    # At an auto-reset step, reward := V(x_t) and discount := 0 make V-trace's target
    # there exactly V(x_t): delta_t = V(x_t) - V(x_t) = 0 and the trace stops. The step
    # before it then bootstraps from V(x_t), which is right after a truncation (and
    # multiplied by a zero discount after a termination).
    rewards = jnp.where(episode_ends, jax.lax.stop_gradient(values_t), rewards)
    log_rhos = target_log_probs - batch.behaviour_log_probs[:-1]
    return VTraceInputs(log_rhos, discounts, rewards, values_t, bootstrap_value, mask)


def policy_outputs(params: Params, agent: Agent, batch: Trajectories) -> PolicyOutput:
    """The network on every step of `batch`: logits [T+1, B, A] and values [T+1, B]."""
    return agent.unroll(params, batch)


def _masked_mean(x: jax.Array, mask: jax.Array, axis: str | None = None) -> jax.Array:
    """The mean of x where mask is 1; with `axis`, over every device's share of the batch
    (inside shard_map), so that several devices see the one device's figure."""
    total, count = jnp.sum(x * mask), jnp.sum(mask)
    if axis is not None:
        total, count = jax.lax.psum(total, axis), jax.lax.psum(count, axis)
    return total / jnp.maximum(count, 1.0)


def _masked_variance(x: jax.Array, mask: jax.Array, axis: str | None = None) -> jax.Array:
    return _masked_mean(jnp.square(x - _masked_mean(x, mask, axis)), mask, axis)


def learning_health(
    inputs: VTraceInputs, targets: VTraceReturns, advantages: jax.Array
) -> dict[str, jax.Array]:
    """Figures that show whether an agent learns before its return moves, over the batch's
    real transitions.

    The spreads are variances, which the log pools over its interval's updates
    (telemetry/metrics.py, explained_variance_of): value_target_variance, Var[v_s];
    baseline_error_variance, Var[v_s - V(x_s)]; advantage_variance, the policy gradient's
    scale. A minibatch of two unrolls often holds no reward and its targets hardly vary: a
    mean of each update's own 1 - error / target would be ruled by those and read near 0
    while the baseline predicts most of the targets. kl_behaviour: KL(mu || pi) of the
    policy that acted from the one that learns, estimated from the taken actions
    ((rho - 1) - log rho, unbiased and never negative).
    """
    mask = inputs.mask
    values = jax.lax.stop_gradient(inputs.values)
    log_rhos = jax.lax.stop_gradient(inputs.log_rhos)
    return {
        "value_target_variance": _masked_variance(targets.vs, mask),
        "baseline_error_variance": _masked_variance(targets.vs - values, mask),
        "advantage_variance": _masked_variance(advantages, mask),
        "kl_behaviour": _masked_mean(jnp.expm1(log_rhos) - log_rhos, mask),
    }


def loss_fn(
    params: Params,
    agent: Agent,
    batch: Trajectories,
    settings: LossSettings,
    axis: str | None = None,
    updates: jax.Array | int = 0,
) -> tuple[jax.Array, tuple[dict[str, jax.Array], jax.Array]]:
    """The IMPALA loss, averaged over the T x B transitions of the batch, with its metrics
    and the logits [T+1, B, A] it was computed from (for the update's KL). With `axis` (the
    batch split over devices in shard_map) the advantages are normalised with the whole
    batch's statistics, as on one device. `updates` (applied so far) sets the entropy
    bonus's weight where it decays."""
    output = policy_outputs(params, agent, batch)
    logits, values = output.logits[:-1], output.values
    log_policy = jax.nn.log_softmax(logits)
    actions = batch.actions[:-1]
    target_log_probs = jnp.take_along_axis(log_policy, actions[..., None], axis=-1)[..., 0]
    inputs = vtrace_inputs(batch, target_log_probs, values, settings)
    targets = vtrace(
        inputs.log_rhos,
        inputs.discounts,
        inputs.rewards,
        inputs.values,
        inputs.bootstrap_value,
        lambda_=settings.lambda_,
        clip_rho_threshold=settings.clip_rho_threshold,
        clip_pg_rho_threshold=settings.clip_pg_rho_threshold,
    )
    mask = inputs.mask
    count = mask.size
    if settings.policy_clip is None:
        advantages = targets.pg_advantages
    else:
        # The clipped surrogate weighs by the ratio itself: the advantage without rho.
        vs_tp1 = jnp.concatenate([targets.vs[1:], inputs.bootstrap_value[None]], axis=0)
        advantages = jax.lax.stop_gradient(
            inputs.rewards + inputs.discounts * vs_tp1 - inputs.values
        )
    health = learning_health(inputs, targets, advantages)
    if settings.normalize_advantages:
        mean = _masked_mean(advantages, mask, axis)
        std = jnp.sqrt(_masked_variance(advantages, mask, axis))
        advantages = (advantages - mean) / (std + 1e-8)
    if settings.policy_clip is None:
        policy_loss = -jnp.sum(target_log_probs * advantages * mask) / count
    else:
        # PPO's clipped surrogate against the policy that acted (APPO): several passes
        # over one batch cannot move the policy far from mu on its actions.
        ratio = jnp.exp(inputs.log_rhos)
        clipped = jnp.clip(ratio, 1.0 - settings.policy_clip, 1.0 + settings.policy_clip)
        surrogate = jnp.minimum(ratio * advantages, clipped * advantages)
        policy_loss = -jnp.sum(surrogate * mask) / count
    baseline_loss = 0.5 * jnp.sum(jnp.square(targets.vs - inputs.values) * mask) / count
    entropy = -jnp.sum(jnp.exp(log_policy) * log_policy, axis=-1)
    entropy_mean = jnp.sum(entropy * mask) / count
    entropy_loss = -entropy_cost(settings, updates) * entropy_mean
    if settings.entropy_floor:
        # A hinge, not a bonus: above the floor the policy gradient alone sets the entropy.
        # Over this device's real transitions (on several devices, its share's mean).
        floor = settings.entropy_floor * float(np.log(logits.shape[-1]))
        shortfall = jax.nn.relu(floor - _masked_mean(entropy, mask))
        entropy_loss = entropy_loss + settings.entropy_floor_cost * shortfall
    total = policy_loss + settings.baseline_cost * baseline_loss + entropy_loss
    metrics = {
        "loss": total,
        "policy_loss": policy_loss,
        "baseline_loss": baseline_loss,
        "entropy_loss": entropy_loss,
        "entropy": entropy_mean,
        "value_mean": jnp.mean(values),
        "rho_mean": _masked_mean(jnp.exp(inputs.log_rhos), mask),
        **health,
    }
    return total, (metrics, jax.lax.stop_gradient(output.logits))


def entropy_cost(settings: LossSettings, updates: jax.Array | int) -> jax.Array:
    """The entropy bonus's weight after `updates` updates."""
    if not settings.entropy_decay_updates:
        return jnp.float32(settings.entropy_cost)
    left = 1.0 - jnp.asarray(updates, jnp.float32) / settings.entropy_decay_updates
    return settings.entropy_cost * jnp.clip(left, 0.0, 1.0)


KL_UNROLLS = 4
KL_STEP_STRIDE = 5
"""The policy is run again after the update, for the KL between consecutive policies, on every
KL_STEP_STRIDE-th step of the batch's (per device) first KL_UNROLLS unrolls: the Atari
preset's minibatches are 2 unrolls, and all their steps again would add a third of a forward
pass to every update (the trainer is the bottleneck on a CPU); this takes a few percent."""


def update_kl(
    agent: Agent, params: Params, batch: Trajectories, logits_before: jax.Array
) -> jax.Array:
    """Mean KL(pi_before || pi_after) over the steps KL_UNROLLS and KL_STEP_STRIDE pick (a
    recurrent agent: every step of those unrolls, since its core needs them all),
    `logits_before` [T+1, B, A] being the policy's before the update, `params` after it."""
    columns = min(KL_UNROLLS, batch.actions.shape[1])
    after, before = agent.kl_logits(params, batch, logits_before, columns, KL_STEP_STRIDE)
    after, before = jax.nn.log_softmax(after), jax.nn.log_softmax(before)
    return jnp.mean(jnp.sum(jnp.exp(before) * (before - after), axis=-1))


def make_optimizer(
    name: Literal["adam", "rmsprop"],
    learning_rate: float | optax.Schedule,
    max_grad_norm: float,
    epsilon: float,
    rmsprop_decay: float = 0.99,
    momentum: float = 0.0,
) -> optax.GradientTransformation:
    if name == "adam":
        optimizer = optax.adam(learning_rate, eps=epsilon)
    elif name == "rmsprop":
        optimizer = optax.rmsprop(
            learning_rate, decay=rmsprop_decay, eps=epsilon, momentum=momentum or None
        )
    else:
        raise ValueError(f"unknown optimizer {name!r}")
    return optax.chain(optax.clip_by_global_norm(max_grad_norm), optimizer)


def _update_step(
    agent: Agent,
    optimizer: optax.GradientTransformation,
    settings: LossSettings,
    axis: str | None,
    guarded: bool = True,
    measure_kl: bool = True,
) -> Callable[[TrainState, Trajectories], tuple[TrainState, dict[str, jax.Array]]]:
    """One gradient step, unjitted (see make_update_fn); with `axis`, one device's share of it
    inside shard_map."""

    def share_of_loss(
        params: Params, batch: Trajectories, updates: jax.Array
    ) -> tuple[jax.Array, tuple]:
        total, (metrics, logits) = loss_fn(params, agent, batch, settings, axis, updates)
        if axis is None:
            return total, (metrics, logits)
        # In shard_map the gradient of the replicated parameters comes back summed over
        # the devices (the transpose of their broadcast is a psum: the all-reduce), so
        # each device's loss is divided by their number to make the sum the mean.
        return total / jax.lax.axis_size(axis), (jax.lax.pmean(metrics, axis), logits)

    def update(state: TrainState, batch: Trajectories) -> tuple[TrainState, dict[str, jax.Array]]:
        grads, (metrics, logits) = jax.grad(share_of_loss, has_aux=True)(
            state.params, batch, state.updates
        )
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        if measure_kl:
            kl = update_kl(agent, params, batch, logits)
            metrics["kl_update"] = kl if axis is None else jax.lax.pmean(kl, axis)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
        metrics["grad_norm"] = grad_norm
        metrics["finite"] = finite
        stepped = TrainState(params, opt_state, state.updates + 1)
        if not guarded:
            return stepped, metrics
        kept = jax.tree.map(lambda new, old: jnp.where(finite, new, old), stepped, state)
        return kept, metrics

    return update


def _axis(placement: Placement | None) -> str | None:
    return placement.axis_name if placement is not None and placement.sharded else None


def make_update_fn(
    agent: Agent,
    optimizer: optax.GradientTransformation,
    settings: LossSettings,
    placement: Placement | None = None,
    guarded: bool = True,
    measure_kl: bool = True,
) -> Callable[[TrainState, Trajectories], tuple[TrainState, dict[str, jax.Array]]]:
    """One jitted gradient step: (state, batch) -> (new state, metrics).

    On several devices (`placement`, learner/backends/devices.py) each device computes
    the loss of its share of the batch; the gradients and metrics are averaged
    over the devices (an all-reduce) before the optimizer step, so every
    device applies the same step: the global batch's mean gradient, as one
    device would compute it (the shares are equal, so the mean of the shares'
    means is the global mean).

    A step whose loss or gradient is not finite changes nothing (the state
    comes back as it went in) and says so in `metrics["finite"]`: one NaN
    applied would spoil the parameters for good. Unless `guarded`, such a step
    returns the stepped state all the same, and the caller, which still holds the
    state it passed in, keeps that one (the trainer does): the select of every
    parameter and moment between the two states costs about 5% of a compact-CNN
    step on a CPU. Without `measure_kl` the metrics have no `kl_update` (a second
    forward pass over a sample of the batch, about 7% of such a step).
    """
    axis = _axis(placement)
    update = _update_step(agent, optimizer, settings, axis, guarded, measure_kl)
    return jax.jit(update) if axis is None else placement.jit_sharded(update)


KL_EVERY = 4
"""The trainer's steps measure kl_update on every KL_EVERY-th step (SampledKlUpdate): at
tens of steps a second the log's interval mean still holds hundreds of them."""


class SampledKlUpdate:
    """make_update_fn's step that measures kl_update on every `every`-th call only: two
    compiled programs, one with the KL's forward pass and one without, called in turn."""

    def __init__(
        self,
        agent: Agent,
        optimizer: optax.GradientTransformation,
        settings: LossSettings,
        placement: Placement | None = None,
        guarded: bool = True,
        every: int = KL_EVERY,
    ):
        self._with_kl = make_update_fn(agent, optimizer, settings, placement, guarded, True)
        self._without_kl = make_update_fn(agent, optimizer, settings, placement, guarded, False)
        self._every = every
        self._calls = 0

    def __call__(
        self, state: TrainState, batch: Trajectories
    ) -> tuple[TrainState, dict[str, jax.Array]]:
        measure = self._calls % self._every == 0
        self._calls += 1
        return (self._with_kl if measure else self._without_kl)(state, batch)

    def warm_up(self, state: TrainState, batch: Trajectories) -> None:
        """Compiles both programs (their results are discarded)."""
        jax.block_until_ready((self._with_kl(state, batch), self._without_kl(state, batch)))


def make_batch_update_fn(
    agent: Agent,
    optimizer: optax.GradientTransformation,
    settings: LossSettings,
    placement: Placement | None = None,
    passes: int = 1,
    minibatches: int = 1,
) -> Callable[[TrainState, Trajectories], tuple[TrainState, dict[str, jax.Array]]]:
    """A whole batch's training as one jitted call: `passes` passes over its `minibatches`
    minibatches, a gradient step (make_update_fn's) on each in turn. Returns the new state
    and each step's metrics, [passes * minibatches] in the order they ran.

    One call per batch, not per step, because what a step costs the host (dispatch, the
    metrics' transfer, the Python between steps, which shares the GIL with serving) is
    paid once: on a GPU that host work, not the device, bounds a step of a small batch.

    Each device (of `placement`) cuts its share of the batch into `minibatches` runs of
    consecutive unrolls; minibatch_columns says which unrolls of the whole batch that makes
    each minibatch.
    """
    axis = _axis(placement)
    step = _update_step(agent, optimizer, settings, axis)

    def train(state: TrainState, batch: Trajectories) -> tuple[TrainState, dict[str, jax.Array]]:
        def cut(x: jax.Array) -> jax.Array:  # [S, B, ...] -> [M, S, B / M, ...]
            parts = x.reshape(x.shape[0], minibatches, x.shape[1] // minibatches, *x.shape[2:])
            return jnp.moveaxis(parts, 1, 0)

        parts = jax.tree.map(cut, batch)

        def one_pass(state: TrainState, _: None) -> tuple[TrainState, dict[str, jax.Array]]:
            return jax.lax.scan(step, state, parts, unroll=True)

        state, metrics = jax.lax.scan(one_pass, state, None, length=passes, unroll=True)
        return state, jax.tree.map(lambda m: m.reshape(-1), metrics)

    return jax.jit(train) if axis is None else placement.jit_sharded(train)


def minibatch_columns(batch_size: int, minibatches: int, devices: int = 1) -> list[np.ndarray]:
    """The unrolls (columns) of a batch of `batch_size` that make each of its `minibatches`
    minibatches in make_batch_update_fn, the batch split evenly over `devices`."""
    share, size = batch_size // devices, batch_size // devices // minibatches
    return [
        np.concatenate(
            [np.arange(d * share + m * size, d * share + (m + 1) * size) for d in range(devices)]
        )
        for m in range(minibatches)
    ]


def make_finite_check_fn(
    agent: Agent, settings: LossSettings
) -> Callable[[Params, Trajectories, jax.Array], jax.Array]:
    """(params, batch, updates) -> whether the loss and gradient of `batch` are finite, on
    one device (jitted). An update that was not finite runs it unroll by unroll, to find
    whose data alone makes it so."""

    def finite(params: Params, batch: Trajectories, updates: jax.Array) -> jax.Array:
        grads, (metrics, _) = jax.grad(
            lambda p: loss_fn(p, agent, batch, settings, None, updates), has_aux=True
        )(params)
        return jnp.isfinite(metrics["loss"]) & jnp.isfinite(optax.tree.norm(grads))

    return jax.jit(finite)
