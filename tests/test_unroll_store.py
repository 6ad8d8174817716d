"""UnrollStore: one-step overlap, owners, episode bookkeeping."""

from __future__ import annotations

import numpy as np
import pytest

from learner.data.unroll_store import UnrollStore
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


def _one_slot_stepper(store: UnrollStore, owner: int = 1):
    """A function that takes one step of one slot with observation [value, value]."""
    slots = store.allocate(owner=owner, count=1)
    owners = np.full(1, owner, np.int64)

    def step(value: float) -> list:
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

    return step


def test_unrolls_are_lent_buffers_until_given_back_then_copies():
    spec = TensorSpec("float32", (2,))
    for stack in (1, 3):
        store = UnrollStore(
            unroll_length=2, observation_spec=spec, initial_slots=1, frame_stack=stack
        )
        step = _one_slot_stepper(store)
        emitted, expected = [], []
        for value in range(1, 12):
            emitted.extend(step(float(value)))
            if value >= 3 and value % 2 == 1:  # T = 2: unrolls end at 3, 5, 7, ...
                frames = np.arange(value - 2 - (stack - 1), value + 1, dtype=np.float32)
                expected.append(np.where(frames > 0, frames, 0.0))  # zeros before the first
        assert len(emitted) == len(expected) == 5
        # One slot: one buffer of its own and one spare, so the first unroll is the
        # spare-swapped buffer and those after it (none given back) are copies.
        for unroll, frames in zip(emitted, expected, strict=True):
            np.testing.assert_array_equal(unroll.observations[:, 0], frames)
        assert emitted[0].observations.base is not None
        assert all(unroll.observations.base is None for unroll in emitted[1:])

        # Given back, the lent buffer is lent again; a given-back copy is reused for a
        # copy; the contents are right either way.
        assert store.copied_unrolls == 4
        store.recycle([emitted[0], emitted[1], emitted[1]])
        store.recycle([emitted[0], emitted[1]])  # again: ignored
        lent_memory = emitted[0].observations.ctypes.data
        copy_memory = emitted[1].observations.ctypes.data
        more = []
        for value in range(12, 16):
            more.extend(step(float(value)))
        assert [u.observations[-1, 0] for u in more] == [13.0, 15.0]
        np.testing.assert_array_equal(
            more[0].observations[:, 0], np.arange(11 - (stack - 1), 14, dtype=np.float32)
        )
        np.testing.assert_array_equal(
            more[1].observations[:, 0], np.arange(13 - (stack - 1), 16, dtype=np.float32)
        )
        # The first of these was lent (the slot went on in the buffer given back), the
        # second copied into the copy given back.
        assert more[0].observations.base is not None
        assert more[1].observations is emitted[1].observations
        assert copy_memory == more[1].observations.ctypes.data
        assert store.copied_unrolls == 5
        store.recycle([more[0]])
        step(16.0)
        (last,) = step(17.0)
        assert last.observations.ctypes.data == lent_memory
        np.testing.assert_array_equal(
            last.observations[:, 0], np.arange(15 - (stack - 1), 18, dtype=np.float32)
        )
        # A stale unroll of that row given back again while the row is lent anew (to
        # `last`) frees nothing: the next unroll is a copy and `last` keeps its frames.
        store.recycle([emitted[0]])
        step(18.0)
        (after,) = step(19.0)
        assert after.observations.base is None and store.copied_unrolls == 6
        assert after.observations is not emitted[1].observations  # given back only once
        np.testing.assert_array_equal(
            last.observations[:, 0], np.arange(15 - (stack - 1), 18, dtype=np.float32)
        )


def test_unrolls_lent_before_the_store_grows_keep_their_frames():
    spec = TensorSpec("float32", (2,))
    store = UnrollStore(unroll_length=2, observation_spec=spec, initial_slots=1)
    step = _one_slot_stepper(store)
    for value in (1.0, 2.0):
        assert step(value) == []
    (before,) = step(3.0)
    frames = before.observations.copy()
    store.allocate(owner=2, count=5)  # the store grows: new frame buffers
    assert store.capacity >= 6
    store.recycle([before])  # from the old buffers: not taken back
    after = []
    for value in range(4, 8):
        after.extend(step(float(value)))
    np.testing.assert_array_equal(before.observations, frames)
    assert [u.observations[:, 0].tolist() for u in after] == [[3.0, 4.0, 5.0], [5.0, 6.0, 7.0]]
    assert not any(np.shares_memory(before.observations, u.observations) for u in after)


def test_clipped_returns_scale_and_clip_each_reward_as_training_does():
    for clipping, scale, expected_clipped in (
        ("abs_one", 1.0, 1.0 - 1.0 + 0.5),
        ("none", 1.0, 5.0 - 3.0 + 0.5),
        ("none", 0.1, 0.5 - 0.3 + 0.05),
        ("abs_one", 0.25, 1.0 - 0.75 + 0.125),
    ):
        store = UnrollStore(
            unroll_length=10,
            observation_spec=SPEC,
            initial_slots=1,
            reward_clipping=clipping,
            reward_scale=scale,
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
        assert episodes.clipped_returns == [pytest.approx(expected_clipped)]


def test_a_batch_of_several_messages_is_observed_as_if_it_were_one_array():
    """The inference loop hands observe() one array per message; the result must be the
    same as one concatenated array, with frame stacking, episode starts and a gone
    stream's rows among them."""
    rng = np.random.default_rng(0)
    for stack in (1, 3):
        stores = [
            UnrollStore(unroll_length=2, observation_spec=SPEC, initial_slots=8, frame_stack=stack)
            for _ in range(2)
        ]
        for store in stores:
            gone = store.allocate(owner=1, count=2)
            store.release(1, gone)
            live = store.allocate(owner=2, count=5)
        # Three messages: 2 envs, 2 of a stream that has ended, 3 envs.
        slots = np.concatenate([live[:2], gone, live[2:]])
        owners = np.array([2, 2, 1, 1, 2, 2, 2])
        for t in range(7):
            values = rng.integers(1, 100, (7, 1)).astype(np.int32)
            ends = rng.random(7) < 0.3
            step = EnvStep(values, values[:, 0].astype(np.float32), ends, np.zeros(7, bool))
            seen = [np.full((7, stack, 1), -1, np.int32).reshape(7, stack) for _ in stores]
            alive = [
                stores[0].observe(slots, owners, values, seen[0]),
                stores[1].observe(slots, owners, [values[:2], values[2:4], values[4:]], seen[1]),
            ]
            np.testing.assert_array_equal(alive[0], alive[1])
            np.testing.assert_array_equal(seen[0], seen[1])
            assert (seen[1][2:4] == 0).all()  # the gone stream's rows
            emitted = [
                store.append(slots, owners, step, values[:, 0] % 5, np.zeros(7, np.float32), t)[0]
                for store in stores
            ]
            assert len(emitted[0]) == len(emitted[1]) == (5 if t % 2 == 0 and t else 0)
            for a, b in zip(emitted[0], emitted[1], strict=True):
                for x, y in zip(a, b, strict=True):
                    np.testing.assert_array_equal(x, y)
        with pytest.raises(ValueError, match="observations for 6 envs, slots for 7"):
            stores[1].observe(slots, owners, [values[:2], values[3:]], seen[1])
