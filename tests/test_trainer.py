"""The trainer thread: batches of B unrolls, published versions, a prompt stop."""

from __future__ import annotations

import contextlib
import queue
import threading
import time

import numpy as np

from learner.agents.vtrace.learning import TrainState
from learner.data.unroll_store import Unroll
from learner.inference.loop import ParameterSource
from learner.telemetry.stats import LearnerStats
from learner.training.trainer import NonFiniteLoss, Trainer, stack_unrolls
from tests.fleet import wait_until


def unroll(value: int, steps: int = 4, version: int = 0) -> Unroll:
    return Unroll(
        observations=np.full((steps, 2), value, np.float32),
        first=np.zeros(steps, bool),
        actions=np.zeros(steps, np.int32),
        behaviour_log_probs=np.zeros(steps, np.float32),
        rewards=np.zeros(steps, np.float32),
        terminated=np.zeros(steps, bool),
        truncated=np.zeros(steps, bool),
        policy_versions=np.full(steps, version, np.int64),
        owner=1,
    )


def fake_update(state: TrainState, batch):
    metrics = {"loss": np.float32(0.5), "grad_norm": np.float32(1.0), "finite": np.bool_(True)}
    return TrainState(state.params, state.opt_state, state.updates + 1), metrics


def nonfinite_update(state: TrainState, batch):
    """What the real update returns for a NaN loss: the state unchanged."""
    metrics = {"loss": np.float32("nan"), "grad_norm": np.float32("nan"), "finite": np.bool_(False)}
    return state, metrics


def make_trainer(
    unrolls: queue.Queue, parameters: ParameterSource, failures: list, update_fn=fake_update, **kw
) -> Trainer:
    return Trainer(
        update_fn=update_fn,
        state=TrainState(params={"w": 1}, opt_state=(), updates=np.int32(0)),
        unrolls=unrolls,
        batch_size=2,
        parameters=parameters,
        stats=LearnerStats(),
        learning_rate=lambda step: 0.1,
        on_failure=failures.append,
        **kw,
    )


def test_unrolls_stack_time_major():
    trajectories, versions = stack_unrolls([unroll(1, version=3), unroll(2, version=5)])
    assert trajectories.observations.shape == (4, 2, 2)
    np.testing.assert_array_equal(trajectories.observations[:, 1, 0], [2, 2, 2, 2])
    np.testing.assert_array_equal(versions[0], [3, 5])


def test_each_batch_publishes_a_new_version():
    unrolls: queue.Queue = queue.Queue()
    parameters = ParameterSource({"w": 0}, version=0)
    failures: list = []
    trainer = make_trainer(unrolls, parameters, failures)
    trainer.start()
    for value in range(6):
        unrolls.put(unroll(value))
    deadline = time.monotonic() + 30
    while parameters.version < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    trainer.stop()
    assert parameters.version == 3 and not failures


def test_stop_returns_while_unrolls_keep_arriving():
    unrolls: queue.Queue = queue.Queue(maxsize=4)
    trainer = make_trainer(unrolls, ParameterSource({"w": 0}), [])
    producing = threading.Event()
    producing.set()

    def produce():
        while producing.is_set():
            with contextlib.suppress(queue.Full):
                unrolls.put(unroll(0), timeout=0.05)
            time.sleep(0.005)  # pacing of the load, not synchronisation

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    trainer.start()
    try:
        stopper = threading.Thread(target=trainer.stop, daemon=True)
        stopper.start()
        stopper.join(timeout=10)
        assert not stopper.is_alive(), "the trainer did not stop while unrolls kept coming"
    finally:
        producing.clear()
        producer.join()


def test_a_batch_left_unfinished_by_stop_goes_back_to_recycle():
    unrolls: queue.Queue = queue.Queue()
    given_back: list = []
    trainer = make_trainer(unrolls, ParameterSource({"w": 0}), [], recycle=given_back.extend)
    held = unroll(7)
    unrolls.put(held)  # one of a batch of 2: the trainer holds it and waits for another
    trainer.start()
    wait_until(unrolls.empty, 10, "the trainer to take the unroll")
    trainer.stop()
    assert given_back == [held]  # the store's frame buffer is not left lent
    assert trainer.state.updates == 0


def train_batches(update_fn, batches, parameters, failures, until, what) -> Trainer:
    """A trainer (3 non-finite updates in a row allowed) fed `batches` batches of 2, run
    until `until()` holds, then stopped."""
    unrolls: queue.Queue = queue.Queue()
    trainer = make_trainer(
        unrolls, parameters, failures, update_fn=update_fn, max_nonfinite_updates=3
    )
    for index in range(2 * batches):
        unrolls.put(unroll(index))
    trainer.start()
    try:
        wait_until(until, 30, what)
    finally:
        trainer.stop()
    return trainer


def test_nonfinite_updates_are_skipped_then_stop_the_trainer():
    parameters = ParameterSource({"w": 0}, version=0)
    failures: list = []
    trainer = train_batches(
        nonfinite_update, 3, parameters, failures, lambda: failures, "the trainer to give up"
    )
    (error,) = failures
    assert isinstance(error, NonFiniteLoss)
    assert "3 updates in a row had a non-finite loss" in str(error)
    assert parameters.latest() == ({"w": 0}, 0)  # nothing was published
    assert int(trainer.state.updates) == 0
    assert trainer._stats.counters()["skipped_updates"] == 3


