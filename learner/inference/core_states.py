"""What inference keeps for each env between its steps, by kind of agent: nothing for a
feed-forward agent; for a recurrent one every env slot's core state, on the device.

The inference loop holds one of the two and calls the same methods on either: the flags
the unroll store fills for a batch, the policy's call on a padded batch, and the start
state each finished unroll carries to training.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from learner.backends.cpu.host_arrays import aligned_zeros

NO_SLOT = np.iinfo(np.int32).max
"""The slot index of rows that have no slot (padding, a stream that ended): past any
capacity, so the policy reads zeros for them and writes nothing."""


class NoCoreStates:
    """A feed-forward agent's: the policy sees the observations alone
    (policy.make_policy_fn's)."""

    def __init__(self, policy_fn: Callable):
        self.policy_fn = policy_fn

    def flags(self, size: int, num_envs: int, capacity: int) -> tuple[None, None]:
        """The arrays the unroll store fills with each row's first and at-start flags for a
        batch of `num_envs` rows padded to `size`: none needed."""
        return None, None

    def bind(self, num_envs: int, slots: np.ndarray, live: np.ndarray) -> None:
        """The rows' slots, `live` where the slot is still its stream's."""

    def run(self, params: Any, observations: np.ndarray, key: jax.Array) -> tuple:
        """(PolicyStep, next key, each row's finished unroll start state or None)."""
        step, key = self.policy_fn(params, observations, key)
        return step, key, None

    def attach(self, unrolls: list, slots: np.ndarray, finished_starts: Any) -> list:
        """The unrolls with what training needs of their start: nothing."""
        return unrolls


class SlotCoreStates:
    """A recurrent agent's: every env slot's core state, and the state it started its
    current unroll from, live on the device next to the parameters
    (policy.make_recurrent_policy_fn's, which reads and writes them by slot)."""

    def __init__(
        self, policy_fn: Callable, core_state_shape: tuple[int, ...], sizes: list[int], device
    ):
        self.policy_fn = policy_fn
        self._shape = core_state_shape
        self._device = device or jax.devices()[0]
        # Per padded size: each row's first flag, at-start flag and slot (NO_SLOT: none).
        self._flags = {
            size: (
                aligned_zeros(size, np.bool_),
                aligned_zeros(size, np.bool_),
                aligned_zeros(size, np.int32),
            )
            for size in sizes
        }
        for _, _, slots in self._flags.values():
            slots[:] = NO_SLOT
        self._size = sizes[0]
        self._states = self._starts = None

    def grow(self, capacity: int) -> None:
        """Room for `capacity` slots' core states (new ones zero), made and kept on the
        device; the policy compiles once more for the new size."""
        if self._states is not None and self._states.shape[0] >= capacity:
            return

        def grown(old: jax.Array | None) -> jax.Array:
            new = jnp.zeros((capacity, *self._shape), jnp.float32, device=self._device)
            return new if old is None else new.at[: old.shape[0]].set(old)

        self._states, self._starts = grown(self._states), grown(self._starts)

    def flags(self, size: int, num_envs: int, capacity: int) -> tuple[np.ndarray, np.ndarray]:
        self.grow(capacity)
        self._size = size
        first, at_start, slots = self._flags[size]
        first[num_envs:] = at_start[num_envs:] = False
        slots[num_envs:] = NO_SLOT
        return first[:num_envs], at_start[:num_envs]

    def bind(self, num_envs: int, slots: np.ndarray, live: np.ndarray) -> None:
        # A stream gone: its rows neither read nor write any slot's state.
        self._flags[self._size][2][:num_envs] = np.where(live, slots, NO_SLOT)

    def run(self, params: Any, observations: np.ndarray, key: jax.Array) -> tuple:
        first, at_start, slots = self._flags[len(observations)]
        result = self.policy_fn(
            params, observations, first, slots, at_start, self._states, self._starts, key
        )
        self._states, self._starts = result.states, result.starts
        return result.step, result.key, result.finished_starts

    def attach(self, unrolls: list, slots: np.ndarray, finished_starts: Any) -> list:
        """Each unroll with the core state it started from (a slice on the device)."""
        row_of = {slot: row for row, slot in enumerate(slots.tolist())}
        return [
            unroll._replace(core_state=finished_starts[row_of[unroll.slot]]) for unroll in unrolls
        ]


def core_states_for(
    policy_fn: Callable,
    core_state_shape: tuple[int, ...] | None,
    sizes: list[int],
    device: Any = None,
) -> NoCoreStates | SlotCoreStates:
    """The keeper for an agent whose env carries `core_state_shape` (None: nothing)."""
    if core_state_shape is None:
        return NoCoreStates(policy_fn)
    return SlotCoreStates(policy_fn, core_state_shape, sizes, device)
