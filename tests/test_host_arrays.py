"""Host arrays aligned for XLA on a CPU: the learner's batches reach the device without a copy."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from learner.backends.cpu.host_arrays import aligned_empty, aligned_zeros, is_aligned
from learner.data.unroll_store import UnrollStore
from learner.training.trainer import stack_unrolls
from seedrl.codec import EnvStep
from seedrl.specs import TensorSpec
from tests.test_unroll_store import observe_and_append

CPU = jax.devices("cpu")[0]


def read_in_place(array: np.ndarray) -> bool:
    """Whether XLA on the CPU takes `array` as it is, with no copy."""
    return jax.device_put(array, CPU).unsafe_buffer_pointer() == array.ctypes.data


@pytest.mark.parametrize("make", [aligned_zeros, aligned_empty])
@pytest.mark.parametrize("dtype", [np.uint8, np.int32, np.float64])
@pytest.mark.parametrize("shape", [0, (7, 5), (64, 4, 84, 84)])
def test_aligned_arrays_are_ordinary_numpy_arrays(make, dtype, shape):
    array = make(shape, dtype)
    assert array.shape == ((shape,) if isinstance(shape, int) else shape)
    assert array.dtype == dtype
    assert array.flags.c_contiguous and array.flags.writeable
    assert is_aligned(array)
    if make is aligned_zeros:
        assert not array.any()
    values = np.arange(array.size).reshape(array.shape).astype(dtype)
    array[...] = values
    np.testing.assert_array_equal(array, values)


def test_xla_on_a_cpu_reads_an_aligned_array_in_place_and_copies_a_misaligned_one():
    """The rule host_arrays.py rests on, checked against the installed jaxlib."""
    from bench.aligned import sixteen_bytes_off

    aligned = aligned_zeros((64, 4, 84, 84), np.uint8)
    assert read_in_place(aligned)
    misaligned = sixteen_bytes_off(aligned)
    assert not is_aligned(misaligned)
    assert not read_in_place(misaligned)


def test_the_learners_inference_batches_are_read_in_place(tmp_path):
    """Every padded batch buffer of a Pong learner (a 64-row one is 1.8 MB, mapped
    memory, which numpy's allocation leaves 16 bytes past a page)."""
    from learner.learner import Learner
    from tests.fleet import learner_config

    learner = Learner(learner_config("atari:Pong/84x84", tmp_path / "run", inference_batch_size=64))
    buffers = learner.inference._buffers
    assert sorted(buffers) == [1, 2, 4, 8, 16, 32, 64]
    for size, buffer in buffers.items():
        assert read_in_place(buffer), size


def test_the_trainers_batch_is_read_in_place():
    """stack_unrolls' arrays: the observations of 32 Pong unrolls are 5.2 MB."""
    frame = TensorSpec("uint8", (1, 84, 84))
    store = UnrollStore(unroll_length=20, observation_spec=frame, initial_slots=32, frame_stack=4)
    slots = store.allocate(owner=1, count=32)
    owners = np.ones(32, np.int64)
    rng = np.random.default_rng(0)
    unrolls = []
    for _ in range(21):
        step = EnvStep(
            observations=rng.integers(0, 256, (32, 1, 84, 84), np.uint8),
            rewards=np.zeros(32, np.float32),
            terminated=np.zeros(32, bool),
            truncated=np.zeros(32, bool),
        )
        emitted, _, _ = observe_and_append(
            store, slots, owners, step, np.zeros(32, np.int32), np.zeros(32, np.float32), 0
        )
        unrolls.extend(emitted)
    assert len(unrolls) == 32
    trajectories, versions = stack_unrolls(unrolls)
    assert trajectories.observations.shape == (24, 32, 1, 84, 84)
    assert versions.shape == (21, 32) and not versions.any()
    for name in ("observations", "actions", "behaviour_log_probs", "rewards", "terminated"):
        assert read_in_place(getattr(trajectories, name)), name
    np.testing.assert_array_equal(trajectories.observations[:, 5], unrolls[5].observations)
