"""Fail-back to a former primary that never restarted: its ``run_id`` is the one it committed
under, yet its data came from the primary that replaced it.  P commits X; R (P's replica)
is promoted while P still runs and takes an invalidation of X that R never receives; P then
syncs from R as its replica (R's data: X complete at the old version) and is promoted again
once R fails.  Stamped with the ``run_id`` alone, X read as complete and fresh there again:
the invalidation was rolled back without anyone noticing.  Blocks are stamped with the
server's tenure (``run_id`` and ``master_replid``, new at every promotion), so every block
from before the fail-back reads stale on P."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from kvwire.aio.registry_redis import RedisRegistry
from kvwire.consistency.blocks import block_key
from kvwire.errors import StaleVersionError
from tests.consistency.conftest import start_redis

pytestmark = pytest.mark.timeout(60)


async def _synced(raw: Any, key: str, version: int) -> None:
    """Until replica ``raw`` holds block hash ``key`` at ``version`` with its link up (bounded)."""
    for _ in range(400):
        info = await raw.info("replication")
        if info.get("master_link_status") == "up" and await raw.hget(key, "v") == str(version).encode():
            return
        await asyncio.sleep(0.05)
    pytest.fail(f"the replica never held {key} at {version}")


async def test_a_former_primary_promoted_again_reports_no_block_from_before_fresh(
    redis_binary: str, tmp_path: Path
) -> None:
    import redis.asyncio as aioredis

    p_server = start_redis(redis_binary, tmp_path / "p")
    r_server = start_redis(redis_binary, tmp_path / "r", args=["--replicaof", "127.0.0.1", str(p_server.port)])
    p_raw = aioredis.from_url(p_server.url)
    r_raw = aioredis.from_url(r_server.url)
    on_p = await RedisRegistry.connect(p_server.url, namespace="fb", timeout=2.0)
    x = on_p.layout.block(block_key(b"X"))
    try:
        [(_, v1)] = await on_p.commit(await on_p.begin([b"X"], owner="a", ttl=60))  # a decode node caches X at v1
        [(_, w1)] = await on_p.commit(await on_p.begin([b"W"], owner="a", ttl=60))
        await _synced(r_raw, x, v1)
        # R promoted; P, partitioned from its clients' failover but still running, takes one more write
        await r_raw.replicaof("NO", "ONE")
        v2 = await on_p.invalidate(b"X")  # new weights: R never hears of it
        assert v2 > v1
        # P rejoins as R's replica (a full sync: X complete at v1 again), then R fails and P is promoted
        await p_raw.replicaof("127.0.0.1", str(r_server.port))
        await _synced(p_raw, x, v1)
        r_server.stop()
        await p_raw.replicaof("NO", "ONE")
        async with await RedisRegistry.connect(p_server.url, namespace="fb", timeout=2.0) as back:
            assert await back.check_many([(b"X", v1), (b"W", w1)]) == [b"X", b"W"]
            with pytest.raises(StaleVersionError, match="restarted or failed over"):
                await back.check(b"X", v1)
            assert await back.lookup([b"X"]) == []
            assert await back.superseded([(b"X", v1)]) == [b"X"]
            assert await back.publish([(b"X", v1)]) == [b"X"]
            # v2 was handed out (on P, before the fail-back) though the synced counter is below
            # it: rejected as not confirmed, not refused as never issued
            assert await back.publish([(b"X", v2)]) == [b"X"]
            again = await back.begin([b"X", b"W"], owner="b", ttl=60)
            assert again.started == (b"X", b"W") and again.complete == ()
            [(_, v3), (_, w3)] = await back.commit(again)
            assert v3 > v2 and w3 > v3  # versions stay increasing across the fail-back
            assert await back.check_many([(b"X", v3), (b"W", w3)]) == []
            assert await back.lookup([b"X", b"W"]) == [(b"X", v3), (b"W", w3)]
            assert await back.invalidate(b"X") > w3
    finally:
        await on_p.close()
        await p_raw.aclose()
        await r_raw.aclose()
        r_server.stop()
        p_server.stop()


async def test_a_lease_begun_before_the_fail_back_cannot_commit(redis_binary: str, tmp_path: Path) -> None:
    """A lease begun on P before its demotion, its blocks synced back from R, holds nothing on
    P promoted again: renew ends it (it is not live), commit refuses it, and its block is
    free for another lease at once."""
    import redis.asyncio as aioredis

    from kvwire.consistency import LeaseExpiredError

    p_server = start_redis(redis_binary, tmp_path / "p")
    r_server = start_redis(redis_binary, tmp_path / "r", args=["--replicaof", "127.0.0.1", str(p_server.port)])
    p_raw = aioredis.from_url(p_server.url)
    r_raw = aioredis.from_url(r_server.url)
    on_p = await RedisRegistry.connect(p_server.url, namespace="fbl", timeout=2.0)
    marker = on_p.layout.block(block_key(b"M"))
    try:
        lease = await on_p.begin([b"L"], owner="a", ttl=60)
        vm = await on_p.invalidate(b"M")
        await _synced(r_raw, marker, vm)  # R holds the lease's block as begun
        await r_raw.replicaof("NO", "ONE")
        await p_raw.replicaof("127.0.0.1", str(r_server.port))
        await _synced(p_raw, marker, vm)
        r_server.stop()
        await p_raw.replicaof("NO", "ONE")
        async with await RedisRegistry.connect(p_server.url, namespace="fbl", timeout=2.0) as back:
            with pytest.raises(LeaseExpiredError):
                await back.renew(lease, ttl=60)
            with pytest.raises(LeaseExpiredError):
                await back.commit(lease)
            assert (await back.begin([b"L"], owner="b", ttl=60)).started == (b"L",)  # not busy
    finally:
        await on_p.close()
        await p_raw.aclose()
        await r_raw.aclose()
        r_server.stop()
        p_server.stop()
