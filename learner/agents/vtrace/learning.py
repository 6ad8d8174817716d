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
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from learner.devices import Placement
from learner.frame_stack import stack_frames
from learner.networks import PolicyOutput
from learner.ops.onednn_conv import for_inference
from learner.ops.vtrace import VTraceReturns, vtrace
from learner.rewards import training_rewards

Params = Any
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
    """int32 [T+1, B, S]: the frames of each step's stack (learner/frame_stack.py),
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


def policy_outputs(params: Params, apply_fn: ApplyFn, batch: Trajectories) -> PolicyOutput:
    """The network on every step of `batch`: logits [T+1, B, A] and values [T+1, B]."""
    steps, batch_size = batch.actions.shape
    observations = batch.observations
    if batch.frame_index is not None:
        observations = stack_frames(observations, batch.frame_index)
    if batch.core_state is not None:
        # The core unrolled from the state inference had before step 0, reset where
        # episodes start, as it ran when acting.
        output, _ = apply_fn(params, observations, batch.first, batch.core_state[0])
        return output
    flat_observations = observations.reshape(steps * batch_size, *observations.shape[2:])
    output = apply_fn(params, flat_observations)
    return PolicyOutput(
        logits=output.logits.reshape(steps, batch_size, -1),
        values=output.values.reshape(steps, batch_size),
    )


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

    explained_variance: 1 - Var[v_s - V(x_s)] / Var[v_s], how much of the value targets'
    spread the baseline predicts (NaN while the targets do not vary); near 0 or below, the
    advantages are mostly the baseline's error. advantage_std and value_target_std: the
    scales the policy gradient and the value loss work with. kl_behaviour: KL(mu || pi) of
    the policy that acted from the one that learns, estimated from the taken actions
    ((rho - 1) - log rho, unbiased and never negative).
    """
    mask = inputs.mask
    values = jax.lax.stop_gradient(inputs.values)
    target_variance = _masked_variance(targets.vs, mask)
    residual_variance = _masked_variance(targets.vs - values, mask)
    explained = jnp.where(target_variance > 0, 1.0 - residual_variance / target_variance, jnp.nan)
    log_rhos = jax.lax.stop_gradient(inputs.log_rhos)
    return {
        "explained_variance": explained,
        "advantage_std": jnp.sqrt(_masked_variance(advantages, mask)),
        "value_target_std": jnp.sqrt(target_variance),
        "kl_behaviour": _masked_mean(jnp.expm1(log_rhos) - log_rhos, mask),
    }


def loss_fn(
    params: Params,
    apply_fn: ApplyFn,
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
    output = policy_outputs(params, apply_fn, batch)
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
    apply_fn: ApplyFn, params: Params, batch: Trajectories, logits_before: jax.Array
) -> jax.Array:
    """Mean KL(pi_before || pi_after) over the steps KL_UNROLLS and KL_STEP_STRIDE pick (a
    recurrent policy: every step of those unrolls, since its core needs them all),
    `logits_before` [T+1, B, A] being the policy's before the update, `params` after it."""
    columns = min(KL_UNROLLS, batch.actions.shape[1])
    if batch.core_state is not None:
        subset = jax.tree.map(lambda x: x[:, :columns], batch)
        after = policy_outputs(params, apply_fn, subset).logits
        before = logits_before[:, :columns]
    else:
        steps = slice(None, None, KL_STEP_STRIDE)
        observations = batch.observations[:, :columns]
        if batch.frame_index is not None:
            observations = stack_frames(observations, batch.frame_index[steps, :columns])
        else:
            observations = observations[steps]
        after = apply_fn(params, observations.reshape(-1, *observations.shape[2:])).logits
        before = logits_before[steps, :columns].reshape(after.shape)
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


def make_update_fn(
    apply_fn: ApplyFn,
    optimizer: optax.GradientTransformation,
    settings: LossSettings,
    placement: Placement | None = None,
) -> Callable[[TrainState, Trajectories], tuple[TrainState, dict[str, jax.Array]]]:
    """One jitted gradient step: (state, batch) -> (new state, metrics).

    On several devices (`placement`, learner/devices.py) each device computes
    the loss of its share of the batch; the gradients and metrics are averaged
    over the devices (an all-reduce) before the optimizer step, so every
    device applies the same step: the global batch's mean gradient, as one
    device would compute it (the shares are equal, so the mean of the shares'
    means is the global mean).

    A step whose loss or gradient is not finite changes nothing (the state
    comes back as it went in) and says so in `metrics["finite"]`: one NaN
    applied would spoil the parameters for good.
    """

    axis = placement.axis_name if placement is not None and placement.sharded else None

    def share_of_loss(
        params: Params, batch: Trajectories, updates: jax.Array
    ) -> tuple[jax.Array, tuple]:
        total, (metrics, logits) = loss_fn(params, apply_fn, batch, settings, axis, updates)
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
        kl = update_kl(apply_fn, params, batch, logits)
        metrics["kl_update"] = kl if axis is None else jax.lax.pmean(kl, axis)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
        metrics["grad_norm"] = grad_norm
        metrics["finite"] = finite
        stepped = TrainState(params, opt_state, state.updates + 1)
        kept = jax.tree.map(lambda new, old: jnp.where(finite, new, old), stepped, state)
        return kept, metrics

    return jax.jit(update) if axis is None else placement.jit_sharded(update)


