"""UnrollStore: one-step overlap, owners, episode bookkeeping."""

from __future__ import annotations

import numpy as np

from learner.unroll_store import UnrollStore
from seedrl.codec import EnvStep
from seedrl.specs import TensorSpec

SPEC = TensorSpec("int32", (1,))


def observe_and_append(store, slots, owners, step, actions, log_probs, policy_version):
    """One step as the inference loop takes it: observe, (act), append; returns
    append's result and what the policy was given."""
    first, *rest = step.observations.shape[1:]
    seen = np.empty((len(slots), store.frame_stack * first, *rest), step.observations.dtype)
    store.observe(slots, owners, step.observations, seen)
    unrolls, episodes = store.append(slots, owners, step, actions, log_probs, policy_version)
    return unrolls, episodes, seen


def feed(store, slots, owner, values, terminated=None, truncated=None, version=0):
    """Appends one step per slot whose observation is `values`."""
    count = len(slots)
    step = EnvStep(
        observations=np.asarray(values, np.int32).reshape(count, 1),
        rewards=np.asarray(values, np.float32),
        terminated=np.zeros(count, bool) if terminated is None else np.asarray(terminated),
        truncated=np.zeros(count, bool) if truncated is None else np.asarray(truncated),
    )
    return observe_and_append(
        store,
        slots,
        np.full(count, owner),
        step,
        actions=np.asarray(values, np.int32) % 5,
        log_probs=np.full(count, -0.5, np.float32),
        policy_version=version,
    )[:2]


def test_unrolls_overlap_by_one_step():
    store = UnrollStore(unroll_length=3, observation_spec=SPEC, initial_slots=1)
    slots = store.allocate(owner=1, count=2)
    emitted = []
    for t in range(10):
        unrolls, _ = feed(store, slots, 1, [100 + t, 200 + t], version=t)
        emitted.extend(unrolls)
    first = [u.observations[:, 0].tolist() for u in emitted if u.observations[0, 0] < 200]
    assert first == [[100, 101, 102, 103], [103, 104, 105, 106], [106, 107, 108, 109]]
    second = [u.observations[:, 0].tolist() for u in emitted if u.observations[0, 0] >= 200]
    assert second == [[200, 201, 202, 203], [203, 204, 205, 206], [206, 207, 208, 209]]
    unroll = emitted[-1]
    assert unroll.policy_versions.tolist() == [6, 7, 8, 9]
    assert unroll.actions.tolist() == [v % 5 for v in range(206, 210)]
    assert unroll.owner == 1


def test_store_grows_and_reuses_released_slots():
    store = UnrollStore(unroll_length=2, observation_spec=SPEC, initial_slots=1)
    first = store.allocate(owner=1, count=3)
    assert store.slots_in_use == 3
    feed(store, first, 1, [1, 2, 3])
    # One step per slot, no transition yet: nothing of value is dropped.
    assert store.release(1, first) == (0, 0)
    assert store.slots_in_use == 0
    capacity = store.capacity
    second = store.allocate(owner=2, count=capacity)
    assert store.capacity == capacity  # every released slot was reused, none added
    assert set(first.tolist()) <= set(second.tolist())
    second = second[:3]
    # The new owner starts from an empty unroll: nothing of owner 1 leaks in.
    emitted = []
    for t in range(3):
        emitted.extend(feed(store, second, 2, [10 + t] * 3)[0])
    assert {tuple(u.observations[:, 0]) for u in emitted} == {(10, 11, 12)}


def test_release_counts_the_partial_unrolls_it_drops():
    store = UnrollStore(unroll_length=3, observation_spec=SPEC, initial_slots=1)
    slots = store.allocate(owner=1, count=3)
    # Slots 0 and 1 hold 4 steps (one unroll emitted, its last step kept) then
    # 2 and 1 more; slot 2 joins late with a single step.
    for t in range(4):
        feed(store, slots[:2], 1, [t, t])
    feed(store, slots[:2], 1, [4, 4])
    feed(store, slots[:1], 1, [5])
    feed(store, slots[2:], 1, [7])
    # Slot 0: steps 3, 4, 5 (2 transitions); slot 1: 3, 4 (1); slot 2: 7 (none).
    assert store.release(1, slots) == (2, 3)
    # Another owner's slots are not its to drop.
    others = store.allocate(owner=2, count=1)
    feed(store, others, 2, [1])
    feed(store, others, 2, [2])
    assert store.release(1, others) == (0, 0)
    assert store.release(2, others) == (1, 1)


