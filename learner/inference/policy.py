"""The policy functions inference runs: jitted sampling for feed-forward and recurrent
agents, and on a CPU the chunking of large batches that keeps XLA's scratch memory in the
heap."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from learner.agents.agent import Agent
from learner.agents.vtrace.learning import ApplyFn, Params


class PolicyStep(NamedTuple):
    actions: jax.Array
    """int32 [N]."""
    log_probs: jax.Array
    """float32 [N]: log-probability of each chosen action."""


CPU_CALL_TEMP_BYTES = 24 << 20
"""On a CPU, the most scratch memory one network call of the policy may take.

XLA:CPU allocates a program's temporaries afresh on every call, in one block.
glibc serves blocks above its mmap ceiling (32 MiB on 64-bit) with mmap and
returns them on free, so every call faults the whole block in again. Run in
chunks whose temporaries stay below the ceiling, the heap keeps reusing one
block (docs/benchmarks.md, case e, has what it saves). GPUs and TPUs keep their own pools and
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
    results are the same rows either way.
    """
    cache: dict = {}

    def logits(params: Params, observations: jax.Array) -> jax.Array:
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


def policy_fn_for(agent: Agent, max_temp_bytes: int | None = None) -> Callable:
    """The jitted sampling inference runs for `agent` (agents.agent.make_agent's):
    make_recurrent_policy_fn's, which keeps every env's core state on the device, or
    make_policy_fn's."""
    if agent.recurrent:
        return make_recurrent_policy_fn(agent.network.apply, max_temp_bytes)
    return make_policy_fn(agent.network.apply, max_temp_bytes)
