"""What a log line says of its peer: the text a peer chose, escaped and cut, its address,
and an error code by name.  One rule for the server, the client and ``kvwire serve``."""

from __future__ import annotations

import socket
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


def scoped_host(sockaddr: tuple[Any, ...]) -> str:
    """The host of a socket address, with its zone (``fe80::1%eth0``) where an IPv6
    address has a scope: a link-local address names no host without the interface it is
    reached through.  The interface is named where the system can name it, else given
    by its index."""
    host = str(sockaddr[0])
    scope = sockaddr[3] if len(sockaddr) >= 4 else 0
    if isinstance(scope, int) and scope and "%" not in host:
        try:
            zone = socket.if_indextoname(scope)
        except (AttributeError, OSError, ValueError, OverflowError):
            zone = str(scope)
        host = f"{host}%{zone}"
    return host


def address(peer: Any) -> str:
    """A peer's address for a log line: ``host:port``, ``[host]:port`` for IPv6, its zone
    included where it has a scope (``[fe80::1%eth0]:7070``)."""
    if isinstance(peer, tuple) and len(peer) >= 2:
        host = scoped_host(peer)
        return f"[{host}]:{peer[1]}" if ":" in host else f"{host}:{peer[1]}"
    return printable(str(peer)) if peer else "a client"


def code_name(code: int) -> str:
    """An error code for a log line: its name and number (an unknown one, the number)."""
    try:
        return f"{ErrorCode(code).name} (0x{code:04x})"
    except ValueError:
        return f"code 0x{code:04x}"
