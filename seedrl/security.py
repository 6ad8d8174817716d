"""Who may talk to the learner: a shared token, and TLS, for both ends.

The token travels as gRPC metadata (`authorization: Bearer TOKEN`) on every
stream; the learner compares it in constant time before it reads a single
message, and ends a stream without it, or with a wrong one, with
UNAUTHENTICATED. It comes from a flag or from SEEDRL_AUTH_TOKEN, and is
never logged or written to the run directory.

TLS is on when the learner is given a certificate and key: actors then need
the CA that signed it (`--tls-ca`), and, if the learner names a client CA,
a certificate of their own. scripts/make_certs.sh makes a self-signed set.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Sequence

import grpc

TOKEN_ENV = "SEEDRL_AUTH_TOKEN"
METADATA_KEY = "authorization"
SCHEME = "Bearer "


def resolve_token(flag_value: str) -> str:
    """The flag's token, else the environment's, else "" (no authentication)."""
    return flag_value or os.environ.get(TOKEN_ENV, "")


def call_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """What an actor sends with each stream."""
    return ((METADATA_KEY, SCHEME + token),) if token else ()


def token_matches(metadata: Sequence[tuple[str, str | bytes]] | None, token: str) -> bool:
    """Whether a call's metadata carries `token` (always true when no token is set)."""
    if not token:
        return True
    for key, value in metadata or ():
        if key == METADATA_KEY and isinstance(value, str) and value.startswith(SCHEME):
            return hmac.compare_digest(value[len(SCHEME) :].encode(), token.encode())
    return False


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError as error:
        raise ValueError(f"cannot read the {what} {path!r}: {error.strerror}") from error


def server_credentials(cert: str, key: str, client_ca: str = "") -> grpc.ServerCredentials:
    """TLS for the learner; with `client_ca`, actors must present a certificate it signed."""
    return grpc.ssl_server_credentials(
        [(_read(key, "TLS key"), _read(cert, "TLS certificate"))],
        root_certificates=_read(client_ca, "client CA") if client_ca else None,
        require_client_auth=bool(client_ca),
    )


def channel_credentials(ca: str, cert: str = "", key: str = "") -> grpc.ChannelCredentials:
    """TLS for an actor: the learner's CA, and optionally the actor's own certificate."""
    if bool(cert) != bool(key):
        raise ValueError("a client certificate needs its key, and a key its certificate")
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca, "TLS CA"),
        private_key=_read(key, "TLS key") if key else None,
        certificate_chain=_read(cert, "TLS certificate") if cert else None,
    )
