"""What a test that talks to a server over a plain socket needs: a client connection through
its handshake, a frame read off the socket, and a wait for a condition to hold."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from kvwire.wire import Connection, ConnectionConfig, FrameDecoder, Role, State
from tests.conftest import SECRET


async def read_one_frame(reader: asyncio.StreamReader, timeout: float = 5.0) -> Any:
    """The next frame the server sends, alone in what one read gets, within ``timeout``
    seconds."""
    dec = FrameDecoder(1 << 20)
    async def go() -> Any:
        while True:
            data = await reader.read(65536)
            assert data, "server closed before sending a frame"
            got = dec.feed(data)
            if got:
                assert len(got) == 1, got
                return got[0][0]
    return await asyncio.wait_for(go(), timeout)


async def wait_until(cond: Callable[[], bool], timeout: float = 5.0) -> bool:
    """True once ``cond()`` holds, polled every 20 ms; False after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() > end:
            return False
        await asyncio.sleep(0.02)
    return True


async def raw_client(port: int, *, session_id: bytes | None = None) -> tuple[Connection, Any, Any]:
    """A client connection through its handshake (joining ``session_id``'s stream 0)."""
    cfg = ConnectionConfig(secret=SECRET) if session_id is None else ConnectionConfig(
        secret=SECRET, session_id=session_id, stream_index=0)
    conn = Connection(Role.CLIENT, cfg)
    conn.initiate()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.writelines([bytes(p) for p in conn.data_to_send()])
    while conn.state is not State.OPEN:
        data = await asyncio.wait_for(reader.read(65536), 5)
        assert data, "server closed during the handshake"
        conn.receive_data(data)
        writer.writelines([bytes(p) for p in conn.data_to_send()])
        assert conn.state is not State.CLOSED
    return conn, reader, writer
