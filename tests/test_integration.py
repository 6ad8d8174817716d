"""A real learner, real actor processes, the counting env: unrolls are exact.

The counting env writes into every observation which env instance made it
(NONCE, ENV_INDEX) and where in time it stands (TOTAL, EPISODE, STEP), plus
the last action it received. From the learner's unrolls alone the test
checks that each unroll is T+1 consecutive steps of one env of one run, that
consecutive unrolls overlap by exactly one step with nothing lost or
repeated, that every action reached the env it was chosen for, and that a
killed and restarted actor comes back as a new run whose steps never join an
unroll of the old one. "counting:wide" runs the same checks on observations
large enough to travel as observation changes (seedrl.codec), padding
included.
"""

from __future__ import annotations

import collections
import itertools
import queue
import time

import numpy as np
import pytest

from envs import counting
from learner.data.unroll_store import Unroll
from tests.fleet import LearnerThread, free_port, learner_config, spawn_actor, wait_until

ENV = "counting:v0"


class Collector:
    """Drains the learner's unroll queue (no trainer runs in these tests), naming each
    unroll's actor and run. Make it before any actor connects: it learns the names as
    the learner accepts each stream."""

    def __init__(self, fleet: LearnerThread):
        self.fleet = fleet
        self.unrolls: list[tuple[str, str, Unroll]] = []
        self._names: dict[int, tuple[str, str]] = {}  # stream owner -> (actor id, run id)
        service = fleet.learner.service
        accept = service._accept

        async def accept_and_name(context):
            actor = await accept(context)
            if actor is not None:
                self._names[actor.owner] = (actor.actor_id, actor.run_id)
            return actor

        service._accept = accept_and_name

    def drain_until(self, condition, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        learner = self.fleet.learner
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
            try:
                unroll = learner.unrolls.get(timeout=0.1)
            except queue.Empty:
                continue
            actor_id, run_id = self._names[unroll.owner]
            self.unrolls.append((actor_id, run_id, unroll))

    def count(self, actor_id: str, run_id: str | None = None) -> int:
        return sum(
            1 for a, r, _ in self.unrolls if a == actor_id and (run_id is None or r == run_id)
        )


def check_unroll(unroll: Unroll) -> None:
    obs = unroll.observations
    if obs.shape[1] > counting.OBSERVATION_SIZE:  # counting:wide: every value arrived
        np.testing.assert_array_equal(
            obs[:, counting.OBSERVATION_SIZE :], counting.padding(obs[:, counting.ENV_INDEX])
        )
    assert len(np.unique(obs[:, counting.NONCE])) == 1, "an unroll mixes env instances"
    assert len(np.unique(obs[:, counting.ENV_INDEX])) == 1, "an unroll mixes envs"
    np.testing.assert_array_equal(np.diff(obs[:, counting.TOTAL]), 1, "a step lost or repeated")
    env_index = obs[:, counting.ENV_INDEX].astype(np.int64)
    episode = obs[:, counting.EPISODE].astype(np.int64)
    step = obs[:, counting.STEP].astype(np.int64)
    ended = unroll.terminated | unroll.truncated
    # The flags are the env's own: an episode ends exactly at its length.
    expected_end = step == counting.episode_length(env_index, episode)
    np.testing.assert_array_equal(ended, expected_end)
    np.testing.assert_array_equal(
        unroll.truncated, expected_end & counting.ends_by_truncation(env_index, episode)
    )
    for t in range(len(obs) - 1):
        following = obs[t + 1]
        if ended[t]:
            # Next-step auto-reset: the action is ignored, a new episode starts.
            assert following[counting.STEP] == 0
            assert following[counting.EPISODE] == episode[t] + 1
            assert following[counting.LAST_ACTION] == -1
            assert unroll.rewards[t + 1] == 0.0
        else:
            assert following[counting.STEP] == step[t] + 1
            # The action chosen for this env is the one the env received...
            assert following[counting.LAST_ACTION] == unroll.actions[t]
            # ...and the reward that came back is the one it earned.
            assert unroll.rewards[t + 1] == float(unroll.actions[t] == step[t] % 3)
    assert np.all(unroll.behaviour_log_probs <= 0) and np.all(
        np.isfinite(unroll.behaviour_log_probs)
    )


def check_chains(unrolls: list[Unroll]) -> dict[tuple[float, float], int]:
    """Per env instance: unrolls chain from TOTAL 0 with a one-step overlap."""
    chains: dict[tuple[float, float], list[Unroll]] = collections.defaultdict(list)
    for unroll in unrolls:
        key = (unroll.observations[0, counting.NONCE], unroll.observations[0, counting.ENV_INDEX])
        chains[key].append(unroll)
    lengths = {}
    for key, chain in chains.items():
        chain.sort(key=lambda u: u.observations[0, counting.TOTAL])
        assert chain[0].observations[0, counting.TOTAL] == 0, f"env {key} lost its first unroll"
        for previous, current in itertools.pairwise(chain):
            # The last step of one unroll is the first of the next, in every field.
            for field in (
                "observations",
                "actions",
                "behaviour_log_probs",
                "rewards",
                "terminated",
                "truncated",
                "policy_versions",
            ):
                np.testing.assert_array_equal(
                    getattr(current, field)[0], getattr(previous, field)[-1], field
                )
        lengths[key] = len(chain)
    return lengths


@pytest.fixture
def fleet(tmp_path):
    config = learner_config(ENV, tmp_path / "run", unroll_length=5, unroll_queue_size=64)
    learner = LearnerThread(config, train=False).start()
    yield learner
    learner.stop()


@pytest.mark.parametrize("env", [ENV, "counting:wide"])
def test_unrolls_are_stitched_exactly_across_an_actor_restart(env, tmp_path):
    config = learner_config(env, tmp_path / "run", unroll_length=5, unroll_queue_size=64)
    fleet = LearnerThread(config, train=False).start()
    logs = tmp_path / "actors"
    collector = Collector(fleet)
    # Observation changes are on by default (loopback too): no flag needed.
    steady = spawn_actor(fleet.address, env, 2, "steady", logs)
    doomed = spawn_actor(fleet.address, env, 3, "doomed", logs)
    restarted = None
    try:
        collector.drain_until(
            lambda: collector.count("steady") >= 30 and collector.count("doomed") >= 30,
            120,
            "unrolls from both actors",
        )
        streams = {s.actor_id: s for s in fleet.learner.service.streams.values()}
        first_run = streams["doomed"].run_id
        doomed.kill()
        restarted = spawn_actor(fleet.address, env, 3, "doomed", logs)
        collector.drain_until(
            lambda: (
                sum(1 for a, r, _ in collector.unrolls if a == "doomed" and r != first_run) >= 30
            ),
            120,
            "unrolls from the restarted actor",
        )
        steady_before = collector.count("steady")
        collector.drain_until(
            lambda: collector.count("steady") >= steady_before + 10, 60, "the steady actor to go on"
        )
        streams = list(fleet.learner.service.streams.values())
    finally:
        for actor in (steady, doomed, restarted):
            if actor is not None:
                actor.kill()
        fleet.stop()

    # A wide observation travels as its changes (2 of its 128 words per env step), a
    # counting:v0 one whole; either way with the step's rewards and flags.
    wide = env == "counting:wide"
    assert len(streams) == 2 and all(s.observation_changes == wide for s in streams)
    for stream in streams:
        per_env_step = stream.received_bytes / (stream.steps * stream.num_envs)
        assert per_env_step < (60 if wide else 45), (stream.actor_id, per_env_step)

    runs = collections.defaultdict(set)
    nonces = collections.defaultdict(set)
    for actor_id, run_id, unroll in collector.unrolls:
        check_unroll(unroll)
        runs[actor_id].add(run_id)
        nonces[(actor_id, run_id)].add(float(unroll.observations[0, counting.NONCE]))

    # The restart is a new run, and the two runs share no env instance: no unroll
    # of the new run continues one of the old.
    assert len(runs["doomed"]) == 2 and first_run in runs["doomed"]
    (second_run,) = runs["doomed"] - {first_run}
    assert nonces[("doomed", first_run)].isdisjoint(nonces[("doomed", second_run)])
    assert len(nonces[("doomed", first_run)]) == 3 and len(nonces[("doomed", second_run)]) == 3
    assert len(runs["steady"]) == 1 and len(nonces[("steady", next(iter(runs["steady"])))]) == 2

    chains = check_chains([unroll for _, _, unroll in collector.unrolls])
    assert len(chains) == 2 + 3 + 3
    assert sum(chains.values()) == len(collector.unrolls)


def test_policy_version_of_each_action_is_recorded(tmp_path):
    config = learner_config(ENV, tmp_path / "run", unroll_length=4, batch_size=2)
    fleet = LearnerThread(config, train=True).start()
    actor = spawn_actor(fleet.address, ENV, 2, "a", tmp_path / "actors")
    try:
        wait_until(lambda: fleet.learner.stats.updates >= 20, 120, "20 updates")
    finally:
        actor.kill()
        fleet.stop()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert lines, "no metrics were written"
    import json

    records = [json.loads(line) for line in lines]
    lags = [r["policy_lag_mean"] for r in records if r["policy_lag_mean"] is not None]
    # Training ran while acting went on: lags are measured, small, and not negative.
    assert lags and all(0 <= lag < 10 for lag in lags)
    assert max(r["updates"] for r in records) >= 20


def test_an_actor_is_refused_for_the_wrong_env_and_exits(fleet, tmp_path):
    actor = spawn_actor(fleet.address, "classic:CartPole-v1", 1, "lost", tmp_path / "actors")
    code = actor.wait(timeout_s=60)
    assert code == 2, actor.log()
    assert "does not match the learner's env 'counting:v0'" in actor.log()


def test_an_actor_refused_by_a_cap_exits(tmp_path):
    fleet = LearnerThread(learner_config(ENV, tmp_path / "run", max_env_slots=1)).start()
    actor = spawn_actor(fleet.address, ENV, 2, "wide", tmp_path / "actors")
    try:
        assert actor.wait(timeout_s=60) == 2, actor.log()
        assert "RESOURCE_EXHAUSTED" in actor.log() and "--max-env-slots" in actor.log()
    finally:
        actor.kill()
        fleet.stop()


def test_a_stopped_learner_leaves_actors_retrying_until_one_is_back(tmp_path):
    # Wide observations: the reconnected actor must begin its new stream with them whole.
    env = "counting:wide"
    port = free_port()
    config = learner_config(env, tmp_path / "run", port=port)
    first = LearnerThread(config, train=True).start()
    actor = spawn_actor(first.address, env, 2, "patient", tmp_path / "actors")
    try:
        wait_until(lambda: first.learner.stats.updates >= 5, 60, "training with a live actor")
        (old_run,) = [s.run_id for s in first.learner.service.streams.values()]
        stopped_at = time.monotonic()
        first.stop()  # fails the test if the learner does not stop
        assert time.monotonic() - stopped_at < 15
        # Not "training finished": the actor must not exit, it retries.
        assert actor.process.poll() is None, actor.log()
        second = LearnerThread(learner_config(env, tmp_path / "run2", port=port)).start()
        try:
            wait_until(
                lambda: (
                    [(s.actor_id, s.steps >= 20) for s in second.learner.service.streams.values()]
                    == [("patient", True)]
                ),
                60,
                "the actor to reconnect to the new learner and step on",
            )
            (stream,) = second.learner.service.streams.values()
            assert stream.run_id != old_run and stream.observation_changes
        finally:
            second.stop()
        assert "UNAVAILABLE" in actor.log() and "retrying" in actor.log()
    finally:
        actor.kill()


def test_a_second_learner_on_a_busy_port_says_so(tmp_path):
    first = LearnerThread(learner_config(ENV, tmp_path / "run")).start()
    try:
        busy = learner_config(ENV, tmp_path / "run2", port=first.learner.port)
        assert LearnerThread(busy).start().wait(timeout_s=60) == 2
    finally:
        first.stop()


def test_the_learner_stops_taking_steps_at_its_budget(tmp_path):
    """Streams end at their next step once the budget is counted, whenever the learner's
    completion check (every 0.25 s, later under load) comes: counting envs step in
    microseconds, so a quarter of a second more would be thousands of steps."""
    import json

    from tests.fleet import train_to_the_end

    budget, actors, num_envs = 3000, 2, 8
    train_to_the_end(
        "counting:v0",
        tmp_path / "run",
        tmp_path / "logs",
        "--total-env-steps",
        str(budget),
        actors=actors,
        num_envs=num_envs,
        timeout_s=300,
    )
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    counted = json.loads(lines[-1])["env_steps"]
    # At most the step each stream had sent before its next one was refused.
    assert budget <= counted <= budget + actors * num_envs, counted
