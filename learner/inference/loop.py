"""The inference thread: batches in, actions out, unrolls on.

It takes batches from the DynamicBatcher, has the UnrollStore take their
observations and write what the policy sees (the observation, or the env's
last S frames) into a preallocated array padded to one of a few sizes (so
XLA compiles a handful of programs, never one per batch size), runs the
jitted policy with the newest parameters, and hands each stream its encoded
reply. Then it appends the step to the UnrollStore and queues the unrolls
that completed; when the queue is full it waits, which holds back the actors
(backpressure).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from learner.backends.cpu.host_arrays import aligned_zeros
from learner.data.unroll_store import UnrollStore
from learner.serving.batcher import STOPPED, DynamicBatcher, InferenceRequest
from learner.telemetry.stats import LearnerStats
from seedrl.codec import EnvStep, encode_actions_message
from seedrl.specs import TensorSpec

logger = logging.getLogger(__name__)

# The slot index of rows that have no slot (padding, a stream that ended): past any
# capacity, so the policy reads zeros for them and writes nothing.
NO_SLOT = np.iinfo(np.int32).max

# Consecutive failed batches after which inference gives up and stops the learner.
MAX_CONSECUTIVE_FAILURES = 10


def padded_sizes(max_batch: int) -> list[int]:
    """Powers of two below `max_batch`, and `max_batch` itself."""
    sizes = [1]
    while sizes[-1] * 2 < max_batch:
        sizes.append(sizes[-1] * 2)
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class ParameterSource:
    """The newest parameters and their version; the trainer publishes, inference reads.

    With them the trainer may publish the whole training state they are the
    parameters of (the stop's check keeps it, so that a run stopping on a passing
    check ends with exactly that state). Publishing swaps one tuple, so a reader
    always sees a matching set.
    """

    def __init__(self, params: Any, version: int = 0, state: Any = None):
        self._latest = (params, version, state)

    def publish(self, params: Any, version: int, state: Any = None) -> None:
        self._latest = (params, version, state)

    def latest(self) -> tuple[Any, int]:
        params, version, _ = self._latest
        return params, version

    def latest_with_state(self) -> tuple[Any, int, Any]:
        """(params, version, the training state they came from, or None)."""
        return self._latest

    @property
    def version(self) -> int:
        return self._latest[1]


Deliver = Callable[[list[InferenceRequest], list[Any]], None]


class InferenceLoop:
    def __init__(
        self,
        policy_fn: Callable,
        parameters: ParameterSource,
        batcher: DynamicBatcher,
        store: UnrollStore,
        unrolls: queue.Queue,
        model_observation: TensorSpec,
        deliver: Deliver,
        stats: LearnerStats,
        rng_key: jax.Array,
        on_failure: Callable[[BaseException], None],
        core_state_shape: tuple[int, ...] | None = None,
        device: Any = None,
    ):
        """With `core_state_shape` (one env's core state), `policy_fn` is a recurrent
        agent's (policy.make_recurrent_policy_fn) and every env slot's core state
        lives on `device` (default: JAX's), next to the parameters."""
        self._policy_fn = policy_fn
        self._on_failure = on_failure
        self._parameters = parameters
        self._batcher = batcher
        self._store = store
        self._unrolls = unrolls
        self._deliver = deliver
        self._stats = stats
        self._key = rng_key
        self._sizes = padded_sizes(batcher.max_batch_envs)
        # Aligned, so that a CPU's policy reads them in place (learner/backends/cpu/host_arrays.py).
        self._buffers = {
            size: aligned_zeros((size, *model_observation.shape), model_observation.np_dtype)
            for size in self._sizes
        }
        self._core_shape = core_state_shape
        if core_state_shape is not None:
            self._flags = {
                size: (
                    aligned_zeros(size, np.bool_),
                    aligned_zeros(size, np.bool_),
                    aligned_zeros(size, np.int32),
                )
                for size in self._sizes
            }
            self._states = self._starts = None
            self._device = device or jax.devices()[0]
            self._grow_core_states(store.capacity)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="inference", daemon=True)

    def _grow_core_states(self, capacity: int) -> None:
        """Room for `capacity` slots' core states (new ones zero), made and kept on the
        device; the policy compiles once more for the new size."""

        def grown(old: jax.Array | None) -> jax.Array:
            new = jnp.zeros((capacity, *self._core_shape), jnp.float32, device=self._device)
            return new if old is None else new.at[: old.shape[0]].set(old)

        self._states, self._starts = grown(self._states), grown(self._starts)

    def warm_up(self) -> None:
        """Compiles the policy for every padded size before actors are served."""
        params, _ = self._parameters.latest()
        for size in self._sizes:
            if self._core_shape is not None:
                self._flags[size][2][:] = NO_SLOT  # rows of no slot: nothing read or written
            jax.block_until_ready(self._policy(params, size)[0])

    def _policy(self, params: Any, size: int) -> tuple[Any, jax.Array | None]:
        """Runs the policy on the padded batch of `size` rows: (PolicyStep, and for a
        recurrent agent each row's finished unroll start state, else None)."""
        observations = self._buffers[size]
        if self._core_shape is None:
            step, self._key = self._policy_fn(params, observations, self._key)
            return step, None
        first, at_start, slots = self._flags[size]
        result = self._policy_fn(
            params, observations, first, slots, at_start, self._states, self._starts, self._key
        )
        self._states, self._starts, self._key = result.states, result.starts, result.key
        return result.step, result.finished_starts

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stops after the batch in hand; pending requests are answered STOPPED."""
        self._stop.set()
        self._batcher.close()
        if self._thread.is_alive():
            self._thread.join()
        while batch := self._batcher.next_batch(0):
            self._deliver(batch, [STOPPED] * len(batch))

    @property
    def policy_fn(self) -> Callable:
        """The jitted policy inference runs (to inspect its compiled programs)."""
        return self._policy_fn

    @property
    def rng_key(self) -> jax.Array:
        """The sampling key as it stands (for checkpoints)."""
        return self._key

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            batch = self._batcher.next_batch(wait_s=0.1)
            if not batch:
                continue
            try:
                self._serve(batch)
                failures = 0
            except Exception as error:
                # One bad batch must not stop inference: its streams get INTERNAL.
                failures += 1
                logger.exception("inference failed for a batch of %d requests", len(batch))
                self._deliver(batch, [error] * len(batch))
                if failures >= MAX_CONSECUTIVE_FAILURES:
                    # Not a bad batch but a broken policy (device lost, out of memory).
                    self._on_failure(error)
                    return

    def _serve(self, batch: list[InferenceRequest]) -> None:
        started = time.perf_counter()
        slots = np.concatenate([request.slots for request in batch])
        owners = np.concatenate([request.slot_owners for request in batch])
        num_envs = len(slots)
        size = next(size for size in self._sizes if size >= num_envs)
        observations = self._buffers[size]
        first = at_start = core_slots = None
        if self._core_shape is not None:
            first, at_start, core_slots = self._flags[size]
            first[num_envs:] = at_start[num_envs:] = False
            core_slots[num_envs:] = NO_SLOT
            if self._store.capacity > self._states.shape[0]:
                self._grow_core_states(self._store.capacity)
        live = self._store.observe(
            slots,
            owners,
            [request.step.observations for request in batch],
            observations[:num_envs],
            first_out=None if first is None else first[:num_envs],
            at_start_out=None if at_start is None else at_start[:num_envs],
        )
        if core_slots is not None:
            # A stream gone: its rows neither read nor write any slot's state.
            core_slots[:num_envs] = np.where(live, slots, NO_SLOT)

        params, version = self._parameters.latest()
        step, finished_starts = self._policy(params, size)
        actions = np.asarray(step.actions)[:num_envs]
        log_probs = np.asarray(step.log_probs)[:num_envs]
        computed = time.perf_counter()

        replies = []
        offset = 0
        for request in batch:
            end = offset + request.num_envs
            replies.append(encode_actions_message(actions[offset:end], version))
            offset = end
        self._deliver(batch, replies)

        step_of_batch = EnvStep(
            observations=None,  # the store has them from observe()
            rewards=np.concatenate([r.step.rewards for r in batch]),
            terminated=np.concatenate([r.step.terminated for r in batch]),
            truncated=np.concatenate([r.step.truncated for r in batch]),
        )
        unrolls, episodes = self._store.append(
            slots, owners, step_of_batch, actions, log_probs, version
        )
        self._stats.add_episodes(
            episodes.returns, episodes.lengths, episodes.env_steps, episodes.clipped_returns
        )
        served = time.perf_counter()
        latency = sum(computed - request.arrival for request in batch)
        self._stats.add("inference_batch_envs", num_envs)
        self._stats.add("inference_latency_s", latency, len(batch))
        self._stats.add_time("inference", served - started)

        if finished_starts is not None and unrolls:
            # Each unroll carries the core state it started from (a slice on the device).
            row_of = {slot: row for row, slot in enumerate(slots.tolist())}
            unrolls = [
                unroll._replace(core_state=finished_starts[row_of[unroll.slot]])
                for unroll in unrolls
            ]
        if unrolls:
            self._enqueue(unrolls)

    def _enqueue(self, unrolls: list[Any]) -> None:
        """Queues the unrolls for the trainer, waiting while the queue is full."""
        waited = time.perf_counter()
        for unroll in unrolls:
            while not self._stop.is_set():
                try:
                    self._unrolls.put(unroll, timeout=0.1)
                    break
                except queue.Full:
                    continue
        self._stats.add_time("inference_blocked", time.perf_counter() - waited)
