"""--stop-eval-episodes: a stop at --stop-at-return waits for the policy itself.

A real learner (not served), its own CartPole envs and its untrained parameters,
whose greedy policy holds the pole for tens of steps at most; the fleet's
episodes are written into its counters as the actors' would be. The learner
asks its `return_stop.reason()` every 0.25 s while it serves; here the test asks, and
waits for a check's play to finish where the learner would ask again later.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from learner.agents.vtrace import learning
from learner.learner import Learner
from learner.presets import preset_for
from learner.training import checkpoint
from tests.fleet import wait_until

ENV = "classic:CartPole-v1"


@pytest.fixture
def make_learner(tmp_path):
    made: list[Learner] = []

    def make(target: float, episodes: int) -> Learner:
        config = dataclasses.replace(
            preset_for(ENV),
            run_dir=str(tmp_path / f"run-{len(made)}"),
            port=0,
            http_port=-1,
            stop_at_return=target,
            stop_eval_episodes=episodes,
        )
        made.append(Learner(config, console=False))
        return made[-1]

    yield make
    for learner in made:
        if learner.return_stop.check is not None:
            learner.return_stop.check.close()


def ask(learner: Learner) -> str:
    """The learner's verdict on --stop-at-return; a check it starts is played to the end
    before this returns (the verdict on it comes at the next ask)."""
    reason = learner.return_stop.reason()
    if learner.return_stop.check is not None:
        learner.return_stop.check.wait(timeout_s=120)
    return reason


def checks(learner: Learner) -> tuple[int, float | None]:
    """How many checks were judged since the last call, and their greedy mean."""
    check = learner.stats.snapshot()["window"].get("stop_check_return")
    return (0, None) if check is None else (check.count, check.mean())


def fleet_played(learner: Learner, episodes: int, episode_return: float) -> None:
    learner.stats.add_episodes([episode_return] * episodes, [500] * episodes, 500 * episodes)


def test_the_fleets_mean_alone_does_not_stop_a_policy_that_falls_short(make_learner, caplog):
    caplog.set_level(logging.INFO, logger="learner.training.stop_check")
    learner = make_learner(target=475, episodes=4)
    fleet_played(learner, 99, 500.0)
    assert ask(learner) == "" and ask(learner) == ""  # fewer than 100 episodes: no check
    assert checks(learner) == (0, None)
    fleet_played(learner, 1, 500.0)  # the 100-episode mean reaches 475
    assert ask(learner) == ""  # a check starts, and plays
    assert ask(learner) == ""  # its verdict: short
    count, untrained = checks(learner)
    assert count == 1 and 0 < untrained < 475
    assert caplog.messages[-1] == (
        f"4 greedy episodes of the parameters of update 0 averaged {untrained:.2f}, "
        "short of 475: training on"
    )
    # None again until the fleet has played as many episodes more.
    fleet_played(learner, 3, 500.0)
    assert ask(learner) == "" and ask(learner) == "" and checks(learner) == (0, None)
    fleet_played(learner, 1, 500.0)
    assert ask(learner) == "" and ask(learner) == "" and checks(learner)[0] == 1


def test_a_policy_that_reaches_the_target_greedily_stops_the_run(make_learner):
    # The untrained policy's tens of steps reach a target of 5 greedily too.
    learner = make_learner(target=5, episodes=4)
    fleet_played(learner, 100, 10.0)
    assert ask(learner) == ""  # the check starts
    reason = ask(learner)
    count, played = checks(learner)
    assert count == 1 and played >= 5
    assert reason == (
        "mean return 10.00 of the last 100 episodes reached 5, and "
        f"4 greedy episodes of the parameters of update 0 averaged {played:.2f}"
    )


def trained_to(learner: Learner, updates: int) -> learning.TrainState:
    """Stands in for the trainer reaching `updates`: a state of that update (parameters
    moved by it) made the trainer's and published, as the trainer's thread does."""
    state = learner.trainer.state
    moved = learning.TrainState(
        jax.tree.map(lambda x: x + updates, state.params), state.opt_state, jnp.int32(updates)
    )
    learner.trainer.state = moved
    learner.parameters.publish(moved.params, updates, moved)
    return moved


def test_a_passing_check_ends_the_run_with_the_state_it_checked(make_learner, caplog):
    """Training goes on while a check plays; a run stopped by the check ends with the
    state the check played, and a checkpoint of a later update is discarded, so the
    run's newest checkpoint is the policy that passed."""
    caplog.set_level(logging.INFO, logger="learner.training.stop_check")
    learner = make_learner(target=5, episodes=4)
    checked = trained_to(learner, 3)
    fleet_played(learner, 100, 10.0)
    assert ask(learner) == ""  # the check starts on update 3
    trained_to(learner, 8)  # ... and training goes on, with a checkpoint of update 8
    learner.trainer.save_checkpoint()
    wait_until(lambda: checkpoint.available(learner.run_dir) == [8], 60, "update 8's checkpoint")
    assert "parameters of update 3 averaged" in ask(learner)
    learner.return_stop.end_with_checked(learner.trainer)  # as the learner's shutdown does
    assert caplog.messages[-1] == (
        "the run ends with the checked state of update 3: the 5 updates trained while "
        "the check played are dropped"
    )
    assert learner.trainer.state is checked
    assert checkpoint.available(learner.run_dir) == []
    learner.trainer.save_checkpoint()  # the final save, as at every stop
    learner.trainer.close_checkpoints()
    assert checkpoint.available(learner.run_dir) == [3]
    params, _ = checkpoint.load_params(learner.run_dir, checked.params)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(checked.params), strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_check_that_passes_after_the_fleets_mean_fell_back_does_not_stop(make_learner, caplog):
    caplog.set_level(logging.INFO, logger="learner.training.stop_check")
    learner = make_learner(target=5, episodes=4)
    fleet_played(learner, 100, 10.0)
    assert ask(learner) == ""  # the check starts with the mean at 10
    fleet_played(learner, 100, 1.0)  # while it played, the fleet's mean fell to 1
    assert ask(learner) == "" and checks(learner)[0] == 1
    assert caplog.messages[-1].endswith(
        ", but the fleet's 100-episode mean fell back below 5: training on"
    )
    fleet_played(learner, 100, 10.0)
    assert ask(learner) == "" and ask(learner).endswith(" averaged " + f"{checks(learner)[1]:.2f}")


