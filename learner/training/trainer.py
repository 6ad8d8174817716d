"""The trainer thread: unrolls in, one jitted V-trace update per batch, parameters out."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from learner.agents.vtrace.learning import (
    Params,
    TrainState,
    Trajectories,
    minibatch_columns,
)
from learner.backends.cpu.host_arrays import aligned_empty
from learner.backends.devices import Placement
from learner.data.frame_stack import frame_indices
from learner.data.unroll_store import Unroll
from learner.inference.loop import ParameterSource
from learner.telemetry.stats import LearnerStats
from learner.training.checkpoint import Checkpointer

logger = logging.getLogger(__name__)


def stack_unrolls(unrolls: list[Unroll]) -> tuple[Trajectories, np.ndarray]:
    """B unrolls of [T+1] steps -> time-major [T+1, B] trajectories, and their policy versions.

    With frame stacking (unrolls of T+S frames) the observations stay frames,
    [T+S, B, ...], and `frame_index` says which make each step's stack.
    """

    def stack(field: str) -> np.ndarray:
        arrays = [getattr(unroll, field) for unroll in unrolls]
        first = arrays[0]
        # Aligned, so that a CPU's update reads the batch in place (learner/backends/cpu/host_arrays.py).
        out = aligned_empty((first.shape[0], len(arrays), *first.shape[1:]), first.dtype)
        return np.stack(arrays, axis=1, out=out)

    frame_stack = len(unrolls[0].observations) - len(unrolls[0].actions) + 1
    recurrent = unrolls[0].core_state is not None
    first = stack("first") if recurrent or frame_stack > 1 else None
    trajectories = Trajectories(
        # The steps' own flags: the last of each step's frames.
        first=first[frame_stack - 1 :] if recurrent else None,
        # Already on the device: stacked there, [1, B, ...] (the batch on axis 1).
        core_state=jnp.stack([unroll.core_state for unroll in unrolls])[None]
        if recurrent
        else None,
        observations=stack("observations"),
        frame_index=None if frame_stack == 1 else frame_indices(first, frame_stack),
        actions=stack("actions"),
        behaviour_log_probs=stack("behaviour_log_probs"),
        rewards=stack("rewards"),
        terminated=stack("terminated"),
        truncated=stack("truncated"),
    )
    return trajectories, stack("policy_versions")


class NonFiniteLoss(RuntimeError):
    """Too many updates in a row had a non-finite loss or gradient."""


class Trainer:
    def __init__(
        self,
        update_fn: Callable,
        state: TrainState,
        unrolls: queue.Queue,
        batch_size: int,
        parameters: ParameterSource,
        stats: LearnerStats,
        learning_rate: Callable[[int], float],
        on_failure: Callable[[BaseException], None],
        placement: Placement | None = None,
        recycle: Callable[[list[Unroll]], None] | None = None,
        checkpointer: Checkpointer | None = None,
        checkpoint_meta: Callable[[], dict] | None = None,
        max_nonfinite_updates: int = 10,
        batch_passes: int = 1,
        minibatches: int = 1,
        finite_check: Callable[[Params, Trajectories, jax.Array], jax.Array] | None = None,
        end_streams: Callable[[list[int], str], None] | None = None,
        batch_update_fn: Callable | None = None,
    ):
        """`batch_size` is this process's share of the batch; `placement` the devices it
        is trained on (default: one); `recycle` takes back the unrolls of each batch once
        it is stacked; `checkpointer` saves the state between updates when one is due,
        with the counters and whatever `checkpoint_meta` adds; after
        `max_nonfinite_updates` skipped (non-finite) updates in a row the trainer fails
        with NonFiniteLoss. Each batch is cut into `minibatches` along B and trained on
        `batch_passes` times, an update per minibatch and pass: `update_fn` (one step) is
        called for each, and each step's parameters are published; with `batch_update_fn`
        (learning.make_batch_update_fn) one call trains on the whole batch and its last
        parameters are published.

        With `finite_check` (learning.make_finite_check_fn) a skipped update is checked
        unroll by unroll: the streams whose unroll alone is not finite, while the
        parameters are finite on other data, go to `end_streams` (their owners, and why),
        and such a skip is theirs, not counted toward the limit, which stands for the
        model itself diverging."""
        self._batch_passes = batch_passes
        self._minibatches = minibatches
        self.state = state
        self._checkpointer = checkpointer
        self._checkpoint_meta = checkpoint_meta
        self._max_nonfinite = max_nonfinite_updates
        self._finite_check = finite_check
        self._last_finite: tuple[Trajectories, np.ndarray] | None = None
        """The batch (on the host; a reference, no copy) and the columns of the last minibatch
        whose update was finite."""
        self._end_streams = end_streams
        self._nonfinite_in_a_row = 0
        self._recycle = recycle
        self._update_fn = update_fn
        self._batch_update_fn = batch_update_fn
        self._unrolls = unrolls
        self._batch_size = batch_size
        self._placement = placement or Placement(jax.local_devices()[:1])
        self._agree_to_stop = self._placement.agree_to_stop()
        self._stop_requested = threading.Event()
        self.agreed_stop = threading.Event()
        self._parameters = parameters
        self._stats = stats
        self._learning_rate = learning_rate
        self._on_failure = on_failure
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainer", daemon=True)

    def warm_up(self, example: Trajectories) -> None:
        """Compiles the update on a batch of this process's shapes (the result is discarded)."""
        if self._batch_update_fn is not None:
            jax.block_until_ready(
                self._batch_update_fn(self.state, self._placement.put_batch(example))
            )
            return
        columns = minibatch_columns(example.actions.shape[1], self._minibatches)[0]
        minibatch = self._placement.put_batch(jax.tree.map(lambda x: x[:, columns], example))
        if hasattr(self._update_fn, "warm_up"):
            self._update_fn.warm_up(self.state, minibatch)
        else:
            jax.block_until_ready(self._update_fn(self.state, minibatch))

    @property
    def coordinated(self) -> bool:
        """Whether other learner processes train in step with this one (multi-host)."""
        return self._placement.process_count > 1

    def request_stop(self) -> None:
        """Multi-host: stop after the update at which every process agrees to (the others may
        be waiting in an all-reduce for this one's share); `agreed_stop` is set then."""
        self._stop_requested.set()

    def join(self) -> None:
        if self._thread.is_alive():
            self._thread.join()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _next_batch(self) -> list[Unroll] | None:
        """B unrolls, or None once asked to stop (even while unrolls keep coming); the
        unrolls of a batch left unfinished go back to `recycle`."""
        batch: list[Unroll] = []
        while len(batch) < self._batch_size:
            if self._stop.is_set():
                if self.coordinated:
                    logger.warning(
                        "this learner process stops outside an agreed update; the others "
                        "wait for its share of the batch until they are stopped too"
                    )
                if batch and self._recycle is not None:
                    self._recycle(batch)  # their frame buffers return to the store
                return None
            try:
                batch.append(self._unrolls.get(timeout=0.1))
            except queue.Empty:
                continue
        return batch

    def _run(self) -> None:
        try:
            while True:
                waited = time.perf_counter()
                batch = self._next_batch()
                if batch is None:
                    return
                started = time.perf_counter()
                self._stats.add_time("trainer_waiting", started - waited)
                self._train(batch)
                self._stats.add_time("training", time.perf_counter() - started)
                if self._checkpointer is not None and self._checkpointer.due():
                    self.save_checkpoint()
                if self.coordinated and self._agree_to_stop(self._stop_requested.is_set()):
                    logger.info(
                        "the learner processes agreed to stop after update %d",
                        int(self.state.updates),
                    )
                    self.agreed_stop.set()
                    return
        except NonFiniteLoss as error:
            logger.error("the trainer stops: %s", error)
            self._on_failure(error)
        except BaseException as error:
            logger.exception("the trainer failed")
            self._on_failure(error)

    def save_checkpoint(self) -> None:
        """Saves the current state (between updates: from the trainer's thread, or once
        it has stopped); nothing before the first update or twice for one update."""
        if self._checkpointer is None or int(self.state.updates) == 0:
            return
        counters = self._stats.counters()
        meta = {"env_steps": counters["env_steps"], "episodes": counters["episodes"]}
        if self._checkpoint_meta is not None:
            meta.update(self._checkpoint_meta())
        params, opt_state = self.state.params, self.state.opt_state
        if self.coordinated:
            # Arrays spanning processes: this process's replica, as host arrays.
            params, opt_state = jax.device_get(self._placement.local_copy((params, opt_state)))
        self._checkpointer.save(int(self.state.updates), params, opt_state, meta)

    def _skip(
        self,
        metrics: dict[str, float],
        update: int,
        trajectories: Trajectories,
        columns: np.ndarray,
        owners: list[int],
    ) -> None:
        """Update number `update`, whose loss or gradient was not finite: nothing of it was
        applied. Its minibatch is `columns` of `trajectories` (on the host); `owners` the
        streams of the batch's unrolls."""
        self._stats.count_skipped_update()
        culprits = self._culprits(trajectories, columns, owners)
        if culprits:
            logger.warning(
                "update %d skipped: loss %s, gradient norm %s; the data of stream(s) %s alone "
                "makes it so: they end",
                update,
                metrics["loss"],
                metrics["grad_norm"],
                culprits,
            )
            assert self._end_streams is not None
            self._end_streams(culprits, f"the data of this stream made update {update} non-finite")
            return
        self._nonfinite_in_a_row += 1
        logger.warning(
            "update %d skipped: loss %s, gradient norm %s (%d in a row; the limit is %d)",
            update,
            metrics["loss"],
            metrics["grad_norm"],
            self._nonfinite_in_a_row,
            self._max_nonfinite,
        )
        if self._nonfinite_in_a_row >= self._max_nonfinite:
            raise NonFiniteLoss(
                f"{self._nonfinite_in_a_row} updates in a row had a non-finite loss or "
                f"gradient; the state of update {int(self.state.updates)}, the last good one, "
                "is checkpointed. Lower --learning-rate or check the inputs."
            )

    def _culprits(
        self, trajectories: Trajectories, columns: np.ndarray, owners: list[int]
    ) -> list[int]:
        """The streams (owners) whose unroll of the minibatch (`columns` of `trajectories`)
        alone has a non-finite loss or gradient under the current parameters, while the
        parameters are sound: on other unrolls, or else on an unroll of the last update that
        was finite, they are finite. [] without a check, or when no unroll is to blame (the
        model itself diverged)."""
        if self._finite_check is None or self._end_streams is None:
            return []
        params = self._placement.local_copy(self.state.params)

        def finite(batch: Trajectories, column: int) -> bool:
            unroll = jax.tree.map(lambda x: x[:, column : column + 1], batch)
            return bool(self._finite_check(params, unroll, self.state.updates))

        failing = [owners[c] for c in columns if not finite(trajectories, c)]
        sound = len(failing) < len(columns) or (
            self._last_finite is not None
            and finite(self._last_finite[0], int(self._last_finite[1][0]))
        )
        return sorted(set(failing)) if sound else []

    def roll_back(self, state: TrainState) -> None:
        """Makes `state`, of an earlier update, the trainer's (once it has stopped), and
        discards any checkpoint of a later update, so the run's newest checkpoint is
        the next one saved."""
        self.state = state
        if self._checkpointer is not None:
            self._checkpointer.discard_after(int(state.updates))

    def close_checkpoints(self) -> None:
        """Waits for checkpoints being written (call once the trainer has stopped)."""
        if self._checkpointer is not None:
            self._checkpointer.close()

    def _train(self, batch: list[Unroll]) -> None:
        trajectories, versions = stack_unrolls(batch)
        owners = [unroll.owner for unroll in batch]
        if self._recycle is not None:
            self._recycle(batch)  # stacked: nothing refers to them any more
        devices = 1 if self._batch_update_fn is None else len(self._placement.local_devices)
        parts = minibatch_columns(trajectories.actions.shape[1], self._minibatches, devices)
        order = [columns for _ in range(self._batch_passes) for columns in parts]
        start = version = int(self.state.updates)
        learning_rate = float(self._learning_rate(version))
        if self._batch_update_fn is not None:
            self.state, metrics = self._batch_update_fn(
                self.state, self._placement.put_batch(trajectories)
            )
            steps = jax.device_get(metrics)
            for index, columns in enumerate(order):
                step = {name: values[index] for name, values in steps.items()}
                version += self._account(step, version, trajectories, columns, versions, owners)
            self._stats.add("learning_rate", learning_rate)
            if version > start:
                self._publish(version)
            return
        on_device = [
            self._placement.put_batch(jax.tree.map(lambda x, c=columns: x[:, c], trajectories))
            for columns in parts
        ]
        for index, columns in enumerate(order):
            # A step that was not finite is dropped here: the state stays the one passed in
            # (update_fn need not guard it, learning.make_update_fn).
            stepped, step = self._update_fn(self.state, on_device[index % len(parts)])
            if self._account(
                jax.device_get(step), version, trajectories, columns, versions, owners
            ):
                self.state = stepped
                version += 1
                self._publish(version)
        self._stats.add("learning_rate", learning_rate)

    def _account(
        self,
        step: dict,
        version: int,
        trajectories: Trajectories,
        columns: np.ndarray,
        versions: np.ndarray,
        owners: list[int],
    ) -> bool:
        """Records one update's metrics (`version` the parameters it started from, `columns`
        its minibatch of `trajectories`, whose unrolls `versions` acted and `owners` sent);
        whether it was applied (finite)."""
        metrics = {name: float(value) for name, value in step.items()}
        if not metrics.pop("finite"):
            self._skip(metrics, version + 1, trajectories, columns, owners)
            return False
        self._last_finite = (trajectories, columns)
        self._nonfinite_in_a_row = 0
        # Lag: updates between the parameters that acted and those that learnt from it.
        lag = version - versions[:-1, columns]
        metrics["policy_lag"] = float(lag.mean())
        self._stats.add("policy_lag_max", float(lag.max()))
        self._stats.add_many(metrics)
        return True

    def _publish(self, version: int) -> None:
        self._parameters.publish(self._placement.local_copy(self.state.params), version, self.state)
        self._stats.set_updates(version)
