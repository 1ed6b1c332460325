"""How a stream reads its owner's two declared flags: ``replaces_streams`` (is every read
to ask ``is_current``) and ``fixed_connections`` (does it read into its core connection
straight), each read once, and which owners say what."""

from __future__ import annotations

from typing import Any

from kvwire.aio._stream import Pump, Stream
from kvwire.aio.client import PeerLink
from kvwire.aio.server import Server
from tests.aio.stream_helpers import FakeTransport, Owner


class Counting(Owner):
    """An owner with its own ``is_current`` that says it replaces no stream."""

    replaces_streams = False

    def __init__(self) -> None:
        super().__init__()
        self.asked = 0

    def is_current(self, stream: Stream) -> bool:
        self.asked += 1
        return False


class Fixed(Owner):
    fixed_connections = True

    def __init__(self) -> None:
        super().__init__()
        self.core.connection = lambda key: ("conn", key)  # type: ignore[method-assign]


async def test_an_owner_that_replaces_no_stream_is_not_asked_per_read() -> None:
    owner, tr = Counting(), FakeTransport()
    s = Stream(owner, 0)
    s.connection_made(tr)
    s.get_buffer(-1)[:2] = b"ab"
    s.buffer_updated(2)
    assert owner.core.fed == [(0, b"ab")] and owner.asked == 0


async def test_an_owner_that_replaces_streams_is_asked_per_read() -> None:
    owner, tr = Owner(), FakeTransport()
    s = Stream(owner, 0)
    s.connection_made(tr)
    owner.current = False
    s.get_buffer(-1)[:2] = b"ab"
    s.buffer_updated(2)
    assert owner.core.fed == []


async def test_fixed_connections_is_read_from_the_owner() -> None:
    fixed, plain = Fixed(), Owner()
    a, b = Stream(fixed, 4), Stream(plain, 4)
    a.connection_made(FakeTransport())
    b.connection_made(FakeTransport())
    fixed_conn: Any = a._fixed
    assert fixed_conn == ("conn", 4) and b._fixed is None


def test_which_owners_say_what() -> None:
    assert Pump.replaces_streams is False and Pump.fixed_connections is False
    assert Server.replaces_streams is False and Server.fixed_connections is True
    assert PeerLink.replaces_streams is True and PeerLink.fixed_connections is False
