"""The compiled send queue (``kvwire.aio._sendq``) when a ranges item's spans change while
``push()`` runs: a push counts the parts of its items (one per range of a ranges item)
and reserves that many, then converts each item, which may run Python code (a crc's
``__index__``, a ``more`` flag's ``__bool__``).  Spans made longer in between take more
parts than were reserved: the push is refused with nothing queued, whatever room the
queue's array has left, and the queue goes on working.  Spans made shorter need fewer
parts and are pushed as they are when read.  Without the extension streams write through
their transports (``tests/aio/test_stream.py``)."""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvwire._extensions import load_extension
from kvwire.wire.crc import crc32c
from tests.conftest import needs_extension

EXT = "kvwire.aio._sendq"
sendq = load_extension(EXT)
pytestmark = needs_extension(sendq is not None, EXT)


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    a.setblocking(False)
    b.settimeout(10)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def pairs(n: int) -> bytes:
    """``n`` (start, size) int64 pairs: 8-byte ranges one after the other."""
    return np.array([[8 * i, 8] for i in range(n)], np.int64).tobytes()


def read(b: socket.socket, n: int) -> bytes:
    got = bytearray()
    while len(got) < n:
        data = b.recv(n - len(got))
        assert data, "the writer's side closed early"
        got += data
    return bytes(got)


class OnIndex:
    """A crc whose ``__index__`` runs ``hook`` (push converts it after counting parts)."""

    def __init__(self, hook: Callable[[], None]) -> None:
        self.hook = hook

    def __index__(self) -> int:
        self.hook()
        return 0


class OnBool:
    """A ``more`` flag whose ``__bool__`` runs ``hook``."""

    def __init__(self, hook: Callable[[], None]) -> None:
        self.hook = hook

    def __bool__(self) -> bool:
        self.hook()
        return False


def grow_to(spans: bytearray, n: int) -> Callable[[], None]:
    def hook() -> None:
        spans[:] = pairs(n)

    return hook


@pytest.mark.parametrize("via", ["crc", "more"])
@pytest.mark.parametrize("after", [1, 3])
def test_spans_made_longer_during_a_push_are_refused_and_nothing_is_queued(
    pair: tuple[socket.socket, socket.socket], via: str, after: int,
) -> None:
    """Counted as 1 range (1 + ``after`` parts reserved), read as 3 or 4: refused, though
    the queue's array (16 parts) has room for all of them."""
    assert sendq is not None
    a, b = pair
    q = sendq.SendQueue(a.fileno())
    base = bytearray(range(64))
    spans = bytearray(pairs(1))
    hook = grow_to(spans, 4 if after == 1 else 3)
    item = (base, OnIndex(hook), False, spans) if via == "crc" else (base, 0, OnBool(hook), spans)
    with pytest.raises(ValueError, match="spans changed while it was pushed"):
        q.push([item, *[b"tail"] * after])
    assert q.pending == 0 and q.flush() == 0
    base.extend(b"x")  # nothing is held: the bytearrays may resize
    spans.extend(b"y")
    # the queue goes on working
    q.push([b"head", (bytes(range(40)), 5, False, pairs(2)), b"end"])
    want = b"head" + bytes(range(16)) + struct.pack(">I", crc32c(bytes(range(16)), 5)) + b"end"
    assert q.flush() == 0
    assert read(b, len(want)) == want


def test_spans_made_longer_after_a_shorter_one_are_refused(pair: tuple[socket.socket, socket.socket]) -> None:
    """Two ranges items, the first's spans made shorter and the second's longer by as
    many ranges: still more parts than reserved after the plain items, refused."""
    assert sendq is not None
    a, _ = pair
    q = sendq.SendQueue(a.fileno())
    base = bytes(64)
    first, second = bytearray(pairs(3)), bytearray(pairs(1))

    def change() -> None:
        first[:] = pairs(1)
        second[:] = pairs(4)

    with pytest.raises(ValueError, match="spans changed while it was pushed"):
        q.push([(base, OnIndex(change), False, first), (base, 0, False, second), b"a", b"b"])
    assert q.pending == 0 and q.flush() == 0


def test_spans_made_shorter_during_a_push_are_pushed_as_read(pair: tuple[socket.socket, socket.socket]) -> None:
    assert sendq is not None
    a, b = pair
    q = sendq.SendQueue(a.fileno())
    base = bytes(range(64))
    spans = bytearray(pairs(5))
    q.push([(base, OnIndex(grow_to(spans, 2)), False, spans), b"tail"])
    want = base[:16] + struct.pack(">I", crc32c(base[:16], 0)) + b"tail"
    assert q.pending == len(want)
    assert q.flush() == 0
    assert read(b, len(want)) == want
