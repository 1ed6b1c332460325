"""Redis-only behaviour: failing closed, and many processes sharing one server."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections import defaultdict
from pathlib import Path

import pytest

from kvwire.aio.registry_redis import RedisRegistry
from kvwire.consistency import NotificationsLostError, RegistryUnavailableError
from kvwire.errors import KvwireError
from tests.consistency.conftest import RedisServer, start_redis

pytestmark = pytest.mark.timeout(60)
WORKER = Path(__file__).with_name("redis_worker.py")


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_unreachable_fails_closed() -> None:
    with pytest.raises(RegistryUnavailableError) as info:
        await RedisRegistry.connect(f"redis://127.0.0.1:{_closed_port()}/0", timeout=1.0)
    assert isinstance(info.value, KvwireError)


async def test_server_dies_mid_use(redis_binary: str, tmp_path: Path) -> None:
    server = start_redis(redis_binary, tmp_path)
    try:
        reg = await RedisRegistry.connect(server.url, namespace="die", timeout=1.0)
        async with reg:
            [(_, v)] = await reg.commit(await reg.begin([1], owner="a"))
            await reg.check(1, v)
            watcher = reg.watch()
            await watcher.__aenter__()
            server.stop()
            # nothing may be reported fresh once Redis cannot confirm it
            for op in (
                reg.check(1, v),
                reg.check_many([(1, v)]),
                reg.lookup([1]),
                reg.begin([2], owner="a"),
                reg.invalidate(1),
                reg.publish([(1, v + 1)]),
            ):
                with pytest.raises(RegistryUnavailableError):
                    await op
            with pytest.raises(NotificationsLostError):
                await asyncio.wait_for(anext(watcher), 5)
            await watcher.aclose()
    finally:
        server.stop()


async def test_a_redis_that_lost_its_data_never_hands_out_an_old_version_again(redis_server: RedisServer) -> None:
    """Redis restarted without its data (no persistence, a crash between snapshots, a
    replica behind its primary): the version counter is gone, yet the versions handed out
    afterwards are above every earlier one, so a copy cached at an old version is still
    stale after the block is recomputed."""
    import redis.asyncio as aioredis

    namespace = f"lost-{uuid.uuid4().hex}"
    reg = await RedisRegistry.connect(redis_server.url, namespace=namespace, timeout=5.0)
    async with reg:
        [(_, v1)] = await reg.commit(await reg.begin([b"b1"], owner="a"))  # a consumer caches b1 at v1
        v2 = await reg.invalidate(b"b1")  # new weights
        assert v2 > v1
        raw = aioredis.from_url(redis_server.url)
        try:
            for key in await raw.keys(f"{{{namespace}}}*"):
                await raw.delete(key)  # the namespace's data, the counter included, is lost
        finally:
            await raw.aclose()
        [(_, v3)] = await reg.commit(await reg.begin([b"b1"], owner="c"))  # recomputed with the new weights
        assert v3 > v2
        assert await reg.check_many([(b"b1", v1)]) == [b"b1"]  # the old copy is stale
        assert await reg.check_many([(b"b1", v3)]) == []


def test_many_processes_no_lost_update(redis_server: RedisServer) -> None:
    namespace = f"mp-{uuid.uuid4().hex}"
    procs, ops = 8, 500
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path.cwd()), *sys.path])}
    workers = [
        subprocess.Popen(
            [sys.executable, str(WORKER), redis_server.url, namespace, str(i), str(ops)],
            stdout=subprocess.PIPE,
            env=env,
        )
        for i in range(procs)
    ]
    results = []
    for w in workers:
        out, _ = w.communicate(timeout=50)
        assert w.returncode == 0
        results.append(json.loads(out))
    handed: list[int] = []
    per_block: dict[str, list[int]] = defaultdict(list)
    busy = 0
    for r in results:
        busy += r["busy"]
        for block, version in r["versions"]:
            handed.append(version)
            per_block[str(block)].append(version)
        # each process saw every block's versions only grow
        for seq in r["seen"].values():
            assert seq == sorted(seq)
    assert len(handed) == len(set(handed)), "a version was handed out twice"
    assert busy > 0, "no contention: the test did not exercise concurrent begins"

    async def final() -> None:
        async with await RedisRegistry.connect(redis_server.url, namespace=namespace) as reg:
            for block, versions in per_block.items():
                state = await reg._read([f"i:{block}"])
                assert state[0][0] == max(versions), "the last update was lost"

    asyncio.run(final())


async def test_a_wrapped_client_that_decodes_replies_works_alike(redis_server: RedisServer) -> None:
    """A client made with ``decode_responses=True`` answers str where kvwire's own answers
    bytes: a committed block must still read as complete."""
    import redis.asyncio as aioredis

    client = aioredis.from_url(redis_server.url, decode_responses=True)
    reg = RedisRegistry(client, namespace=f"dec-{uuid.uuid4().hex}")
    try:
        lease = await reg.begin([b"a", b"b"], owner="p")
        assert lease.started == (b"a", b"b")
        committed = await reg.commit(lease)
        assert await reg.lookup([b"a", b"b"]) == committed
        [(_, va), (_, vb)] = committed
        await reg.check(b"a", va)
        assert await reg.check_many([(b"a", va), (b"b", vb - 1)]) == [b"b"]
        assert await reg.superseded([(b"a", va)]) == []
        assert (await reg.begin([b"a"], owner="q")).complete == ((b"a", va),)
        async with reg.watch() as watcher:
            v2 = await reg.invalidate(b"a")
            assert await asyncio.wait_for(anext(watcher), 10) == (b"a", v2)
    finally:
        await reg.close()
        await client.aclose()


async def test_a_wrapped_client_without_socket_timeout_does_not_hang(redis_binary: str, tmp_path: Path) -> None:
    """A Redis that accepts but never answers (here: stopped) fails each call within the
    registry's ``timeout``, even when the wrapped client itself would wait forever."""
    import signal

    import redis.asyncio as aioredis

    server = start_redis(redis_binary, tmp_path)
    client = aioredis.from_url(server.url, socket_timeout=None)  # waits forever on its own
    reg = RedisRegistry(client, namespace="silent", timeout=0.5)
    try:
        [(_, v)] = await reg.commit(await reg.begin([1], owner="a"))
        os.kill(server.process.pid, signal.SIGSTOP)
        try:
            for op in (reg.check(1, v), reg.begin([2], owner="a"), reg.invalidate(1), reg.publish([(1, v + 1)])):
                with pytest.raises(RegistryUnavailableError, match="no reply within"):
                    await asyncio.wait_for(op, 10)
            with pytest.raises(RegistryUnavailableError):
                await asyncio.wait_for(reg.watch().__aenter__(), 10)
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
    finally:
        await reg.close()
        await client.aclose()
        server.stop()
