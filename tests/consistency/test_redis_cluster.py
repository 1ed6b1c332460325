"""The Redis registry wrapping a ``redis.asyncio.RedisCluster`` client (a one-node cluster):
a namespace's keys share one slot, so each command goes, once, to the node that owns it."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvwire.aio.registry_redis import RedisRegistry
from kvwire.consistency import LeaseExpiredError, RegistryUnavailableError
from tests.consistency.conftest import RedisServer, start_redis

pytestmark = pytest.mark.timeout(60)


def _command(port: int, *args: str) -> bytes:
    """One command over a bare socket (RESP), its whole reply as sent."""
    payload = f"*{len(args)}\r\n".encode() + b"".join(f"${len(a)}\r\n{a}\r\n".encode() for a in args)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(payload)
        return s.recv(65536)


@pytest.fixture
def cluster_server(redis_binary: str, tmp_path: Path) -> Iterator[RedisServer]:
    server = start_redis(
        redis_binary,
        tmp_path,
        args=["--cluster-enabled", "yes", "--cluster-config-file", str(tmp_path / "nodes.conf")],
    )
    try:
        # ADDSLOTS, not ADDSLOTSRANGE (Redis 7 only)
        assert _command(server.port, "CLUSTER", "ADDSLOTS", *map(str, range(16384))).startswith(b"+OK")
        deadline = time.monotonic() + 20
        while b"cluster_state:ok" not in _command(server.port, "CLUSTER", "INFO"):
            assert time.monotonic() < deadline, "the one-node cluster never came up"
            time.sleep(0.05)
        yield server
    finally:
        server.stop()


async def test_a_wrapped_cluster_client_works(cluster_server: RedisServer) -> None:
    """Every call failed with AttributeError ('RedisCluster' has no connection_pool)."""
    import redis.asyncio as aioredis

    client = aioredis.RedisCluster(host="127.0.0.1", port=cluster_server.port)
    reg = RedisRegistry(client, namespace=f"cl-{uuid.uuid4().hex}")
    try:
        async with reg.watch() as watcher:
            lease = await reg.begin([b"a", b"b"], owner="o")
            assert lease.started == (b"a", b"b")
            lease = await reg.renew(lease)
            committed = await reg.commit(lease)
            assert await reg.lookup([b"a", b"b"]) == committed
            assert await reg.publish(committed) == []
            version = await reg.invalidate(b"a")
            assert await reg.lookup([b"a", b"b"]) == []
            with pytest.raises(LeaseExpiredError):
                await reg.commit(lease)
            # A lease holding nothing is renewed by the server's clock (TIME, routed too).
            empty = await reg.renew(dataclasses.replace(lease, started=()))
            assert empty.expires_at > 0
            seen = [await asyncio.wait_for(anext(watcher), 10) for _ in range(3)]
            assert seen == [*committed, (b"a", version)]
            held = await reg.begin([b"c"], owner="o")
            await reg.release(held)
            assert (await reg.begin([b"c"], owner="p")).started == (b"c",)
    finally:
        await reg.close()
        await client.aclose()


async def test_a_cluster_client_whose_node_is_gone_fails_closed(cluster_server: RedisServer) -> None:
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    client = aioredis.RedisCluster(host="127.0.0.1", port=cluster_server.port, retry=Retry(NoBackoff(), 0))
    reg = RedisRegistry(client, namespace=f"cl-{uuid.uuid4().hex}", timeout=2.0)
    try:
        await reg.commit(await reg.begin([b"a"], owner="o"))
        cluster_server.stop()
        with pytest.raises(RegistryUnavailableError):
            await reg.lookup([b"a"])
    finally:
        await reg.close()
        await client.aclose()
