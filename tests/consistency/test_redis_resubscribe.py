"""A Redis watcher whose subscription is lost subscribes anew itself, bounded by the
registry's timeout, before it raises NotificationsLostError: every change made after the
error is delivered, and aclose() ends it whatever it waits for."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any

import pytest

from kvwire.aio.registry_redis import RedisRegistry
from kvwire.consistency import NotificationsLostError
from tests.consistency.conftest import RedisServer
from tests.consistency.proxy import Switchboard

pytestmark = pytest.mark.timeout(90)


async def _registry(kind: str, port: int, namespace: str, timeout: float) -> tuple[RedisRegistry, Any]:
    """A registry through ``port``: connect()'s, or wrapping a client without socket
    timeouts (it would wait forever on its own); the wrapped client too (None for connect)."""
    import redis.asyncio as aioredis

    if kind == "connect":
        return await RedisRegistry.connect(f"redis://127.0.0.1:{port}/0", namespace=namespace, timeout=timeout), None
    client = aioredis.Redis(host="127.0.0.1", port=port)
    return RedisRegistry(client, namespace=namespace, timeout=timeout), client


@pytest.mark.parametrize("kind", ["wrapped", "connect"])
async def test_a_watcher_subscribing_anew_into_a_silent_network_ends_within_its_timeout(
    redis_server: RedisServer, kind: str
) -> None:
    """The network stops forwarding: the watcher's read raises NotificationsLostError
    (silence, then an unanswered PING).  The reads after it subscribed anew inside redis-py
    (get_message reconnecting), bounded only by the client's socket timeouts: with a
    wrapped client that has none, the next read never ended, nor did aclose(), which waits
    for the read.  Subscribing anew is bounded by the registry's timeout, in a task aclose()
    cancels: each read ends with NotificationsLostError, and aclose() ends a read that is
    subscribing anew."""
    namespace = f"hole-{uuid.uuid4().hex}"
    async with Switchboard(redis_server.port) as proxy:
        reg, client = await _registry(kind, proxy.port, namespace, 0.5)
        try:
            async with reg.watch() as watcher:
                proxy.hole = True
                for _ in range(3):  # the silent one, then reads that try to subscribe anew
                    with pytest.raises(NotificationsLostError, match="not subscribed again"):
                        await asyncio.wait_for(anext(watcher), 20)
                reg.timeout = 60.0  # (white box) the next subscription attempt waits long
                reading = asyncio.ensure_future(anext(watcher))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(reading), 0.3)
                assert not reading.done()
                await asyncio.wait_for(watcher.aclose(), 10)
                with pytest.raises(StopAsyncIteration):
                    await asyncio.wait_for(reading, 10)
        finally:
            proxy.hole = False
            await asyncio.wait_for(reg.close(), 20)
            if client is not None:
                await client.aclose()


@pytest.mark.parametrize("kind", ["wrapped", "connect"])
async def test_a_change_made_after_notifications_lost_is_delivered(redis_server: RedisServer, kind: str) -> None:
    """The reader does what NotificationsLostError asks: it re-reads, then reads on.  The
    watcher subscribed anew only at that next read, so a change made between the re-read
    and the next read was never delivered, and nothing said so.  The new subscription is
    in place before the error is raised."""
    namespace = f"gap-{uuid.uuid4().hex}"
    async with Switchboard(redis_server.port) as proxy:
        reg, client = await _registry(kind, proxy.port, namespace, 5.0)
        direct = await RedisRegistry.connect(redis_server.url, namespace=namespace)
        try:
            async with reg.watch() as watcher:
                proxy.cut()  # the subscription's connection breaks
                with pytest.raises(NotificationsLostError, match="subscribed again"):
                    await asyncio.wait_for(anext(watcher), 10)
                assert await direct.lookup([b"a"]) == []  # the re-read
                va = await direct.invalidate(b"a")  # after it, before the next read
                reading = asyncio.ensure_future(anext(watcher))
                for _ in range(200):  # bounded, should a's change never come
                    done, _ = await asyncio.wait({reading}, timeout=0.05)
                    if done:
                        break
                    await direct.invalidate(b"later")
                assert await asyncio.wait_for(reading, 10) == (b"a", va)
        finally:
            await reg.close()
            await direct.close()
            if client is not None:
                await client.aclose()


@pytest.mark.parametrize("kind", ["wrapped", "connect"])
async def test_a_watcher_that_could_not_subscribe_anew_raises_again_at_its_next_read(
    redis_server: RedisServer, kind: str
) -> None:
    """The subscription breaks and a new one cannot be made at once (Redis refuses
    connections): the read raises NotificationsLostError saying so.  The reader re-reads
    and reads on; a change made meanwhile is not covered, so that next read raises
    NotificationsLostError again (having subscribed anew) instead of reading on as though
    nothing had been missed; from then on changes are delivered."""
    namespace = f"again-{uuid.uuid4().hex}"
    async with Switchboard(redis_server.port) as proxy:
        reg, client = await _registry(kind, proxy.port, namespace, 5.0)
        direct = await RedisRegistry.connect(redis_server.url, namespace=namespace)
        try:
            async with reg.watch() as watcher:
                proxy.refuse = True
                proxy.cut()
                with pytest.raises(NotificationsLostError, match="not subscribed again"):
                    await asyncio.wait_for(anext(watcher), 10)
                proxy.refuse = False
                assert await direct.lookup([b"c"]) == []  # the re-read...
                await direct.invalidate(b"c")  # ...which this change, unwatched, outdates
                reading = asyncio.ensure_future(anext(watcher))
                with pytest.raises(NotificationsLostError, match="subscribed again"):
                    for _ in range(200):  # bounded: a watcher reading on yields "later"
                        done, _ = await asyncio.wait({reading}, timeout=0.05)
                        if done:
                            break
                        await direct.invalidate(b"later")
                    await asyncio.wait_for(reading, 10)
                vd = await direct.invalidate(b"d")
                # ("later"s made once the new subscription stood, before the read above
                # ended, are changes it delivers too: read past them)
                for _ in range(200):
                    got = await asyncio.wait_for(anext(watcher), 10)
                    if got[0] != b"later":
                        break
                assert got == (b"d", vd)
        finally:
            await reg.close()
            await direct.close()
            if client is not None:
                await client.aclose()
