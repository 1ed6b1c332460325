"""The one connection protocol both pumps use, driven by hand: what reaches the core,
what is written, and the side-specific parts left to its owner."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from kvwire.aio._stream import LARGE_PART, RCVLOWAT_MAX, RCVLOWAT_MIN, Stream, gathers, write_parts
from kvwire.wire.crc import crc32c
from tests.aio.stream_helpers import FakeSocket, FakeTransport, Owner
from tests.conftest import require_send_queue


async def test_bytes_go_to_the_core_and_its_answers_out_then_close() -> None:
    owner, tr = Owner(), FakeTransport()
    s = Stream(owner, 3)
    s.connection_made(tr)
    assert s.peer == ("127.0.0.1", 1) and owner.pumps == 1
    s.get_buffer(-1)[:3] = b"abc"
    s.buffer_updated(3)
    assert owner.core.fed == [(3, b"abc")] and owner.pumps == 2
    owner.core.progress = False  # only bytes of an unfinished frame: no pump
    s.get_buffer(-1)[:1] = b"d"
    s.buffer_updated(1)
    assert owner.core.fed[-1] == (3, b"d") and owner.pumps == 2
    owner.core.out = [b"ack"]
    s.flush()
    assert tr.written == [b"ack"] and not tr.closing
    owner.core.closed = True
    s.flush()
    assert tr.closing
    s.pause_writing()
    s.resume_writing()
    assert owner.writable == [False, True]
    s.connection_lost(None)
    assert owner.core.fed[-1] == (3, b"") and owner.lost == [s] and s.closed.is_set() and s.transport is None


async def test_a_replaced_stream_feeds_nothing_and_an_unwanted_one_is_aborted() -> None:
    owner, tr = Owner(), FakeTransport()
    s = Stream(owner, 0)
    s.connection_made(tr)
    owner.current = False  # its slot has a newer connection
    s.get_buffer(-1)[:2] = b"zz"
    s.buffer_updated(2)
    s.eof_received()
    s.pause_writing()
    assert owner.core.fed == [] and owner.writable == []
    unwanted, tr2 = Stream(Owner(want=False), 1), FakeTransport()
    unwanted.connection_made(tr2)
    assert tr2.aborted and not unwanted.made
    unwanted.connection_lost(None)
    assert unwanted.owner.lost == [] and unwanted.closed.is_set()  # type: ignore[attr-defined]


async def test_pause_reading_is_idempotent_and_tracked() -> None:
    owner, tr = Owner(), FakeTransport()
    s = Stream(owner, 0)
    s.connection_made(tr)
    s.pause_reading(True)
    s.pause_reading(True)
    assert s.reading_paused and not tr.reading
    s.pause_reading(False)
    assert not s.reading_paused and tr.reading


def test_large_parts_are_written_alone_and_small_neighbours_joined() -> None:
    # A frame's parts: header, a payload given as a view of 2-byte items, the CRC; then an
    # ack.  Every byte goes out in order, the payload in one write of its own (not copied
    # into a joined buffer), the small parts around it joined.
    payload = np.arange(LARGE_PART, dtype=np.uint16)
    parts = [b"HDR", b"params", memoryview(payload), b"CRC!", b"ack"]
    tr = FakeTransport()
    write_parts(tr, parts)
    assert b"".join(tr.written) == b"HDR" + b"params" + payload.tobytes() + b"CRC!" + b"ack"
    assert tr.written == [b"HDRparams", payload.tobytes(), b"CRC!ack"]
    tr2 = FakeTransport()
    write_parts(tr2, [b"a", b"b"])
    assert tr2.written == [b"ab"]


def test_the_send_queue_gets_each_run_of_small_parts_as_one() -> None:
    """The compiled queue keeps an entry per part (about 150 bytes): 20-byte frames pushed
    one by one (a PING flood answered while the peer does not read) would cost many times
    the bytes the queue counts against its limit. Small runs are joined; a checked payload
    and a large buffer pass as they are, in order."""
    from kvwire.aio._stream import _queue_parts
    from kvwire.wire import Chunk
    from kvwire.wire.frames import CheckedPayload, encode_chunk_checked_as_written

    pongs = [struct.pack("<5sQ", b"PONG!", i) for i in range(1000)]
    assert _queue_parts(pongs) == [b"".join(pongs)]
    payload = bytes(range(256)) * (4 * 1024)
    chunk = Chunk(transfer_id=1, layer=0, kind=0, codec_id=0, token_start=0, token_count=1,
                  layer_tokens=1, params=b"", payload=payload)
    *heads, checked = encode_chunk_checked_as_written(chunk)
    assert isinstance(checked, CheckedPayload)
    big = memoryview(np.arange(LARGE_PART, dtype=np.uint16))
    parts = _queue_parts([b"ack1", b"ack2", *heads, checked, b"ack3", big, b"x"])
    assert parts[0] == b"ack1ack2" + b"".join(bytes(h) for h in heads)
    assert parts[1] == (checked.payload, checked.crc)
    assert parts[2:] == [b"ack3", big, b"x"]


async def test_rcvlowat_follows_the_payload_the_peer_committed_to() -> None:
    """While a large payload arrives the socket wakes the reader only once (at most) the
    rest of it is in; below RCVLOWAT_MIN, and after it, every byte wakes it again."""
    owner, sock = Owner(), FakeSocket()
    s = Stream(owner, 0)
    s.connection_made(FakeTransport(sock))
    for remaining in (0, 3 * RCVLOWAT_MAX, RCVLOWAT_MAX // 2, RCVLOWAT_MAX // 2, RCVLOWAT_MIN - 1, 0):
        owner.core.remaining = remaining
        s.get_buffer(-1)
        s.buffer_updated(1)
    assert sock.lowat == [RCVLOWAT_MAX, RCVLOWAT_MAX // 2, 1]  # set only when it changes


async def test_rcvlowat_is_left_alone_under_tls() -> None:
    owner, sock = Owner(), FakeSocket()
    s = Stream(owner, 0)
    s.connection_made(FakeTransport(sock, tls=True))
    owner.core.remaining = RCVLOWAT_MAX
    s.buffer_updated(1)
    assert sock.lowat == []


def test_a_checked_payload_is_written_piece_by_piece_as_its_frame() -> None:
    from kvwire.wire import Chunk, frame_bytes
    from kvwire.wire.frames import CHECK_AS_WRITTEN, encode_chunk_checked_as_written

    payload = bytes(range(256)) * (9 * 1024)  # 2.25 MiB: pieces of CHECK_AS_WRITTEN
    chunk = Chunk(transfer_id=1, layer=0, kind=0, codec_id=0, token_start=0, token_count=1,
                  layer_tokens=1, params=b"", payload=payload)
    tr = FakeTransport()
    write_parts(tr, [b"ack!", *encode_chunk_checked_as_written(chunk), b"next"])
    assert b"".join(tr.written) == b"ack!" + frame_bytes(chunk) + b"next"
    assert [len(w) for w in tr.written[1:-1]] == [CHECK_AS_WRITTEN] * 9  # each piece alone


def test_with_gather_the_small_parts_go_in_one_write_with_the_large_part_after_them() -> None:
    """What precedes a large part (an ack, a frame's header and params, the trailer of the
    frame before) goes in one writelines() with it, so no write (and, with TCP_NODELAY, no
    packet) carries a header alone; the bytes and their order are those of plain writes."""
    from kvwire.wire import Chunk, frame_bytes
    from kvwire.wire.frames import CHECK_AS_WRITTEN, encode_chunk_checked_as_written

    def chunk(layer: int) -> Chunk:
        return Chunk(transfer_id=1, layer=layer, kind=0, codec_id=0, token_start=0, token_count=1,
                     layer_tokens=1, params=b"p", payload=bytes([layer]) * (5 * CHECK_AS_WRITTEN))

    parts = [b"ack!", *encode_chunk_checked_as_written(chunk(0)), *encode_chunk_checked_as_written(chunk(1)), b"next"]
    stream = b"ack!" + frame_bytes(chunk(0)) + frame_bytes(chunk(1)) + b"next"
    tr = FakeTransport()
    write_parts(tr, parts, gather=True)
    assert b"".join(tr.written) == stream
    # Per frame: one writelines() of what came before it and its first piece, then four
    # pieces alone; at the end the last trailer and "next" together.
    assert len(tr.gathered) == 2 and [len(g[1]) for g in tr.gathered] == [CHECK_AS_WRITTEN] * 2
    assert tr.gathered[0][0].startswith(b"ack!") and len(tr.gathered[1][0]) == len(tr.gathered[0][0])  # CRC + head
    assert [len(w) for w in tr.written if w not in map(b"".join, tr.gathered)] == [CHECK_AS_WRITTEN] * 8 + [4 + 4]
    plain = FakeTransport()
    write_parts(plain, parts)
    assert plain.gathered == [] and b"".join(plain.written) == stream


def test_gather_is_used_on_uvloop_tcp_only() -> None:
    import uvloop

    assert not gathers(FakeTransport()) and not gathers(FakeTransport(tls=True))
    loop = uvloop.new_event_loop()
    try:
        server = loop.run_until_complete(loop.create_server(asyncio.Protocol, "127.0.0.1", 0))
        port = server.sockets[0].getsockname()[1]
        tr, _ = loop.run_until_complete(loop.create_connection(asyncio.Protocol, "127.0.0.1", port))
        assert gathers(tr)
        tr.close()
        server.close()
        loop.run_until_complete(server.wait_closed())
    finally:
        loop.close()


# -- the compiled send queue on a real connection ----------------------------------------


async def _connected(owner: Owner) -> tuple[Stream, socket.socket]:
    """A Stream connected over loopback to a plain socket the test reads from, both with
    small fixed buffers, so that the kernel holds no more than a few hundred KiB of what
    the stream writes, whatever this host's autotuning limits."""
    loop = asyncio.get_running_loop()
    lst = socket.create_server(("127.0.0.1", 0))
    lst.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)  # the accepted socket's
    lst.setblocking(False)
    accepted = asyncio.ensure_future(loop.sock_accept(lst))
    tr, stream = await loop.create_connection(lambda: Stream(owner, 1), *lst.getsockname())
    tr.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
    peer, _ = await accepted
    lst.close()
    return stream, peer


