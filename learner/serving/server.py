"""The learner's gRPC service: one bidirectional stream per actor.

The handler receives raw bytes and parses them itself, so that a message that
is not even protobuf ends its stream with a status naming the fault rather
than grpc's generic deserialisation error. Nothing a peer sends can raise
out of a handler except as a status for that one stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
import uuid
from collections.abc import Callable

import grpc
import grpc.aio
import numpy as np

from learner.data.unroll_store import UnrollStore
from learner.serving.batcher import STOPPED, DynamicBatcher, InferenceRequest
from learner.serving.hello import StreamRefused, check_hello, parse_hello_message, parse_message
from learner.telemetry.stats import LearnerStats
from seedrl import security
from seedrl.codec import StepCodec, WireError, observation_changes_allowed
from seedrl.proto import seedrl_pb2
from seedrl.specs import EnvSpec
from seedrl.text import shown
from seedrl.transport import (
    SERVICE_NAME,
    STREAM_METHOD,
)

logger = logging.getLogger(__name__)

STALL_S = 1.0
"""A stream that has owed its step this long no longer holds batches back (see
ActorStream.stepping)."""
TAKEOVER_S = 10.0
"""A stream that has owed its step this long may be taken over by a hello of its actor id
from another process (the actor restarted, or its old connection is half-open)."""


@dataclasses.dataclass
class ActorStream:
    """A connected actor, as the learner sees it."""

    owner: int
    actor_id: str
    run_id: str
    hostname: str
    pid: int
    peer: str
    num_envs: int
    slots: np.ndarray
    slot_owners: np.ndarray
    """int64 [K] filled with `owner`, for the unroll store's owner check."""
    observation_changes: bool = False
    """Its steps may carry observation changes (the hello offered, the welcome accepted)."""
    steps: int = 0
    received_bytes: int = 0
    """Bytes of its step messages so far (what its link carries to the learner)."""
    superseded_by: str = ""
    spoiled: str = ""
    """Why training refuses this stream's data (set by `end_streams`); it ends at its next
    step."""
    connected_at: float = dataclasses.field(default_factory=time.monotonic)
    last_seen: float = dataclasses.field(default_factory=time.monotonic)
    """time.monotonic() of its latest message."""
    replied_at: float = 0.0
    """time.monotonic() of the learner's latest reply: after it, the actor owes a step."""
    task: asyncio.Task | None = None
    idle: bool = False
    stepping: bool = False
    """Whether the batcher counts on this stream's next step: from each step it sends
    until it has owed one for STALL_S, so that streams that are silent (a hello and
    nothing more, or a stalled actor) do not hold every batch to the batcher's timeout."""
    """Set by the idle watchdog before it cancels the stream's task."""


