"""The actor: K envs in one process, streamed to the learner, no model.

It sends a hello, then loops: send the K observations, receive K actions,
step the envs. With `groups` G > 1 the K envs are split into G vector envs
of K/G, each with its own stream: while one group waits for its actions the
others step, so the envs' core never idles for the round trip (the
double-buffered sampling of Sample Factory). When a stream breaks the actor
reconnects every group with capped exponential backoff and jitter, under a
new run id and with freshly reset envs, since the learner has dropped what
it held of the old run. It exits 0 when the learner ends the stream with OK
(training finished), and 2 when the learner refuses it for good (wrong env, spec
or protocol, bad data, a cap): the learner marks each refusal final or retryable.
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
from typing import Literal

import grpc
import grpc.aio

from envs import registry
from envs.base import VectorEnv
from seedrl import security
from seedrl.codec import CHANGES_MIN_BYTES, StepCodec, WireError, observation_changes_allowed
from seedrl.proto import seedrl_pb2
from seedrl.specs import PROTOCOL_VERSION
from seedrl.transport import (
    KEEPALIVE_INTERVAL_S,
    KEEPALIVE_TIMEOUT_S,
    REFUSAL_KEY,
    REFUSAL_RETRY,
    STREAM_PATH,
    channel_options,
    check_keepalive,
    parse_address,
)

logger = logging.getLogger(__name__)

# Statuses without the learner's verdict (from gRPC itself, or a learner that gives
# none) that a retry cannot cure: the actor exits instead of looping. RESOURCE_EXHAUSTED
# is gRPC's for a message past a size limit, which the next attempt passes again.
PERMANENT_FAILURES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)


def is_final(error: grpc.aio.AioRpcError) -> bool:
    """Whether the stream's end forbids reconnecting: the learner's own verdict
    (REFUSAL_KEY in the trailing metadata) where it gave one, whatever the code."""
    verdict = dict(error.trailing_metadata() or ()).get(REFUSAL_KEY)
    if verdict is not None:
        return verdict != REFUSAL_RETRY
    return error.code() in PERMANENT_FAILURES


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
    """K: envs this process steps."""
    groups: int = 1
    """G: the K envs form G groups of K/G, each sent in one message on its own stream;
    while one group waits for its actions the others step (2 hides the round trip)."""
    actor_id: str = ""
    """Stable name of this actor; empty: HOSTNAME-PID."""
    env_threads: int = 1
    """Threads of ale-py's vector env (Atari only); 1 suits one actor process per core."""
    observation_changes: Literal["on", "off"] = "on"
    """Offer to send each step's observations as what changed since the last step (8-byte
    words; ~35x fewer bytes for Atari), for observations of 1 KiB or more per env; the
    learner's welcome accepts. On loopback too: the gRPC copies it saves cost both sides
    more CPU than the actor's comparison (docs/benchmarks.md, (c))."""
    seed: int | None = None
    """Base seed of the envs; None: random. The envs are seeded once, when made; a
    reconnection starts new episodes that go on from each env's random stream."""
    connect_timeout_s: float = 10.0
    """How long to wait for the learner's welcome before retrying."""
    backoff_initial_s: float = 0.5
    """First wait after a failed connection; doubled after each failure."""
    backoff_max_s: float = 8.0
    """Longest wait between attempts: a learner that is back is found within about this
    long (plus jitter)."""
    keepalive_interval_s: float = KEEPALIVE_INTERVAL_S
    """Seconds between pings to the learner; a link that died without closing is
    noticed within about interval + timeout, and the actor reconnects."""
    keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_S
    """A ping unanswered for this long ends the connection."""
    give_up_after_s: float = 0.0
    """Exit (code 3) after this long without a learner; 0: retry forever."""
    log_interval_s: float = 30.0
    """Seconds between progress lines."""
    auth_token: str = dataclasses.field(default="", repr=False)
    """The learner's shared token; empty: SEEDRL_AUTH_TOKEN from the environment, or none."""
    tls_ca: str = ""
    """PEM CA that signed the learner's certificate: connects with TLS when set."""
    tls_cert: str = ""
    """PEM client certificate, for a learner that requires one (with --tls-key)."""
    tls_key: str = ""
    """PEM private key of --tls-cert."""
    tls_server_name: str = ""
    """Name to verify the learner's certificate against, when --learner is an address
    the certificate does not name."""

    def __post_init__(self) -> None:
        parse_address(self.learner)
        registry.split_env_id(self.env)
        if self.num_envs < 1:
            raise ValueError(f"num_envs must be at least 1, got {self.num_envs}")
        if self.groups < 1 or self.num_envs % self.groups:
            raise ValueError(
                f"groups must be at least 1 and divide num_envs {self.num_envs}, got {self.groups}"
            )
        if self.backoff_initial_s <= 0 or self.backoff_max_s < self.backoff_initial_s:
            raise ValueError("backoff needs 0 < backoff_initial_s <= backoff_max_s")
        check_keepalive(self.keepalive_interval_s, self.keepalive_timeout_s)
        if self.give_up_after_s < 0:
            raise ValueError("give_up_after_s must not be negative (0: never)")
        if (self.tls_cert or self.tls_key or self.tls_server_name) and not self.tls_ca:
            raise ValueError("--tls-cert, --tls-key and --tls-server-name need --tls-ca")

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


