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
import numpy as np

from learner.backends.cpu.host_arrays import aligned_zeros
from learner.data.unroll_store import UnrollStore
from learner.inference.core_states import core_states_for
from learner.serving.batcher import STOPPED, DynamicBatcher, InferenceRequest
from learner.telemetry.stats import LearnerStats
from seedrl.codec import EnvStep, encode_actions_message
from seedrl.specs import TensorSpec

logger = logging.getLogger(__name__)

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
        lives on `device` (default: JAX's), next to the parameters (core_states.py)."""
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
        self._core = core_states_for(policy_fn, core_state_shape, self._sizes, device)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="inference", daemon=True)

    def warm_up(self) -> None:
        """Compiles the policy for every padded size before actors are served."""
        params, _ = self._parameters.latest()
        for size in self._sizes:
            self._core.flags(size, 0, self._store.capacity)  # no rows: no slot read or written
            step, self._key, _ = self._core.run(params, self._buffers[size], self._key)
            jax.block_until_ready(step)

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
        return self._core.policy_fn

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
        first, at_start = self._core.flags(size, num_envs, self._store.capacity)
        live = self._store.observe(
            slots,
            owners,
            [request.step.observations for request in batch],
            observations[:num_envs],
            first_out=first,
            at_start_out=at_start,
        )
        self._core.bind(num_envs, slots, live)

        params, version = self._parameters.latest()
        step, self._key, finished_starts = self._core.run(params, observations, self._key)
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

        if unrolls:
            self._enqueue(self._core.attach(unrolls, slots, finished_starts))

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
