"""A send() that times out while stream 0 of its session is stalled: its RESET(TIMEOUT)
goes on every open stream, so the receiver reads it on stream 1 and fails the transfer
with TransferTimeoutError at once, while the peer stays open.  Before, it went on stream
0 only (the first open one), behind the bytes the server did not read: the receiver
learned only when that stream broke at the idle timeout (30 s by default), or with
ConnectionLostError when the client closed first, the server holding the transfer's
buffer meanwhile."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

import kvwire
from tests.conftest import make_layers

pytestmark = pytest.mark.timeout(90)

SECRET = b"reset-on-stalled-stream-secret"
SPEC = kvwire.KVSpec(num_layers=4, num_kv_heads=2, head_dim=16)
FAR = 600.0  # idle timeouts and the server's own deadline: none of them may end the wait


async def test_a_send_timing_out_while_stream_0_is_stalled_fails_the_receivers_transfer_as_a_timeout() -> None:
    layers = make_layers(4, 64, 2, 16)
    never = asyncio.Event()

    async def producer() -> AsyncIterator[tuple[Any, Any]]:
        yield layers[0]
        await never.wait()  # the send is under way until its deadline passes
        yield layers[1]

    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, transfer_timeout=FAR, idle_timeout=FAR) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, streams=2,
                                  idle_timeout=FAR) as peer:
            sending = asyncio.create_task(peer.send("r", SPEC, producer(), timeout=4.0))
            transfer = await asyncio.wait_for(server.expect("r", timeout=30), 30)
            layers_in = transfer.__aiter__()
            # the server stops reading stream 0 (the stream carrying the BEGIN): what the
            # client writes on it from now on stays unread
            first = peer.streams[0].transport
            assert first is not None
            (stalled,) = [s for s in server._by_cid.values() if s.transport is not None
                          and s.transport.get_extra_info("peername") == first.get_extra_info("sockname")]
            assert stalled.transport is not None
            stalled.transport.pause_reading()
            with pytest.raises(kvwire.TransferTimeoutError):
                await sending

            async def rest() -> None:
                async for _ in layers_in:
                    pass

            # well before any idle timeout or the server's own deadline
            with pytest.raises(kvwire.TransferTimeoutError):
                await asyncio.wait_for(rest(), 30)
            assert peer.broken is None and peer.resumes == 0
            stalled.transport.resume_reading()
