"""What a stream must say first: its hello, checked before the learner holds anything for
it, and the refusals that end a stream with a status naming the fault."""

from __future__ import annotations

import grpc
from google.protobuf.message import DecodeError

from seedrl.proto import seedrl_pb2
from seedrl.specs import PROTOCOL_VERSION, ActionSpec, EnvSpec, SpecError, TensorSpec
from seedrl.text import shown
from seedrl.transport import REFUSAL_FINAL, REFUSAL_KEY, REFUSAL_RETRY

MAX_NAME_CHARS = 128
"""The longest actor id, run id or host name a hello may carry."""


# Refusals after which the same actor may reconnect: the learner is stopping, the stream
# owed a step too long, or the id was another live stream's or passed to a newer one.
RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.ABORTED,
    }
)


class StreamRefused(Exception):
    """Ends a stream with `code` and a message that names the fault."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code

    @property
    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        """Tells the actor whether reconnecting can help (seedrl.transport.REFUSAL_KEY)."""
        verdict = REFUSAL_RETRY if self.code in RETRYABLE else REFUSAL_FINAL
        return ((REFUSAL_KEY, verdict),)


MAX_HELLO_BYTES = 64 << 10
"""The largest first message a stream may send. A hello is a few hundred bytes (ids, the
env id, its specs); a larger one is refused before it is parsed, so a peer's megabyte
hellos cost the learner their reading only."""


def parse_hello_message(raw: bytes) -> seedrl_pb2.ActorMessage:
    """A stream's first message, or StreamRefused if it is larger than a hello may be or
    is not an ActorMessage."""
    if len(raw) > MAX_HELLO_BYTES:
        raise StreamRefused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the first message is {len(raw):,} bytes; a hello is at most {MAX_HELLO_BYTES:,}",
        )
    return parse_message(raw, "the first message")


def parse_message(raw: bytes, what: str) -> seedrl_pb2.ActorMessage:
    message = seedrl_pb2.ActorMessage()
    try:
        message.ParseFromString(raw)
    except DecodeError as error:
        raise StreamRefused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{what} is not a valid ActorMessage ({len(raw)} bytes): {error}",
        ) from error
    return message


def check_hello(
    message: seedrl_pb2.ActorMessage, env_spec: EnvSpec, max_envs: int
) -> seedrl_pb2.Hello:
    """The hello of a stream's first message, or StreamRefused saying why not."""
    kind = message.WhichOneof("message")
    if kind != "hello":
        raise StreamRefused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the first message must be a hello, got {kind or 'an empty message'}",
        )
    hello = message.hello
    if hello.protocol_version != PROTOCOL_VERSION:
        raise StreamRefused(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"protocol version {hello.protocol_version} is not supported; "
            f"this learner speaks version {PROTOCOL_VERSION}",
        )
    if not hello.actor_id or not hello.run_id:
        raise StreamRefused(
            grpc.StatusCode.INVALID_ARGUMENT, "the hello must carry an actor_id and a run_id"
        )
    for name in ("actor_id", "run_id", "hostname"):
        # Logged and shown on the fleet page as they are: plain, short text only.
        value = getattr(hello, name)
        if len(value) > MAX_NAME_CHARS or not value.isprintable():
            raise StreamRefused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the hello's {name} must be at most {MAX_NAME_CHARS} printable characters, "
                f"got {shown(value)}",
            )
    if not 1 <= hello.num_envs <= max_envs:
        raise StreamRefused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"num_envs {hello.num_envs} is outside 1..{max_envs} (this learner's limit)",
        )
    if hello.env_id != env_spec.env_id:
        raise StreamRefused(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"env {shown(hello.env_id)} does not match the learner's env {env_spec.env_id!r}",
        )
    try:
        observation = TensorSpec.from_proto(hello.observation_spec)
        action = ActionSpec.from_proto(hello.action_spec)
    except SpecError as error:
        raise StreamRefused(
            grpc.StatusCode.INVALID_ARGUMENT, f"bad spec in hello: {error}"
        ) from error
    if observation != env_spec.observation:
        raise StreamRefused(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"observation spec {observation} does not match the learner's {env_spec.observation}",
        )
    if action != env_spec.action:
        raise StreamRefused(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"action spec {action} does not match the learner's {env_spec.action}",
        )
    return hello
