"""The trainer thread: batches of B unrolls, published versions, a prompt stop."""

from __future__ import annotations

import contextlib
import queue
import threading
import time

import numpy as np

from learner.agents.vtrace.learning import TrainState
from learner.inference import ParameterSource
from learner.stats import LearnerStats
from learner.trainer import Trainer, stack_unrolls
from learner.unroll_store import Unroll


def unroll(value: int, steps: int = 4, version: int = 0) -> Unroll:
    return Unroll(
        observations=np.full((steps, 2), value, np.float32),
        actions=np.zeros(steps, np.int32),
        behaviour_log_probs=np.zeros(steps, np.float32),
        rewards=np.zeros(steps, np.float32),
        terminated=np.zeros(steps, bool),
        truncated=np.zeros(steps, bool),
        policy_versions=np.full(steps, version, np.int64),
        owner=1,
    )


def fake_update(state: TrainState, batch):
    return TrainState(state.params, state.opt_state, state.updates + 1), {"loss": np.float32(0.5)}


def make_trainer(unrolls: queue.Queue, parameters: ParameterSource, failures: list) -> Trainer:
    return Trainer(
        update_fn=fake_update,
        state=TrainState(params={"w": 1}, opt_state=(), updates=np.int32(0)),
        unrolls=unrolls,
        batch_size=2,
        parameters=parameters,
        stats=LearnerStats(),
        learning_rate=lambda step: 0.1,
        on_failure=failures.append,
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
