"""Recurrent agents: the LSTM core, its per-env state on the learner, the memory task."""

from __future__ import annotations

import json
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from envs import memory
from learner.agents.networks import FORGET_BIAS, _forget_bias, init_params, make_network
from learner.inference import policy as policy_fns
from learner.presets import preset_for
from learner.training.trainer import stack_unrolls
from tests.fleet import (
    ROOT,
    LearnerThread,
    learner_config,
    spawn_actor,
    train_to_the_end,
    wait_until,
)
from tests.test_agent import traced_rows

# -- the memory env ---------------------------------------------------------------------


def test_the_memory_env_asks_for_the_cue_after_the_delay():
    env = memory.make("cue-3", 64, seed=0)
    step = env.reset()
    cues = step.observations[:, :2].argmax(axis=1)
    assert (step.observations[:, :2].sum(axis=1) == 1).all()  # one cue shown at step 0
    for _ in range(2):  # N-1 blank steps: no cue, no query, nothing earned or ended
        step = env.step(np.zeros(64, np.int64))
        assert not step.observations[:, :3].any()
        assert not step.rewards.any() and not step.terminated.any()
    step = env.step(np.zeros(64, np.int64))
    assert step.observations[:, memory.QUERY].all()  # the query, N steps on: no cue
    assert not step.observations[:, :2].any()
    guesses = np.arange(64) % 2
    step = env.step(guesses)
    np.testing.assert_array_equal(step.rewards, (guesses == cues).astype(np.float32))
    assert step.terminated.all() and not step.truncated.any()
    step = env.step(np.zeros(64, np.int64))  # next-step autoreset: a new cue
    assert (step.observations[:, :2].sum(axis=1) == 1).all() and not step.rewards.any()
    with pytest.raises(ValueError, match="cue-N"):
        memory.make("cue-0", 1)


# -- the core -----------------------------------------------------------------------------


def test_the_lstm_starts_with_its_forget_gate_open_so_a_cue_lasts():
    """init_params sets every forget gate's bias to FORGET_BIAS (the other gates' and the
    feed-forward network's stay 0), and a cue then lasts longer in the cell's state."""
    network = make_network("mlp", memory.NUM_CUES, (64,), lstm_size=64)
    example = jnp.zeros((1, memory.OBSERVATION_SIZE), jnp.float32)
    params = init_params(network, jax.random.key(0), example)
    gates = params["params"]["Scan_ResettingLSTM_0"]["OptimizedLSTMCell_0"]
    np.testing.assert_array_equal(gates["hf"]["bias"], np.full(64, FORGET_BIAS, np.float32))
    for gate in ("hi", "hg", "ho"):
        assert not np.asarray(gates[gate]["bias"]).any(), gate
    feed_forward = make_network("mlp", memory.NUM_CUES, (64,))
    biases = jax.tree_util.tree_leaves_with_path(
        init_params(feed_forward, jax.random.key(0), example)
    )
    assert all(
        not np.asarray(leaf).any() for path, leaf in biases if "bias" in jax.tree_util.keystr(path)
    )

    def cue_left(params) -> float:
        """How much of the cue's effect on the cell is left 8 blank steps later."""
        env = memory.make("cue-8", 2, seed=0)
        step = env.reset()
        observations = [step.observations]
        for _ in range(8):
            observations.append(env.step(np.zeros(2, np.int64)).observations)
        observations = jnp.asarray(np.stack(observations))  # [9 steps, 2 envs, 4]
        first = jnp.zeros((9, 2), jnp.bool_).at[0].set(True)
        # The same blank steps after cue 0 and after cue 1: the cells' difference is the cue.
        shown = observations.at[0, :, : memory.NUM_CUES].set(jnp.eye(2))
        _, state = network.apply(params, shown, first, network.initial_state(2))
        return float(jnp.abs(state[0, 0] - state[1, 0]).mean())

    closed = _forget_bias(params, -FORGET_BIAS)  # flax's own initialisation: bias 0
    assert cue_left(params) > 3 * cue_left(closed)


# -- the core on the device ---------------------------------------------------------------


