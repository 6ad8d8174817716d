"""One V-trace update on N devices against the same update on one (run as a subprocess).

`python -m tests.multidevice_check N NETWORK` (nature_cnn, mlp or lstm) needs N devices (on CPU:
XLA_FLAGS=--xla_force_host_platform_device_count=N, set by the test). It
builds the learner's real update for the atari or classic preset, applies it
to one random batch on device 0 alone and on a mesh of N devices (the batch
split, the state replicated), and prints JSON: the relative differences of
the gradient, of the parameter change and of the loss, where the sharded
arrays lived, and the collectives the compiled N-device update holds.
"""

from __future__ import annotations

import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

from learner.agents.agent import make_agent
from learner.agents.networks import init_params, make_network
from learner.agents.vtrace import learning
from learner.backends.devices import Placement
from learner.presets import PRESETS
from learner.training.settings import learning_rate_schedule, loss_settings, optimizer_for

LSTM_SIZE = 16


def random_batch(network: str, steps: int, batch: int, rng: np.random.Generator):
    shape = (steps + 1, batch)
    extra = {}
    if network == "nature_cnn":
        stack = 4
        frames = rng.integers(0, 256, (steps + stack, batch, 1, 84, 84), dtype=np.uint8)
        first = rng.random((steps + stack, batch)) < 0.05
        from learner.data.frame_stack import frame_indices

        extra["frame_index"] = frame_indices(first, stack)
        num_actions, example = 6, np.zeros((1, 4, 84, 84), np.uint8)
    else:
        frames = rng.normal(size=(*shape, 4)).astype(np.float32)
        num_actions, example = 2, np.zeros((1, 4), np.float32)
    if network == "lstm":
        extra["first"] = rng.random(shape) < 0.1
        extra["core_state"] = rng.normal(size=(1, batch, 2, LSTM_SIZE)).astype(np.float32)
    trajectories = learning.Trajectories(
        observations=frames,
        actions=rng.integers(0, num_actions, shape).astype(np.int32),
        behaviour_log_probs=np.log(rng.uniform(0.2, 0.9, shape)).astype(np.float32),
        rewards=rng.normal(size=shape).astype(np.float32),
        terminated=rng.random(shape) < 0.05,
        truncated=rng.random(shape) < 0.02,
        **extra,
    )
    return trajectories, num_actions, example


def collectives(update, state, batch) -> dict[str, int]:
    """How many of each cross-device operation the compiled update holds."""
    text = update.lower(state, batch).compile().as_text()
    names = ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter")
    return {name: len(re.findall(rf"\b{name}(?:-start)?\(", text)) for name in names}


def relative(a, b) -> float:
    """||a - b|| / ||b|| over every leaf of two trees."""
    diff = sum(
        float(jnp.sum(jnp.square(x - y)))
        for x, y in zip(*map(jax.tree.leaves, (a, b)), strict=True)
    )
    norm = sum(float(jnp.sum(jnp.square(y))) for y in jax.tree.leaves(b))
    return (diff / max(norm, 1e-30)) ** 0.5


def fused_batch(network, config, optimizer, params, trajectories, count: int) -> dict:
    """Two passes over two minibatches of the batch in one call on `count` devices, against
    the same four steps one by one on one device, each on the unrolls minibatch_columns names."""
    passes, minibatches = 2, 2
    settings = loss_settings(config)
    state = learning.TrainState(params, optimizer.init(params), jnp.int32(0))
    many = Placement(jax.devices()[:count])
    fused = learning.make_batch_update_fn(
        make_agent(network), optimizer, settings, many, passes, minibatches
    )
    fused_state, fused_metrics = fused(many.put_state(state), many.put_batch(trajectories))
    step = learning.make_update_fn(make_agent(network), optimizer, settings)
    stepped, losses = jax.device_put(state, jax.devices()[0]), []
    batch = trajectories.actions.shape[1]
    for _ in range(passes):
        for columns in learning.minibatch_columns(batch, minibatches, count):
            stepped, metrics = step(
                stepped, jax.tree.map(lambda x, c=columns: x[:, c], trajectories)
            )
            losses.append(float(metrics["loss"]))
    fused_losses = np.asarray(fused_metrics["loss"])
    # The loss sums terms of either sign that can cancel to near zero, while float error
    # scales with the terms: each step's difference is measured against their magnitudes.
    policy, baseline, entropy = (
        np.asarray(fused_metrics[name]) for name in ("policy_loss", "baseline_loss", "entropy_loss")
    )
    scales = np.abs(policy) + settings.baseline_cost * baseline + np.abs(entropy)
    return {
        "fused_relative": relative(
            jax.tree.map(
                lambda new, old: np.asarray(new) - np.asarray(old), fused_state.params, params
            ),
            jax.tree.map(
                lambda new, old: np.asarray(new) - np.asarray(old), stepped.params, params
            ),
        ),
        "fused_loss_relative": float(np.max(np.abs(fused_losses - losses) / scales)),
        "fused_updates": [int(fused_state.updates), int(stepped.updates)],
    }


