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

import grpc.aio
import jax
import numpy as np
from jax.experimental import multihost_utils

from envs import registry
from learner.agents.agent import make_agent
from learner.agents.networks import (
    CONV_RELU_TORSOS,
    check_network_fits,
    init_params,
    make_network,
)
from learner.agents.vtrace import learning
from learner.backends.cpu import onednn_conv, xla_flags
from learner.backends.devices import (
    digest,
)
from learner.config import LearnerConfig
from learner.data.unroll_store import UnrollStore
from learner.inference import policy as policy_fns
from learner.inference.loop import InferenceLoop, ParameterSource
from learner.serving.batcher import DynamicBatcher
from learner.serving.server import LearnerService
from learner.telemetry.metrics import MetricsLogger
from learner.telemetry.server import Telemetry
from learner.telemetry.stats import LearnerStats
from learner.training import checkpoint
from learner.training.checkpoint import Checkpointer
from learner.training.settings import (
    example_trajectories,
    fused_batch_update,
    learning_rate_schedule,
    loss_settings,
    optimizer_for,
    placement_for,
)
from learner.training.stop_check import ReturnStop, StopCheck
from learner.training.trainer import Trainer
from seedrl import security
from seedrl.specs import EnvSpec
from seedrl.transport import server_options

logger = logging.getLogger(__name__)

COMPLETION_CHECK_S = 0.25
STOP_CHECK_SEED = 2_000_003  # the envs of --stop-eval-episodes: apart from the actors' seeds


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
        xla_flags.ensure_applied()  # a program that did not apply them: while they can act
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
        self.placement, self.global_batch, self.local_batch = placement_for(config)
        network = make_network(
            config.network,
            spec.action.num_actions,
            config.mlp_hidden_sizes,
            config.lstm_size,
            config.torso_hidden_size,
            config.torso_channels,
            config.torso_layer_norm,
            config.torso_activation,
        )
        agent = self.agent = make_agent(network)
        init_key, self._policy_key = jax.random.split(jax.random.key(config.seed))
        example_observation = np.zeros((1, *model_observation.shape), model_observation.np_dtype)
        params = init_params(network, init_key, example_observation)
        self._schedule = learning_rate_schedule(config, self.global_batch)
        optimizer = optimizer_for(config, self._schedule)
        settings = loss_settings(config, self.global_batch)
        params, opt_state, resumed = checkpoint.starting_state(
            self.run_dir, config.init_checkpoint, params, jax.jit(optimizer.init)(params)
        )
        self.resumed_from = None if resumed is None else int(resumed["updates"])
        updates = self.resumed_from or 0
        if resumed is not None:
            self.stats.restore(int(resumed["env_steps"]), int(resumed["episodes"]), updates)
            if "rng_key" in resumed:
                key_data = np.asarray(resumed["rng_key"], np.uint32)
                self._policy_key = jax.random.wrap_key_data(key_data)
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
            policy_version=lambda: self.parameters.version,
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
        temp_budget = policy_fns.policy_temp_budget(self.placement.inference_device)
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
            policy_fn=policy_fn or policy_fns.policy_fn_for(agent, temp_budget),
            core_state_shape=agent.core_state_shape,
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
            update_fn=learning.SampledKlUpdate(
                agent, optimizer, settings, self.placement, guarded=False
            ),
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
            finite_check=learning.make_finite_check_fn(agent, settings),
            end_streams=self.service.end_streams,
            batch_update_fn=learning.make_batch_update_fn(
                agent,
                optimizer,
                settings,
                self.placement,
                config.batch_passes,
                config.minibatches,
            )
            if fused_batch_update(config, self.placement)
            else None,
        )
        self.return_stop = ReturnStop(
            config.stop_at_return,
            StopCheck(
                config.env,
                agent,
                config.stop_eval_episodes,
                seed=STOP_CHECK_SEED + config.seed,
                epsilon=config.stop_eval_epsilon,
            )
            if config.stop_eval_episodes
            else None,
            self.stats,
            self.parameters,
            on_failure=self._fail,
        )
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
            example_trajectories(self.config, self.env_spec, self.agent, self.local_batch)
        )
        self.return_stop.warm_up(self.parameters.latest()[0])

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
                reason = self._completion() or self.return_stop.reason()
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
            self.return_stop.close()
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

    async def _shutdown(self, server: grpc.aio.Server, finished: bool) -> None:
        # Streams end with OK (actors exit) when training finished; otherwise with
        # UNAVAILABLE (actors retry until a learner is back).
        self.service.stop_serving(finished)
        self.telemetry.serving = False
        await asyncio.to_thread(self.trainer.stop)
        await asyncio.to_thread(self.return_stop.end_with_checked, self.trainer)
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

    def stop(self) -> None:
        """Asks a running learner to stop (thread-safe); nothing once it has ended."""
        loop = self._loop
        if self._stopping is not None and loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: it ended already
                loop.call_soon_threadsafe(self._stopping.set)
