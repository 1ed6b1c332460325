"""A Redis out of memory (``maxmemory`` reached, ``maxmemory-policy noeviction``, the
setting the docs ask for): COMMIT and INVALIDATE raise RegistryUnavailableError and change
nothing, and no watcher hears of them.  The scripts PUBLISH every change before their first
write (so that a denied PUBLISH changes nothing), and Redis refuses a script's first
memory-using write, not a PUBLISH: watchers received versions that were never written (and
were handed out again later).  A write that changes nothing now comes before the PUBLISHes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvwire.aio.registry_redis import RedisRegistry
from kvwire.consistency import RegistryUnavailableError
from tests.consistency.conftest import start_redis

pytestmark = pytest.mark.timeout(60)


async def test_a_full_redis_commits_and_invalidates_nothing_and_notifies_nothing(
    redis_binary: str, tmp_path: Path
) -> None:
    import redis.asyncio as aioredis
    from redis.exceptions import ResponseError

    server = start_redis(redis_binary, tmp_path, args=["--maxmemory-policy", "noeviction"])
    raw = aioredis.from_url(server.url)
    reg = await RedisRegistry.connect(server.url, namespace="oom", timeout=2.0)
    try:
        fresh = await reg.commit(await reg.begin([b"x"], owner="p", ttl=60))
        lease = await reg.begin([b"a", b"b"], owner="p", ttl=60)
        seq = await raw.get(reg.layout.seq)
        async with reg.watch() as watcher:
            await raw.set("filler", b"\0" * (1 << 20))  # fill memory, then cap it below what is used
            used = int((await raw.info("memory"))["used_memory"])
            await raw.config_set("maxmemory", str(used - (512 << 10)))
            with pytest.raises(ResponseError, match="maxmemory"):
                await raw.set("probe", b"1")  # Redis is full
            with pytest.raises(RegistryUnavailableError, match="maxmemory"):
                await reg.commit(lease)
            with pytest.raises(RegistryUnavailableError, match="maxmemory"):
                await reg.renew(lease, ttl=60)
            with pytest.raises(RegistryUnavailableError, match="maxmemory"):
                await reg.begin([b"c"], owner="p", ttl=60)
            with pytest.raises(RegistryUnavailableError, match="maxmemory"):
                await reg.invalidate_many([b"x", b"y"])
            with pytest.raises(RegistryUnavailableError, match="maxmemory"):
                await reg.invalidate(b"z")
            # reads still answer, and nothing changed
            assert await reg.check_many(fresh) == []
            assert await reg.lookup([b"a", b"b"]) == []
            assert await raw.get(reg.layout.seq) == seq  # no version handed out
            await raw.config_set("maxmemory", "0")
            await raw.delete("filler")
            # the first notification is the marker's: none came for the refused calls
            marker = await reg.invalidate(b"marker")
            assert await asyncio.wait_for(anext(watcher), 10) == (b"marker", marker)
            # the lease stayed live: it commits once Redis has room
            committed = await reg.commit(lease)
            assert [b for b, _ in committed] == [b"a", b"b"]
            assert [await asyncio.wait_for(anext(watcher), 10) for _ in range(2)] == committed
        assert await reg.lookup([b"a", b"b"]) == committed
        assert await reg.check_many(fresh) == []
    finally:
        await reg.close()
        await raw.aclose()
        server.stop()
