"""--stop-eval-episodes: before stopping at --stop-at-return, the learner plays its current
parameters greedily on envs of its own.

The 100-episode mean lags the policy: on CartPole its episodes span ~50k env
steps, hundreds of updates, and a stop can land while the policy swings
(docs/architecture.md, "CartPole"). The check asks the policy as it is now.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from envs import registry
from learner.evaluate import Player

MAX_ENVS = 8  # envs played in parallel, as seedrl-eval's default


class StopCheck:
    """Plays `episodes` greedy episodes of given parameters, and says when the next check
    may come: after a check that fell short, once the fleet has played as many episodes
    more, so that training has moved on before the policy is asked again."""

    def __init__(self, env_id: str, network: Any, lstm_size: int, episodes: int, seed: int) -> None:
        self.episodes = episodes
        self._seed = seed
        self._env = registry.make(env_id, min(episodes, MAX_ENVS), seed=seed)
        self._player = Player(network, self._env.spec, lstm_size, sample=False)
        self._next_at = 0

    def due(self, fleet_episodes: int) -> bool:
        """Whether a check may run now, the fleet having played `fleet_episodes`."""
        return fleet_episodes >= self._next_at

    def play(self, params: Any, cancelled: Callable[[], bool] = lambda: False) -> list[float]:
        """The returns of the episodes played (fewer if cancelled meanwhile)."""
        returns, _ = self._player.play(
            self._env, params, self.episodes, self._seed, cancelled=cancelled
        )
        return returns

    def fell_short(self, fleet_episodes: int) -> None:
        self._next_at = fleet_episodes + self.episodes

    def close(self) -> None:
        self._env.close()
