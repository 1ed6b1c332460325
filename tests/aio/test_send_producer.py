"""What send() and its receiver see when the layer producer misbehaves: a producer
cancelled on its own, one that yields too few or too many layers or fails after its last,
layers that do not fit the spec.  Real loopback sockets."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import pytest

import kvwire
from tests.conftest import SECRET, make_layers

pytestmark = pytest.mark.timeout(60)

SPEC = kvwire.KVSpec(num_layers=4, num_kv_heads=2, head_dim=32)


def layers() -> list[tuple[np.ndarray, np.ndarray]]:
    return make_layers(SPEC.num_layers, 64, SPEC.num_kv_heads, SPEC.head_dim, seed=3)


async def received(server: kvwire.Server, request_id: str) -> Any:
    """The receiver's outcome: the collected cache or the error it failed with."""
    transfer = await server.expect(request_id, timeout=20)
    try:
        return await transfer.collect(timeout=20)
    except kvwire.KvwireError as exc:
        return exc


async def send_outcome(peer: kvwire.Peer, request_id: str, source: Any) -> tuple[BaseException | None, int]:
    """send() run in a task of its own: what it raised (None for a receipt) and that
    task's cancelling() count once it ended."""
    async def caller() -> BaseException | None:
        try:
            await peer.send(request_id, SPEC, source, timeout=20)
        except BaseException as exc:  # a CancelledError too: what send() ended with
            return exc
        return None

    task = asyncio.create_task(caller())
    error = await task
    return error, task.cancelling()


async def test_a_producer_cancelled_on_its_own_fails_send_with_a_kvwire_error() -> None:
    """A producer whose own await was cancelled (nobody cancelled send()) fails send()
    with TransferAbortedError, not with a CancelledError its caller's task never got."""
    data = layers()

    async def producer() -> AsyncIterator[tuple[np.ndarray, np.ndarray]]:
        loop = asyncio.get_running_loop()
        for i, layer in enumerate(data):
            if i == 2:
                fut = loop.create_future()
                loop.call_soon(fut.cancel)  # e.g. a copy the application cancelled
                await fut
            yield layer

    def sync_producer() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        yield data[0]
        raise asyncio.CancelledError()

    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server, \
            kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
        for rid, source in (("async", producer()), ("sync", sync_producer())):
            rx = asyncio.create_task(received(server, rid))
            error, cancelling = await send_outcome(peer, rid, source)
            assert isinstance(error, kvwire.TransferAbortedError), repr(error)
            assert "producer was cancelled" in str(error)
            assert isinstance(error.__cause__, asyncio.CancelledError)
            assert cancelling == 0
            assert isinstance(await rx, kvwire.TransferAbortedError)


async def test_cancelling_send_still_cancels_it() -> None:
    """send() cancelled by its caller ends with CancelledError; the receiver is told."""
    data = layers()
    stalled = asyncio.Event()

    async def producer() -> AsyncIterator[tuple[np.ndarray, np.ndarray]]:
        yield data[0]
        stalled.set()
        await asyncio.Event().wait()  # the next layer never comes
        yield data[1]

    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server, \
            kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
        rx = asyncio.create_task(received(server, "c"))
        task = asyncio.create_task(peer.send("c", SPEC, producer(), timeout=20))
        await asyncio.wait_for(stalled.wait(), 20)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert isinstance(await rx, kvwire.TransferAbortedError)
