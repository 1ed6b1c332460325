"""Closing a watcher, or its registry, while the watcher waits: in its first read (for Redis:
its subscription still in flight) or for a later change."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import pytest

from kvwire.aio.registry_redis import RedisRegistry
from kvwire.consistency import Registry
from tests.consistency.conftest import RedisServer
from tests.consistency.proxy import RedisProxy

pytestmark = pytest.mark.timeout(60)


class _HoldingProxy(RedisProxy):
    """A TCP proxy to Redis that holds back Redis's replies on a connection: from the
    client's SUBSCRIBE on (``subscribe``), or on the first connection from its start
    (``first``: the handshake of a connection being made)."""

    def __init__(self, target_port: int, hold: str) -> None:
        super().__init__(target_port)
        self.hold = hold
        self.holding = asyncio.Event()  # a request is waiting for a held reply
        self.released = asyncio.Event()
        self.accepted = 0
        self.open = 0

    async def __aexit__(self, *exc: object) -> None:
        self.released.set()
        await super().__aexit__(*exc)

    async def wait_closed_by_client(self, left: int = 0) -> None:
        """Until the client closed every connection it made through the proxy but ``left``
        (bounded)."""
        for _ in range(200):
            if self.open == left:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"{self.open} connection(s) through the proxy left open, not {left}")

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.accepted += 1
        self.open += 1
        holding = self.hold == "first" and self.accepted == 1
        try:
            server_r, server_w = await asyncio.open_connection("127.0.0.1", self.target_port)

            async def forward() -> None:
                nonlocal holding
                while data := await client_r.read(65536):
                    if self.hold == "subscribe" and b"SUBSCRIBE" in data.upper():
                        holding = True
                    if holding:
                        self.holding.set()
                    server_w.write(data)
                    await server_w.drain()

            async def backward() -> None:
                while data := await server_r.read(65536):
                    if holding:
                        await self.released.wait()
                    client_w.write(data)
                    await client_w.drain()

            pumps = {asyncio.ensure_future(forward()), asyncio.ensure_future(backward())}
            try:
                await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            finally:
                server_w.close()  # first: a cancellation of the wait below must not skip it
                for pump in pumps:
                    pump.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            client_w.close()
            self.open -= 1
            self._tasks.discard(task)


@pytest.mark.parametrize("closer", ["registry", "watcher"])
@pytest.mark.parametrize("first", ["anext", "aenter"])
@pytest.mark.parametrize("held", ["confirmation", "connecting"])
async def test_a_watcher_closed_while_subscribing_ends_and_releases_its_connection(
    redis_server: RedisServer, held: str, first: str, closer: str
) -> None:
    """close() (or the watcher's aclose()) while the watcher's first read waits for its
    subscription: the read ended with RegistryUnavailableError ('subscribe failed:
    ConnectionError', as though Redis had failed) when the SUBSCRIBE's confirmation was
    awaited; when the pool was still making the connection, close() found no connection
    to close, the read went on for the registry's whole timeout, and the connection,
    once made, stayed open and subscribed, in use in the pool forever.  Now the read
    ends as a subscribed watcher's does (its iteration stops; ``async with`` enters an
    ended watcher), at once, and the connection is closed."""
    import redis.asyncio as aioredis

    namespace = f"wc-{uuid.uuid4().hex}"
    async with _HoldingProxy(redis_server.port, "subscribe" if held == "confirmation" else "first") as proxy:
        client: aioredis.Redis | None = None
        if held == "confirmation":
            reg = await RedisRegistry.connect(f"redis://127.0.0.1:{proxy.port}/0", namespace=namespace, timeout=30)
        else:  # a wrapped client that has made no connection yet: the watcher's is the first
            client = aioredis.Redis(host="127.0.0.1", port=proxy.port)
            reg = RedisRegistry(client, namespace=namespace, timeout=30)
        try:
            watcher = reg.watch()
            reading = asyncio.ensure_future(anext(watcher) if first == "anext" else watcher.__aenter__())
            await asyncio.wait_for(proxy.holding.wait(), 10)
            assert not reading.done()
            await asyncio.wait_for(reg.close() if closer == "registry" else watcher.aclose(), 10)
            if first == "anext":
                with pytest.raises(StopAsyncIteration):
                    await asyncio.wait_for(reading, 10)
            else:
                assert await asyncio.wait_for(reading, 10) is watcher
            with pytest.raises(StopAsyncIteration):
                await asyncio.wait_for(anext(watcher), 10)
            # connect()'s registry keeps the connection of its calls (its ping) in their pool,
            # apart from the watcher's, until the registry is closed
            left = 1 if held == "confirmation" and closer == "watcher" else 0
            await proxy.wait_closed_by_client(left)
            proxy.released.set()  # a reply let through now finds nobody subscribing
            await asyncio.sleep(0.1)
            await proxy.wait_closed_by_client(left)
            if closer == "watcher":  # the registry goes on working
                assert await asyncio.wait_for(reg.lookup([b"blk"]), 10) == []
        finally:
            await reg.close()
            if client is not None:
                await client.aclose()


@pytest.mark.parametrize("read", ["first", "later"])
@pytest.mark.parametrize("closer", ["registry", "watcher"])
async def test_closing_ends_a_watcher_waiting_for_a_change(registry: Registry, read: str, closer: str) -> None:
    """A watcher waiting in its first read, or for a change after others came, ends
    (StopAsyncIteration), the same on both backends, when it or its registry is closed."""
    watcher = registry.watch()
    if read == "later":
        await watcher.__aenter__()
        v = await registry.invalidate(b"a")
        assert await asyncio.wait_for(anext(watcher), 10) == (b"a", v)
    reading = asyncio.ensure_future(anext(watcher))
    with contextlib.suppress(TimeoutError):  # it waits: nothing changes
        await asyncio.wait_for(asyncio.shield(reading), 0.2)
    assert not reading.done()
    await asyncio.wait_for(registry.close() if closer == "registry" else watcher.aclose(), 10)
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(reading, 10)
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(anext(watcher), 10)
    await watcher.aclose()
