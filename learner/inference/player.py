"""Plays parameters of a network on a vector env of its own, outside the fleet: seedrl-eval
plays a checkpoint with it, the learner's stop check its current parameters."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

MAX_ENVS = 8
"""Envs played in parallel unless told otherwise."""


def quotas(episodes: int, num_envs: int) -> list[int]:
    """Episodes each env plays: as even as possible, summing to `episodes`."""
    base, extra = divmod(episodes, num_envs)
    return [base + (1 if index < extra else 0) for index in range(num_envs)]


def _key(params: Any, seed: int) -> Any:
    """A PRNG key placed as the keys the policy returns will be: on the parameters' device
    when they are committed to one, so that every step runs one compiled program."""
    import jax

    key = jax.random.key(seed)
    leaf = jax.tree.leaves(params)[0]
    if isinstance(leaf, jax.Array) and leaf.committed:
        key = jax.device_put(key, leaf.sharding)
    return key


class Player:
    """Plays episodes of a network's policy on a vector env: its most likely actions, or
    actions sampled from it. seedrl-eval plays a checkpoint with it; the learner, its
    current parameters when --stop-eval-episodes asks it to."""

    def __init__(self, agent: Any, spec: Any, sample: bool, epsilon: float = 0.0):
        """`agent`: agents.agent.make_agent's, for the network that made the parameters."""
        import jax
        import jax.numpy as jnp

        self._agent = agent
        self._spec = spec
        epsilon = 0.0 if sample else epsilon
        self.policy = (
            "sample" if sample else f"epsilon-greedy ({epsilon:g})" if epsilon else "greedy"
        )
        """What `play` does: "greedy" (most likely actions), "epsilon-greedy (E)" (a uniform
        action with probability E, else the most likely) or "sample"."""

        @jax.jit
        def act(
            params: Any, observations: jax.Array, first: jax.Array, state: Any, key: jax.Array
        ) -> tuple[jax.Array, Any, jax.Array]:
            # A recurrent agent's core state is carried from step to step, zeroed where
            # episodes start.
            logits, state = agent.step(params, observations, first, state)
            key, sample_key = jax.random.split(key)
            if sample:
                return jax.random.categorical(sample_key, logits).astype(jnp.int32), state, key
            actions = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            if epsilon:
                explore_key, action_key = jax.random.split(sample_key)
                explore = jax.random.uniform(explore_key, actions.shape) < epsilon
                uniform = jax.random.randint(action_key, actions.shape, 0, logits.shape[-1])
                actions = jnp.where(explore, uniform.astype(jnp.int32), actions)
            return actions, state, key

        self._act = act

    def warm_up(self, params: Any, num_envs: int) -> None:
        """Compiles the policy for `num_envs` envs, so that the first play does not."""
        import jax
        import numpy as np

        model = self._spec.model_observation
        observations = np.zeros((num_envs, *model.shape), model.np_dtype)
        first = np.ones(num_envs, np.bool_)
        state = self._agent.initial_state(num_envs)
        jax.block_until_ready(self._act(params, observations, first, state, _key(params, 0)))

    def play(
        self,
        env: Any,
        params: Any,
        episodes: int,
        seed: int,
        video: Any = None,
        cancelled: Callable[[], bool] = lambda: False,
        observed: Callable[[Any], None] | None = None,
    ) -> tuple[list[float], list[int]]:
        """(returns, lengths) of `episodes` episodes, spread evenly over the env's copies
        (each plays its own quota, so short episodes are not over-counted), from a reset.
        With `video` (a writer with `add(frame)`), the first episode of env 0 is recorded. Stops early, with what it has,
        once `cancelled()` says so. `observed`, where given, gets each step's observations
        as the policy sees them (stacked)."""
        import numpy as np

        from learner.data.frame_stack import FrameStacker

        num_envs = env.num_envs
        quota = quotas(episodes, num_envs)
        played = [0] * num_envs
        running = np.zeros(num_envs, np.float64)
        steps = np.zeros(num_envs, np.int64)
        returns: list[float] = []
        lengths: list[int] = []
        key = _key(params, seed)
        stacker = FrameStacker(self._spec, num_envs)  # the learner's frame stacking, if any
        state = self._agent.initial_state(num_envs)
        step = env.reset()
        first = np.ones(num_envs, np.bool_)
        recording = video is not None
        if recording:
            video.add(env.render())
        while sum(played) < episodes and not cancelled():
            observations = stacker(step.observations, first)
            if observed is not None:
                observed(observations)
            actions, state, key = self._act(params, observations, first, state, key)
            step = env.step(np.asarray(actions))
            first = step.terminated | step.truncated  # the next observation starts anew
            running += step.rewards
            steps += 1
            if recording:
                video.add(env.render())
            ended = np.flatnonzero(step.terminated | step.truncated)
            for index in ended.tolist():
                if index == 0:
                    recording = False
                if played[index] < quota[index]:
                    returns.append(float(running[index]))
                    lengths.append(int(steps[index]))
                    played[index] += 1
            if ended.size:
                # Next-step autoreset: the envs that ended start over at the next
                # step, which ignores their action and brings reward 0.
                running[ended] = 0.0
                steps[ended] = -1
        return returns, lengths
