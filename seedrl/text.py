"""Text a peer supplies, made safe to log or echo back."""

from __future__ import annotations

MAX_SHOWN_CHARS = 64
"""Characters of a peer's text kept where it is logged or echoed in a status."""


def shown(text: str, limit: int = MAX_SHOWN_CHARS) -> str:
    """A peer's text as it may be logged or echoed: quoted, control characters escaped (no
    forged log lines, no terminal escapes) and at most `limit` characters of it."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"
