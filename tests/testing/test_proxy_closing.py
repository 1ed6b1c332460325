"""A proxy closed while a connection is being accepted (kvwire.bench._proxy.TcpProxy,
behind kvwire.testing.FaultProxy): the connection is closed too, not left open after the
proxy's close() returned (its socket then outlived the proxy's loop, and a test's
ResourceWarning for it failed whichever test collected it)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from kvwire.testing import FaultProxy


@pytest.mark.parametrize("turns", range(6))
async def test_a_connection_accepted_as_the_proxy_closes_is_closed(turns: int) -> None:
    """A client connects (the kernel completes the handshake before the proxy's loop
    accepts it) and the proxy is closed ``turns`` loop turns later: around its accept,
    whose transport is made a turn after the accept itself.  Whichever turn it is, the
    client's connection ends (EOF or reset) once the proxy closed."""
    target = socket.create_server(("127.0.0.1", 0))  # (the kernel completes the proxy's connects)
    proxy = FaultProxy("127.0.0.1", target.getsockname()[1])
    await proxy.start()
    client = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
    try:
        for _ in range(turns):
            await asyncio.sleep(0)
        await proxy.close()
        for _ in range(10):  # what the proxy's loop still has to run of that connection
            await asyncio.sleep(0)
        loop = asyncio.get_running_loop()
        try:
            data = await asyncio.wait_for(loop.run_in_executor(None, client.recv, 1), 10)
        except ConnectionResetError:
            data = b""
        except TimeoutError:
            pytest.fail("the connection was left open after the proxy closed")
        assert data == b""
        assert proxy.statistics().active == 0
    finally:
        client.close()
        target.close()