def test_the_trainer_keeps_its_state_when_an_unguarded_update_is_not_finite():
    """An update_fn that returns its stepped state even when not finite (make_update_fn's
    guarded=False): the trainer drops that state and keeps, and publishes, the last good one."""
    outcomes = iter([True, False, True])

    def unguarded_update(state, batch):
        stepped, metrics = fake_update(state, batch)
        if next(outcomes):
            return stepped._replace(params={"w": state.params["w"] + 1}), metrics
        poisoned = stepped._replace(params={"w": float("nan")})
        return poisoned, {**metrics, "loss": np.float32("nan"), "finite": np.bool_(False)}

    parameters = ParameterSource({"w": 0}, version=0)
    failures: list = []
    trainer = train_batches(
        unguarded_update,
        3,
        parameters,
        failures,
        lambda: parameters.latest()[1] == 2,
        "two good updates",
    )
    assert not failures
    assert parameters.latest() == ({"w": 3}, 2)  # 1 + two good steps; the NaN one dropped
    assert trainer.state.params == {"w": 3} and int(trainer.state.updates) == 2
    assert trainer._stats.counters()["skipped_updates"] == 1


def test_a_finite_update_resets_the_count_of_skipped_ones():
    outcomes = iter([False, False, True, False, False, True])

    def flaky_update(state, batch):
        return nonfinite_update(state, batch) if not next(outcomes) else fake_update(state, batch)

    parameters = ParameterSource({"w": 0}, version=0)
    failures: list = []
    trainer = train_batches(
        flaky_update,
        6,
        parameters,
        failures,
        lambda: parameters.latest()[1] == 2,
        "two good updates",
    )
    assert not failures
    assert trainer._stats.counters()["skipped_updates"] == 4


def train_recording(values: list[int], updates: int, record, **kw) -> tuple[list, int]:
    """Trains on unrolls of `values` until `updates` updates, recording what `record`
    takes of each update's batch; returns the records and the published version."""
    unrolls: queue.Queue = queue.Queue()
    parameters = ParameterSource(params={"w": 1})
    failures: list = []
    seen: list = []

    def recording_update(state, batch):
        seen.append(record(batch))
        return fake_update(state, batch)

    trainer = make_trainer(unrolls, parameters, failures, recording_update, **kw)
    for value in values:
        unrolls.put(unroll(value))
    trainer.start()
    try:
        wait_until(lambda: int(trainer.state.updates) == updates, 30, f"{updates} updates")
    finally:
        trainer.stop()
    assert not failures
    return seen, parameters.latest()[1]


def test_each_batch_is_trained_on_batch_passes_times():
    """--batch-passes: every batch gives that many updates, each publishing its version."""
    seen, version = train_recording([0, 1, 2, 3], 6, lambda batch: batch, batch_passes=3)
    assert version == 6
    # Three passes over each of the two batches: the same device batch each time.
    assert seen[0] is seen[1] is seen[2] and seen[3] is seen[4] is seen[5]
    assert seen[0] is not seen[3]


def test_minibatches_cut_each_batch_along_its_unrolls():
    """--minibatches 2 with --batch-passes 2: four updates per batch of two unrolls, each on
    one unroll, in the order first, second, first, second."""
    seen, _ = train_recording(
        [7, 9],
        4,
        lambda batch: np.asarray(batch.observations)[0, :, 0].tolist(),
        batch_passes=2,
        minibatches=2,
    )
    assert seen == [[7.0], [9.0], [7.0], [9.0]]


class RecordingSource(ParameterSource):
    def __init__(self):
        super().__init__({"w": 0}, version=0)
        self.published: list[int] = []

    def publish(self, params, version, state=None):
        self.published.append(version)
        super().publish(params, version, state)


def test_a_batch_trained_in_one_call_publishes_its_last_parameters_once():
    """With batch_update_fn the whole batch goes to one call, which returns each step's
    metrics: a non-finite step among them is skipped and counted, the others are applied,
    and the parameters after the last step are published once per batch."""
    finite = [True, False, True, True]  # 2 passes x 2 minibatches
    seen: list = []

    def batch_update(state, batch):
        seen.append(np.asarray(batch.observations)[0, :, 0].tolist())
        metrics = {
            "loss": np.where(finite, 0.5, np.nan).astype(np.float32),
            "grad_norm": np.ones(4, np.float32),
            "finite": np.array(finite),
        }
        applied = sum(finite)
        return TrainState(state.params, state.opt_state, state.updates + applied), metrics

    unrolls: queue.Queue = queue.Queue()
    parameters = RecordingSource()
    failures: list = []
    trainer = make_trainer(
        unrolls,
        parameters,
        failures,
        batch_update_fn=batch_update,
        batch_passes=2,
        minibatches=2,
        max_nonfinite_updates=3,
    )
    for value in range(4):
        unrolls.put(unroll(value))
    trainer.start()
    try:
        wait_until(lambda: parameters.version == 6, 30, "two batches")
    finally:
        trainer.stop()
    assert not failures
    assert seen == [[0.0, 1.0], [2.0, 3.0]]  # whole batches, not minibatches
    assert parameters.published == [3, 6]
    assert trainer._stats.counters()["skipped_updates"] == 2