def make_finite_check_fn(
    apply_fn: ApplyFn, settings: LossSettings
) -> Callable[[Params, Trajectories, jax.Array], jax.Array]:
    """(params, batch, updates) -> whether the loss and gradient of `batch` are finite, on
    one device (jitted). An update that was not finite runs it unroll by unroll, to find
    whose data alone makes it so."""

    def finite(params: Params, batch: Trajectories, updates: jax.Array) -> jax.Array:
        grads, (metrics, _) = jax.grad(
            lambda p: loss_fn(p, apply_fn, batch, settings, None, updates), has_aux=True
        )(params)
        return jnp.isfinite(metrics["loss"]) & jnp.isfinite(optax.tree.norm(grads))

    return jax.jit(finite)


class PolicyStep(NamedTuple):
    actions: jax.Array
    """int32 [N]."""
    log_probs: jax.Array
    """float32 [N]: log-probability of each chosen action."""


CPU_CALL_TEMP_BYTES = 24 << 20
"""On a CPU, the most scratch memory one network call of the policy may take.

XLA:CPU allocates a program's temporaries afresh on every call, in one block.
glibc serves blocks above its mmap ceiling (32 MiB on 64-bit) with mmap and
returns them on free, so every call faults the whole block in again: at 256
rows of the Nature CNN (40 MiB) 10,300 page faults and a third of the call.
Run in chunks whose temporaries stay below the ceiling, the heap keeps reusing
one block (docs/benchmarks.md, case e). GPUs and TPUs keep their own pools and
run a batch whole."""


def policy_temp_budget(device: jax.Device) -> int | None:
    """The temporaries budget of one policy call on `device`: None runs batches whole."""
    return CPU_CALL_TEMP_BYTES if device.platform == "cpu" else None