@pytest.mark.parametrize("max_temp_bytes", [None, 1], ids=["whole", "row by row"])
def test_each_slot_keeps_its_own_core_state_across_batches(max_temp_bytes):
    """Rows of interleaved batches in any order read and write their own slot's state:
    the actions' log-probabilities equal those of the network run on each env's sequence
    alone, and padding rows change nothing; also with the network run a row at a time
    (a temporaries budget of one byte)."""
    network = make_network("mlp", 2, (8,), lstm_size=8)
    rng = np.random.default_rng(0)
    steps, envs, capacity = 6, 5, 8
    observations = rng.normal(size=(steps, envs, 4)).astype(np.float32)
    first = rng.random((steps, envs)) < 0.3
    first[0] = True
    params = network.init(
        jax.random.key(0), observations[:1], first[:1], network.initial_state(envs)
    )
    rows_traced: list[int] = []
    apply = traced_rows(network.apply, rows_traced, axis=1)  # observations are [T=1, N, ...]
    policy = policy_fns.make_recurrent_policy_fn(apply, max_temp_bytes)
    states = np.zeros((capacity, 2, 8), np.float32)
    starts = np.zeros_like(states)
    slots = np.array([6, 1, 3, 0, 4], np.int32)  # env e lives in slot slots[e]
    key = jax.random.key(1)
    got = np.zeros((steps, envs))
    actions = np.zeros((steps, envs), np.int32)
    no_slot = np.iinfo(np.int32).max
    for t in range(steps):
        order = rng.permutation(envs)
        rows = np.concatenate([order, [-1, -1, -1]])  # 3 padding rows
        batch_obs = np.where(rows[:, None] >= 0, observations[t][rows], 0.0).astype(np.float32)
        batch_first = np.where(rows >= 0, first[t][rows], True)
        batch_slots = np.where(rows >= 0, slots[rows], no_slot).astype(np.int32)
        result = policy(
            params, batch_obs, batch_first, batch_slots, np.zeros(8, np.bool_), states, starts, key
        )
        states, starts, key = result.states, result.starts, result.key
        got[t, order] = np.asarray(result.step.log_probs)[:envs]
        actions[t, order] = np.asarray(result.step.actions)[:envs]
    # The same envs, all at once, unrolled from zeros: the same log-probabilities.
    output, _ = network.apply(params, observations, first, network.initial_state(envs))
    log_policy = jax.nn.log_softmax(output.logits)
    expected = np.take_along_axis(np.asarray(log_policy), actions[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    unused = [slot for slot in range(capacity) if slot not in slots]
    assert not np.asarray(states)[unused].any()  # padding rows wrote nowhere
    assert set(rows_traced) == ({8} if max_temp_bytes is None else {1})


def test_unrolls_carry_the_state_inference_started_them_from(tmp_path):
    """Through the real path (gRPC, actor processes, a reconnecting actor): with the
    parameters fixed, the learner's replay of every unroll from its stored core state
    gives exactly the log-probabilities the actors' actions were sampled with."""
    config = learner_config(
        # Episodes of 7 observations and unrolls of 6: most unrolls start mid-episode.
        "memory:cue-5",
        tmp_path / "run",
        unroll_length=5,
        total_env_steps=10**9,
    )
    learner = LearnerThread(config, train=False)
    actors = []
    unrolls = []
    try:
        learner.start()
        address = learner.address
        # 3 x 24 envs: more than the store's first 64 slots, so the state arrays grow.
        actors = [spawn_actor(address, "memory:cue-5", 24, f"m{i}", tmp_path) for i in range(3)]

        def collect(count: int) -> bool:
            while not learner.learner.unrolls.empty():
                unrolls.append(learner.learner.unrolls.get())
            return len(unrolls) >= count

        wait_until(
            lambda: collect(100) and len({unroll.owner for unroll in unrolls}) == 3,
            120,
            "100 unrolls from the 3 actors",
        )
        before = len(unrolls)
        # A new run of one actor: its slots start over, with fresh state.
        actors[0].kill()
        actors.append(spawn_actor(address, "memory:cue-5", 24, "m0", tmp_path))

        def from_the_new_run() -> int:
            first_owners = {unroll.owner for unroll in unrolls[:before]}
            return sum(unroll.owner not in first_owners for unroll in unrolls)

        wait_until(lambda: collect(0) and from_the_new_run() >= 20, 120, "the new run's unrolls")
    finally:
        for actor in actors:
            actor.kill()
        learner.stop()
    assert len({unroll.owner for unroll in unrolls}) == 4  # four runs
    assert learner.learner.store.capacity > 64
    params, _ = learner.learner.parameters.latest()
    network = make_network("mlp", 2, config.mlp_hidden_sizes, config.lstm_size)
    batch, _ = stack_unrolls(unrolls)
    output, _ = network.apply(params, batch.observations, batch.first, batch.core_state[0])
    log_policy = np.asarray(jax.nn.log_softmax(output.logits))
    replayed = np.take_along_axis(log_policy, np.asarray(batch.actions)[..., None], -1)[..., 0]
    np.testing.assert_allclose(replayed, batch.behaviour_log_probs, atol=2e-5)
    # The check can fail: without the stored states the replay differs.
    output, _ = network.apply(
        params, batch.observations, batch.first, np.zeros_like(batch.core_state[0])
    )
    zeroed = np.take_along_axis(
        np.asarray(jax.nn.log_softmax(output.logits)), np.asarray(batch.actions)[..., None], -1
    )[..., 0]
    assert np.abs(zeroed - batch.behaviour_log_probs).max() > 1e-3


# -- learning ----------------------------------------------------------------------------


def train_on_memory(tmp_path, *flags: str) -> dict:
    """A memory:cue-8 run through the real path; seedrl-eval's result on its checkpoint."""
    train_to_the_end(
        "memory:cue-8", tmp_path / "run", tmp_path, "--total-env-steps", "120000", *flags
    )
    result = subprocess.run(
        [
            str(ROOT / ".venv/bin/seedrl-eval"),
            "--run-dir",
            str(tmp_path / "run"),
            "--episodes",
            "200",
            "--sample",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_lstm_agent_solves_the_memory_task_and_the_feed_forward_one_cannot(tmp_path):
    assert preset_for("memory:cue-8").lstm_size > 0  # the preset is recurrent
    recurrent = train_on_memory(tmp_path / "lstm")
    feed_forward = train_on_memory(tmp_path / "ff", "--lstm-size", "0")
    print(
        f"\nmemory:cue-8, 120k env steps each: LSTM success {recurrent['mean']:.3f}, "
        f"feed-forward {feed_forward['mean']:.3f} (200 sampled episodes each)"
    )
    assert recurrent["mean"] >= 0.9
    assert feed_forward["mean"] <= 0.6
