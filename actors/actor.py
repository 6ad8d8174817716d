"""The actor: K envs in one process, one stream to the learner, no model.

It sends a hello, then loops: send the K observations, receive K actions,
step the envs. When the stream breaks it reconnects with capped exponential
backoff and jitter, under a new run id and with freshly reset envs, since
the learner has dropped what it held of the old run. It exits 0 when the
learner ends the stream with OK (training finished), and 2 when the learner
refuses it for a reason retrying cannot fix (wrong env, spec or protocol).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import random
import secrets
import socket
import time

import grpc
import grpc.aio

from envs import registry
from envs.base import VectorEnv
from seedrl.codec import StepCodec, WireError
from seedrl.proto import seedrl_pb2
from seedrl.specs import PROTOCOL_VERSION
from seedrl.transport import STREAM_PATH, channel_options, parse_address

logger = logging.getLogger(__name__)

# Refusals that a retry cannot cure: the actor exits instead of looping.
PERMANENT_FAILURES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
    }
)

EXIT_FINISHED = 0
EXIT_REFUSED = 2
EXIT_GAVE_UP = 3


@dataclasses.dataclass(frozen=True)
class ActorConfig:
    """Steps K environments and streams them to a seedrl learner."""

    learner: str = "127.0.0.1:8470"
    """Address of the learner, HOST:PORT or [IPV6]:PORT."""
    env: str = "atari:Pong"
    """Environment id; must match the learner's."""
    num_envs: int = 8
    """K: envs stepped in lock step and sent in one message."""
    actor_id: str = ""
    """Stable name of this actor; empty: HOSTNAME-PID."""
    env_threads: int = 1
    """Threads of ale-py's vector env (Atari only); 1 suits one actor process per core."""
    seed: int | None = None
    """Base seed of the envs; None: random. Each run adds its own offset."""
    connect_timeout_s: float = 10.0
    """How long to wait for the learner's welcome before retrying."""
    backoff_initial_s: float = 0.5
    """First wait after a failed connection; doubled after each failure."""
    backoff_max_s: float = 30.0
    """Longest wait between attempts."""
    give_up_after_s: float = 0.0
    """Exit (code 3) after this long without a learner; 0: retry forever."""
    log_interval_s: float = 30.0
    """Seconds between progress lines."""

    def __post_init__(self) -> None:
        parse_address(self.learner)
        registry.split_env_id(self.env)
        if self.num_envs < 1:
            raise ValueError(f"num_envs must be at least 1, got {self.num_envs}")
        if self.backoff_initial_s <= 0 or self.backoff_max_s < self.backoff_initial_s:
            raise ValueError("backoff needs 0 < backoff_initial_s <= backoff_max_s")
        if self.give_up_after_s < 0:
            raise ValueError("give_up_after_s must not be negative (0: never)")

    def resolved_actor_id(self) -> str:
        return self.actor_id or f"{socket.gethostname()}-{os.getpid()}"


class Backoff:
    """Capped exponential backoff with full jitter."""

    def __init__(self, initial_s: float, maximum_s: float, rng: random.Random):
        self._initial = initial_s
        self._maximum = maximum_s
        self._rng = rng
        self._next = initial_s

    def reset(self) -> None:
        self._next = self._initial

    def delay(self) -> float:
        delay = self._rng.uniform(0.5 * self._next, self._next)
        self._next = min(self._maximum, 2 * self._next)
        return delay


class LearnerFinished(Exception):
    """The learner ended the stream with OK: training is over."""