def _spec(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def _rows_per_call(
    fn: Callable, params: Params, rows: tuple[jax.Array, ...], budget: int | None, cache: dict
) -> int:
    """The most rows, a power of two or all of them, whose call of `fn` keeps XLA's
    temporaries within `budget` bytes (no budget: all), estimated from one row's
    program (a network's temporaries grow with its rows). Called while tracing;
    the one-row program is compiled once per parameter and row shape."""
    count = rows[0].shape[0]
    if budget is None:
        return count
    one_row = tuple(jax.ShapeDtypeStruct((1, *x.shape[1:]), x.dtype) for x in rows)
    key = (jax.tree.structure(params), tuple(jax.tree.leaves(jax.tree.map(_spec, params))), one_row)
    if key not in cache:
        analysis = (
            jax.jit(fn).lower(jax.tree.map(_spec, params), *one_row).compile().memory_analysis()
        )
        cache[key] = None if analysis is None else analysis.temp_size_in_bytes
    per_row = cache[key]
    if not per_row or count * per_row <= budget:
        return count
    chunk = 1
    while chunk * 2 * per_row <= budget:
        chunk *= 2
    return chunk


def _in_chunks(fn: Callable, params: Params, rows: tuple[jax.Array, ...], chunk: int) -> Any:
    """fn(params, *rows), every input and output batched on axis 0, run on at most
    `chunk` rows at a time in one loop (lax.map).

    The rows are cut in equal chunks, each read in place (a dynamic slice, no
    copy of the batch); where they do not divide evenly the last chunk starts
    early, overlapping the one before, and its repeated rows are dropped. So
    every call, the last included, is one program of one size, and the
    temporaries stay those of one chunk.
    """
    count = rows[0].shape[0]
    if chunk >= count:
        return fn(params, *rows)
    calls = -(-count // chunk)
    size = -(-count // calls)

    def call(index: jax.Array) -> Any:
        start = jnp.minimum(index * size, count - size)
        return fn(params, *(jax.lax.dynamic_slice_in_dim(x, start, size) for x in rows))

    out = jax.lax.map(call, jnp.arange(calls))
    repeated = calls * size - count  # rows the last chunk shares with the one before

    def unstack(y: jax.Array) -> jax.Array:
        head = y[:-1].reshape((calls - 1) * size, *y.shape[2:])
        return jnp.concatenate([head, y[-1, repeated:]])

    return jax.tree.map(unstack, out)


def make_policy_fn(
    apply_fn: ApplyFn, max_temp_bytes: int | None = None
) -> Callable[[Params, jax.Array, jax.Array], tuple[PolicyStep, jax.Array]]:
    """Jitted sampling: (params, observations [N, ...], key) -> (PolicyStep, next key).

    The key is split inside the program, so it never leaves the device. With
    `max_temp_bytes` (`policy_temp_budget`), a batch whose network call would take
    more scratch memory runs the network on chunks of rows that do not; the
    results are the same rows either way. The network is traced `for_inference`:
    on a CPU its convolutions may run on oneDNN (ops/onednn_conv.py).
    """
    cache: dict = {}

    def logits(params: Params, observations: jax.Array) -> jax.Array:
        with for_inference():
            return apply_fn(params, observations).logits

    def policy(
        params: Params, observations: jax.Array, key: jax.Array
    ) -> tuple[PolicyStep, jax.Array]:
        key, sample_key = jax.random.split(key)
        rows = (observations,)
        chunk = _rows_per_call(logits, params, rows, max_temp_bytes, cache)
        return _sample(_in_chunks(logits, params, rows, chunk), sample_key), key

    return jax.jit(policy)


def _sample(logits: jax.Array, key: jax.Array) -> PolicyStep:
    """Actions drawn from logits [N, A], with their log-probabilities."""
    actions = jax.random.categorical(key, logits).astype(jnp.int32)
    log_probs = jnp.take_along_axis(jax.nn.log_softmax(logits), actions[:, None], axis=-1)
    return PolicyStep(actions, log_probs[:, 0])


class RecurrentPolicyStep(NamedTuple):
    step: PolicyStep
    key: jax.Array
    states: jax.Array
    """[capacity, 2, size]: every env slot's core state, after this batch."""
    starts: jax.Array
    """[capacity, 2, size]: each slot's state before step 0 of its current unroll."""
    finished_starts: jax.Array
    """[N, 2, size]: per row, the start state of the unroll that row's step completes."""


def make_recurrent_policy_fn(
    apply_fn: Callable, max_temp_bytes: int | None = None
) -> Callable[..., RecurrentPolicyStep]:
    """Jitted sampling for a recurrent agent, with every env's core state on the device.

    (params, observations [N, ...], first bool [N], slots int32 [N], at_start bool [N],
    states, starts, key) -> RecurrentPolicyStep. Row i reads and writes the state of
    env slot `slots[i]`; a slot out of range (padding, a stream gone) reads zeros and
    writes nothing. Where `at_start` (the row's observation is step 0 of an unroll),
    the state it read becomes the slot's unroll start, and the previous one is
    returned in `finished_starts` for the unroll that step completes. `states` and
    `starts` are donated: updated in place. `max_temp_bytes` as for
    `make_policy_fn`: rows are independent, so the network may run on chunks of them.
    """
    cache: dict = {}

    def core(params, observations, first, state_in):
        with for_inference():
            output, state_out = apply_fn(params, observations[None], first[None], state_in)
        return output.logits[0], state_out

    def policy(params, observations, first, slots, at_start, states, starts, key):
        key, sample_key = jax.random.split(key)
        state_in = states.at[slots].get(mode="fill", fill_value=0.0)
        finished_starts = starts.at[slots].get(mode="fill", fill_value=0.0)
        rows = (observations, first, state_in)
        chunk = _rows_per_call(core, params, rows, max_temp_bytes, cache)
        logits, state_out = _in_chunks(core, params, rows, chunk)
        step = _sample(logits, sample_key)
        states = states.at[slots].set(state_out, mode="drop")
        new_starts = jnp.where(at_start[:, None, None], state_in, finished_starts)
        starts = starts.at[slots].set(new_starts, mode="drop")
        return RecurrentPolicyStep(step, key, states, starts, finished_starts)

    return jax.jit(policy, donate_argnums=(5, 6))


def make_uniform_policy_fn(
    num_actions: int,
) -> Callable[[Params, jax.Array, jax.Array], tuple[PolicyStep, jax.Array]]:
    """A policy with no network compute: uniform random actions (serving benchmarks).

    Same signature and outputs as `make_policy_fn`'s, so the learner serves it
    unchanged; the observations still reach the device, as a real policy's do (jit
    would drop an argument the program does not read, and with it the transfer).
    """
    log_prob = -float(np.log(num_actions))

    def policy(
        params: Params, observations: jax.Array, key: jax.Array
    ) -> tuple[PolicyStep, jax.Array]:
        del params
        key, sample_key = jax.random.split(key)
        # 32 random bits modulo A: a bias below A / 2**32, and a third of randint's cost
        # at a batch of 256 on CPU (its exact range reduction draws twice the bits).
        bits = jax.random.bits(sample_key, observations.shape[:1], jnp.uint32)
        actions = (bits % num_actions).astype(jnp.int32)
        return PolicyStep(actions, jnp.full(actions.shape, log_prob, jnp.float32)), key

    return jax.jit(policy, keep_unused=True)
