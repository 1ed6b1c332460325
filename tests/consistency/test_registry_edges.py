"""Registry edges both backends keep alike: a block begun and never committed is said to
be so, a closed watcher yields nothing more, and a synchronous Redis client is refused."""

from __future__ import annotations

import asyncio

import pytest

from kvwire.aio.registry_redis import RedisRegistry
from kvwire.consistency import Registry
from kvwire.errors import StaleVersionError, UsageError

pytestmark = pytest.mark.timeout(30)


async def test_a_block_begun_and_never_committed_is_said_so(registry: Registry) -> None:
    await registry.begin([b"begun"], owner="a")
    for block in (b"begun", b"unknown"):
        with pytest.raises(StaleVersionError, match="never committed"):
            await registry.check(block, 1)


@pytest.mark.parametrize("how", ["aclose", "registry.close"])
async def test_a_closed_watcher_yields_nothing_it_buffered(registry: Registry, backend: str, how: str) -> None:
    """The memory watcher went on yielding what it buffered after aclose() or the
    registry's close(); the Redis one stops at once: both stop at once now."""
    watcher = registry.watch()
    await watcher.__aenter__()
    changes = await registry.invalidate_many(["a", "b", "c"])
    if backend == "redis":  # until the changes reached the watcher: the first one read
        assert await asyncio.wait_for(anext(watcher), 10) == changes[0]
        await asyncio.sleep(0.2)  # the others on their way
    if how == "aclose":
        await watcher.aclose()
    else:
        await registry.close()

    async def drain() -> list[object]:
        return [item async for item in watcher]

    assert await asyncio.wait_for(drain(), 10) == []


async def test_redis_registry_refuses_a_synchronous_client() -> None:
    """A redis.Redis failed every call with a TypeError ('can't be used in an await
    expression') instead of being refused when wrapped."""
    import redis

    client = redis.Redis(host="127.0.0.1", port=1)  # nothing is connected here
    try:
        with pytest.raises(UsageError, match=r"redis\.asyncio"):
            RedisRegistry(client)  # type: ignore[arg-type]
        with pytest.raises(UsageError, match=r"redis\.asyncio"):
            RedisRegistry(object())  # type: ignore[arg-type]
    finally:
        client.close()