class LearnerService:
    """Handles every actor stream; the event loop's side of the learner."""

    def __init__(
        self,
        env_spec: EnvSpec,
        store: UnrollStore,
        batcher: DynamicBatcher,
        policy_version: Callable[[], int],
        stats: LearnerStats,
        max_envs: int,
        hello_timeout_s: float,
        auth_token: str = "",
        idle_timeout_s: float = 300.0,
        max_abs_reward: float = 1e6,
        max_abs_observation: float = 1e8,
        max_streams: int = 8192,
        max_env_slots: int = 65536,
        step_budget: int = 0,
    ):
        """`auth_token`: streams must carry it (see seedrl.security); "" lets all in.
        `idle_timeout_s`: a stream owing its next step for this long is ended.
        `max_abs_reward`, `max_abs_observation`: a step beyond them ends its stream.
        `max_streams`, `max_env_slots`: hellos past these caps are refused.
        `step_budget`: once the env steps counted reach it, streams end with OK at their
        next step, without waiting for the learner's completion check (0: no budget)."""
        self._step_budget = step_budget
        self._max_streams = max_streams
        self._max_env_slots = max_env_slots
        self._max_abs_reward = max_abs_reward
        self._max_abs_observation = max_abs_observation
        self.env_spec = env_spec
        self._token = auth_token
        self._idle_timeout_s = idle_timeout_s
        self.learner_id = uuid.uuid4().hex[:12]
        self._store = store
        self._batcher = batcher
        self._policy_version = policy_version
        self._stats = stats
        self._max_envs = max_envs
        self._hello_timeout_s = hello_timeout_s
        self._owners = itertools.count(1)
        self.streams: dict[int, ActorStream] = {}
        # Set when the learner stops serving; `finished` says whether training is over.
        self.stopping = False
        self.finished = False
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def requires_token(self) -> bool:
        return bool(self._token)

    async def watch_idle(self) -> None:
        """Ends streams that owe a step for longer than the idle timeout, and stops the
        batcher waiting for those that owe one for longer than STALL_S (runs forever)."""
        period = min(STALL_S / 2, self._idle_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for actor in list(self.streams.values()):
                owes_step = actor.replied_at > actor.last_seen
                if owes_step and actor.stepping and now - actor.replied_at > STALL_S:
                    actor.stepping = False
                    self._batcher.stream_closed()
                if owes_step and now - actor.replied_at > self._idle_timeout_s and not actor.idle:
                    actor.idle = True
                    if actor.task is not None:
                        actor.task.cancel()

    def handlers(self) -> grpc.GenericRpcHandler:
        # No (de)serialisers: the handler gets and returns raw bytes.
        handler = grpc.stream_stream_rpc_method_handler(self.stream)
        return grpc.method_handlers_generic_handler(SERVICE_NAME, {STREAM_METHOD: handler})

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def deliver(self, batch: list[InferenceRequest], replies: list) -> None:
        """Called by the inference thread: hands each request its reply."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(_resolve, batch, replies)

    def end_streams(self, owners: list[int], reason: str) -> None:
        """Ends the streams of `owners` at their next step with INVALID_ARGUMENT and
        `reason` (thread-safe: the trainer calls it)."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._spoil, owners, reason)

    def _spoil(self, owners: list[int], reason: str) -> None:
        for owner in owners:
            actor = self.streams.get(owner)
            if actor is not None and not actor.spoiled:
                actor.spoiled = reason

    def stop_serving(self, finished: bool) -> None:
        """Ends every stream at its next message or reply.

        With `finished` (training is over) streams end with OK and actors exit;
        otherwise with UNAVAILABLE, and actors retry until a learner is back.
        """
        self.finished = finished
        self.stopping = True

    def _end_of_service(self) -> None:
        """Ends the calling stream as `stop_serving` decided."""
        if self.finished:
            return
        raise StreamRefused(grpc.StatusCode.UNAVAILABLE, "the learner is stopping; reconnect later")

    async def stream(self, request_iterator, context: grpc.aio.ServicerContext) -> None:
        del request_iterator  # read through the context, which can time out
        actor: ActorStream | None = None
        try:
            if not security.token_matches(context.invocation_metadata(), self._token):
                # Before anything is read: a stranger learns nothing but this.
                raise StreamRefused(
                    grpc.StatusCode.UNAUTHENTICATED,
                    "missing or wrong auth token (the learner's --auth-token or "
                    f"{security.TOKEN_ENV}, sent as 'authorization: Bearer TOKEN')",
                )
            actor = await self._accept(context)
            if actor is None:
                self._end_of_service()
                return
            actor.task = asyncio.current_task()
            await context.write(self._welcome(actor))
            actor.replied_at = time.monotonic()  # the welcome is a reply: a step is owed
            await self._serve(actor, context)
        except asyncio.CancelledError:
            if actor is None or not actor.idle:
                raise  # the server is stopping
            refusal = StreamRefused(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"no step for {self._idle_timeout_s:g} s after the learner's last reply",
            )
            await self._refuse(refusal, actor, context)
        except StreamRefused as refusal:
            await self._refuse(refusal, actor, context)
        except Exception as error:  # a path no check foresaw: this stream ends, not others
            logger.error("stream handler failed", exc_info=error)
            refusal = StreamRefused(
                grpc.StatusCode.INTERNAL,
                f"the learner failed on this stream ({type(error).__name__})",
            )
            await self._refuse(refusal, actor, context)
        finally:
            if actor is not None:
                self._disconnect(actor)

    async def _refuse(
        self, refusal: StreamRefused, actor: ActorStream | None, context: grpc.aio.ServicerContext
    ) -> None:
        """Ends the stream by `refusal`: counted (unless the learner is stopping) and logged."""
        if refusal.code != grpc.StatusCode.UNAVAILABLE:
            self._stats.count_stream_error(refusal.code.name)
            if actor is None:
                self._stats.count_rejection()
        who = f"actor {actor.actor_id} run {actor.run_id}" if actor else context.peer()
        log = logger.info if refusal.code == grpc.StatusCode.UNAVAILABLE else logger.warning
        log("stream of %s ended: %s: %s", who, refusal.code.name, refusal)
        await context.abort(refusal.code, str(refusal), refusal.trailing_metadata)

    async def _accept(self, context: grpc.aio.ServicerContext) -> ActorStream | None:
        """Reads and checks the hello and registers the stream; None when stopping.

        Nothing here awaits after the slots are allocated, so the caller's
        cleanup always covers them.
        """
        try:
            raw = await asyncio.wait_for(context.read(), self._hello_timeout_s)
        except TimeoutError as error:
            raise StreamRefused(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"no hello within {self._hello_timeout_s:g} s of opening the stream",
            ) from error
        if raw is grpc.aio.EOF:
            raise StreamRefused(grpc.StatusCode.INVALID_ARGUMENT, "stream closed before its hello")
        hello = check_hello(parse_hello_message(raw), self.env_spec, self._max_envs)
        if self.stopping:
            return None
        self._check_room(hello)
        owner = next(self._owners)
        actor = ActorStream(
            owner=owner,
            actor_id=hello.actor_id,
            run_id=hello.run_id,
            hostname=hello.hostname,
            pid=hello.pid,
            peer=context.peer(),
            num_envs=hello.num_envs,
            slots=self._store.allocate(owner, hello.num_envs),
            slot_owners=np.full(hello.num_envs, owner, np.int64),
            observation_changes=hello.observation_changes
            and observation_changes_allowed(self.env_spec.observation, hello.num_envs),
        )
        for other in self.streams.values():
            if other.actor_id == actor.actor_id:
                # The same actor again (_check_room let it in), with a new run: its old
                # stream is stale.
                other.superseded_by = actor.run_id
        self.streams[owner] = actor
        self._stats.stream_change(actors=1, envs=actor.num_envs)
        logger.info(
            "actor %s run %s connected from %s (%s) with %d envs",
            actor.actor_id,
            actor.run_id,
            actor.hostname,
            actor.peer,
            actor.num_envs,
        )
        return actor

    def _welcome(self, actor: ActorStream) -> bytes:
        welcome = seedrl_pb2.Welcome(
            action_spec=self.env_spec.action.to_proto(),
            policy_version=self._policy_version(),
            learner_id=self.learner_id,
            observation_changes=actor.observation_changes,
        )
        return seedrl_pb2.LearnerMessage(welcome=welcome).SerializeToString()

    async def _serve(self, actor: ActorStream, context: grpc.aio.ServicerContext) -> None:
        codec = StepCodec(
            self.env_spec.observation,
            self.env_spec.action,
            actor.num_envs,
            observation_changes=actor.observation_changes,
            max_abs_reward=self._max_abs_reward,
            max_abs_observation=self._max_abs_observation,
        )
        loop = asyncio.get_running_loop()
        while True:
            raw = await context.read()
            if raw is grpc.aio.EOF:
                return
            actor.last_seen = time.monotonic()
            actor.received_bytes += len(raw)
            if self._step_budget and self._stats.env_steps >= self._step_budget:
                # Under load the completion check comes late, while every stream steps on.
                self.stop_serving(finished=True)
            if self.stopping:
                self._end_of_service()
                return
            if actor.spoiled:
                raise StreamRefused(grpc.StatusCode.INVALID_ARGUMENT, actor.spoiled)
            if actor.superseded_by:
                raise StreamRefused(
                    grpc.StatusCode.ABORTED,
                    f"actor {actor.actor_id} reconnected as run {actor.superseded_by}; "
                    f"this stream of run {actor.run_id} is stale",
                )
            try:
                # The fast reader takes a well-formed step without copying its bytes;
                # anything else goes through protobuf, which names what is wrong.
                step = codec.decode_step_message(raw)
                if step is None:
                    step = codec.decode_step(self._step_of(raw, actor))
            except WireError as error:
                raise StreamRefused(
                    grpc.StatusCode.INVALID_ARGUMENT, f"step {actor.steps + 1}: {error}"
                ) from error
            reply = loop.create_future()
            if not actor.stepping:
                actor.stepping = True
                self._batcher.stream_opened()
            self._batcher.submit(
                InferenceRequest(actor.owner, actor.slots, actor.slot_owners, step, reply)
            )
            result = await reply
            if result is STOPPED:
                self._end_of_service()
                return
            if isinstance(result, BaseException):
                raise StreamRefused(
                    grpc.StatusCode.INTERNAL, f"inference failed on the learner: {result}"
                )
            actor.steps += 1
            await context.write(result)
            actor.replied_at = time.monotonic()

    @staticmethod
    def _step_of(raw: bytes, actor: ActorStream) -> seedrl_pb2.Step:
        message = parse_message(raw, f"message {actor.steps + 1}")
        kind = message.WhichOneof("message")
        if kind != "step":
            raise StreamRefused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"message {actor.steps + 1} must be a step, got {kind or 'an empty message'}",
            )
        return message.step

    def _check_room(self, hello: seedrl_pb2.Hello) -> None:
        """Refuses a hello the caps leave no room for, or one that would take over the id of
        an actor that is connected and stepping: only that actor itself (its host and
        process) may, or anyone once the old stream has owed a step for a while."""
        if len(self.streams) >= self._max_streams:
            raise StreamRefused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the learner serves {len(self.streams)} streams, its cap (--max-streams)",
            )
        taken = self._stats.connected_envs
        if taken + hello.num_envs > self._max_env_slots:
            raise StreamRefused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{hello.num_envs} envs more would pass the learner's cap of "
                f"{self._max_env_slots} env slots (--max-env-slots); {taken} are taken",
            )
        now = time.monotonic()
        for other in self.streams.values():
            if other.actor_id != hello.actor_id or other.superseded_by:
                continue
            same_process = (other.hostname, other.pid) == (hello.hostname, hello.pid)
            silent = other.replied_at > other.last_seen and now - other.replied_at > TAKEOVER_S
            if not same_process and not silent:
                raise StreamRefused(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"actor {shown(hello.actor_id)} is connected and stepping, from another "
                    "process; ids name one actor each",
                )

    def _disconnect(self, actor: ActorStream) -> None:
        self.streams.pop(actor.owner, None)
        if actor.stepping:
            self._batcher.stream_closed()
        self._stats.count_dropped(*self._store.release(actor.owner, actor.slots))
        self._stats.stream_change(actors=-1, envs=-actor.num_envs)
        logger.info(
            "actor %s run %s disconnected after %d steps", actor.actor_id, actor.run_id, actor.steps
        )


def _resolve(batch: list[InferenceRequest], replies: list) -> None:
    for request, reply in zip(batch, replies, strict=True):
        if not request.reply.done():
            request.reply.set_result(reply)
