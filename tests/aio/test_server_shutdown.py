"""A server that closes tells the senders of the transfers it still holds why, before
its streams close: their send() says the server is shutting down."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

import kvwire
from kvwire.errors import ConnectionLostError
from tests.conftest import SECRET, make_layers

pytestmark = pytest.mark.timeout(60)

SPEC = kvwire.KVSpec(num_layers=3, num_kv_heads=2, head_dim=16)


async def _first_layer_then_wait(stop: asyncio.Event) -> AsyncIterator[tuple[np.ndarray, np.ndarray]]:
    """Layer 0 of a cache, then nothing until ``stop``: a transfer in progress."""
    yield make_layers(3, 8, 2, 16)[0]
    await stop.wait()


async def _wait_first_layer_acked(peer: Any) -> None:
    while not any((t := peer.core.transfer(tid)) is not None and t.kv_bytes_acked > 0 for tid in list(peer.sends)):
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("taken", [False, True], ids=["unclaimed", "being-taken"])
async def test_close_tells_the_sender_the_server_is_shutting_down(taken: bool) -> None:
    # The sender learnt only that its streams closed ("stream N closed"), or, where the
    # application's task was stopped first, "the application stopped taking layers".
    stop = asyncio.Event()
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, streams=2) as peer:
            sending = asyncio.ensure_future(peer.send("a", SPEC, _first_layer_then_wait(stop), timeout=30))
            taking: asyncio.Future[Any] | None = None
            if taken:
                transfer = await server.expect("a", timeout=10)
                taking = asyncio.ensure_future(transfer.collect(timeout=30))
            await _wait_first_layer_acked(peer)
            await server.close()
            with pytest.raises(kvwire.TransferAbortedError, match="transfer 'a': the server is shutting down"):
                await sending
            if taking is not None:
                with pytest.raises(ConnectionLostError, match="the server is shutting down"):
                    await taking
            stop.set()
