"""A stream that closes with GOAWAY: its last frames reach the peer even while the peer
still has bytes on their way, and the stream is gone once the peer closes, or after the
linger, or when its server closes (docs/protocol.md 10)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

import kvwire
from kvwire.aio import _stream
from kvwire.aio._stream import Stream
from kvwire.errors import ErrorCode
from kvwire.wire import GoAway
from kvwire.wire.frames import HANDSHAKE_MAX_BODY, HEADER, FrameType
from tests.aio.stream_helpers import FakeTransport, Owner
from tests.rawpeer import read_one_frame, wait_until

SECRET = b"goaway-close-secret"


def _oversized_hello(extra: int) -> bytes:
    """A HELLO whose header announces more than a handshake frame may carry, followed by
    ``extra`` bytes of its body: refused from the header, the rest still on its way."""
    return HEADER.pack(FrameType.HELLO, 0, 0, HANDSHAKE_MAX_BODY + 1) + bytes(extra)


async def _read_goaway(reader: asyncio.StreamReader) -> int:
    frame = await read_one_frame(reader, 10)
    assert isinstance(frame, GoAway)
    return frame.code


async def test_a_goaway_reaches_a_peer_whose_bytes_the_server_never_read() -> None:
    """The server refuses the frame from its header and closes; a megabyte the peer sent
    behind it is unread.  Closing the socket then would reset the connection and the
    peer would never read the GOAWAY: it gets the GOAWAY, then EOF."""
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        try:
            writer.write(_oversized_hello(1 << 20))
            code = await _read_goaway(reader)
            assert code == ErrorCode.FRAME_TOO_LARGE
            assert await asyncio.wait_for(reader.read(), 10) == b""  # then the server's EOF
            await asyncio.wait_for(writer.drain(), 10)  # everything sent was taken (and dropped)
        finally:
            writer.close()
        assert await wait_until(lambda: server.statistics()["connections"] == 0, 10)


async def test_a_peer_that_never_closes_is_dropped_after_the_linger(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_stream, "CLOSE_LINGER", 0.5)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        try:
            writer.write(_oversized_hello(256 * 1024))
            assert await _read_goaway(reader) == ErrorCode.FRAME_TOO_LARGE
            assert await asyncio.wait_for(reader.read(), 10) == b""
            # The peer goes on sending and never closes: the server reads and drops it
            # until the linger passes, then drops the connection.

            async def keep_sending() -> None:
                with contextlib.suppress(OSError):
                    while True:
                        writer.write(bytes(4096))
                        await writer.drain()
                        await asyncio.sleep(0.02)

            sending = asyncio.create_task(keep_sending())
            try:
                assert await wait_until(lambda: server.statistics()["connections"] == 0, 10)
            finally:
                sending.cancel()
                await asyncio.gather(sending, return_exceptions=True)
        finally:
            writer.close()


async def test_server_close_ends_with_a_peer_that_never_closes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_stream, "CLOSE_LINGER", 120.0)  # only close() ends it
    server = await kvwire.serve("127.0.0.1", 0, secret=SECRET).__aenter__()
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        assert await wait_until(lambda: server.statistics()["connections"] == 1, 10)
        streams = list(server._by_cid.values())
        await asyncio.wait_for(server.close(), 30)
        assert all(s.closed.is_set() and s.transport is None for s in streams)
        assert server.statistics()["connections"] == 0
        assert await _read_goaway(reader) == ErrorCode.NO_ERROR
    finally:
        writer.close()


# -- the stream on its own -----------------------------------------------------------------


class HalfClosing(FakeTransport):
    """A transport that can send EOF (plain TCP) or cannot (TLS)."""

    def __init__(self, half: bool) -> None:
        super().__init__(tls=not half)
        self.half, self.eof_written = half, False

    def can_write_eof(self) -> bool:
        return self.half

    def write_eof(self) -> None:
        self.eof_written = True


@pytest.mark.parametrize("half", [True, False], ids=["tcp", "tls"])
async def test_a_closed_stream_half_closes_reads_and_drops_until_eof(half: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_stream, "CLOSE_LINGER", 120.0)
    owner, tr = Owner(), HalfClosing(half)
    s = Stream(owner, 2)
    s.connection_made(tr)
    s.pause_reading(True)  # its peer was not reading
    owner.core.out, owner.core.closed = [b"GOAWAY"], True
    s.flush()
    assert tr.written == [b"GOAWAY"] and tr.eof_written is half and not tr.is_closing()
    assert tr.reading and not s.reading_paused  # reads on, so nothing is left unread
    s.pause_reading(True)
    assert tr.reading
    fed = list(owner.core.fed)
    s.get_buffer(-1)[:4] = b"late"
    s.buffer_updated(4)
    assert owner.core.fed == fed  # dropped, not fed to the closed connection
    owner.core.out = [b"more"]
    s.flush()
    assert tr.written == [b"GOAWAY"]
    assert s.eof_received() is False  # the peer closed too: the transport closes now
    s.connection_lost(None)
    assert s.closed.is_set() and owner.lost == [s]


async def test_a_closed_stream_whose_peer_never_closes_is_aborted_at_the_linger(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_stream, "CLOSE_LINGER", 0.05)
    owner, tr = Owner(), HalfClosing(True)
    s = Stream(owner, 2)
    s.connection_made(tr)
    owner.core.closed = True
    s.flush()
    assert tr.eof_written and not tr.aborted
    assert await wait_until(lambda: tr.aborted, 10)


async def test_a_stream_whose_peer_closed_first_closes_once_written() -> None:
    owner, tr = Owner(), HalfClosing(True)
    s = Stream(owner, 2)
    s.connection_made(tr)
    s.eof_received()
    owner.core.out, owner.core.closed = [b"GOAWAY"], True
    s.flush()
    assert tr.written == [b"GOAWAY"] and tr.closing and not tr.eof_written


class _Closed:
    def __init__(self, goaway: bool, by_peer: bool) -> None:
        self.goaway, self.by_peer = goaway, by_peer


class _Conn:
    closed_event: _Closed | None = None


@pytest.mark.parametrize("half", [True, False], ids=["tcp", "tls"])
async def test_a_stream_closed_by_the_peers_goaway_closes_at_once(half: bool) -> None:
    """The peer sends nothing after its GOAWAY: nothing can be left unread, and waiting
    for it to close would make both ends wait where neither can half-close (TLS)."""
    owner, tr = Owner(), HalfClosing(half)
    conn = _Conn()
    owner.core.connection = lambda key: conn  # type: ignore[method-assign]
    s = Stream(owner, 2)
    s.connection_made(tr)

    def goaway_arrives(key: int, nbytes: int, now: float) -> bool:
        conn.closed_event = _Closed(goaway=True, by_peer=True)
        owner.core.closed = True
        return True

    owner.core.buffer_updated = goaway_arrives  # type: ignore[method-assign]
    s.get_buffer(-1)[:4] = b"GOAW"
    s.buffer_updated(4)
    s.flush()
    assert tr.closing and not tr.eof_written
