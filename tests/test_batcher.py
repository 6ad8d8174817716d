"""DynamicBatcher: full batches, batches of every waiting stream, the timeout."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from learner.serving.batcher import DynamicBatcher, InferenceRequest
from seedrl.codec import EnvStep


def request(owner: int, num_envs: int) -> InferenceRequest:
    step = EnvStep(
        np.zeros((num_envs, 1)), np.zeros(num_envs), np.zeros(num_envs), np.zeros(num_envs)
    )
    slots = np.arange(num_envs)
    return InferenceRequest(owner, slots, np.full(num_envs, owner), step, reply=None)


def test_a_full_batch_is_taken_without_waiting_for_the_timeout():
    batcher = DynamicBatcher(max_batch_envs=8, timeout_s=60.0)
    for _ in range(10):
        batcher.stream_opened()
    for owner in range(3):
        batcher.submit(request(owner, 4))
    started = time.perf_counter()
    batch = batcher.next_batch(wait_s=1.0)
    assert time.perf_counter() - started < 5.0
    # 4 + 4 fills it; the third request would overflow and waits for the next batch.
    assert [r.owner for r in batch] == [0, 1]
    assert batcher.pending_envs == 4


def test_a_batch_goes_when_every_stream_is_waiting():
    batcher = DynamicBatcher(max_batch_envs=64, timeout_s=60.0)
    batcher.stream_opened()
    batcher.stream_opened()
    batcher.submit(request(1, 2))
    batcher.submit(request(2, 2))
    started = time.perf_counter()
    batch = batcher.next_batch(wait_s=1.0)
    assert time.perf_counter() - started < 5.0
    assert [r.owner for r in batch] == [1, 2]


def test_a_partial_batch_waits_for_the_timeout():
    timeout = 0.2
    batcher = DynamicBatcher(max_batch_envs=64, timeout_s=timeout)
    for _ in range(3):
        batcher.stream_opened()
    submitted = request(1, 2)
    batcher.submit(submitted)
    batch = batcher.next_batch(wait_s=1.0)
    waited = time.perf_counter() - submitted.arrival
    assert batch == [submitted]
    assert waited >= timeout


def test_a_late_request_joins_the_batch_before_the_timeout():
    batcher = DynamicBatcher(max_batch_envs=64, timeout_s=30.0)
    batcher.stream_opened()
    batcher.stream_opened()
    batcher.submit(request(1, 3))
    taken: list = []
    consumer = threading.Thread(target=lambda: taken.extend(batcher.next_batch(wait_s=10.0)))
    consumer.start()
    batcher.submit(request(2, 3))  # the second stream arrives: everyone waits now
    consumer.join(timeout=20.0)
    assert not consumer.is_alive()
    assert [r.owner for r in taken] == [1, 2]


def test_a_closing_stream_releases_the_others_batch():
    batcher = DynamicBatcher(max_batch_envs=64, timeout_s=30.0)
    batcher.stream_opened()
    batcher.stream_opened()
    batcher.submit(request(1, 1))
    taken: list = []
    consumer = threading.Thread(target=lambda: taken.extend(batcher.next_batch(wait_s=10.0)))
    consumer.start()
    batcher.stream_closed()  # the other stream is gone: no one else can come
    consumer.join(timeout=20.0)
    assert not consumer.is_alive()
    assert [r.owner for r in taken] == [1]


def test_nothing_pending_returns_empty_after_the_wait():
    batcher = DynamicBatcher(max_batch_envs=4, timeout_s=0.0)
    assert batcher.next_batch(wait_s=0.01) == []
    batcher.close()
    assert batcher.next_batch(wait_s=None) == []


def test_an_oversized_request_is_refused():
    batcher = DynamicBatcher(max_batch_envs=4, timeout_s=0.0)
    with pytest.raises(ValueError, match="exceeds the batch limit 4"):
        batcher.submit(request(1, 5))