@dataclasses.dataclass
class _Group:
    """K/G envs of the actor and the stream they are sent on."""

    actor_id: str
    env: VectorEnv
    codec: StepCodec
    offers_changes: bool
    """Its hellos offer observation changes (config and observation)."""


class Actor:
    def __init__(self, config: ActorConfig, envs: list[VectorEnv] | None = None):
        """`envs`: one vector env of K/G per group, instead of making them from the config."""
        self.config = config
        self.actor_id = config.resolved_actor_id()
        self._rng = random.Random(config.seed)
        per_group = config.num_envs // config.groups
        if envs is None:
            # Each group its own seed (from the base seed), used by its envs' first reset.
            envs = [
                registry.make(
                    config.env,
                    per_group,
                    seed=None if config.seed is None else self._rng.randrange(2**31),
                    **self._env_options(),
                )
                for _ in range(config.groups)
            ]
        if len(envs) != config.groups or any(env.num_envs != per_group for env in envs):
            raise ValueError(f"expected {config.groups} vector envs of {per_group} envs")
        self.groups = [
            _Group(
                actor_id=self.actor_id if config.groups == 1 else f"{self.actor_id}/{index}",
                env=env,
                codec=StepCodec(env.spec.observation, env.spec.action, per_group),
                offers_changes=self._offers_changes(env),
            )
            for index, env in enumerate(envs)
        ]
        self.run_id = ""
        self.env_steps = 0
        self.connections = 0
        self._token = security.resolve_token(config.auth_token)

    def _env_options(self) -> dict:
        family, _ = registry.split_env_id(self.config.env)
        return {"num_threads": self.config.env_threads} if family == "atari" else {}

    def _hello(self, group: _Group) -> bytes:
        spec = group.env.spec
        hello = seedrl_pb2.Hello(
            protocol_version=PROTOCOL_VERSION,
            actor_id=group.actor_id,
            run_id=self.run_id,
            num_envs=group.env.num_envs,
            env_id=self.config.env,
            observation_spec=spec.observation.to_proto(),
            action_spec=spec.action.to_proto(),
            hostname=socket.gethostname(),
            pid=os.getpid(),
            observation_changes=group.offers_changes,
        )
        return seedrl_pb2.ActorMessage(hello=hello).SerializeToString()

    def _offers_changes(self, env: VectorEnv) -> bool:
        observation = env.spec.observation
        return (
            self.config.observation_changes == "on"
            and observation.nbytes >= CHANGES_MIN_BYTES
            and observation_changes_allowed(observation, env.num_envs)
        )

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
                if is_final(error):
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

    def _channel(self) -> grpc.aio.Channel:
        config = self.config
        options = channel_options(
            keepalive_interval_s=config.keepalive_interval_s,
            keepalive_timeout_s=config.keepalive_timeout_s,
        )
        if not config.tls_ca:
            return grpc.aio.insecure_channel(config.learner, options=options)
        if config.tls_server_name:
            options.append(("grpc.ssl_target_name_override", config.tls_server_name))
        credentials = security.channel_credentials(config.tls_ca, config.tls_cert, config.tls_key)
        return grpc.aio.secure_channel(config.learner, credentials, options=options)

    async def _run_once(self, on_welcome) -> None:
        config = self.config
        metadata = security.call_metadata(self._token)
        async with self._channel() as channel:
            calls = [channel.stream_stream(STREAM_PATH)(metadata=metadata) for _ in self.groups]
            try:
                # The whole handshake is bounded: a connection attempt into a dead
                # link must not outlast it, or the actor would find the link back late.
                async with asyncio.timeout(config.connect_timeout_s):
                    for group, call in zip(self.groups, calls, strict=True):
                        await call.write(self._hello(group))
                    welcomes = [await self._read(call, timeout=None) for call in calls]
            except TimeoutError as error:
                raise TimeoutError(f"no welcome within {config.connect_timeout_s:g} s") from error
            for group, welcome in zip(self.groups, welcomes, strict=True):
                if welcome.WhichOneof("message") != "welcome":
                    raise WireError(f"expected a welcome, got {welcome.WhichOneof('message')}")
                # A learner that does not know of changes leaves the welcome's flag unset.
                group.codec.start_stream(
                    welcome.welcome.observation_changes and group.offers_changes
                )
            self.connections += 1
            on_welcome()
            logger.info(
                "actor %s run %s connected to learner %s at %s (policy version %d, %d streams)",
                self.actor_id,
                self.run_id,
                welcome.welcome.learner_id,
                config.learner,
                welcome.welcome.policy_version,
                len(calls),
            )
            tasks = [
                asyncio.create_task(self._serve(group, call))
                for group, call in zip(self.groups, calls, strict=True)
            ]
            tasks.append(asyncio.create_task(self._report_progress()))
            try:
                # The groups live and die together: the first to end ends the run.
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            for task in done:
                task.result()  # raises what ended the run

    async def _serve(self, group: _Group, call) -> None:
        # The learner dropped our past: every env starts a new episode under the new run
        # id, going on from its random stream (not reseeded: see envs.base.SeedOnce).
        step = group.env.reset()
        while True:
            await call.write(group.codec.encode_step(step))
            reply = await self._read(call, timeout=None)
            if reply.WhichOneof("message") != "actions":
                raise WireError(f"expected actions, got {reply.WhichOneof('message')}")
            # Blocks the loop while the envs step; the other groups' replies queue up meanwhile.
            step = group.env.step(group.codec.decode_actions(reply.actions))
            self.env_steps += group.env.num_envs

    async def _report_progress(self) -> None:
        interval = self.config.log_interval_s
        while True:
            before, started = self.env_steps, time.monotonic()
            await asyncio.sleep(interval)
            rate = (self.env_steps - before) / (time.monotonic() - started)
            logger.info("actor %s: %.0f env steps/s", self.actor_id, rate)

    async def _read(self, call, timeout: float | None) -> seedrl_pb2.LearnerMessage:
        raw = await asyncio.wait_for(call.read(), timeout)
        if raw is grpc.aio.EOF:
            code = await call.code()
            if code == grpc.StatusCode.OK:
                raise LearnerFinished()
            raise ConnectionError(f"stream ended with {code.name}: {await call.details()}")
        return seedrl_pb2.LearnerMessage.FromString(raw)

    def close(self) -> None:
        for group in self.groups:
            group.env.close()
