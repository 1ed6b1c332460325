"""A log line's address of a link-local IPv6 peer keeps its zone."""

from __future__ import annotations

import socket

from kvwire.aio._logtext import address


def test_a_link_local_address_keeps_its_zone() -> None:
    """A link-local peer was logged as [fe80::1]:PORT, its interface lost (the client
    writes fe80::1%lo)."""
    index, name = socket.if_nameindex()[0]
    assert address(("fe80::1", 47334, 0, index)) == f"[fe80::1%{name}]:47334"
    assert address(("fe80::1%lo", 47334, 0, 1)) == "[fe80::1%lo]:47334"  # not twice
    assert address(("fe80::1", 47334, 0, 0x7FFFFFF0)) == f"[fe80::1%{0x7FFFFFF0}]:47334"  # no such interface
    assert address(("::1", 5, 0, 0)) == "[::1]:5"
    assert address(("127.0.0.1", 5)) == "127.0.0.1:5"
