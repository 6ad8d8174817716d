"""--stop-eval-episodes: before stopping at --stop-at-return, the learner plays its current
parameters greedily on envs of its own.

The 100-episode mean lags the policy: on CartPole its episodes span ~50k env
steps, hundreds of updates, and a stop can land while the policy swings
(docs/architecture.md, "CartPole"). The check asks the policy as it is now.
It plays on a thread of its own while the learner serves and trains on.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any

from envs import registry
from learner.evaluate import MAX_ENVS, Player


class StopCheck:
    """Plays `episodes` greedy (or epsilon-greedy) episodes of given parameters in the
    background, one check
    at a time, and says when the next may start: after a check that fell short, once
    the fleet has played as many episodes more, so that training has moved on."""

    def __init__(
        self,
        env_id: str,
        network: Any,
        lstm_size: int,
        episodes: int,
        seed: int,
        epsilon: float = 0.0,
    ):
        self.episodes = episodes
        self._seed = seed
        self._env = registry.make(env_id, min(episodes, MAX_ENVS), seed=seed)
        self._player = Player(network, self._env.spec, lstm_size, sample=False, epsilon=epsilon)
        self.policy = self._player.policy
        """How the check acts: "greedy" or "epsilon-greedy (E)"."""
        self._executor = concurrent.futures.ThreadPoolExecutor(1, "stop-check")
        self._cancelled = threading.Event()
        self._playing: concurrent.futures.Future | None = None  # of (update, returns)
        self._next_at = 0

    def warm_up(self, params: Any) -> None:
        """Compiles the check's policy ahead of its first play."""
        self._player.warm_up(params, self._env.num_envs)

    def may_start(self, fleet_episodes: int) -> bool:
        """Whether a check may start now, the fleet having played `fleet_episodes`."""
        return self._playing is None and fleet_episodes >= self._next_at

    def start(self, params: Any, version: int) -> None:
        """Starts playing `params` (of update `version`)."""
        self._playing = self._executor.submit(lambda: (version, self.play(params)))

    def play(self, params: Any) -> list[float]:
        """The returns of the episodes played (fewer if closed meanwhile)."""
        returns, _ = self._player.play(
            self._env, params, self.episodes, self._seed, cancelled=self._cancelled.is_set
        )
        return returns

    def finished(self) -> tuple[int, list[float]] | None:
        """(update, returns) of the check just finished, once; None while one plays or none
        was started. Raises what the play raised."""
        if self._playing is None or not self._playing.done():
            return None
        playing, self._playing = self._playing, None
        return playing.result()

    def wait(self, timeout_s: float) -> None:
        """Blocks until the check playing now (if any) has finished."""
        if self._playing is not None:
            concurrent.futures.wait([self._playing], timeout=timeout_s)

    def fell_short(self, fleet_episodes: int) -> None:
        self._next_at = fleet_episodes + self.episodes

    def close(self) -> None:
        """Ends a check that is playing (it stops within a step) and closes the envs."""
        self._cancelled.set()
        self._executor.shutdown(wait=True)
        self._env.close()
