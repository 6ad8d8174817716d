"""--stop-eval-episodes: a stop at --stop-at-return waits for the policy itself.

A real learner (not served), its own CartPole envs and its untrained parameters,
whose greedy policy holds the pole for tens of steps at most; the fleet's
episodes are written into its counters as the actors' would be.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from learner.config import preset_for
from learner.learner import Learner

ENV = "classic:CartPole-v1"


def make_learner(tmp_path, target: float, episodes: int) -> Learner:
    config = dataclasses.replace(
        preset_for(ENV),
        run_dir=str(tmp_path / "run"),
        port=0,
        http_port=-1,
        stop_at_return=target,
        stop_eval_episodes=episodes,
    )
    return Learner(config, console=False)


def reached(learner: Learner) -> str:
    """The learner's verdict on --stop-at-return, as its serving loop asks for it."""

    async def ask() -> str:
        learner._stopping = asyncio.Event()
        return await learner._return_reached()

    return asyncio.run(ask())


def checks(learner: Learner) -> tuple[int, float | None]:
    """How many checks ran since the last call, and their greedy mean (the metrics' window)."""
    check = learner.stats.snapshot()["window"].get("stop_check_return")
    return (0, None) if check is None else (check.count, check.mean())


def fleet_played(learner: Learner, episodes: int, episode_return: float) -> None:
    learner.stats.add_episodes([episode_return] * episodes, [500] * episodes, 500 * episodes)


def test_the_fleets_mean_alone_does_not_stop_a_policy_that_falls_short(tmp_path):
    learner = make_learner(tmp_path, target=475, episodes=4)
    try:
        fleet_played(learner, 99, 500.0)
        assert reached(learner) == "" and checks(learner) == (0, None)  # under 100 episodes
        fleet_played(learner, 1, 500.0)  # the 100-episode mean reaches 475
        assert reached(learner) == ""
        count, untrained = checks(learner)
        assert count == 1 and 0 < untrained < 475  # the greedy policy played, and fell short
        # Not asked again until the fleet has played as many episodes more.
        fleet_played(learner, 3, 500.0)
        assert reached(learner) == "" and checks(learner) == (0, None)
        fleet_played(learner, 1, 500.0)
        assert reached(learner) == "" and checks(learner)[0] == 1
    finally:
        learner._stop_check.close()


def test_a_policy_that_reaches_the_target_greedily_stops_the_run(tmp_path):
    # The untrained policy's ~10 steps reach a target of 5 greedily too.
    learner = make_learner(tmp_path, target=5, episodes=4)
    try:
        fleet_played(learner, 100, 10.0)
        reason = reached(learner)
        count, played = checks(learner)
        assert count == 1 and played >= 5
        assert reason.startswith("mean return 10.00 of the last 100 episodes reached 5, and ")
        assert f"4 greedy episodes of the parameters of update 0 averaged {played:.2f}" in reason
    finally:
        learner._stop_check.close()


def test_without_the_check_the_fleets_mean_decides(tmp_path):
    learner = make_learner(tmp_path, target=475, episodes=0)
    assert learner._stop_check is None
    fleet_played(learner, 100, 480.0)
    assert reached(learner) == "mean return 480.00 of the last 100 episodes reached 475"
    assert checks(learner) == (0, None)


def test_a_cancelled_check_plays_no_further(tmp_path):
    learner = make_learner(tmp_path, target=475, episodes=4)
    try:
        params, _ = learner.parameters.latest()
        assert learner._stop_check.play(params, cancelled=lambda: True) == []
        assert len(learner._stop_check.play(params)) == 4
    finally:
        learner._stop_check.close()


@pytest.mark.parametrize("episodes", [1, 20])
def test_the_check_plays_exactly_its_episodes(tmp_path, episodes):
    learner = make_learner(tmp_path, target=475, episodes=episodes)
    try:
        params, _ = learner.parameters.latest()
        returns = learner._stop_check.play(params)
        assert len(returns) == episodes and all(r > 0 for r in returns)
    finally:
        learner._stop_check.close()
