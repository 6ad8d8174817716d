"""Frame stacking on the learner sees exactly what ale-py's own stacking would have shown."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from learner.agents.agent import stack_frames
from learner.data.frame_stack import FrameStacker, frame_indices, window_validity
from learner.data.unroll_store import UnrollStore
from learner.training.trainer import stack_unrolls
from seedrl.codec import EnvStep
from seedrl.specs import ActionSpec, EnvSpec, SpecError, TensorSpec


def test_a_frame_is_valid_only_in_the_episode_of_the_newest_frame():
    first = np.array(
        [
            [False, False, False, False],  # one episode throughout
            [False, False, True, False],  # an episode starts at the third frame
            [True, False, False, True],  # ... and at the last: only it counts
            [True, True, True, True],
        ]
    )
    np.testing.assert_array_equal(
        window_validity(first),
        [
            [True, True, True, True],
            [False, False, True, True],
            [False, False, False, True],
            [False, False, False, True],
        ],
    )


def test_frame_indices_slide_one_frame_per_step():
    # T = 3, S = 3: five frames; an episode starts at frame 3 (step 1's newest).
    first = np.array([True, False, False, True, False])[:, None]
    index = frame_indices(first, 3)
    assert index.shape == (3, 1, 3) and index.dtype == np.int32
    np.testing.assert_array_equal(index[:, 0], [[0, 1, 2], [-1, -1, 3], [-1, 3, 4]])


def test_stack_frames_gathers_and_zero_pads_on_the_device():
    frames = np.arange(5 * 2 * 1 * 2, dtype=np.uint8).reshape(5, 2, 1, 2) + 1
    first = np.zeros((5, 2), bool)
    first[3, 1] = True
    index = frame_indices(first, 3)
    stacked = np.asarray(jax.jit(stack_frames)(frames, index))
    assert stacked.shape == (3, 2, 3, 2)
    np.testing.assert_array_equal(stacked[2, 0], frames[2:5, 0].reshape(3, 2))
    np.testing.assert_array_equal(stacked[1, 1], [[0, 0], [0, 0], frames[3, 1, 0]])


def test_spec_stacks_along_the_first_axis():
    spec = EnvSpec("x", TensorSpec("uint8", (1, 84, 84)), ActionSpec(3), frame_stack=4)
    assert spec.model_observation == TensorSpec("uint8", (4, 84, 84))
    unstacked = EnvSpec("x", TensorSpec("float32", (4,)), ActionSpec(2))
    assert unstacked.model_observation is unstacked.observation
    with pytest.raises(SpecError, match="frame_stack"):
        EnvSpec("x", TensorSpec("uint8", (1,)), ActionSpec(2), frame_stack=0)


class NativeStack:
    """ale-py's vector env with its own 4-frame stacking: the reference."""

    def __init__(self, num_envs: int, seed: int, settings: dict):
        from ale_py.vector_env import AtariVectorEnv

        from envs.atari import ATARI_SETTINGS

        self.env = AtariVectorEnv(
            "pong", num_envs, autoreset_mode="NextStep", **{**ATARI_SETTINGS, **settings}
        )
        self.seed = seed

    def reset(self) -> np.ndarray:
        return self.env.reset(seed=self.seed)[0]

    def step(self, actions: np.ndarray) -> np.ndarray:
        return self.env.step(actions)[0]


