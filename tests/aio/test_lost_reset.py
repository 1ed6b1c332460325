"""A send() cancelled while its stream is stalled: the RESET waits on that stream, which
then breaks, losing it.  The session resumes, and the RESET goes again on the new stream:
the receiver fails the transfer then, not at its transfer_timeout (docs/protocol.md 6.3)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

import kvwire
from tests.conftest import make_layers

pytestmark = pytest.mark.timeout(60)

SECRET = b"lost-reset-secret"
SPEC = kvwire.KVSpec(num_layers=4, num_kv_heads=2, head_dim=16)


async def test_a_reset_lost_with_a_broken_stream_reaches_the_receiver_after_the_resume() -> None:
    layers = make_layers(4, 64, 2, 16)
    never = asyncio.Event()

    async def producer() -> AsyncIterator[tuple[Any, Any]]:
        yield layers[0]
        await never.wait()  # the send is under way until it is cancelled
        yield layers[1]

    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, transfer_timeout=300) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, streams=1) as peer:
            sending = asyncio.create_task(peer.send("r", SPEC, producer()))
            transfer = await asyncio.wait_for(server.expect("r", timeout=30), 30)
            layers_in = transfer.__aiter__()
            assert (await asyncio.wait_for(layers_in.__anext__(), 30)).index == 0
            (stream,) = server._by_cid.values()
            assert stream.transport is not None
            stream.transport.pause_reading()  # the server reads nothing more of this stream
            sending.cancel()  # its RESET waits, unread, on the stream
            with contextlib.suppress(asyncio.CancelledError):
                await sending
            stream.transport.abort()  # the stream breaks: the RESET is lost with it

            async def rest() -> None:
                async for _ in layers_in:
                    pass

            with pytest.raises(kvwire.TransferAbortedError):
                await asyncio.wait_for(rest(), 20)
            assert peer.resumes == 1
