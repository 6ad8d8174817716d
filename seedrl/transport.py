"""gRPC settings shared by the learner's server and the actors' channels."""

from __future__ import annotations

import re

SERVICE_NAME = "seedrl.v1.Learner"
STREAM_METHOD = "Stream"
STREAM_PATH = f"/{SERVICE_NAME}/{STREAM_METHOD}"

# The learner ends every stream it refuses with this trailing metadata key, valued
# REFUSAL_FINAL (the actor exits: retrying cannot help) or REFUSAL_RETRY (the actor
# reconnects). A status without it comes from gRPC or the network, not the learner.
REFUSAL_KEY = "seedrl-refusal"
REFUSAL_FINAL = "final"
REFUSAL_RETRY = "retry"

# Large enough for 256 Atari observations (4x84x84 bytes each) in one step,
# small enough that a bad peer cannot make the learner buffer gigabytes.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

# Pings keep NAT and load-balancer state alive and let either side notice a
# peer that vanished without closing its socket (a preempted machine, a cut
# link): a dead peer is noticed within about interval + timeout.
KEEPALIVE_INTERVAL_S = 20.0
KEEPALIVE_TIMEOUT_S = 10.0
# The shortest keepalive interval: the learner accepts pings this often, so
# an actor's setting never has to match its learner's.
MIN_KEEPALIVE_INTERVAL_S = 1.0


def _common_options(
    max_message_bytes: int, keepalive_interval_s: float, keepalive_timeout_s: float
) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", round(keepalive_interval_s * 1000)),
        ("grpc.keepalive_timeout_ms", round(keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def check_keepalive(interval_s: float, timeout_s: float) -> None:
    """ValueError unless the keepalive settings are usable."""
    if not MIN_KEEPALIVE_INTERVAL_S <= interval_s <= 3600:
        raise ValueError(
            f"keepalive_interval_s must be in {MIN_KEEPALIVE_INTERVAL_S:g}..3600, got {interval_s:g}"
        )
    if not 0.5 <= timeout_s <= 600:
        raise ValueError(f"keepalive_timeout_s must be in 0.5..600, got {timeout_s:g}")


def channel_options(
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    keepalive_interval_s: float = KEEPALIVE_INTERVAL_S,
    keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_S,
) -> list[tuple[str, int]]:
    """Options for an actor's channel to the learner."""
    return [
        *_common_options(max_message_bytes, keepalive_interval_s, keepalive_timeout_s),
        # Reconnection pacing is the actor's own (with jitter and a new run id).
        ("grpc.enable_retries", 0),
    ]


def server_options(
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    keepalive_interval_s: float = KEEPALIVE_INTERVAL_S,
    keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_S,
) -> list[tuple[str, int]]:
    """Options for the learner's server."""
    return [
        *_common_options(max_message_bytes, keepalive_interval_s, keepalive_timeout_s),
        # Accept the actors' pings at any interval they may be set to, with room
        # for timer jitter (a ping is a few bytes); faster ones are sent away
        # (GOAWAY too_many_pings).
        ("grpc.http2.min_ping_interval_without_data_ms", round(MIN_KEEPALIVE_INTERVAL_S * 500)),
        # Another learner on the same port must fail to start, not share the port.
        ("grpc.so_reuseport", 0),
    ]


_ADDRESS = re.compile(r"^(?:\[(?P<ipv6>[0-9a-fA-F:.]+)\]|(?P<host>[^:\[\]]+)):(?P<port>\d+)$")


def parse_address(address: str) -> tuple[str, int]:
    """Splits "HOST:PORT" or "[IPV6]:PORT"; raises ValueError saying what is wrong."""
    match = _ADDRESS.match(address.strip())
    if not match:
        raise ValueError(f"address {address!r} is not HOST:PORT (or [IPV6]:PORT)")
    port = int(match["port"])
    if not 0 < port < 65536:
        raise ValueError(f"port {port} in {address!r} is outside 1..65535")
    return (match["ipv6"] or match["host"]), port