class Actor:
    def __init__(self, config: ActorConfig, env: VectorEnv | None = None):
        self.config = config
        self.actor_id = config.resolved_actor_id()
        self._rng = random.Random(config.seed)
        self.env = env or registry.make(
            config.env, config.num_envs, seed=config.seed, **self._env_options()
        )
        self.codec = StepCodec(self.env.spec.observation, self.env.spec.action, config.num_envs)
        self.run_id = ""
        self.steps = 0
        self.connections = 0

    def _env_options(self) -> dict:
        family, _ = registry.split_env_id(self.config.env)
        return {"num_threads": self.config.env_threads} if family == "atari" else {}

    def _hello(self) -> bytes:
        spec = self.env.spec
        hello = seedrl_pb2.Hello(
            protocol_version=PROTOCOL_VERSION,
            actor_id=self.actor_id,
            run_id=self.run_id,
            num_envs=self.config.num_envs,
            env_id=self.config.env,
            observation_spec=spec.observation.to_proto(),
            action_spec=spec.action.to_proto(),
            hostname=socket.gethostname(),
            pid=os.getpid(),
        )
        return seedrl_pb2.ActorMessage(hello=hello).SerializeToString()

    async def run(self) -> int:
        """Runs until the learner finishes or refuses us; returns the exit code."""
        config = self.config
        backoff = Backoff(config.backoff_initial_s, config.backoff_max_s, self._rng)
        last_contact = time.monotonic()
        while True:
            self.run_id = secrets.token_hex(8)
            connections = self.connections
            try:
                await self._run_once(on_welcome=backoff.reset)
            except LearnerFinished:
                logger.info("the learner finished training; actor %s exits", self.actor_id)
                return EXIT_FINISHED
            except grpc.aio.AioRpcError as error:
                if error.code() in PERMANENT_FAILURES:
                    logger.error(
                        "the learner refused actor %s: %s: %s",
                        self.actor_id,
                        error.code().name,
                        error.details(),
                    )
                    return EXIT_REFUSED
                reason = f"{error.code().name}: {error.details()}"
            except (TimeoutError, ConnectionError, WireError) as error:
                reason = str(error) or type(error).__name__
            was_connected = self.connections > connections
            if was_connected:
                last_contact = time.monotonic()
            waited = time.monotonic() - last_contact
            if config.give_up_after_s and waited > config.give_up_after_s:
                logger.error("no learner at %s for %.0f s; giving up", config.learner, waited)
                return EXIT_GAVE_UP
            delay = backoff.delay()
            what = "lost the stream to" if was_connected else "cannot reach"
            logger.warning(
                "%s the learner at %s (%s); retrying in %.1f s", what, config.learner, reason, delay
            )
            await asyncio.sleep(delay)

    async def _run_once(self, on_welcome) -> None:
        config = self.config
        async with grpc.aio.insecure_channel(config.learner, options=channel_options()) as channel:
            call = channel.stream_stream(STREAM_PATH)()
            await call.write(self._hello())
            welcome = await self._read(call, timeout=config.connect_timeout_s)
            if welcome.WhichOneof("message") != "welcome":
                raise WireError(f"expected a welcome, got {welcome.WhichOneof('message')}")
            self.connections += 1
            on_welcome()
            logger.info(
                "actor %s run %s connected to learner %s at %s (policy version %d)",
                self.actor_id,
                self.run_id,
                welcome.welcome.learner_id,
                config.learner,
                welcome.welcome.policy_version,
            )
            # The learner dropped our past: start every env afresh under the new run id.
            step = self.env.reset(seed=self._rng.randrange(2**31))
            last_log, steps_at_log = time.monotonic(), self.steps
            while True:
                await call.write(self.codec.encode_step(step))
                reply = await self._read(call, timeout=None)
                if reply.WhichOneof("message") != "actions":
                    raise WireError(f"expected actions, got {reply.WhichOneof('message')}")
                step = self.env.step(self.codec.decode_actions(reply.actions))
                self.steps += 1
                now = time.monotonic()
                if now - last_log >= config.log_interval_s:
                    rate = (self.steps - steps_at_log) * config.num_envs / (now - last_log)
                    logger.info("actor %s: %.0f env steps/s", self.actor_id, rate)
                    last_log, steps_at_log = now, self.steps

    async def _read(self, call, timeout: float | None) -> seedrl_pb2.LearnerMessage:
        raw = await asyncio.wait_for(call.read(), timeout)
        if raw is grpc.aio.EOF:
            code = await call.code()
            if code == grpc.StatusCode.OK:
                raise LearnerFinished()
            raise ConnectionError(f"stream ended with {code.name}: {await call.details()}")
        return seedrl_pb2.LearnerMessage.FromString(raw)

    def close(self) -> None:
        self.env.close()
