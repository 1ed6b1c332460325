"""How a message quotes a request id, shared by the sender and the receiver cores."""

from __future__ import annotations

__all__ = ["LOCAL_ID_LIMIT", "QUOTED_ID_LIMIT", "local_id", "quoted_id"]

#: Most characters of a request id's repr that a message quotes.
QUOTED_ID_LIMIT = 48
#: Most characters of a request id's repr that a message kept on this host quotes (one
#: never sent on the wire, such as kvwire.sync's): a serving engine's ids stay whole
#: (vLLM's, with the connector's suffix, run to about 90), a 64 KiB one does not.
LOCAL_ID_LIMIT = 256


def quoted_id(request_id: str, limit: int = QUOTED_ID_LIMIT) -> str:
    """``repr(request_id)`` for a message, shortened to ``limit`` characters: an id may be
    65535 bytes, whose repr (control characters escaped) is four times that."""
    text = repr(request_id[:limit])
    return text if len(text) <= limit else text[: limit - 4] + "..." + text[0]


def local_id(request_id: str) -> str:
    """:func:`quoted_id` for a message kept on this host, up to :data:`LOCAL_ID_LIMIT`."""
    return quoted_id(request_id, LOCAL_ID_LIMIT)