def main(count: int, network_name: str) -> dict:
    preset = "atari" if network_name == "nature_cnn" else "classic"
    config = PRESETS[preset]
    steps, batch = (5, 8) if network_name == "nature_cnn" else (10, 16)
    trajectories, num_actions, example = random_batch(
        network_name, steps, batch, np.random.default_rng(0)
    )
    lstm_size = LSTM_SIZE if network_name == "lstm" else 0
    torso = "mlp" if network_name == "lstm" else network_name
    network = make_network(torso, num_actions, config.mlp_hidden_sizes, lstm_size)
    params = init_params(network, jax.random.key(0), example)
    optimizers = {
        # The preset's optimizer (Adam: its first step is nearly the gradient's sign) ...
        "update": optimizer_for(config, learning_rate_schedule(config, batch)),
        # ... and plain SGD, whose step is the (all-reduced) gradient itself.
        "gradient": optax.sgd(1.0),
    }
    settings = loss_settings(config)

    results = {}
    for name, devices in (("one", jax.devices()[:1]), ("many", jax.devices()[:count])):
        placement = Placement(devices)
        results[name] = {}
        for kind, optimizer in optimizers.items():
            state = learning.TrainState(params, optimizer.init(params), jnp.int32(0))
            update = learning.make_update_fn(make_agent(network), optimizer, settings, placement)
            placed_batch = placement.put_batch(trajectories)
            placed_state = placement.put_state(state)
            if name == "many" and kind == "update":
                results["collectives"] = collectives(update, placed_state, placed_batch)
            new_state, metrics = update(placed_state, placed_batch)
            results[name][kind] = jax.tree.map(
                lambda new, old: np.asarray(new) - np.asarray(old),
                jax.device_get(new_state.params),
                jax.device_get(params),
            )
        results[name].update(
            loss=float(metrics["loss"]),
            grad_norm=float(metrics["grad_norm"]),
            # Where each device's share of the batch went, and where the state lives.
            batch_shards=sorted(
                {
                    (str(shard.device), shard.data.shape[1])
                    for leaf in jax.tree.leaves(jax.device_put(placed_batch))
                    for shard in leaf.addressable_shards
                }
            ),
            state_devices=len(jax.tree.leaves(new_state.params)[0].devices()),
            updates=int(new_state.updates),
        )
    # The fused comparison's four steps run on SGD with momentum and a decaying rate: state
    # and step count carried from step to step, as Adam's are, but each step linear in its
    # gradient. Adam divides every component's step by that component's own gradient
    # scale, so over several steps it grows the summation-order differences between 4
    # devices' partial sums and one device's wherever a gradient nearly cancels: on one
    # 2-core machine 7e-4 of the Nature CNN's parameter change with Adam, 2e-6 with this.
    carried = optax.chain(
        optax.clip_by_global_norm(config.max_grad_norm),
        optax.sgd(optax.linear_schedule(0.05, 0.0, 8), momentum=0.9),
    )
    results.update(fused_batch(network, config, carried, params, trajectories, count))
    one, many = results["one"], results["many"]
    return {
        "fused_relative": results["fused_relative"],
        "fused_loss_relative": results["fused_loss_relative"],
        "fused_updates": results["fused_updates"],
        "collectives": results["collectives"],
        "batch_shards_one": one["batch_shards"],
        "batch_shards_many": many["batch_shards"],
        "state_devices": [one["state_devices"], many["state_devices"]],
        "grad_norm_relative": abs(many["grad_norm"] - one["grad_norm"]) / one["grad_norm"],
        "update_relative": relative(many["update"], one["update"]),
        "gradient_relative": relative(many["gradient"], one["gradient"]),
        "loss_relative": abs(many["loss"] - one["loss"]) / abs(one["loss"]),
        "updates": [one["updates"], many["updates"]],
    }


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), sys.argv[2])))
