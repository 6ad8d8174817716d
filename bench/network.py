"""Case (e): the network's compute on CPU, JAX against a PyTorch yardstick.

Two workloads, each timed in JAX and in PyTorch in the same process:

- the policy: Nature CNN apply plus sampling an action and its log-probability
  (`policy_fns.make_policy_fn`), on uint8 Atari observations [N, 4, 84, 84];
- the V-trace train step (`learning.make_update_fn`): T=20 (21 steps) x B=32
  unrolls, 6 actions, the atari preset's optimizer after gradient clipping.

The PyTorch versions are the same computation written in torch: same layer
sizes, uint8 NCHW input scaled by 1/255, same loss and optimizer. torch is
optional and imported only here; it is never a dependency of the project.

Fairness: each program is compiled and warmed up first; then rounds alternate
JAX and torch (the order flips every round), so load from other processes on
a shared machine falls on both alike, and the median per call is reported.
Compare ratios from one run only.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from bench.common import CaseResult, Column, Settings, cores
from learner.agents.agent import make_agent
from learner.agents.networks import make_network
from learner.agents.vtrace import learning
from learner.data.rewards import training_rewards
from learner.inference import policy as policy_fns
from learner.presets import PRESETS
from learner.training.settings import loss_settings, optimizer_for

NUM_ACTIONS = 6
OBSERVATION_SHAPE = (4, 84, 84)
FORWARD_BATCHES = (1, 4, 16, 64, 256)
SHORT_FORWARD_BATCHES = (1, 16)
TRAIN_SHAPE = (20, 32)
"""(T, B): transitions per unroll, unrolls per update."""
SHORT_TRAIN_SHAPE = (5, 4)
TORCH_INSTALL = "python3 -m pip --python .venv/bin/python install torch==2.13.0"

Timed = Callable[[], Any]
"""One call of a workload, returning only when its result is computed."""


# -- batches ------------------------------------------------------------------


def _observations(count: int, rng: np.random.Generator) -> np.ndarray:
    return rng.integers(0, 256, (count, *OBSERVATION_SHAPE), dtype=np.uint8)


def _trajectories(steps: int, batch: int, rng: np.random.Generator) -> learning.Trajectories:
    """A [T+1, B] batch with random frames, actions and rewards, and a few episode ends."""
    shape = (steps + 1, batch)
    return learning.Trajectories(
        observations=rng.integers(0, 256, (*shape, *OBSERVATION_SHAPE), dtype=np.uint8),
        actions=rng.integers(0, NUM_ACTIONS, shape).astype(np.int32),
        behaviour_log_probs=np.full(shape, -np.log(NUM_ACTIONS), np.float32),
        rewards=rng.normal(size=shape).astype(np.float32),
        terminated=rng.random(shape) < 0.01,
        truncated=rng.random(shape) < 0.005,
    )


# -- JAX ----------------------------------------------------------------------


class _Jax:
    def __init__(self, config) -> None:
        self.config = config
        self.network = make_network("nature_cnn", NUM_ACTIONS)
        self.params = self.network.init(
            jax.random.key(0), np.zeros((1, *OBSERVATION_SHAPE), np.uint8)
        )
        # As the learner builds it for a CPU: large batches run in chunks (learning.py).
        self.policy_fn = policy_fns.make_policy_fn(
            self.network.apply, policy_fns.policy_temp_budget(jax.devices()[0])
        )

    def forward(self, observations: np.ndarray) -> Timed:
        device_observations = jax.device_put(observations)
        key = [jax.random.key(1)]

        def call() -> None:
            step, key[0] = self.policy_fn(self.params, device_observations, key[0])
            jax.block_until_ready(step)

        return call

    def update(self, trajectories: learning.Trajectories) -> tuple[Callable, Any, Any]:
        """(the jitted V-trace update, its first train state, `trajectories` on the device)."""
        config = self.config
        # The learner's schedule decays linearly; a schedule costs nothing measurable.
        schedule = optax.linear_schedule(config.learning_rate, 0.0, 1_000_000)
        optimizer = optimizer_for(config, schedule)
        update_fn = learning.make_update_fn(
            make_agent(self.network), optimizer, loss_settings(config)
        )
        state = learning.TrainState(self.params, optimizer.init(self.params), jnp.int32(0))
        return update_fn, state, jax.device_put(trajectories)

    def train_step(self, trajectories: learning.Trajectories) -> Timed:
        update_fn, first_state, batch = self.update(trajectories)
        state = [first_state]

        def call() -> None:
            state[0], metrics = update_fn(state[0], batch)
            jax.block_until_ready((state[0], metrics))

        return call


# -- PyTorch --------------------------------------------------------------------


class _Torch:
    """The same network, policy, V-trace loss and optimizer, written in torch."""

    def __init__(self, config, threads: int) -> None:
        import torch
        from torch import nn

        self.torch = torch
        self.config = config
        torch.manual_seed(0)
        torch.set_num_threads(threads)

        class NatureCNN(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.conv0 = nn.Conv2d(4, 32, 8, stride=4)
                self.conv1 = nn.Conv2d(32, 64, 4, stride=2)
                self.conv2 = nn.Conv2d(64, 64, 3, stride=1)
                self.dense = nn.Linear(64 * 7 * 7, 512)
                self.policy = nn.Linear(512, NUM_ACTIONS)
                self.value = nn.Linear(512, 1)

            def forward(self, observations):
                x = observations.float() / 255.0
                x = torch.relu(self.conv0(x))
                x = torch.relu(self.conv1(x))
                x = torch.relu(self.conv2(x))
                x = torch.relu(self.dense(x.flatten(1)))
                return self.policy(x), self.value(x)[:, 0]

        self.network = NatureCNN()

    def forward(self, observations: np.ndarray) -> Timed:
        torch = self.torch
        inputs = torch.from_numpy(observations.copy())
        network = self.network

        def call() -> None:
            with torch.inference_mode():
                logits, _ = network(inputs)
                actions = torch.multinomial(torch.softmax(logits, -1), 1)
                torch.log_softmax(logits, -1).gather(-1, actions)

        return call

    def _vtrace(self, log_rhos, discounts, rewards, values, bootstrap_value):
        torch, config = self.torch, self.config
        rhos = torch.exp(log_rhos)
        clipped_rhos = rhos
        if config.clip_rho_threshold is not None:
            clipped_rhos = torch.clamp(rhos, max=config.clip_rho_threshold)
        cs = config.vtrace_lambda * torch.clamp(rhos, max=1.0)
        values_tp1 = torch.cat([values[1:], bootstrap_value[None]])
        deltas = clipped_rhos * (rewards + discounts * values_tp1 - values)
        acc = torch.zeros_like(bootstrap_value)
        backwards = []
        for t in range(log_rhos.shape[0] - 1, -1, -1):
            acc = deltas[t] + discounts[t] * cs[t] * acc
            backwards.append(acc)
        vs = torch.stack(backwards[::-1]) + values
        vs_tp1 = torch.cat([vs[1:], bootstrap_value[None]])
        pg_rhos = rhos
        if config.clip_pg_rho_threshold is not None:
            pg_rhos = torch.clamp(rhos, max=config.clip_pg_rho_threshold)
        return vs, pg_rhos * (rewards + discounts * vs_tp1 - values)

    def train_step(self, trajectories: learning.Trajectories) -> Timed:
        torch, config, network = self.torch, self.config, self.network
        if config.optimizer == "adam":
            optimizer = torch.optim.Adam(
                network.parameters(), lr=config.learning_rate, eps=config.optimizer_epsilon
            )
        else:
            optimizer = torch.optim.RMSprop(
                network.parameters(),
                lr=config.learning_rate,
                alpha=config.rmsprop_decay,
                eps=config.optimizer_epsilon,
                momentum=config.rmsprop_momentum,
            )
        batch = learning.Trajectories(
            *(None if x is None else torch.from_numpy(np.array(x)) for x in trajectories)
        )

        def call() -> None:
            steps, batch_size = batch.actions.shape
            logits, values = network(batch.observations.flatten(0, 1))
            logits = logits.reshape(steps, batch_size, -1)[:-1]
            values = values.reshape(steps, batch_size)
            log_policy = torch.log_softmax(logits, -1)
            target_log_probs = log_policy.gather(-1, batch.actions[:-1, :, None])[..., 0]
            episode_ends = (batch.terminated | batch.truncated)[:-1]
            mask = 1.0 - episode_ends.float()
            values_t, bootstrap_value = values[:-1], values[-1]
            rewards = training_rewards(
                batch.rewards[1:], config.reward_clipping, config.reward_scale
            )
            discounts = config.discount * (1.0 - batch.terminated[1:].float()) * mask
            rewards = torch.where(episode_ends, values_t.detach(), rewards)
            log_rhos = target_log_probs - batch.behaviour_log_probs[:-1]
            with torch.no_grad():
                vs, advantages = self._vtrace(
                    log_rhos, discounts, rewards, values_t, bootstrap_value
                )
            count = mask.numel()
            policy_loss = -(target_log_probs * advantages * mask).sum() / count
            baseline_loss = 0.5 * ((vs - values_t) ** 2 * mask).sum() / count
            entropy = -(log_policy.exp() * log_policy).sum(-1)
            loss = (
                policy_loss
                + config.baseline_cost * baseline_loss
                - config.entropy_cost * (entropy * mask).sum() / count
            )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(network.parameters(), config.max_grad_norm)
            optimizer.step()

        return call


def _load_torch(config, threads: int) -> tuple[_Torch | None, str]:
    try:
        import torch
    except ImportError:
        return (
            None,
            f"torch is not installed: JAX rows only (scripts/bench.sh installs it; or {TORCH_INSTALL})",
        )
    return _Torch(config, threads), f"torch {torch.__version__}"


# -- timing -------------------------------------------------------------------


def _interleaved(
    calls: dict[str, Timed], window_s: float, min_rounds: int, unit_s: float
) -> dict[str, tuple[float, float]]:
    """(median, min) seconds per call of each workload, timed in alternating rounds.

    Each workload is called twice unmeasured first (compilation, allocator,
    caches). A round times every workload once, `reps` calls in a row, with
    `reps` chosen so one timing lasts about `unit_s`; the order reverses every
    round. Rounds go on until `window_s` has passed and `min_rounds` are done.
    """
    reps = {}
    for name, call in calls.items():
        call()
        start = time.perf_counter()
        call()
        reps[name] = max(1, round(unit_s / max(time.perf_counter() - start, 1e-6)))
    times: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls)
    deadline = time.perf_counter() + window_s
    rounds = 0
    while rounds < min_rounds or time.perf_counter() < deadline:
        for name in order:
            call, count = calls[name], reps[name]
            start = time.perf_counter()
            for _ in range(count):
                call()
            times[name].append((time.perf_counter() - start) / count)
        order.reverse()
        rounds += 1
    return {name: (statistics.median(ts), min(ts)) for name, ts in times.items()}


def _row(
    framework: str, what: str, batch: str, samples: int, timing: tuple[float, float]
) -> dict[str, Any]:
    median_s, best_s = timing
    return {
        "framework": framework,
        "what": what,
        "batch": batch,
        "samples": samples,
        "ms_per_call": median_s * 1e3,
        "samples_per_s": samples / median_s,
        "us_per_sample": median_s / samples * 1e6,
        "best_us_per_sample": best_s / samples * 1e6,
        "vs_torch": None,
    }


def _measure(
    label: str,
    what: str,
    samples: int,
    jax_call: Timed,
    torch_call: Timed | None,
    window_s: float,
    min_rounds: int,
    unit_s: float,
) -> list[dict[str, Any]]:
    calls = {"jax": jax_call}
    if torch_call is not None:
        calls["torch"] = torch_call
    timings = _interleaved(calls, window_s, min_rounds, unit_s)
    rows = [_row(name, what, label, samples, timing) for name, timing in timings.items()]
    if torch_call is not None:
        rows[0]["vs_torch"] = rows[0]["samples_per_s"] / rows[1]["samples_per_s"]
    return rows


def run(settings: Settings) -> CaseResult:
    config = PRESETS["atari"]
    threads = cores()
    rng = np.random.default_rng(0)
    jax_side = _Jax(config)
    torch_side, torch_note = _load_torch(config, threads)
    if settings.short:
        batches, (steps, batch) = SHORT_FORWARD_BATCHES, SHORT_TRAIN_SHAPE
        window_s, min_rounds, unit_s = 0.0, 3, 0.02
    else:
        batches, (steps, batch) = FORWARD_BATCHES, TRAIN_SHAPE
        window_s, min_rounds, unit_s = settings.duration_s / 2, 5, 0.2

    rows: list[dict[str, Any]] = []
    for size in batches:
        observations = _observations(size, rng)
        rows += _measure(
            str(size),
            "forward",
            size,
            jax_side.forward(observations),
            torch_side.forward(observations) if torch_side else None,
            window_s,
            min_rounds,
            unit_s,
        )
    trajectories = _trajectories(steps, batch, rng)
    label = f"T={steps} x B={batch}" + (" (short mode)" if settings.short else "")
    rows += _measure(
        label,
        "train_step",
        steps * batch,
        jax_side.train_step(trajectories),
        torch_side.train_step(trajectories) if torch_side else None,
        window_s,
        min_rounds,
        unit_s,
    )

    flags = os.environ.get("XLA_FLAGS", "")
    notes = [
        f"jax {jax.__version__} on {jax.default_backend()}; {torch_note}; {threads} cores: "
        f"torch.set_num_threads({threads}), XLA's intra-op pool uses every core.",
        # Importing `learner` (below) set them before this program's first JAX use.
        f"XLA_FLAGS={flags!r}",
        "forward: Nature CNN apply + action sampling (policy_fns.make_policy_fn), uint8 "
        "[N, 4, 84, 84]; train step: learning.make_update_fn, V-trace loss, "
        f"{config.optimizer} after clipping to global norm {config.max_grad_norm}, "
        f"{NUM_ACTIONS} actions, samples = T x B transitions.",
        "Median of interleaved rounds after warm-up (best_us_per_sample: the fastest "
        "round). On a shared machine torch's OpenMP threads stall when a core is taken "
        "(small batches suffer most): compare ratios of one run only.",
    ]
    if settings.short:
        notes.append(f"short mode: forward batches {batches}, train step T={steps} x B={batch}.")
    return CaseResult(
        case="e",
        title="Network compute on CPU: Nature CNN policy and V-trace train step, JAX vs PyTorch",
        columns=[
            Column("framework", "framework", "{}"),
            Column("what", "what", "{}"),
            Column("batch", "batch", "{}"),
            Column("samples_per_s", "samples/s", "{:,.0f}"),
            Column("us_per_sample", "us/sample", "{:,.1f}"),
            Column("ms_per_call", "ms/call", "{:,.2f}"),
            Column("vs_torch", "jax/torch", "{:.2f}"),
        ],
        rows=rows,
        notes=notes,
    )


def plot(result: CaseResult, path: str) -> None:
    """Forward samples/s against batch size (log x), and the train step as bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (forward_axes, train_axes) = plt.subplots(
        1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [2, 1]}
    )
    frameworks = sorted({row["framework"] for row in result.rows})
    for framework in frameworks:
        points = sorted(
            (row["samples"], row["samples_per_s"])
            for row in result.rows
            if row["framework"] == framework and row["what"] == "forward"
        )
        if points:
            sizes, rates = zip(*points, strict=True)
            forward_axes.plot(sizes, rates, marker="o", label=framework)
    forward_axes.set_xscale("log", base=2)
    forward_axes.set_xlabel("batch size")
    forward_axes.set_ylabel("samples/s")
    forward_axes.set_title("policy forward")
    forward_axes.grid(True, alpha=0.3)
    forward_axes.legend()

    train_rows = [row for row in result.rows if row["what"] == "train_step"]
    train_axes.bar(
        [row["framework"] for row in train_rows],
        [row["samples_per_s"] for row in train_rows],
        color=[f"C{frameworks.index(row['framework'])}" for row in train_rows],
    )
    train_axes.set_ylabel("samples/s")
    train_axes.set_title("train step, " + (train_rows[0]["batch"] if train_rows else ""))
    figure.suptitle(result.title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
