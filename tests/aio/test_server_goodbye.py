"""A server that closes with no transfer of a peer's in progress: the peer's session ends
for the reason its GOAWAYs give, and a send on it says the server is shutting down (it
said "stream N closed")."""

from __future__ import annotations

import asyncio

import pytest

import kvwire
from tests.conftest import SECRET, make_layers

pytestmark = pytest.mark.timeout(60)

SPEC = kvwire.KVSpec(num_layers=2, num_kv_heads=2, head_dim=16)


async def test_a_send_after_the_server_closed_says_it_is_shutting_down() -> None:
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, streams=2) as peer:
            await server.close()
            loop = asyncio.get_running_loop()
            end = loop.time() + 30
            while peer.core.broken is None and loop.time() < end:
                await asyncio.sleep(0.01)
            assert isinstance(peer.core.broken, kvwire.ConnectionLostError), peer.core.broken
            with pytest.raises(kvwire.ConnectionLostError, match="the server is shutting down"):
                await peer.send("late", SPEC, make_layers(2, 8, 2, 16), timeout=10)
