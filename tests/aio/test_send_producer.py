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
from tests.aio.arrival_helpers import received
from tests.conftest import SECRET, make_layers

pytestmark = pytest.mark.timeout(60)

SPEC = kvwire.KVSpec(num_layers=4, num_kv_heads=2, head_dim=32)


def layers() -> list[tuple[np.ndarray, np.ndarray]]:
    return make_layers(SPEC.num_layers, 64, SPEC.num_kv_heads, SPEC.head_dim, seed=3)


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
        error = await rx
        assert isinstance(error, kvwire.TransferAbortedError)
        assert str(error) == "sender aborted: the send was cancelled"  # in words, not a repr


async def test_a_send_cancelled_with_a_message_tells_the_receiver_that_message() -> None:
    stalled = asyncio.Event()

    async def producer() -> AsyncIterator[tuple[np.ndarray, np.ndarray]]:
        yield layers()[0]
        stalled.set()
        await asyncio.Event().wait()
        yield layers()[1]

    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server, \
            kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
        rx = asyncio.create_task(received(server, "m"))
        task = asyncio.create_task(peer.send("m", SPEC, producer(), timeout=20))
        await asyncio.wait_for(stalled.wait(), 20)
        task.cancel("request abandoned by the client")
        with pytest.raises(asyncio.CancelledError):
            await task
        error = await rx
        assert isinstance(error, kvwire.TransferAbortedError)
        assert str(error) == "sender aborted: the send was cancelled (request abandoned by the client)"


async def test_a_layer_count_known_up_front_is_checked_before_anything_is_sent() -> None:
    """A sequence of more or fewer layers than the spec says is refused before BEGIN: the
    receiver never hears of it (the next transfer takes the session's first id)."""
    data = layers()
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server, \
            kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
        for bad in (data + data[:1], data[:3], []):
            with pytest.raises(kvwire.UsageError, match=r"spec\.num_layers=4"):
                await peer.send("bad", SPEC, bad, timeout=20)
        rx = asyncio.create_task(received(server, "ok"))
        receipt = await peer.send("ok", SPEC, data, timeout=20)
        assert receipt.transfer_id == 1
        assert not isinstance(await rx, kvwire.KvwireError)


def too_many(data: list[Any]) -> Iterator[Any]:
    yield from data
    yield data[0]


def fails_after_last(data: list[Any]) -> Iterator[Any]:
    yield from data
    raise RuntimeError("the producer failed after its last layer")


async def async_too_many(data: list[Any]) -> AsyncIterator[Any]:
    for layer in data:
        yield layer
    yield data[0]


async def async_fails_after_last(data: list[Any]) -> AsyncIterator[Any]:
    for layer in data:
        await asyncio.sleep(0)
        yield layer
    raise RuntimeError("the producer failed after its last layer")


@pytest.mark.parametrize("codec", ["raw", "fp8"])
@pytest.mark.parametrize("make", [too_many, fails_after_last, async_too_many, async_fails_after_last])
async def test_a_producer_going_wrong_after_its_last_layer_leaves_the_transfer_incomplete(
        codec: str, make: Any) -> None:
    """The producer is read past its last layer before that layer's final chunk is sent:
    a layer too many or a failure there fails send() and the receiver alike, instead of
    a receiver holding a complete cache that send() says was not sent."""
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server, \
            kvwire.connect("127.0.0.1", server.port, secret=SECRET, codec=codec) as peer:
        rx = asyncio.create_task(received(server, "r"))
        error, _ = await send_outcome(peer, "r", make(layers()))
        if make in (too_many, async_too_many):
            assert isinstance(error, kvwire.UsageError), repr(error)
            assert "more than spec.num_layers=4" in str(error)
        else:
            assert isinstance(error, kvwire.TransferAbortedError), repr(error)
            assert isinstance(error.__cause__, RuntimeError)
        assert isinstance(await rx, kvwire.KvwireError)
        # The session goes on.
        rx = asyncio.create_task(received(server, "next"))
        await peer.send("next", SPEC, layers(), timeout=20)
        assert not isinstance(await rx, kvwire.KvwireError)


async def test_layers_still_go_out_one_by_one() -> None:
    """Each layer is sent as it is produced: a producer that yields a layer only once the
    receiver holds the one before completes (nothing waits for the whole cache)."""
    data = layers()
    got: list[asyncio.Event] = [asyncio.Event() for _ in data]

    async def producer() -> AsyncIterator[tuple[np.ndarray, np.ndarray]]:
        for i, layer in enumerate(data):
            if i:
                await got[i - 1].wait()
            yield layer

    async def receive() -> None:
        transfer = await server.expect("p", timeout=20)
        async for layer in transfer:
            got[layer.index].set()

    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server, \
            kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
        rx = asyncio.create_task(receive())
        await peer.send("p", SPEC, producer(), timeout=20)
        await asyncio.wait_for(rx, 20)
        assert all(e.is_set() for e in got)


def wrong_dtype(data: list[Any]) -> list[Any]:
    bad = list(data)
    bad[2] = (data[2][0].astype(np.float32), data[2][1])
    return bad


def wrong_tokens(data: list[Any]) -> list[Any]:
    bad = list(data)
    bad[2] = (data[2][0][:32], data[2][1][:32])
    return bad


def too_few(data: list[Any]) -> Iterator[Any]:
    yield from data[:3]


def not_a_pair(data: list[Any]) -> Iterator[Any]:
    yield from data[:2]
    yield data[2][0]


@pytest.mark.parametrize("make", [wrong_dtype, wrong_tokens, too_few, too_many, not_a_pair])
async def test_a_bad_layer_reaches_the_receiver_as_an_aborted_transfer(make: Any) -> None:
    """send() raises the UsageError; its receiver is told the sender aborted (CANCELLED:
    TransferAbortedError), not handed the sender's INTERNAL_ERROR as a bare KvwireError."""
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server, \
            kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
        rx = asyncio.create_task(received(server, "r"))
        error, _ = await send_outcome(peer, "r", make(layers()))
        assert isinstance(error, kvwire.UsageError), repr(error)
        got = await rx
        assert isinstance(got, kvwire.TransferAbortedError), repr(got)
        assert str(error) in str(got)


@pytest.mark.parametrize(("raised", "told"), [
    # a timeout of its own: the receiver is told TIMEOUT
    (kvwire.TransferTimeoutError("the producer's input timed out"), kvwire.TransferTimeoutError),
    # relaying from a connection of its own that was lost: the receiver's connection is
    # fine, so it is told CANCELLED (a RESET never carries NO_ERROR)
    (kvwire.ConnectionLostError("the producer's upstream was lost"), kvwire.TransferAbortedError),
], ids=["timeout", "connection-lost"])
async def test_a_producers_kvwire_error_reaches_the_receiver_by_its_code(
    raised: kvwire.KvwireError, told: type[kvwire.KvwireError],
) -> None:
    data = layers()

    def producer() -> Iterator[Any]:
        yield data[0]
        raise raised

    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server, \
            kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
        rx = asyncio.create_task(received(server, "r"))
        error, _ = await send_outcome(peer, "r", producer())
        assert type(error) is type(raised), repr(error)
        got = await rx
        assert isinstance(got, told), repr(got)