@pytest.mark.parametrize("size", [84, 42])
def test_learner_stacks_equal_ale_pys_own_through_store_trainer_and_evaluation(size):
    """The same games, seeds and actions: ale-py stacking 4 frames itself, and
    one frame per step stacked by the learner. Inference inputs (the store's
    `observe`), training inputs (unrolls -> stack_unrolls -> stack_frames on
    the device) and evaluation's FrameStacker all equal ale-py's stacks, across
    unroll boundaries and episode ends (time limits every 13 steps here)."""
    from envs.atari import AtariVectorEnv

    num_envs, seed, steps, unroll_length = 3, 11, 80, 5
    settings = {"max_num_frames_per_episode": 52}  # a truncation every 13 agent steps
    native = NativeStack(num_envs, seed, {**settings, "img_height": size, "img_width": size})
    env = AtariVectorEnv(f"Pong/{size}x{size}", num_envs, seed=seed, settings=settings)
    spec = env.spec
    assert spec.frame_stack == 4 and spec.observation.shape == (1, size, size)
    store = UnrollStore(unroll_length, spec.observation, initial_slots=8, frame_stack=4)
    slots = store.allocate(owner=7, count=num_envs)
    owners = np.full(num_envs, 7)
    stacker = FrameStacker(spec, num_envs)
    rng = np.random.default_rng(0)

    expected = [native.reset()]
    step = env.reset()
    first = np.ones(num_envs, bool)
    unrolls, seen_by_policy, episode_ends = [], [], 0
    for index in range(steps):
        seen = np.empty((num_envs, *spec.model_observation.shape), np.uint8)
        store.observe(slots, owners, step.observations, seen)
        seen_by_policy.append(seen)
        np.testing.assert_array_equal(seen, expected[index], err_msg=f"inference, step {index}")
        np.testing.assert_array_equal(
            stacker(step.observations, first), expected[index], err_msg=f"evaluation, {index}"
        )
        actions = rng.integers(0, spec.action.num_actions, num_envs).astype(np.int32)
        emitted, _ = store.append(
            slots, owners, step, actions, np.zeros(num_envs, np.float32), policy_version=index
        )
        unrolls.extend(emitted)
        first = step.terminated | step.truncated
        episode_ends += int(first.sum())
        step = env.step(actions)
        expected.append(native.step(actions))
    assert episode_ends >= 3 * num_envs  # the stacks were reset several times per env

    assert len(unrolls) == num_envs * ((steps - 1) // unroll_length)
    for start in range(0, len(unrolls), num_envs):
        batch = unrolls[start : start + num_envs]
        trajectories, versions = stack_unrolls(batch)
        assert trajectories.observations.shape == (unroll_length + 4, num_envs, 1, size, size)
        stacked = np.asarray(
            jax.jit(stack_frames)(trajectories.observations, trajectories.frame_index)
        )
        for column in range(num_envs):  # a step's unrolls come in slot order: env order
            for t, version in enumerate(versions[:, column]):  # version = the step's index
                np.testing.assert_array_equal(
                    stacked[t, column],
                    seen_by_policy[version][column],
                    err_msg=f"training, unroll {start + column}, step {t}",
                )
        assert all(unroll.owner == 7 for unroll in batch)


def test_observe_zeroes_rows_of_slots_that_changed_owner():
    spec = TensorSpec("uint8", (1, 2))
    store = UnrollStore(2, spec, initial_slots=2, frame_stack=2)
    slots = store.allocate(owner=1, count=2)
    out = np.full((2, 2, 2), 9, np.uint8)
    frames = np.array([[[3, 4]], [[5, 6]]], np.uint8)
    store.observe(slots, np.array([1, 2]), frames, out)  # slot 1 is not owner 2's
    np.testing.assert_array_equal(out[0], [[0, 0], [3, 4]])  # a new episode: zeros first
    np.testing.assert_array_equal(out[1], [[0, 0], [0, 0]])
    with pytest.raises(ValueError, match="C-contiguous"):
        store.observe(slots, np.array([1, 1]), frames, np.zeros((2, 4, 2), np.uint8)[:, ::2])


def test_unstacked_envs_pass_observations_through():
    spec = EnvSpec("x", TensorSpec("float32", (3,)), ActionSpec(2))
    stacker = FrameStacker(spec, 2)
    observations = np.ones((2, 3), np.float32)
    assert stacker(observations, np.ones(2, bool)) is observations
    store = UnrollStore(3, spec.observation, initial_slots=2)
    slots = store.allocate(owner=1, count=2)
    out = np.zeros((2, 3), np.float32)
    store.observe(slots, np.ones(2, np.int64), observations * 2, out)
    np.testing.assert_array_equal(out, observations * 2)
    step = EnvStep(None, np.zeros(2, np.float32), np.zeros(2, bool), np.zeros(2, bool))
    for _ in range(3):
        store.observe(slots, np.ones(2, np.int64), observations, out)
        emitted, _ = store.append(
            slots, np.ones(2, np.int64), step, np.zeros(2, np.int32), np.zeros(2, np.float32), 0
        )
    store.observe(slots, np.ones(2, np.int64), observations, out)
    emitted, _ = store.append(
        slots, np.ones(2, np.int64), step, np.zeros(2, np.int32), np.zeros(2, np.float32), 0
    )
    trajectories, _ = stack_unrolls(emitted)
    assert trajectories.frame_index is None
    assert trajectories.observations.shape == (4, 2, 3)
