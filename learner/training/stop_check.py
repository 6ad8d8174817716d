"""--stop-at-return, and --stop-eval-episodes: before stopping there, the learner plays its
current parameters greedily on envs of its own.

The 100-episode mean lags the policy: on CartPole its episodes span ~50k env
steps, hundreds of updates, and a stop can land while the policy swings
(docs/architecture.md, "CartPole"). The check asks the policy as it is now.
It plays on a thread of its own while the learner serves and trains on.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable
from typing import Any

from envs import registry
from learner.agents.agent import Agent
from learner.agents.vtrace.learning import TrainState
from learner.inference.loop import ParameterSource
from learner.inference.player import MAX_ENVS, Player
from learner.telemetry.stats import RETURN_WINDOW, LearnerStats
from learner.training.trainer import Trainer

logger = logging.getLogger(__name__)


class StopCheck:
    """Plays `episodes` greedy (or epsilon-greedy) episodes of given parameters in the
    background, one check
    at a time, and says when the next may start: after a check that fell short, once
    the fleet has played as many episodes more, so that training has moved on."""

    def __init__(
        self,
        env_id: str,
        agent: Agent,
        episodes: int,
        seed: int,
        epsilon: float = 0.0,
    ):
        self.episodes = episodes
        self._seed = seed
        self._env = registry.make(env_id, min(episodes, MAX_ENVS), seed=seed)
        self._player = Player(agent, self._env.spec, sample=False, epsilon=epsilon)
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


class ReturnStop:
    """--stop-at-return: training is complete once the fleet's 100-episode mean reaches the
    target and, with a `check` (--stop-eval-episodes), the parameters of that moment played
    on the check's envs reach it too. A run stopped by a passing check ends with the state
    it checked (`end_with_checked`)."""

    def __init__(
        self,
        target: float | None,
        check: StopCheck | None,
        stats: LearnerStats,
        parameters: ParameterSource,
        on_failure: Callable[[BaseException], None],
    ):
        self._target = target
        self.check = check
        """The check of the parameters (--stop-eval-episodes), or None."""
        self._stats = stats
        self._parameters = parameters
        self._on_failure = on_failure
        # The training state whose parameters the check playing now plays, and the one a
        # passing check stopped the run with.
        self.checking: TrainState | None = None
        self.checked: TrainState | None = None

    def warm_up(self, params: Any) -> None:
        if self.check is not None:
            self.check.warm_up(params)

    def close(self) -> None:
        if self.check is not None:
            self.check.close()

    def reason(self) -> str:
        """Why training is complete by --stop-at-return, or "" while it is not (called
        often: a check, when one is due, starts here and plays while training goes on)."""
        target = self._target
        if target is None:
            return ""
        _, returns = self._stats.progress()
        fleet_mean = sum(returns) / len(returns) if len(returns) >= RETURN_WINDOW else None
        reached = ""
        if fleet_mean is not None and fleet_mean >= target:
            reached = (
                f"mean return {fleet_mean:.2f} of the last {len(returns)} episodes reached "
                f"{target:g}"
            )
        check = self.check
        if check is None:
            return reached
        episodes = self._stats.counters()["episodes"]
        try:
            finished = check.finished()
        except Exception as error:  # the learner's own envs failed: stop, with a checkpoint
            self._on_failure(error)
            return ""
        if finished is not None:
            version, played = finished
            mean = sum(played) / len(played)
            self._stats.add("stop_check_return", mean)
            verdict = (
                f"{len(played)} {check.policy} episodes of the parameters of update {version} "
                f"averaged {mean:.2f}"
            )
            if reached and mean >= target:
                self.checked = self.checking
                return f"{reached}, and {verdict}"
            check.fell_short(episodes)
            self.checking = None
            logger.info(
                "%s, %s: training on",
                verdict,
                f"short of {target:g}"
                if mean < target
                else f"but the fleet's 100-episode mean fell back below {target:g}",
            )
        elif reached and check.may_start(episodes):
            params, version, self.checking = self._parameters.latest_with_state()
            check.start(params, version)
        return ""

    def end_with_checked(self, trainer: Trainer) -> None:
        """Once `trainer` has stopped: a run stopped by a passing check ends with the state
        it checked. Training went on while the check played, and those updates, never
        checked, are dropped (with any checkpoint of them), so the final checkpoint holds
        the policy that passed."""
        checked = self.checked
        if checked is None:
            return
        checked_updates, trained = int(checked.updates), int(trainer.state.updates)
        if checked_updates == trained:
            return
        if trainer.coordinated:
            # Every process must end with the same state, and they agreed on this one.
            logger.warning(
                "the learner processes agreed to stop after update %d; the check passed "
                "update %d, whose state this process alone cannot go back to",
                trained,
                checked_updates,
            )
            return
        trainer.roll_back(checked)
        logger.info(
            "the run ends with the checked state of update %d: the %d updates trained "
            "while the check played are dropped",
            checked_updates,
            trained - checked_updates,
        )