@contextlib.asynccontextmanager
async def _queued() -> AsyncIterator[tuple[Owner, Stream, socket.socket]]:
    """An owner, its stream writing through the send queue, and the peer socket; both
    closed afterwards."""
    require_send_queue()
    owner = Owner()
    stream, peer = await _connected(owner)
    try:
        yield owner, stream, peer
    finally:
        peer.close()
        stream.abort()


async def _read(peer: socket.socket, nbytes: int | None) -> bytes:
    """``nbytes`` from ``peer`` (None: until EOF)."""
    loop, got = asyncio.get_running_loop(), bytearray()
    while nbytes is None or len(got) < nbytes:
        data = await asyncio.wait_for(loop.sock_recv(peer, 1 << 20), 10)
        if not data:
            break
        got += data
    return bytes(got)


async def test_with_the_send_queue_a_stream_stops_taking_frames_until_the_kernel_has_taken_them() -> None:
    """Plain TCP with the compiled queue: the stream writes through it, not the transport;
    above QUEUE_HIGH queued bytes the owner is told it is not writable, and writable again
    once the peer read enough; the bytes are the frames' own."""
    import kvwire.aio._stream as stream_mod
    from kvwire.wire.frames import CheckedPayload

    async with _queued() as (owner, stream, peer):
        assert stream._queue is not None
        payload = memoryview(np.random.default_rng(5).integers(0, 256, 3 * stream_mod.QUEUE_HIGH, dtype=np.uint8))
        owner.core.out = [b"head", CheckedPayload(payload, 99), b"tail"]
        stream.flush()
        assert owner.writable == [False]  # the peer reads nothing yet: most of it is queued
        assert stream.transport is not None and stream.transport.get_write_buffer_size() == 0
        expect = b"head" + bytes(payload) + struct.pack(">I", crc32c(payload, 99)) + b"tail"
        assert await _read(peer, len(expect)) == expect
        for _ in range(100):
            if owner.writable == [False, True]:
                break
            await asyncio.sleep(0.01)
        assert owner.writable == [False, True]
        assert stream._queue.pending == 0


