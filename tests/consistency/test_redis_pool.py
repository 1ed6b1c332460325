"""connect()'s registry: its calls share a pool of max_connections that makes a call wait for
a connection (within its timeout) rather than fail, and its watchers are on connections of
their own, outside that pool."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any

import pytest

from kvwire.aio.registry_redis import RedisRegistry
from kvwire.consistency import RegistryUnavailableError
from kvwire.errors import UsageError
from tests.consistency.conftest import RedisServer

pytestmark = pytest.mark.timeout(90)


async def test_more_concurrent_calls_than_connections_wait_for_one(redis_server: RedisServer) -> None:
    """redis-py's default pool (100 connections) refused a connection past its size at once
    (MaxConnectionsError, 'Too many connections'): 300 concurrent reads on a healthy Redis
    failed 200 of them with RegistryUnavailableError.  A call now waits for a connection."""
    namespace = f"pool-{uuid.uuid4().hex}"
    async with await RedisRegistry.connect(redis_server.url, namespace=namespace, timeout=30) as reg:
        committed = await reg.commit(await reg.begin([b"a"], owner="p"))
        results = await asyncio.gather(*(reg.check_many(committed) for _ in range(300)), return_exceptions=True)
        assert results == [[]] * 300


async def test_max_connections_bounds_the_calls_connections(redis_server: RedisServer) -> None:
    namespace = f"poolsize-{uuid.uuid4().hex}"
    async with await RedisRegistry.connect(
        redis_server.url, namespace=namespace, timeout=30, max_connections=3
    ) as reg:
        committed = await reg.commit(await reg.begin([b"a"], owner="p"))
        results = await asyncio.gather(*(reg.check_many(committed) for _ in range(50)), return_exceptions=True)
        assert results == [[]] * 50
        pool: Any = reg.client.connection_pool  # (white box) the calls' pool
        assert pool.max_connections == 3
        assert len(pool._available_connections) + len(pool._in_use_connections) <= 3


async def test_a_call_waiting_for_a_connection_ends_within_its_timeout(redis_server: RedisServer) -> None:
    """Every connection in use: a call waits for one at most its timeout, then raises
    RegistryUnavailableError; once one is free, calls go on."""
    namespace = f"poolwait-{uuid.uuid4().hex}"
    async with await RedisRegistry.connect(
        redis_server.url, namespace=namespace, timeout=0.5, max_connections=1
    ) as reg:
        pool: Any = reg.client.connection_pool
        held = await pool.get_connection()  # (white box) the only connection, in use
        try:
            with pytest.raises(RegistryUnavailableError):
                await asyncio.wait_for(reg.check_many([(b"a", 1)]), 10)
        finally:
            await pool.release(held)
        assert await asyncio.wait_for(reg.check_many([(b"a", 1)]), 10) == [b"a"]


async def test_open_watchers_leave_the_calls_their_connections(redis_server: RedisServer) -> None:
    """Each subscribed watcher held a connection of the calls' pool: with 100 watchers
    open, every call failed ('Too many connections') though Redis was healthy.  Watchers
    are on connections of their own."""
    namespace = f"poolwatch-{uuid.uuid4().hex}"
    async with await RedisRegistry.connect(redis_server.url, namespace=namespace, timeout=30) as reg:
        async with contextlib.AsyncExitStack() as stack:
            watchers = [await stack.enter_async_context(reg.watch()) for _ in range(101)]
            assert await asyncio.wait_for(reg.check_many([(b"a", 1)]), 30) == [b"a"]
            version = await asyncio.wait_for(reg.invalidate(b"a"), 30)
            got = await asyncio.wait_for(asyncio.gather(*(anext(w) for w in watchers)), 30)
            assert got == [(b"a", version)] * 101


async def test_a_small_pool_serves_calls_while_watchers_are_open(redis_server: RedisServer) -> None:
    namespace = f"poolsmall-{uuid.uuid4().hex}"
    async with await RedisRegistry.connect(
        redis_server.url, namespace=namespace, timeout=30, max_connections=1
    ) as reg:
        async with reg.watch() as w1, reg.watch() as w2:
            version = await asyncio.wait_for(reg.invalidate(b"a"), 10)
            assert await asyncio.wait_for(reg.check_many([(b"a", version)]), 10) == [b"a"]
            assert await asyncio.wait_for(anext(w1), 10) == (b"a", version)
            assert await asyncio.wait_for(anext(w2), 10) == (b"a", version)


@pytest.mark.parametrize("size", [0, -1, True, 1.5, "3", None])
async def test_connect_refuses_a_pool_size_that_is_not_an_int_of_1_or_more(
    redis_server: RedisServer, size: Any
) -> None:
    with pytest.raises(UsageError, match="max_connections"):
        await RedisRegistry.connect(redis_server.url, max_connections=size)
