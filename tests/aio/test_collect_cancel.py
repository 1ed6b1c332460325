"""``Transfer.collect(timeout=...)`` cancelled in the loop iteration its last layer
arrives raises CancelledError: ``asyncio.wait_for`` on Python 3.11 returned the cache
there and the cancel was lost."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import kvwire
from kvwire.aio._transfer import Transfer
from tests.conftest import SECRET, make_layers

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("timeout", [None, 10.0])
async def test_collect_cancelled_as_its_last_layer_arrives_raises(monkeypatch: pytest.MonkeyPatch,
                                                                    timeout: float | None) -> None:
    spec = kvwire.KVSpec(num_layers=2, num_kv_heads=1, head_dim=8)
    after: list[str] = []
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async def collector() -> Any:
            transfer = await server.expect("x", timeout=10)
            cache = await transfer.collect(timeout=timeout)
            after.append("returned")  # (the cancel was lost)
            return cache

        task = asyncio.create_task(collector())
        ready = Transfer._layer_ready

        def ready_then_cancel(self: Transfer, layer: int, wire_bytes: int) -> None:
            ready(self, layer, wire_bytes)
            if self._arrived_layers == self.spec.num_layers:
                task.cancel()  # in the iteration that completes collect() (a TaskGroup's sibling failing)

        monkeypatch.setattr(Transfer, "_layer_ready", ready_then_cancel)
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            await peer.send("x", spec, make_layers(2, 64, 1, 8), timeout=10)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(task), 10)
        assert task.cancelled()
        assert after == []


async def test_collect_timeout_still_raises_transfer_timeout() -> None:
    spec = kvwire.KVSpec(num_layers=2, num_kv_heads=1, head_dim=8)
    go = asyncio.Event()
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            layers = make_layers(2, 64, 1, 8)

            async def produce() -> Any:
                yield layers[0]
                await go.wait()
                yield layers[1]

            sending = asyncio.create_task(peer.send("x", spec, produce(), timeout=10))
            transfer = await server.expect("x", timeout=10)
            with pytest.raises(kvwire.TransferTimeoutError, match=r"not complete in 0\.2 s"):
                await transfer.collect(timeout=0.2)
            go.set()
            sending.cancel()
            await asyncio.gather(sending, return_exceptions=True)
