"""The two kinds of agent, behind one interface: feed-forward (each observation alone, frame
stacks included) and recurrent (an LSTM core carried from step to step).

What differs between them is here and nowhere else: how the network runs over a step of
many envs and over a time-major batch, which steps the update's KL re-runs, and the core
state an env carries. The update (agents/vtrace/learning.py), inference, the evaluation
player and the learner call these methods and do not ask which kind they hold.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from learner.agents.networks import (
    ActorCritic,
    PolicyOutput,
    RecurrentActorCritic,
    core_state_shape,
)

Params = Any


def stack_frames(frames: jax.Array, frame_index: jax.Array) -> jax.Array:
    """frames [T+S, B, C, ...] and frame_index [T+1, B, S] -> [T+1, B, S*C, ...] (jittable)."""
    padded = jnp.concatenate([jnp.zeros_like(frames[:1]), frames])  # index -1 -> zeros
    batch = jnp.arange(frames.shape[1])[None, :, None]
    stacked = padded[frame_index + 1, batch]  # [T+1, B, S, C, ...]
    return stacked.reshape(*stacked.shape[:2], -1, *stacked.shape[4:])


def observations_of(batch: Any) -> jax.Array:
    """What the model sees at each step of a time-major batch (Trajectories): its
    observations, or the stacks its frames and frame_index make."""
    if batch.frame_index is None:
        return batch.observations
    return stack_frames(batch.observations, batch.frame_index)


class FeedForwardAgent:
    """An agent whose policy sees each observation alone: no state between steps."""

    recurrent = False

    def __init__(self, network: ActorCritic):
        self.network = network

    @property
    def core_state_shape(self) -> tuple[int, ...] | None:
        """One env's core state; None: the agent carries none."""
        return None

    def initial_state(self, num_envs: int) -> None:
        return None

    def step(
        self, params: Params, observations: jax.Array, first: jax.Array, state: None
    ) -> tuple[jax.Array, None]:
        """One step of N envs: (logits [N, A], the state after it). `first` [N] says which
        observations start an episode; a feed-forward agent needs neither it nor a state."""
        return self.network.apply(params, observations).logits, None

    def unroll(self, params: Params, batch: Any) -> PolicyOutput:
        """The network on every step of a time-major batch (Trajectories [T+1, B]): logits
        [T+1, B, A] and values [T+1, B]."""
        observations = observations_of(batch)
        steps, size = observations.shape[:2]
        output = self.network.apply(
            params, observations.reshape(steps * size, *observations.shape[2:])
        )
        return PolicyOutput(
            logits=output.logits.reshape(steps, size, -1),
            values=output.values.reshape(steps, size),
        )

    def kl_logits(
        self, params: Params, batch: Any, logits_before: jax.Array, columns: int, stride: int
    ) -> tuple[jax.Array, jax.Array]:
        """The policy after an update (`params`) and before it (`logits_before` [T+1, B, A])
        on a sample of the batch's steps: every `stride`-th step of its first `columns`
        unrolls, each step on its own. Both [N, A]."""
        steps = slice(None, None, stride)
        observations = batch.observations[:, :columns]
        if batch.frame_index is not None:
            observations = stack_frames(observations, batch.frame_index[steps, :columns])
        else:
            observations = observations[steps]
        after = self.network.apply(params, observations.reshape(-1, *observations.shape[2:]))
        return after.logits, logits_before[steps, :columns].reshape(after.logits.shape)

    def example_fields(self, steps: int, batch: int) -> dict[str, Any]:
        """The batch fields only this kind has, as zeros of their shapes (none)."""
        return {}


class RecurrentAgent:
    """An agent with an LSTM core between torso and heads: each env carries its core state
    from step to step, zeroed where an episode starts."""

    recurrent = True

    def __init__(self, network: RecurrentActorCritic):
        self.network = network

    @property
    def core_state_shape(self) -> tuple[int, ...]:
        return core_state_shape(self.network.core_size)

    def initial_state(self, num_envs: int) -> jax.Array:
        return self.network.initial_state(num_envs)

    def step(
        self, params: Params, observations: jax.Array, first: jax.Array, state: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        output, state = self.network.apply(params, observations[None], first[None], state)
        return output.logits[0], state

    def unroll(self, params: Params, batch: Any) -> PolicyOutput:
        # The core unrolled from the state inference had before step 0, reset where
        # episodes start, as it ran when acting.
        output, _ = self.network.apply(
            params, observations_of(batch), batch.first, batch.core_state[0]
        )
        return output

    def kl_logits(
        self, params: Params, batch: Any, logits_before: jax.Array, columns: int, stride: int
    ) -> tuple[jax.Array, jax.Array]:
        """As FeedForwardAgent's, but on every step of the first `columns` unrolls: the
        core needs them all."""
        subset = jax.tree.map(lambda x: x[:, :columns], batch)
        after = self.unroll(params, subset).logits
        return after, logits_before[:, :columns]

    def example_fields(self, steps: int, batch: int) -> dict[str, Any]:
        """`first` [T+1, B] and `core_state` [1, B, 2, size], as zeros (first: ones)."""
        return {
            "first": np.ones((steps, batch), np.bool_),
            "core_state": np.zeros((1, batch, *self.core_state_shape), np.float32),
        }


Agent = FeedForwardAgent | RecurrentAgent


def make_agent(network: ActorCritic | RecurrentActorCritic) -> Agent:
    """The agent of a network (networks.make_network): recurrent when it has a core."""
    if isinstance(network, RecurrentActorCritic):
        return RecurrentAgent(network)
    return FeedForwardAgent(network)
