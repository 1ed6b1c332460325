"""How a message quotes a request id, shared by the sender and the receiver cores."""

from __future__ import annotations

__all__ = ["QUOTED_ID_LIMIT", "quoted_id"]

#: Most characters of a request id's repr that a message quotes.
QUOTED_ID_LIMIT = 48


def quoted_id(request_id: str) -> str:
    """``repr(request_id)`` for a message, shortened: an id may be 65535 bytes, whose repr
    (control characters escaped) is four times that."""
    text = repr(request_id[:QUOTED_ID_LIMIT])
    return text if len(text) <= QUOTED_ID_LIMIT else text[: QUOTED_ID_LIMIT - 4] + "..." + text[0]
