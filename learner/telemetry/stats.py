"""Counters the learner's threads update and the logger reads, thread-safe.

Cumulative counters (env steps, episodes, updates) only grow. Window figures
(batch sizes, latencies, losses, lags) are summed since the last `snapshot`
and averaged when it is taken, so each log line describes its own interval.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

RETURN_WINDOW = 100  # episodes behind episode_return_mean, as in the usual reports


class _Mean:
    __slots__ = ("count", "maximum", "total")

    def __init__(self) -> None:
        self.total = 0.0
        self.count = 0
        self.maximum = float("-inf")

    def add(self, value: float, count: int = 1) -> None:
        self.total += value
        self.count += count
        self.maximum = max(self.maximum, value / max(count, 1))

    def mean(self) -> float | None:
        return self.total / self.count if self.count else None


class LearnerStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.start_time = time.time()
        self.env_steps = 0
        self.episodes = 0
        self.updates = 0
        self.connected_actors = 0
        self.connected_envs = 0
        self.rejected_streams = 0
        self.skipped_updates = 0
        self.dropped_unrolls = 0
        self.dropped_transitions = 0
        self.stream_errors: collections.Counter[str] = collections.Counter()
        self._returns: collections.deque[float] = collections.deque(maxlen=RETURN_WINDOW)
        self._clipped_returns: collections.deque[float] = collections.deque(maxlen=RETURN_WINDOW)
        self._lengths: collections.deque[int] = collections.deque(maxlen=RETURN_WINDOW)
        self._window: dict[str, _Mean] = collections.defaultdict(_Mean)
        self._timers: dict[str, float] = collections.defaultdict(float)

    # -- writers ------------------------------------------------------------

    def add_episodes(
        self,
        returns: list[float],
        lengths: list[int],
        env_steps: int,
        clipped_returns: list[float] | None = None,
    ) -> None:
        """Episodes that ended; `clipped_returns` default to the raw ones."""
        with self._lock:
            self.env_steps += env_steps
            self.episodes += len(returns)
            self._returns.extend(returns)
            self._clipped_returns.extend(returns if clipped_returns is None else clipped_returns)
            self._lengths.extend(lengths)

    def add(self, name: str, value: float, count: int = 1) -> None:
        """Adds to the window mean `name` (value is a sum over `count` items)."""
        with self._lock:
            self._window[name].add(value, count)

    def add_many(self, values: dict[str, float]) -> None:
        with self._lock:
            for name, value in values.items():
                self._window[name].add(value)

    def add_time(self, name: str, seconds: float) -> None:
        """Time a thread spent on `name` (reported as a fraction of the interval)."""
        with self._lock:
            self._timers[name] += seconds

    def set_updates(self, updates: int) -> None:
        with self._lock:
            self.updates = updates

    def stream_change(self, actors: int, envs: int) -> None:
        with self._lock:
            self.connected_actors += actors
            self.connected_envs += envs

    def count_rejection(self) -> None:
        with self._lock:
            self.rejected_streams += 1

    def count_stream_error(self, code: str) -> None:
        """A stream ended by the learner for a fault, by gRPC status code name."""
        with self._lock:
            self.stream_errors[code] += 1

    def stream_error_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self.stream_errors)

    def count_dropped(self, unrolls: int, transitions: int) -> None:
        """Partial unrolls (and their transitions) of a stream that ended."""
        with self._lock:
            self.dropped_unrolls += unrolls
            self.dropped_transitions += transitions

    def count_skipped_update(self) -> None:
        with self._lock:
            self.skipped_updates += 1

    def restore(self, env_steps: int, episodes: int, updates: int) -> None:
        """Counters of a resumed run continue from its checkpoint."""
        with self._lock:
            self.env_steps, self.episodes, self.updates = env_steps, episodes, updates

    # -- readers ------------------------------------------------------------

    def counters(self) -> dict[str, int]:
        """The cumulative counters, read together."""
        with self._lock:
            return self._counters()

    def _counters(self) -> dict[str, int]:
        return {
            "env_steps": self.env_steps,
            "episodes": self.episodes,
            "updates": self.updates,
            "connected_actors": self.connected_actors,
            "connected_envs": self.connected_envs,
            "rejected_streams": self.rejected_streams,
            "skipped_updates": self.skipped_updates,
            "dropped_unrolls": self.dropped_unrolls,
            "dropped_transitions": self.dropped_transitions,
        }

    def progress(self) -> tuple[int, list[float]]:
        """Env steps so far and the returns of the last RETURN_WINDOW episodes."""
        with self._lock:
            return self.env_steps, list(self._returns)

    def snapshot(self) -> dict[str, Any]:
        """Cumulative counters and the window since the last snapshot (then cleared)."""
        with self._lock:
            window = {name: mean for name, mean in self._window.items()}
            timers = dict(self._timers)
            self._window = collections.defaultdict(_Mean)
            self._timers = collections.defaultdict(float)
            returns = list(self._returns)
            clipped_returns = list(self._clipped_returns)
            lengths = list(self._lengths)
            return {
                **self._counters(),
                "returns": returns,
                "clipped_returns": clipped_returns,
                "lengths": lengths,
                "window": window,
                "timers": timers,
            }