def test_steps_of_a_previous_owner_are_dropped():
    store = UnrollStore(unroll_length=1, observation_spec=SPEC, initial_slots=1)
    old = store.allocate(owner=1, count=1)
    store.release(1, old)
    new = store.allocate(owner=2, count=1)
    assert new.tolist() == old.tolist()
    # A batch formed while owner 1 held the slot arrives late: it must not land.
    unrolls, stats = feed(store, old, owner=1, values=[666])
    assert unrolls == [] and stats.env_steps == 0
    unrolls, _ = feed(store, new, 2, [1])
    unrolls, _ = feed(store, new, 2, [2])
    assert [u.observations[:, 0].tolist() for u in unrolls] == [[1, 2]]


def test_the_policy_sees_zeros_for_rows_of_a_previous_owner():
    """One batch mixing a live stream's rows with a gone one's (no frame stack)."""
    store = UnrollStore(unroll_length=2, observation_spec=SPEC, initial_slots=4)
    gone = store.allocate(owner=1, count=2)
    store.release(1, gone)
    live = store.allocate(owner=2, count=2)
    slots = np.concatenate([live[:1], gone[:1], live[1:]])
    owners = np.array([2, 1, 2])
    seen = np.full((3, 1), -1, np.int32)
    alive = store.observe(slots, owners, np.array([[7], [666], [9]], np.int32), seen)
    assert alive.tolist() == [True, False, True]
    assert seen[:, 0].tolist() == [7, 0, 9]


def test_episode_returns_are_raw_sums_between_ends():
    store = UnrollStore(unroll_length=50, observation_spec=SPEC)
    slots = store.allocate(owner=1, count=1)
    # First observation (reward ignored: nothing led to it), then rewards 1, 2, 3
    # with the last observation terminal, then a new episode: reward 4 truncated.
    _, stats = feed(store, slots, 1, [9])
    assert stats.env_steps == 0
    feed(store, slots, 1, [1])
    feed(store, slots, 1, [2])
    _, stats = feed(store, slots, 1, [3], terminated=[True])
    assert stats.returns == [6.0] and stats.lengths == [3] and stats.env_steps == 1
    _, stats = feed(store, slots, 1, [7])  # the reset observation
    assert stats.returns == [] and stats.env_steps == 0
    _, stats = feed(store, slots, 1, [4], truncated=[True])
    assert stats.returns == [4.0] and stats.lengths == [1]


def test_recycled_observation_arrays_are_reused_and_overwritten_correctly():
    spec = TensorSpec("float32", (2,))
    store = UnrollStore(unroll_length=2, observation_spec=spec, initial_slots=1)
    slots = store.allocate(owner=1, count=1)
    owners = np.ones(1, np.int64)

    def step(value: float):
        observation = np.full((1, 2), value, np.float32)
        zeros = np.zeros(1, bool)
        return observe_and_append(
            store,
            slots,
            owners,
            EnvStep(observation, np.zeros(1, np.float32), zeros, zeros),
            np.zeros(1, np.int32),
            np.zeros(1, np.float32),
            0,
        )[0]

    for value in (0.0, 1.0):
        assert step(value) == []
    (first,) = step(2.0)
    np.testing.assert_array_equal(first.observations[:, 0], [0.0, 1.0, 2.0])
    store.recycle([first])
    assert step(3.0) == []
    (second,) = step(4.0)
    assert second.observations is first.observations  # the array came back
    np.testing.assert_array_equal(second.observations[:, 0], [2.0, 3.0, 4.0])


def test_clipped_returns_clip_each_reward_as_training_does():
    for clipping, expected_clipped in (("abs_one", 1.0 - 1.0 + 0.5), ("none", 5.0 - 3.0 + 0.5)):
        store = UnrollStore(
            unroll_length=10, observation_spec=SPEC, initial_slots=1, reward_clipping=clipping
        )
        (slot,) = store.allocate(owner=1, count=1)
        slots = np.array([slot])
        feed(store, slots, 1, [9])  # the first observation: its reward is not counted
        feed(store, slots, 1, [5])
        feed(store, slots, 1, [-3])
        _, episodes, _ = observe_and_append(
            store,
            slots,
            np.array([1]),
            EnvStep(
                observations=np.zeros((1, 1), np.int32),
                rewards=np.array([0.5], np.float32),
                terminated=np.array([True]),
                truncated=np.array([False]),
            ),
            actions=np.zeros(1, np.int32),
            log_probs=np.zeros(1, np.float32),
            policy_version=0,
        )
        assert episodes.returns == [2.5]
        assert episodes.clipped_returns == [expected_clipped]
