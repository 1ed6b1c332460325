"""``Server.close()`` cancelled still closes the server, as ``Peer.close()`` does: a close
cancelled while it waited for a client that does not close its side left that connection
open, the server marked closed and its timer gone, until the stream's own bound on
closing (``CLOSE_LINGER``) or another close() ended it."""

from __future__ import annotations

import asyncio
import socket

import pytest

import kvwire
from kvwire.aio import _stream
from tests.conftest import SECRET
from tests.rawpeer import wait_until

pytestmark = pytest.mark.timeout(60)


async def read_to_end(sock: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    try:
        while await loop.sock_recv(sock, 65536):
            pass
    except ConnectionError:
        pass


async def raw_client(port: int) -> socket.socket:
    """A client that never says a word, nor closes its side (it does not read the GOAWAY)."""
    sock = socket.socket()
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    return sock


async def test_a_cancelled_close_still_closes_every_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    # Only close()'s teardown drops the connection here (not the stream's own bound on
    # closing, which is not what is tested).
    monkeypatch.setattr(_stream, "CLOSE_LINGER", 600.0)
    server = kvwire.serve("127.0.0.1", 0, secret=SECRET)
    await server.start()
    sock = await raw_client(server.port)
    try:
        assert await wait_until(lambda: server.statistics()["connections"] == 1, 10)
        closing = asyncio.create_task(server.close())
        await asyncio.sleep(0)  # (under way)
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
        # The teardown goes on: the connection is dropped (after its linger)...
        assert await wait_until(lambda: server.statistics()["connections"] == 0, 10)
        async with asyncio.timeout(10):
            await read_to_end(sock)
        # ... and every task of the server ends; a second close() waits for the same one.
        assert server._close_task is not None
        async with asyncio.timeout(10):
            await asyncio.shield(server._close_task)
        assert not server._tasks and server.closed
        async with asyncio.timeout(10):
            await server.close()
    finally:
        sock.close()
        await server.close()  # (for a server whose close did not go on)


async def test_a_close_while_another_is_under_way_waits_for_it() -> None:
    server = kvwire.serve("127.0.0.1", 0, secret=SECRET)
    await server.start()
    sock = await raw_client(server.port)
    try:
        assert await wait_until(lambda: server.statistics()["connections"] == 1, 10)
        first = asyncio.create_task(server.close())
        await asyncio.sleep(0)
        task = server._close_task
        second = asyncio.create_task(server.close())
        async with asyncio.timeout(10):
            await asyncio.gather(first, second)
        assert server._close_task is task and task is not None and task.done()
        assert not server._tasks and not server._by_cid
    finally:
        sock.close()
