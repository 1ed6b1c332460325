"""The splice pump's proxy closed while a connection is waiting to be accepted: the
listener's readiness is already in the loop's queue when close() runs, in the same loop
iteration. Nothing may be accepted and then dropped (an unclosed socket), and nothing may
be logged through the loop's exception handler."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import select
import socket
import warnings
from typing import Any

from kvwire.bench._splice import SpliceProxy
from tests.environment import needs_splice
from tests.servers import target


class Now:
    def pieces(self, now: float, nbytes: int) -> list[tuple[int, float]]:
        return [(nbytes, now)]

    def eof_at(self, now: float) -> float:
        return now


async def idle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.read()


@needs_splice
async def test_close_in_the_iteration_a_connection_is_acceptable_leaves_nothing_unclosed() -> None:
    loop = asyncio.get_running_loop()
    logged: list[str] = []

    def record(_: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        logged.append(str(context.get("message")) + ": " + repr(context.get("exception")))

    loop.set_exception_handler(record)
    try:
        async with target(idle) as port:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for _ in range(5):
                    proxy = SpliceProxy("127.0.0.1", port, lambda c: (Now(), Now()))
                    await proxy.start()
                    for _ in range(3):  # the proxy waits for connections now
                        await asyncio.sleep(0)
                    client = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
                    try:
                        # The connection is in the listener's queue: the next select sees
                        # it, and queues the listener's callback after this task's step.
                        fd = proxy._listening.fileno() if proxy._listening else -1
                        assert select.select([fd], [], [], 5)[0] == [fd]
                        await asyncio.sleep(0)
                        await proxy.close()  # in that same iteration, before the callback
                        for _ in range(3):
                            await asyncio.sleep(0)
                        for conn in proxy.connections:
                            assert conn.client.fileno() < 0
                            assert conn.upstream is None or conn.upstream.fileno() < 0
                        assert not proxy.active
                    finally:
                        client.close()
                gc.collect()
            unclosed = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
            assert unclosed == []
            assert [str(w.message) for w in caught] == []
    finally:
        loop.set_exception_handler(None)
    assert logged == []


@needs_splice
async def test_connections_are_still_accepted_and_spliced() -> None:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()

    async with target(echo) as port:
        proxy = SpliceProxy("127.0.0.1", port, lambda c: (Now(), Now()))
        await proxy.start()
        try:
            pairs = [await asyncio.open_connection("127.0.0.1", proxy.port) for _ in range(20)]
            for i, (_, writer) in enumerate(pairs):
                writer.write(b"hello %d" % i)
                writer.write_eof()
            for i, (reader, writer) in enumerate(pairs):
                assert await asyncio.wait_for(reader.read(), 10) == b"hello %d" % i
                writer.close()
                with contextlib.suppress(ConnectionError):
                    await writer.wait_closed()
            assert len(proxy.connections) == 20
        finally:
            await proxy.close()
