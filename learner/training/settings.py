"""What the configuration means for training: the devices, the global batch, the learning-rate and
entropy schedules, the optimizer, the loss settings, and a batch of zeros to compile on."""

from __future__ import annotations

import logging

import jax
import numpy as np
import optax

from learner.agents.agent import Agent
from learner.agents.vtrace import learning
from learner.backends.devices import DeviceError, Placement, prepare_cpu_devices, select_devices
from learner.config import LearnerConfig
from seedrl.specs import EnvSpec

logger = logging.getLogger(__name__)


def global_batch_size(config: LearnerConfig, device_count: int) -> int:
    """Unrolls per update over every learner device (and process)."""
    if config.batch_size_per_device:
        return config.batch_size_per_device * device_count
    return config.batch_size


def scaled_learning_rate(config: LearnerConfig, global_batch: int) -> float:
    """--learning-rate, scaled linearly with the global batch when --learning-rate-base-batch
    says what batch it was tuned for (Goyal et al. 2017)."""
    if not config.learning_rate_base_batch:
        return config.learning_rate
    return config.learning_rate * global_batch / config.learning_rate_base_batch


def learning_rate_schedule(
    config: LearnerConfig, global_batch: int | None = None
) -> optax.Schedule:
    global_batch = global_batch or config.batch_size
    learning_rate = scaled_learning_rate(config, global_batch)
    if not config.learning_rate_decay:
        return optax.constant_schedule(learning_rate)
    # optax holds the end value past the horizon.
    return optax.linear_schedule(
        learning_rate,
        learning_rate * config.learning_rate_final,
        total_updates(config, global_batch, config.learning_rate_decay_env_steps),
    )


def total_updates(config: LearnerConfig, global_batch: int, env_steps: int = 0) -> int:
    """The gradient steps `env_steps` (default --total-env-steps) buy: where the decaying
    schedules end. A horizon past the run's end ends with the run."""
    env_steps = min(env_steps or config.total_env_steps, config.total_env_steps)
    batches = max(1, env_steps // (config.unroll_length * global_batch))
    # The schedules' step count is an int32 on the device.
    return min(batches * config.batch_passes * config.minibatches, 2**31 - 1)


def optimizer_for(config: LearnerConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
    return learning.make_optimizer(
        config.optimizer,
        schedule,
        config.max_grad_norm,
        config.optimizer_epsilon,
        config.rmsprop_decay,
        config.rmsprop_momentum,
    )


def loss_settings(config: LearnerConfig, global_batch: int | None = None) -> learning.LossSettings:
    decay_updates = 0
    if config.entropy_cost_decay:
        decay_updates = total_updates(
            config, global_batch or config.batch_size, config.entropy_decay_env_steps
        )
    return learning.LossSettings(
        discount=config.discount,
        lambda_=config.vtrace_lambda,
        clip_rho_threshold=config.clip_rho_threshold,
        clip_pg_rho_threshold=config.clip_pg_rho_threshold,
        baseline_cost=config.baseline_cost,
        entropy_cost=config.entropy_cost,
        entropy_decay_updates=decay_updates,
        entropy_floor=config.entropy_floor,
        entropy_floor_cost=config.entropy_floor_cost,
        reward_clipping=config.reward_clipping,
        reward_scale=config.reward_scale,
        policy_clip=config.policy_clip,
        normalize_advantages=config.normalize_advantages,
    )


def example_trajectories(
    config: LearnerConfig, env_spec: EnvSpec, agent: Agent, batch: int | None = None
) -> learning.Trajectories:
    """Zeros of the training batch's shapes for `agent` (`batch` unrolls, default
    --batch-size), to compile the update ahead of time."""
    steps, batch = config.unroll_length + 1, batch or config.batch_size
    stack = env_spec.frame_stack
    frames = config.unroll_length + stack
    return learning.Trajectories(
        observations=np.zeros(
            (frames, batch, *env_spec.observation.shape), env_spec.observation.np_dtype
        ),
        frame_index=None if stack == 1 else np.zeros((steps, batch, stack), np.int32),
        **agent.example_fields(steps, batch),
        actions=np.zeros((steps, batch), np.int32),
        behaviour_log_probs=np.zeros((steps, batch), np.float32),
        rewards=np.zeros((steps, batch), np.float32),
        terminated=np.zeros((steps, batch), np.bool_),
        truncated=np.zeros((steps, batch), np.bool_),
    )


def fused_batch_update(config: LearnerConfig, placement: Placement) -> bool:
    """Whether each batch trains in one device call (--batch-update)."""
    if config.batch_update == "auto":
        return placement.local_devices[0].platform != "cpu"
    return config.batch_update == "fused"


def placement_for(config: LearnerConfig) -> tuple[Placement, int, int]:
    """The training devices and inference's device, the global batch, and the share of it
    this process collects (unrolls)."""
    prepare_cpu_devices(config.learner_devices, config.inference_device)
    local = select_devices(config.learner_devices)
    inference = None
    if config.inference_device >= 0:
        available = jax.local_devices()
        if config.inference_device >= len(available):
            raise DeviceError(
                f"--inference-device {config.inference_device}: this host has "
                f"{len(available)} devices"
            )
        inference = available[config.inference_device]
    placement = Placement(local, inference)
    global_batch = global_batch_size(config, placement.device_count)
    if global_batch % placement.device_count:
        raise DeviceError(
            f"the global batch of {global_batch} unrolls does not split evenly over "
            f"{placement.device_count} learner devices; make it a multiple"
        )
    local_batch = global_batch // placement.process_count
    minibatch = local_batch // config.minibatches
    if local_batch % config.minibatches or minibatch % len(placement.local_devices):
        raise DeviceError(
            f"this process's {local_batch} unrolls do not cut into {config.minibatches} "
            f"minibatches that split evenly over its {len(placement.local_devices)} devices"
        )
    if config.unroll_queue_size < local_batch:
        raise DeviceError(
            f"--unroll-queue-size {config.unroll_queue_size} must hold this process's "
            f"share of the batch ({local_batch} unrolls)"
        )
    logger.info(
        "training on %s; %d unrolls per update (%d from this process)",
        placement.describe(),
        global_batch,
        local_batch,
    )
    return placement, global_batch, local_batch
