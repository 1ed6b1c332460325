"""What a log line says of its peer: the text a peer chose, escaped and cut, its address,
and an error code by name.  One rule for the server, the client and ``kvwire serve``."""

from __future__ import annotations

from typing import Any

from kvwire.errors import ErrorCode

#: Most characters of a peer's text (a request id, a RESET or GOAWAY message, an error it
#: caused) a log line quotes: a request id may be 65535 bytes.
PEER_TEXT_LIMIT = 500


def printable(text: str, limit: int = PEER_TEXT_LIMIT) -> str:
    """``text`` for a log line: every character that is not printable (line breaks, other
    control characters, format characters such as bidirectional overrides) and the
    backslash as its Python escape, so that text a peer chose can neither forge a line nor
    hide part of one, nor pass for an escape; cut after ``limit`` characters ("..." then
    says so)."""
    short = text[:limit]
    if not (short.isprintable() and "\\" not in short):
        short = "".join(c if c.isprintable() and c != "\\" else repr(c)[1:-1] for c in short)
    return short + "..." if len(text) > limit else short


def address(peer: Any) -> str:
    """A peer's address for a log line: ``host:port`` (``[host]:port`` for IPv6)."""
    if isinstance(peer, tuple) and len(peer) >= 2:
        host = str(peer[0])
        return f"[{host}]:{peer[1]}" if ":" in host else f"{host}:{peer[1]}"
    return printable(str(peer)) if peer else "a client"


def code_name(code: int) -> str:
    """An error code for a log line: its name and number (an unknown one, the number)."""
    try:
        return f"{ErrorCode(code).name} (0x{code:04x})"
    except ValueError:
        return f"code 0x{code:04x}"
