"""A producer waiting for its next layer when send() is cancelled or its transfer fails:
its ``__anext__`` is cancelled, awaited (its cleanup done before send() ends) and what it
ended with retrieved, so nothing of it is left running or reported as an exception nobody
retrieved; send() ends with its own cancellation or the transfer's error.  Real loopback
sockets."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest

import kvwire
from kvwire.aio import _send
from tests.conftest import SECRET, make_layers

pytestmark = pytest.mark.timeout(60)

SPEC = kvwire.KVSpec(num_layers=4, num_kv_heads=2, head_dim=32)
Layer = tuple[np.ndarray, np.ndarray]


def layers() -> list[Layer]:
    return make_layers(SPEC.num_layers, 64, SPEC.num_kv_heads, SPEC.head_dim, seed=5)


class Stalled:
    """A producer that yields one layer, then waits for ever; ``how`` says what it does
    once that wait is cancelled: ``return`` (ends quietly), ``fail`` (its cleanup
    raises), ``slow`` (its cleanup takes a few loop turns and a sleep, then re-raises)."""

    def __init__(self, how: str) -> None:
        self.how = how
        self.waiting = asyncio.Event()
        self.cleaned_up = False

    async def __call__(self) -> AsyncIterator[Layer]:
        data = layers()
        yield data[0]
        self.waiting.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            if self.how == "return":
                self.cleaned_up = True
                return
            if self.how == "fail":
                self.cleaned_up = True
                raise RuntimeError("cleanup failed") from None
            for _ in range(10):
                await asyncio.sleep(0)
            await asyncio.sleep(0.05)  # releases what it holds
            self.cleaned_up = True
            raise
        yield data[1]


def unretrieved() -> Callable[[], list[dict[str, Any]]]:
    """Record what the loop's exception handler is given (a task's exception nobody
    retrieved among it); the returned function collects garbage and lists it."""
    loop = asyncio.get_running_loop()
    seen: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: seen.append(context))

    def collect() -> list[dict[str, Any]]:
        gc.collect()
        return seen

    return collect


def others() -> list[asyncio.Task[Any]]:
    me = asyncio.current_task()
    return [t for t in asyncio.all_tasks() if t is not me and not t.done()]


@pytest.mark.parametrize("how", ["return", "fail", "slow"])
async def test_a_cancelled_send_ends_its_producers_wait_and_retrieves_it(how: str) -> None:
    reported = unretrieved()
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server, \
            kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
        before = set(others())
        producer = Stalled(how)
        task = asyncio.create_task(peer.send("c-" + how, SPEC, producer(), timeout=20))
        await asyncio.wait_for(producer.waiting.wait(), 20)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(task), 20)
        assert task.cancelled()
        # The producer's cleanup ran before send() ended, and nothing of it is left.
        assert producer.cleaned_up
        assert set(others()) <= before, others()
        del task  # (its CancelledError's traceback holds send()'s frames)
    assert not others()
    assert reported() == []


@pytest.mark.parametrize("how", ["return", "fail", "slow"])
async def test_a_failed_transfer_ends_its_producers_wait_and_raises_its_error(how: str) -> None:
    reported = unretrieved()
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server, \
            kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
        producer = Stalled(how)
        task = asyncio.create_task(peer.send("f-" + how, SPEC, producer(), timeout=20))
        transfer = await server.expect("f-" + how, timeout=20)
        await asyncio.wait_for(producer.waiting.wait(), 20)
        transfer.abort()  # the receiver gives up: the sender's transfer fails
        with pytest.raises(kvwire.TransferAbortedError):
            await asyncio.wait_for(task, 20)
        assert producer.cleaned_up
        del task
    assert not others()
    assert reported() == []


async def test_a_send_timed_out_by_its_caller_ends_as_a_timeout_after_the_producers_cleanup() -> None:
    """asyncio.timeout() cancels send(): its cancellation is re-raised after the cleanup,
    still counted by cancelling(), so the timeout turns it into TimeoutError."""
    reported = unretrieved()
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server, \
            kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
        producer = Stalled("slow")

        async def caller() -> None:
            async with asyncio.timeout(None) as cm:
                async def arm() -> None:  # the deadline passes while the producer waits
                    await producer.waiting.wait()
                    cm.reschedule(asyncio.get_running_loop().time())
                armed = asyncio.create_task(arm())
                try:
                    await peer.send("t", SPEC, producer(), timeout=20)
                finally:
                    await armed

        with pytest.raises(TimeoutError):
            await asyncio.wait_for(caller(), 20)
        assert producer.cleaned_up
    assert not others()
    assert reported() == []


async def test_cancelling_send_again_while_its_producer_cleans_up_is_not_swallowed() -> None:
    release = asyncio.Event()
    waiting = asyncio.Event()
    in_cleanup = asyncio.Event()
    done: list[str] = []

    async def producer() -> AsyncIterator[Layer]:
        yield layers()[0]
        waiting.set()
        try:
            await asyncio.Event().wait()
        finally:
            in_cleanup.set()
            await release.wait()  # cleanup that waits on something else
            done.append("cleaned up")
    reported = unretrieved()
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server, \
            kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
        task = asyncio.create_task(peer.send("again", SPEC, producer(), timeout=20))
        await asyncio.wait_for(waiting.wait(), 20)
        task.cancel()
        await asyncio.wait_for(in_cleanup.wait(), 20)
        task.cancel()  # a second cancellation: send() stops waiting for the cleanup
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(task), 20)
        assert task.cancelled()
        assert done == []
        del task
        release.set()
        for _ in range(20):
            await asyncio.sleep(0)
        assert done == ["cleaned up"]
    assert reported() == []


async def test_a_producer_that_ignores_its_cancellation_is_left_running_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(_send, "PRODUCER_STOP_TIMEOUT", 0.05)
    release = asyncio.Event()
    waiting = asyncio.Event()

    async def producer() -> AsyncIterator[Layer]:
        data = layers()
        yield data[0]
        waiting.set()
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                continue  # ignores it
        raise RuntimeError("ended late")
        yield data[1]  # pragma: no cover
    reported = unretrieved()
    caplog.set_level(logging.WARNING, logger="kvwire")
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server, \
            kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
        task = asyncio.create_task(peer.send("stubborn", SPEC, producer(), timeout=20))
        await asyncio.wait_for(waiting.wait(), 20)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(task), 20)
        assert any("still running" in r.getMessage() for r in caplog.records), caplog.records
        del task
        release.set()
        for _ in range(20):
            await asyncio.sleep(0)
    assert not others()
    assert reported() == []  # its late end was retrieved all the same

