"""The dynamic batcher between the gRPC streams and the inference thread.

Streams submit one request per actor message (K envs). The inference thread
takes a batch when any of these holds:
  - the pending requests hold `max_batch_envs` envs (full);
  - every stepping stream has a request pending (no one else can come soon, so
    waiting longer would only add latency; the server counts a stream from its
    first step until it stalls);
  - `timeout` has passed since the oldest pending request arrived.
A batch never splits a request and never exceeds `max_batch_envs` envs.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from typing import Any

import numpy as np

from seedrl.codec import EnvStep

STOPPED = object()
"""What a request's reply is when inference stops before answering it."""


@dataclasses.dataclass(eq=False)
class InferenceRequest:
    """One actor message waiting for its actions."""

    owner: int
    """The stream's id (owner of its env slots)."""
    slots: np.ndarray
    """int64 [K] env slots of the stream."""
    slot_owners: np.ndarray
    """int64 [K], `owner` for each slot (made once per stream, not per batch)."""
    step: EnvStep
    """What the K envs reported."""
    reply: Any
    """Where the inference thread delivers the reply (an asyncio future)."""
    arrival: float = dataclasses.field(default_factory=time.perf_counter)

    @property
    def num_envs(self) -> int:
        return len(self.slots)


class DynamicBatcher:
    """Thread-safe queue of inference requests that hands out batches."""

    def __init__(self, max_batch_envs: int, timeout_s: float):
        if max_batch_envs < 1:
            raise ValueError(f"max_batch_envs must be at least 1, got {max_batch_envs}")
        if timeout_s < 0:
            raise ValueError(f"timeout must not be negative, got {timeout_s}")
        self.max_batch_envs = max_batch_envs
        self.timeout_s = timeout_s
        self._pending: deque[InferenceRequest] = deque()
        self._pending_envs = 0
        self._streams = 0
        self._closed = False
        self._condition = threading.Condition(threading.Lock())

    # -- stream side --------------------------------------------------------

    @property
    def streams(self) -> int:
        """The streams a batch may wait for (stream_opened less stream_closed)."""
        with self._condition:
            return self._streams

    def stream_opened(self) -> None:
        with self._condition:
            self._streams += 1

    def stream_closed(self) -> None:
        with self._condition:
            self._streams -= 1
            # One fewer stream may mean every remaining one is now waiting.
            self._condition.notify()

    def submit(self, request: InferenceRequest) -> None:
        if request.num_envs > self.max_batch_envs:
            raise ValueError(
                f"a request of {request.num_envs} envs exceeds the batch limit {self.max_batch_envs}"
            )
        with self._condition:
            self._pending.append(request)
            self._pending_envs += request.num_envs
            # Wake the inference thread only when its wait may be over.
            if len(self._pending) == 1 or self._ready():
                self._condition.notify()

    def close(self) -> None:
        """Makes `next_batch` return what is left, then empty lists, at once."""
        with self._condition:
            self._closed = True
            self._condition.notify_all()

    # -- inference side -----------------------------------------------------

    def _ready(self) -> bool:
        return (
            self._pending_envs >= self.max_batch_envs
            or len(self._pending) >= self._streams
            or self._closed
        )

    @property
    def pending_envs(self) -> int:
        with self._condition:
            return self._pending_envs

    def next_batch(self, wait_s: float | None = None) -> list[InferenceRequest]:
        """The next batch; [] when nothing arrived within `wait_s` or the batcher closed."""
        with self._condition:
            if not self._pending and not self._closed:
                self._condition.wait(wait_s)
            if not self._pending:
                return []
            deadline = self._pending[0].arrival + self.timeout_s
            while not self._ready():
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    break
                self._condition.wait(remaining)
            batch: list[InferenceRequest] = []
            batch_envs = 0
            while self._pending and batch_envs + self._pending[0].num_envs <= self.max_batch_envs:
                request = self._pending.popleft()
                batch.append(request)
                batch_envs += request.num_envs
            self._pending_envs -= batch_envs
            return batch