def test_without_the_check_the_fleets_mean_decides(make_learner):
    learner = make_learner(target=475, episodes=0)
    assert learner.return_stop.check is None
    fleet_played(learner, 100, 480.0)
    assert ask(learner) == "mean return 480.00 of the last 100 episodes reached 475"
    assert checks(learner) == (0, None)


def test_closing_ends_a_check_that_is_playing(make_learner):
    learner = make_learner(target=475, episodes=20)
    check = learner.return_stop.check
    params, version = learner.parameters.latest()
    check.start(params, version)
    # Stops the play within a step, then closes the envs: no episode ends (the first step
    # compiles the policy, and an episode of CartPole takes at least 8).
    check.close()
    assert check.finished() == (version, [])
    learner.return_stop.check = None  # closed already


@pytest.mark.parametrize("episodes", [1, 20])
def test_a_check_plays_exactly_its_episodes(make_learner, episodes):
    learner = make_learner(target=475, episodes=episodes)
    params, _ = learner.parameters.latest()
    returns = learner.return_stop.check.play(params)
    assert len(returns) == episodes and all(r > 0 for r in returns)


def test_the_learners_compile_warms_the_checks_policy_for_its_play(make_learner):
    learner = make_learner(target=475, episodes=20)
    player = learner.return_stop.check._player
    assert player._act._cache_size() == 0
    learner.compile()
    compiled = player._act._cache_size()
    assert compiled >= 1
    params, _ = learner.parameters.latest()
    learner.return_stop.check.play(params)
    assert player._act._cache_size() == compiled  # the play ran what compile had compiled
