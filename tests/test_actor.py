"""The actor's own logic: backoff, giving up, refusing bad configuration, seeding."""

from __future__ import annotations

import random

import numpy as np
import pytest

from actors.actor import EXIT_GAVE_UP, Actor, ActorConfig, Backoff
from envs import counting
from tests.fleet import free_port, spawn_actor


def test_backoff_doubles_with_jitter_up_to_the_cap_and_resets():
    backoff = Backoff(0.5, 4.0, random.Random(0))
    delays = [backoff.delay() for _ in range(6)]
    caps = [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert all(cap / 2 <= delay <= cap for delay, cap in zip(delays, caps, strict=True))
    assert len(set(delays)) == len(delays)  # jittered, so a fleet does not retry in step
    backoff.reset()
    assert 0.25 <= backoff.delay() <= 0.5


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"learner": "nohost"}, "is not HOST:PORT"),
        ({"learner": "h:99999"}, "outside 1..65535"),
        ({"env": "Pong"}, "not FAMILY:NAME"),
        ({"num_envs": 0}, "at least 1"),
        ({"backoff_initial_s": 5.0, "backoff_max_s": 1.0}, "backoff"),
    ],
)
def test_bad_configuration_is_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        ActorConfig(**changes)


def test_the_actor_gives_up_when_no_learner_answers(tmp_path):
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    actor = spawn_actor(address, "counting:v0", 1, "alone", tmp_path, "--give-up-after-s", "1")
    assert actor.wait(timeout_s=60) == EXIT_GAVE_UP
    log = actor.log()
    assert "cannot reach the learner" in log and "giving up" in log


def test_each_group_is_seeded_apart_and_a_seed_reproduces_the_actor():
    def first_observations(seed):
        actor = Actor(ActorConfig(env="counting:v0", num_envs=6, groups=3, seed=seed))
        return [group.env.reset().observations[:, counting.NONCE] for group in actor.groups]

    groups = first_observations(5)
    nonces = np.concatenate(groups)
    assert len(set(nonces.tolist())) == len(nonces)  # no two groups play the same envs
    np.testing.assert_array_equal(np.stack(first_observations(5)), np.stack(groups))
    assert not np.array_equal(np.stack(first_observations(6)), np.stack(groups))


@pytest.mark.parametrize(
    ("learner", "setting", "env", "offered"),
    [
        ("10.1.2.3:8470", "on", "counting:wide", True),  # the default, on any link
        ("learner-host:8470", "on", "counting:wide", True),
        ("127.0.0.1:8470", "on", "counting:wide", True),  # loopback: gRPC's copies saved
        ("[::1]:8470", "on", "counting:wide", True),
        ("127.0.0.1:8470", "off", "counting:wide", False),
        ("10.1.2.3:8470", "off", "counting:wide", False),
        ("10.1.2.3:8470", "on", "counting:v0", False),  # 24 bytes: too small to pay
        ("127.0.0.1:8470", "on", "classic:CartPole-v1", False),  # 16 bytes
    ],
)
def test_observation_changes_are_offered_where_they_pay(learner, setting, env, offered):
    from seedrl.proto import seedrl_pb2

    assert ActorConfig().observation_changes == "on"

    actor = Actor(ActorConfig(learner=learner, env=env, num_envs=2, observation_changes=setting))
    hello = seedrl_pb2.ActorMessage.FromString(actor._hello(actor.groups[0])).hello
    assert hello.observation_changes == offered
