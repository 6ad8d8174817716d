"""The learner process: gRPC server, inference thread and trainer thread together.

Threads: the asyncio event loop serves every actor stream (parsing, checks,
replies); the inference thread batches and runs the policy; the trainer
thread runs V-trace updates. JAX releases the GIL while it computes, so the
three overlap. Parameters live on the learner's device; inference reads the
newest ones at every batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import queue
import signal
import time
from collections.abc import Callable
from typing import Any

import grpc.aio
import jax
import numpy as np
import optax
from jax.experimental import multihost_utils

from envs import registry
from learner import checkpoint
from learner.agents.vtrace import learning
from learner.batcher import DynamicBatcher
from learner.checkpoint import Checkpointer
from learner.config import LearnerConfig
from learner.devices import DeviceError, Placement, digest, prepare_cpu_devices, select_devices
from learner.inference import InferenceLoop, ParameterSource
from learner.metrics import MetricsLogger
from learner.networks import (
    CONV_RELU_TORSOS,
    check_network_fits,
    core_state_shape,
    init_params,
    make_network,
)
from learner.ops import onednn_conv
from learner.server import LearnerService
from learner.stats import RETURN_WINDOW, LearnerStats
from learner.stop_check import StopCheck
from learner.telemetry import Telemetry
from learner.trainer import Trainer
from learner.unroll_store import UnrollStore
from seedrl import security
from seedrl.specs import EnvSpec
from seedrl.transport import server_options

logger = logging.getLogger(__name__)

COMPLETION_CHECK_S = 0.25
STOP_CHECK_SEED = 2_000_003  # the envs of --stop-eval-episodes: apart from the actors' seeds


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
    return optax.linear_schedule(learning_rate, 0.0, total_updates(config, global_batch))


def total_updates(config: LearnerConfig, global_batch: int) -> int:
    """The gradient steps --total-env-steps buys: where the decaying schedules reach 0."""
    batches = max(1, config.total_env_steps // (config.unroll_length * global_batch))
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
        decay_updates = total_updates(config, global_batch or config.batch_size)
    return learning.LossSettings(
        discount=config.discount,
        lambda_=config.vtrace_lambda,
        clip_rho_threshold=config.clip_rho_threshold,
        clip_pg_rho_threshold=config.clip_pg_rho_threshold,
        baseline_cost=config.baseline_cost,
        entropy_cost=config.entropy_cost,
        entropy_decay_updates=decay_updates,
        reward_clipping=config.reward_clipping,
        reward_scale=config.reward_scale,
        policy_clip=config.policy_clip,
        normalize_advantages=config.normalize_advantages,
    )


def example_trajectories(
    config: LearnerConfig, env_spec: EnvSpec, batch: int | None = None
) -> learning.Trajectories:
    """Zeros of the training batch's shapes (`batch` unrolls, default --batch-size), to compile
    the update ahead of time."""
    steps, batch = config.unroll_length + 1, batch or config.batch_size
    stack = env_spec.frame_stack
    frames = config.unroll_length + stack
    return learning.Trajectories(
        observations=np.zeros(
            (frames, batch, *env_spec.observation.shape), env_spec.observation.np_dtype
        ),
        frame_index=None if stack == 1 else np.zeros((steps, batch, stack), np.int32),
        first=np.ones((steps, batch), np.bool_) if config.lstm_size else None,
        core_state=np.zeros((1, batch, *core_state_shape(config.lstm_size)), np.float32)
        if config.lstm_size
        else None,
        actions=np.zeros((steps, batch), np.int32),
        behaviour_log_probs=np.zeros((steps, batch), np.float32),
        rewards=np.zeros((steps, batch), np.float32),
        terminated=np.zeros((steps, batch), np.bool_),
        truncated=np.zeros((steps, batch), np.bool_),
    )


class Learner:
    def __init__(
        self,
        config: LearnerConfig,
        env_spec: EnvSpec | None = None,
        policy_fn: Callable | None = None,
        console: bool = True,
    ):
        """`policy_fn` replaces the network's policy in inference (serving benchmarks);
        `console=False` keeps the progress lines off stdout (metrics.jsonl still has them)."""
        self.config = config
        self._console = console
        self.env_spec = env_spec or registry.spec(config.env)
        self.run_dir = config.resolved_run_dir()
        self.stats = LearnerStats()
        self.port: int | None = None
        self._failure: BaseException | None = None
        self._stopping: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

        spec = self.env_spec
        model_observation = spec.model_observation
        check_network_fits(config.network, model_observation.dtype, model_observation.shape)
        self.placement = self._place()
        network = make_network(
            config.network, spec.action.num_actions, config.mlp_hidden_sizes, config.lstm_size
        )
        init_key, self._policy_key = jax.random.split(jax.random.key(config.seed))
        example_observation = np.zeros((1, *model_observation.shape), model_observation.np_dtype)
        params = init_params(network, init_key, example_observation)
        self._schedule = learning_rate_schedule(config, self.global_batch)
        optimizer = optimizer_for(config, self._schedule)
        settings = loss_settings(config, self.global_batch)
        params, opt_state, updates = self._initial_state(params, optimizer.init(params))
        state = learning.TrainState(params, opt_state, jax.numpy.int32(updates))
        if self.placement.process_count > 1:
            # Whatever each process found in its run directory, all start from process 0's.
            state = multihost_utils.broadcast_one_to_all(state)
            updates = int(state.updates)
        state = self.placement.put_state(state)
        self.parameters = ParameterSource(
            self.placement.local_copy(state.params), version=updates, state=state
        )
        self.unrolls: queue.Queue = queue.Queue(maxsize=config.unroll_queue_size)
        self.store = UnrollStore(
            config.unroll_length,
            spec.observation,
            reward_clipping=config.reward_clipping,
            frame_stack=spec.frame_stack,
            reward_scale=config.reward_scale,
        )
        self.batcher = DynamicBatcher(config.inference_batch_size, config.inference_timeout_s)
        self.service = LearnerService(
            env_spec=spec,
            store=self.store,
            batcher=self.batcher,
            parameters=self.parameters,
            stats=self.stats,
            max_envs=config.max_envs_per_stream,
            hello_timeout_s=config.hello_timeout_s,
            auth_token=security.resolve_token(config.auth_token),
            idle_timeout_s=config.stream_idle_timeout_s,
            max_abs_reward=config.max_abs_reward,
            max_abs_observation=config.max_abs_observation,
            max_streams=config.max_streams,
            max_env_slots=config.max_env_slots,
            # With several processes each counts its own share, and a process whose actors
            # stopped could not train on to the update they all agree to stop after.
            step_budget=config.total_env_steps if self.placement.process_count == 1 else 0,
        )
        temp_budget = learning.policy_temp_budget(self.placement.inference_device)
        if (
            policy_fn is None
            and self.placement.inference_device.platform == "cpu"
            and config.network in CONV_RELU_TORSOS
        ):
            reason = onednn_conv.unavailable_reason()
            logger.info(
                "the policy's convolutions run on %s",
                f"oneDNN (batches of {onednn_conv.MIN_ROWS} rows or more)"
                if reason is None
                else f"XLA's own kernels ({reason})",
            )
        self.inference = InferenceLoop(
            policy_fn=policy_fn
            or (
                learning.make_recurrent_policy_fn(network.apply, temp_budget)
                if config.lstm_size
                else learning.make_policy_fn(network.apply, temp_budget)
            ),
            core_state_shape=core_state_shape(config.lstm_size) if config.lstm_size else None,
            device=self.placement.inference_device,
            parameters=self.parameters,
            batcher=self.batcher,
            store=self.store,
            unrolls=self.unrolls,
            model_observation=model_observation,
            deliver=self.service.deliver,
            stats=self.stats,
            rng_key=self._policy_key,
            on_failure=self._fail,
        )
        self.trainer = Trainer(
            update_fn=learning.make_update_fn(network.apply, optimizer, settings, self.placement),
            state=state,
            unrolls=self.unrolls,
            batch_size=self.local_batch,
            placement=self.placement,
            parameters=self.parameters,
            stats=self.stats,
            learning_rate=self._schedule,
            on_failure=self._fail,
            recycle=self.store.recycle,
            # Parameters are identical on every process: only process 0 writes them.
            checkpointer=Checkpointer(
                self.run_dir, config.checkpoint_interval_s, config.checkpoints_to_keep
            )
            if self.placement.is_primary
            else None,
            checkpoint_meta=lambda: {
                "rng_key": jax.random.key_data(self.inference.rng_key).tolist()
            },
            max_nonfinite_updates=config.max_nonfinite_updates,
            batch_passes=config.batch_passes,
            minibatches=config.minibatches,
            finite_check=learning.make_finite_check_fn(network.apply, settings),
            end_streams=self.service.end_streams,
        )
        self._stop_check = (
            StopCheck(
                config.env,
                network,
                config.lstm_size,
                config.stop_eval_episodes,
                seed=STOP_CHECK_SEED + config.seed,
                epsilon=config.stop_eval_epsilon,
            )
            if config.stop_eval_episodes
            else None
        )
        # The training state whose parameters the check playing now plays, and the one a
        # passing check stopped the run with (its last state; see _shutdown).
        self._checking: learning.TrainState | None = None
        self._checked: learning.TrainState | None = None
        self.telemetry = Telemetry(
            run_dir=self.run_dir,
            stats=self.stats,
            streams=self.service.streams,
            queue_depth=self.unrolls.qsize,
            run_info={
                "env": spec.env_id,
                "network": config.network,
                "learner_id": self.service.learner_id,
                "run_dir": os.path.abspath(self.run_dir),
                "total_env_steps": config.total_env_steps,
                "frames_per_step": spec.frames_per_step,
            },
            tensorboard=config.tensorboard,
            http_address=config.http_bind_address,
            http_port=config.http_port,
            resume_frames=(
                None
                if self.resumed_from is None
                else self.stats.counters()["env_steps"] * spec.frames_per_step
            ),
        )

    def _place(self) -> Placement:
        """The training devices, inference's device, and the batch each process collects."""
        config = self.config
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
        self.global_batch = global_batch_size(config, placement.device_count)
        if self.global_batch % placement.device_count:
            raise DeviceError(
                f"the global batch of {self.global_batch} unrolls does not split evenly over "
                f"{placement.device_count} learner devices; make it a multiple"
            )
        self.local_batch = self.global_batch // placement.process_count
        minibatch = self.local_batch // config.minibatches
        if self.local_batch % config.minibatches or minibatch % len(placement.local_devices):
            raise DeviceError(
                f"this process's {self.local_batch} unrolls do not cut into {config.minibatches} "
                f"minibatches that split evenly over its {len(placement.local_devices)} devices"
            )
        if config.unroll_queue_size < self.local_batch:
            raise DeviceError(
                f"--unroll-queue-size {config.unroll_queue_size} must hold this process's "
                f"share of the batch ({self.local_batch} unrolls)"
            )
        logger.info(
            "training on %s; %d unrolls per update (%d from this process)",
            placement.describe(),
            self.global_batch,
            self.local_batch,
        )
        return placement

    def _initial_state(self, params: Any, opt_state: Any) -> tuple[Any, Any, int]:
        """Resumes the run directory's newest checkpoint, or starts from --init-checkpoint's
        parameters, or from `params`: (params, optimizer state, updates done)."""
        config = self.config
        self.resumed_from: int | None = None
        if checkpoint.available(self.run_dir):
            params, opt_state, meta = checkpoint.load_state(self.run_dir, params, opt_state)
            updates = int(meta["updates"])
            self.resumed_from = updates
            self.stats.restore(int(meta["env_steps"]), int(meta["episodes"]), updates)
            if "rng_key" in meta:
                self._policy_key = jax.random.wrap_key_data(np.asarray(meta["rng_key"], np.uint32))
            logger.info(
                "resuming %s from its checkpoint of update %d (%d env steps)",
                self.run_dir,
                updates,
                meta["env_steps"],
            )
            if config.init_checkpoint:
                logger.warning("--init-checkpoint ignored: the run resumes its own checkpoint")
            return params, opt_state, updates
        if config.init_checkpoint:
            run_dir, updates = checkpoint.resolve(config.init_checkpoint)
            params, meta = checkpoint.load_params(run_dir, params, updates)
            logger.info(
                "a new run from the parameters of %s, update %d",
                config.init_checkpoint,
                meta["updates"],
            )
        return params, opt_state, 0

    # -- lifecycle ----------------------------------------------------------

    def _fail(self, error: BaseException) -> None:
        self._failure = error
        if self._stopping is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)

    def compile(self) -> None:
        """Compiles inference for every padded batch size, the update, and the policy of
        the check before a stop (--stop-eval-episodes), before serving."""
        self.inference.warm_up()
        self.trainer.warm_up(
            example_trajectories(
                self.config, self.env_spec, self.local_batch // self.config.minibatches
            )
        )
        if self._stop_check is not None:
            self._stop_check.warm_up(self.parameters.latest()[0])

    async def run(self, ready: asyncio.Event | None = None, train: bool = True) -> int:
        """Serves and trains until total_env_steps, a signal, or a failure; the exit code.

        With `train=False` nothing consumes `self.unrolls`: the caller does (tests,
        serving benchmarks), or inference stalls once the queue is full.
        """
        config = self.config
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        self.service.bind_loop(self._loop)
        options = server_options(
            int(config.max_message_mb * 1024 * 1024),
            config.keepalive_interval_s,
            config.keepalive_timeout_s,
        )
        server = grpc.aio.server(options=options)
        server.add_generic_rpc_handlers((self.service.handlers(),))
        address = f"{config.bind_address}:{config.port}"
        try:
            if config.tls_cert:
                credentials = security.server_credentials(
                    config.tls_cert, config.tls_key, config.tls_client_ca
                )
                self.port = server.add_secure_port(address, credentials)
            else:
                self.port = server.add_insecure_port(address)
        except ValueError as error:  # an unreadable certificate or key
            logger.error("TLS: %s", error)
            return 2
        except RuntimeError:
            logger.error("cannot listen on %s: is another learner using that port?", address)
            return 2
        os.makedirs(self.run_dir, exist_ok=True)
        try:
            self.telemetry.start()
        except OSError as error:
            logger.error(
                "cannot serve HTTP on %s:%d (%s): is another learner using that port? "
                "--http-port 0 picks a free one, -1 serves none",
                config.http_bind_address,
                config.http_port,
                error,
            )
            return 2
        with open(os.path.join(self.run_dir, "config.json"), "w") as file:
            json.dump(config.public(), file, indent=2)
        metrics = MetricsLogger(
            os.path.join(self.run_dir, "metrics.jsonl"),
            self.stats,
            self.env_spec.frames_per_step,
            # Each of N learner processes counts its own actors: its share of the total.
            config.total_env_steps // self.placement.process_count,
        )
        for signum in (signal.SIGINT, signal.SIGTERM):
            # Off the main thread (tests) there are no signals: the caller stops us.
            with contextlib.suppress(RuntimeError, ValueError):
                self._loop.add_signal_handler(signum, self._stopping.set)

        self.inference.start()
        if train:
            self.trainer.start()
        await server.start()
        self.telemetry.serving = True
        watchdog = asyncio.create_task(self.service.watch_idle())
        logger.info(
            "learner %s serving %s on port %d; run dir %s",
            self.service.learner_id,
            config.env,
            self.port,
            self.run_dir,
        )
        logger.info(
            "actors must connect with %s and %s",
            "TLS" + (" and a client certificate" if config.tls_client_ca else "")
            if config.tls_cert
            else "plain TCP (no TLS)",
            "the shared token" if self.service.requires_token else "no token",
        )
        if self.telemetry.url:
            logger.info(
                "fleet page %s, Prometheus metrics %smetrics",
                self.telemetry.url,
                self.telemetry.url,
            )
        if ready is not None:
            ready.set()
        finished = False
        next_log = time.monotonic() + config.log_interval_s
        try:
            while not self._stopping.is_set():
                # Completion is checked often, so a fast run stops close to its target.
                wait_s = min(COMPLETION_CHECK_S, max(0.0, next_log - time.monotonic()))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), wait_s)
                if time.monotonic() >= next_log:
                    next_log += config.log_interval_s
                    self._log(metrics)
                reason = self._completion() or self._return_reached()
                if reason:
                    finished = True
                    logger.info("%s: training finished", reason)
                    break
        finally:
            watchdog.cancel()
            if train and self.trainer.coordinated and self._failure is None:
                # The other learner processes may be waiting in an all-reduce for this
                # one's share: serve and train on until all agree to stop after one update.
                logger.info("waiting for the other learner processes to agree to stop")
                self.trainer.request_stop()
                await asyncio.to_thread(self.trainer.join)
                finished = finished or self.trainer.agreed_stop.is_set()
            await self._shutdown(server, finished)
            self._log(metrics)
            metrics.close()
            self.telemetry.close()
            if self._stop_check is not None:
                self._stop_check.close()
        if self._failure is not None:
            logger.error("the learner stopped because of: %r", self._failure)
            return 1
        return 0

    def _log(self, metrics: MetricsLogger) -> None:
        """One line of metrics.jsonl and of the console, for the interval just ended."""
        record = metrics.record(self.unrolls.qsize())
        metrics.write(record)
        self.telemetry.publish(record)
        if self._console:
            print(metrics.console_line(record), flush=True)

    def _completion(self) -> str:
        """Why training is complete, or "" while it is not."""
        if self.trainer.agreed_stop.is_set():
            return "the learner processes agreed to stop"
        env_steps = self.stats.counters()["env_steps"]
        # Each of N learner processes counts its own actors' steps: 1/N of the total each.
        env_steps *= self.placement.process_count
        if env_steps >= self.config.total_env_steps:
            return f"reached {env_steps} of {self.config.total_env_steps} env steps"
        return ""

    def _return_reached(self) -> str:
        """Why training is complete by --stop-at-return, or "" while it is not.

        With --stop-eval-episodes the current parameters must also reach the target,
        played greedily on a thread of their own while serving and training go on."""
        target = self.config.stop_at_return
        if target is None:
            return ""
        _, returns = self.stats.progress()
        fleet_mean = sum(returns) / len(returns) if len(returns) >= RETURN_WINDOW else None
        reached = ""
        if fleet_mean is not None and fleet_mean >= target:
            reached = (
                f"mean return {fleet_mean:.2f} of the last {len(returns)} episodes reached "
                f"{target:g}"
            )
        check = self._stop_check
        if check is None:
            return reached
        episodes = self.stats.counters()["episodes"]
        try:
            finished = check.finished()
        except Exception as error:  # the learner's own envs failed: stop, with a checkpoint
            self._fail(error)
            return ""
        if finished is not None:
            version, played = finished
            mean = sum(played) / len(played)
            self.stats.add("stop_check_return", mean)
            verdict = (
                f"{len(played)} {check.policy} episodes of the parameters of update {version} "
                f"averaged {mean:.2f}"
            )
            if reached and mean >= target:
                self._checked = self._checking
                return f"{reached}, and {verdict}"
            check.fell_short(episodes)
            self._checking = None
            logger.info(
                "%s, %s: training on",
                verdict,
                f"short of {target:g}"
                if mean < target
                else f"but the fleet's 100-episode mean fell back below {target:g}",
            )
        elif reached and check.may_start(episodes):
            params, version, self._checking = self.parameters.latest_with_state()
            check.start(params, version)
        return ""

    async def _shutdown(self, server: grpc.aio.Server, finished: bool) -> None:
        # Streams end with OK (actors exit) when training finished; otherwise with
        # UNAVAILABLE (actors retry until a learner is back).
        self.service.stop_serving(finished)
        self.telemetry.serving = False
        await asyncio.to_thread(self.trainer.stop)
        if self._checked is not None:
            await asyncio.to_thread(self._end_with_checked, self._checked)
        # Bit-identical on every learner process of a multi-host run: the logs can say so.
        state = self.trainer.state
        logger.info(
            "final parameters: update %d, sha256 %s",
            int(state.updates),
            digest(self.placement.local_copy(state.params)),
        )
        await asyncio.to_thread(self.inference.stop)
        # The last state, written completely before the process may exit.
        await asyncio.to_thread(self.trainer.save_checkpoint)
        await asyncio.to_thread(self.trainer.close_checkpoints)
        await server.stop(grace=2.0 if finished else 0.5)

    def _end_with_checked(self, checked: learning.TrainState) -> None:
        """A run stopped by a passing check ends with the state it checked: training went
        on while the check played, and those updates, never checked, are dropped (with
        any checkpoint of them), so the final checkpoint holds the policy that passed."""
        checked_updates, trained = int(checked.updates), int(self.trainer.state.updates)
        if checked_updates == trained:
            return
        if self.trainer.coordinated:
            # Every process must end with the same state, and they agreed on this one.
            logger.warning(
                "the learner processes agreed to stop after update %d; the check passed "
                "update %d, whose state this process alone cannot go back to",
                trained,
                checked_updates,
            )
            return
        self.trainer.roll_back(checked)
        logger.info(
            "the run ends with the checked state of update %d: the %d updates trained "
            "while the check played are dropped",
            checked_updates,
            trained - checked_updates,
        )

    def stop(self) -> None:
        """Asks a running learner to stop (thread-safe); nothing once it has ended."""
        loop = self._loop
        if self._stopping is not None and loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: it ended already
                loop.call_soon_threadsafe(self._stopping.set)