async def test_with_the_send_queue_a_closed_stream_writes_everything_before_its_eof(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kvwire.aio._stream as stream_mod

    monkeypatch.setattr(stream_mod, "CLOSE_LINGER", 120.0)
    async with _queued() as (owner, stream, peer):
        last = bytes(range(256)) * 40_000  # 10 MiB: more than the kernel takes at once
        owner.core.out, owner.core.closed = [last], True
        stream.flush()
        assert stream.transport is not None and not stream.transport.is_closing()  # not yet written
        assert await _read(peer, None) == last  # all of it, then EOF
        assert stream._queue is None  # its descriptor closed once all was written
        # Half-closed: the stream waits for the peer to close in turn (docs/protocol.md 10).
        assert not stream.closed.is_set()
        peer.shutdown(socket.SHUT_WR)
        await asyncio.wait_for(stream.closed.wait(), 10)


async def test_with_the_send_queue_abort_drops_what_is_queued_and_resets() -> None:
    async with _queued() as (owner, stream, peer):
        owner.core.out = [b"x" * (16 << 20)]
        stream.flush()
        q = stream._queue
        assert q is not None and q.pending > 0
        fd = q.fd
        stream.abort()
        assert stream._queue is None and q.pending == 0
        with pytest.raises(OSError):
            os.fstat(fd)  # the queue's descriptor is closed
        await asyncio.wait_for(stream.closed.wait(), 10)
        got = await _read(peer, None)  # what the kernel had taken, then the end
        assert len(got) < 16 << 20


async def test_with_the_send_queue_rcvlowat_is_set_through_the_queues_socket_on_the_same_connection() -> None:
    import kvwire.aio._stream as stream_mod

    async with _queued() as (_, stream, _peer):
        if not stream_mod.USE_RCVLOWAT:  # a kernel that does not size reads by it: none set
            assert stream._own is not None and stream._lowat_sock is None
            return
        assert stream._own is not None and stream._lowat_sock is stream._own
        stream.lowat(200_000)
        assert stream.transport is not None
        tsock = stream.transport.get_extra_info("socket")
        assert tsock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 200_000  # the same socket
        stream.abort()
        assert stream._lowat_sock is None and stream._own is None


class _Addresses:
    def __init__(self, peer: Any, own: Any) -> None:
        self.extra = {"peername": peer, "sockname": own}

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.extra.get(name, default)


def test_a_peer_on_this_host_is_one_at_a_loopback_address_or_the_connections_own() -> None:
    from kvwire.aio._stream import on_this_host

    assert on_this_host(_Addresses(("127.0.0.1", 9), ("127.0.0.1", 5)))
    assert on_this_host(_Addresses(("127.3.2.1", 9), ("10.0.0.1", 5)))
    assert on_this_host(_Addresses(("::1", 9, 0, 0), ("::1", 5, 0, 0)))
    assert on_this_host(_Addresses(("10.1.2.3", 9), ("10.1.2.3", 5)))  # this host's own address
    assert not on_this_host(_Addresses(("10.1.2.3", 9), ("10.1.2.4", 5)))  # another host (or namespace)
    assert not on_this_host(_Addresses("/tmp/kv.sock", "/tmp/kv.sock"))  # not an IP connection
    assert not on_this_host(_Addresses(("not-an-address", 9), ("x", 5)))
    assert not on_this_host(_Addresses(None, None))
    assert not on_this_host(None)


async def test_auto_over_loopback_counts_both_ends_on_this_hosts_cores() -> None:
    import kvwire
    from kvwire.aio._send import available_cpus

    secret = b"k" * 32
    async with kvwire.serve("127.0.0.1", 0, secret=secret) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=secret, codec="auto") as peer:
            chooser = peer.chooser
            assert chooser is not None
            assert chooser.shared_host and chooser.cores == available_cpus() >= 1
        async with kvwire.connect("127.0.0.1", server.port, secret=secret, codec="raw") as fixed:
            assert fixed.chooser is None
