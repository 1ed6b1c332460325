"""Peer.close(): one close that every caller waits for, not cancelled with its caller; a
failed connect that does not wait for a silent server."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import kvwire
from kvwire.aio import _stream
from kvwire.aio.client import Peer
from kvwire.errors import TransferTimeoutError

pytestmark = pytest.mark.timeout(60)

SECRET = b"peer-close-secret"


def _open_transports(peer: Peer) -> int:
    return sum(s.transport is not None for s in (*peer.streams, *peer._retired))


async def _deaf_server_and_peer() -> tuple[kvwire.Server, Peer]:
    """A peer of 3 streams whose server has stopped reading them: a GOAWAY the peer writes
    on close is never read, so its streams wait out the close's linger."""
    server = kvwire.serve("127.0.0.1", 0, secret=SECRET)
    await server.start()
    peer = kvwire.connect("127.0.0.1", server.port, secret=SECRET, streams=3)
    await peer.open()
    for s in server._by_cid.values():
        assert s.transport is not None
        s.transport.pause_reading()
    return server, peer


async def test_a_close_while_another_is_under_way_returns_once_the_peer_is_closed() -> None:
    server, peer = await _deaf_server_and_peer()
    try:
        first = asyncio.create_task(peer.close())
        await asyncio.sleep(0)  # the first close is waiting for its streams
        await asyncio.wait_for(peer.close(), 30)
        assert _open_transports(peer) == 0 and not peer._tasks
        await asyncio.wait_for(first, 30)
    finally:
        await server.close()


async def test_a_cancelled_close_still_closes_and_a_later_close_waits_for_it() -> None:
    server, peer = await _deaf_server_and_peer()
    try:
        closing = asyncio.create_task(peer.close())
        await asyncio.sleep(0.05)  # the close is waiting for its streams
        assert not closing.done()
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
        await asyncio.wait_for(peer.close(), 30)
        assert _open_transports(peer) == 0 and not peer._tasks
        await asyncio.wait_for(peer.close(), 30)  # (idempotent)
    finally:
        await server.close()


async def test_a_connect_that_fails_does_not_wait_for_a_silent_server_to_close(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server that accepts and never answers: the handshake times out after
    connect_timeout, and connect() fails then, its sockets dropped, without giving the
    server time to see its GOAWAY (docs/protocol.md 16: connect() within twice
    connect_timeout).  Any wait for a peer to close (the close's, the stream's own linger)
    is made a minute long here."""
    real = _stream.wait_closed

    async def slow_wait_closed(streams: Any, timeout: float) -> None:
        await real(streams, 60.0 if timeout > 0 else timeout)

    monkeypatch.setattr(_stream, "wait_closed", slow_wait_closed)
    monkeypatch.setattr(_stream, "CLOSE_LINGER", 60.0)
    held: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        await reader.read()

    listener = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        for streams in (1, 2):
            peer = kvwire.connect("127.0.0.1", port, secret=SECRET, streams=streams, connect_timeout=0.5)
            with pytest.raises(TransferTimeoutError):
                await asyncio.wait_for(peer.open(), 20)
            assert _open_transports(peer) == 0 and not peer._tasks
    finally:
        for w in held:
            w.close()
        listener.close()
        await listener.wait_closed()
