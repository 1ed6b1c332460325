"""Redis-only behaviour: failing closed, and many processes sharing one server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from kvwire.aio.registry_redis import RedisRegistry
from kvwire.consistency import LeaseExpiredError, NotificationsLostError, RegistryUnavailableError
from kvwire.errors import KvwireError, StaleVersionError, UsageError
from tests.consistency.conftest import RedisServer, start_redis
from tests.consistency.proxy import RedisProxy

pytestmark = pytest.mark.timeout(60)
T = TypeVar("T")
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


async def test_a_watcher_whose_connection_goes_silent_raises(redis_server: RedisServer) -> None:
    """The watcher's connection stops delivering (a half-open connection, a stalled
    network) while changes are published: the watcher raises NotificationsLostError
    (bounded by the registry's timeout) rather than wait forever; the next read subscribes
    anew and receives later changes."""
    from kvwire.testing.fault_proxy import CLEAN, FaultProxy

    namespace = f"stall-{uuid.uuid4().hex}"
    async with FaultProxy("127.0.0.1", redis_server.port, plan=CLEAN) as proxy:
        reg = await RedisRegistry.connect(f"redis://127.0.0.1:{proxy.port}/0", namespace=namespace, timeout=0.5)
        direct = await RedisRegistry.connect(redis_server.url, namespace=namespace)
        async with reg, direct, reg.watch() as watcher:
            v = await direct.invalidate(b"before")
            assert await asyncio.wait_for(anext(watcher), 10) == (b"before", v)
            proxy.stall()  # every connection through the proxy, the subscription's included
            await direct.invalidate(b"during")  # never reaches the watcher
            with pytest.raises(NotificationsLostError):
                await asyncio.wait_for(anext(watcher), 10)
            proxy.resume()
            reading = asyncio.ensure_future(anext(watcher))
            for _ in range(200):  # bounded: until the new subscription is in place
                await direct.invalidate(b"after")
                done, _ = await asyncio.wait({reading}, timeout=0.05)
                if done:
                    break
            assert (await asyncio.wait_for(reading, 10))[0] == b"after"


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


async def _answered(call: Callable[[], Awaitable[T]]) -> T:
    """``call()``'s result once a restarted server answers: a pooled connection to the server
    that died fails the first call (RegistryUnavailableError), the next ones reconnect."""
    for _ in range(5):
        with contextlib.suppress(RegistryUnavailableError):
            return await call()
        await asyncio.sleep(0.1)
    return await call()


async def test_a_redis_restored_from_an_older_snapshot_reports_no_earlier_block_fresh(
    redis_binary: str, tmp_path: Path
) -> None:
    """Redis crashed between snapshots: restarted from the last one, it brings blocks back as
    they were before later invalidations.  A copy cached then, and a lease that lost its
    block after the snapshot, must not pass as fresh; the same registry object (its client
    reconnecting by itself) must not be fooled either."""
    server = start_redis(redis_binary, tmp_path)
    reg = await RedisRegistry.connect(server.url, namespace="rb", timeout=2.0)
    try:
        [(_, v1)] = await reg.commit(await reg.begin([b"blk"], owner="a"))  # a decode node caches blk at v1
        lease = await reg.begin([b"busy"], owner="b", ttl=60)  # in flight at the snapshot
        await reg.client.save()
        v2 = await reg.invalidate(b"blk")  # new weights, after the snapshot
        await reg.invalidate(b"busy")  # taken from the lease: its data is outdated
        assert await reg.check_many([(b"blk", v1)]) == [b"blk"]
        server.process.kill()  # crash before the next snapshot
        server.process.wait(5)
        server = start_redis(redis_binary, tmp_path, port=server.port)  # loads the snapshot
        assert await _answered(lambda: reg.check_many([(b"blk", v1)])) == [b"blk"]
        assert await reg.lookup([b"blk"]) == []
        assert await reg.superseded([(b"blk", v1)]) == [b"blk"]
        assert await reg.publish([(b"blk", v1)]) == [b"blk"]
        # handed out after the snapshot (above the restored counter): rejected, not refused
        assert await reg.publish([(b"blk", v2)]) == [b"blk"]
        with pytest.raises(StaleVersionError, match="restarted"):
            await reg.check(b"blk", v1)
        with pytest.raises(StaleVersionError, match="changed while in flight"):
            await reg.commit(lease)
        again = await reg.begin([b"blk", b"busy"], owner="c")  # computed again, not complete
        assert again.started == (b"blk", b"busy") and again.complete == ()
        [(_, v3), _] = await reg.commit(again)
        assert v3 > v2
        assert await reg.check_many([(b"blk", v3)]) == []
        assert await reg.lookup([b"blk"]) == [(b"blk", v3)]
    finally:
        await reg.close()
        server.stop()


async def test_a_replica_promoted_after_a_failover_reports_no_earlier_block_fresh(
    redis_binary: str, tmp_path: Path
) -> None:
    """A replica may lag its primary (invalidations it never received); once promoted it
    cannot tell, so no block committed on the primary is fresh there (fail closed) and
    begin starts them again."""
    import redis.asyncio as aioredis

    from kvwire.consistency.blocks import block_key

    primary = start_redis(redis_binary, tmp_path / "primary")
    replica = start_redis(redis_binary, tmp_path / "replica", args=["--replicaof", "127.0.0.1", str(primary.port)])
    raw = aioredis.from_url(replica.url)
    reg = await RedisRegistry.connect(primary.url, namespace="fo", timeout=2.0)
    try:
        [(_, v1)] = await reg.commit(await reg.begin([b"blk"], owner="a"))
        for _ in range(200):  # bounded: until the replica holds the commit
            if await raw.hget(reg.layout.block(block_key(b"blk")), "c") == b"1":
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail("the replica never received the commit")
        primary.stop()
        await raw.replicaof("NO", "ONE")
        async with await RedisRegistry.connect(replica.url, namespace="fo", timeout=2.0) as promoted:
            assert await promoted.check_many([(b"blk", v1)]) == [b"blk"]
            assert await promoted.lookup([b"blk"]) == []
            assert (await promoted.begin([b"blk"], owner="b")).started == (b"blk",)
    finally:
        await reg.close()
        await raw.aclose()
        replica.stop()
        primary.stop()


async def test_publish_after_redis_lost_its_data_rejects_the_versions_it_handed_out(
    redis_server: RedisServer,
) -> None:
    """Redis lost the namespace (a restart without persistence, a flush): publish of a
    version the registry really handed out is rejected (the data is not confirmed), not
    refused as never issued; one that cannot have been handed out still raises."""
    import redis.asyncio as aioredis

    namespace = f"lostpub-{uuid.uuid4().hex}"
    async with await RedisRegistry.connect(redis_server.url, namespace=namespace, timeout=5.0) as reg:
        [(_, va)] = await reg.commit(await reg.begin([b"a"], owner="p"))
        vb = await reg.invalidate(b"b")
        raw = aioredis.from_url(redis_server.url)
        try:
            for key in await raw.keys(f"{{{namespace}}}*"):
                await raw.delete(key)
        finally:
            await raw.aclose()
        assert await reg.publish([(b"a", va), (b"b", vb)]) == [b"a", b"b"]
        with pytest.raises(UsageError, match="above the last one it handed out"):
            await reg.publish([(b"a", va), (b"x", 2**53 - 1)])
        [(_, vc)] = await reg.commit(await reg.begin([b"c"], owner="p"))  # the counter moves again
        assert vc > vb
        with pytest.raises(UsageError, match="above the last one it handed out"):
            await reg.publish([(b"c", vc + 1)])
        assert await reg.publish([(b"a", va), (b"c", vc)]) == [b"a"]


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


@pytest.mark.parametrize("failure", ["timeout", "connection", "cancel"])
async def test_a_begin_whose_reply_is_lost_leaves_nothing_held(
    redis_server: RedisServer, failure: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """BEGIN ran on the server but its reply never arrived (too late, connection dropped,
    caller cancelled): the caller never got the lease, so the registry releases it itself
    and a new begin (always safe, says the doc) starts the blocks instead of finding them
    busy for the whole ttl."""
    import redis.asyncio as aioredis
    from redis.exceptions import ConnectionError as RedisConnectionError

    reg = await RedisRegistry.connect(redis_server.url, namespace=f"lost-{uuid.uuid4().hex}", timeout=0.5)
    real = reg._begin
    ran = asyncio.Event()

    async def reply_lost(**kwargs: Any) -> Any:
        await real(**kwargs)  # the script ran...
        ran.set()
        if failure == "connection":
            raise RedisConnectionError("connection lost while reading the reply")
        await asyncio.Event().wait()  # ...and its reply never comes

    async with reg:
        monkeypatch.setattr(reg, "_begin", reply_lost)
        if failure == "cancel":
            task = asyncio.create_task(reg.begin([b"blk", b"blk2"], owner="a", ttl=30))
            await asyncio.wait_for(ran.wait(), 5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            with pytest.raises(RegistryUnavailableError):
                await reg.begin([b"blk", b"blk2"], owner="a", ttl=30)
        assert ran.is_set()
        monkeypatch.setattr(reg, "_begin", real)
        retry = await reg.begin([b"blk", b"blk2"], owner="a-retry", ttl=30)
        assert retry.started == (b"blk", b"blk2") and retry.busy == ()
        raw = aioredis.from_url(redis_server.url)
        try:
            leases = await raw.keys(f"{{{reg.namespace}}}:lease:*")
            # the retry's lease, and the undone one left dead (expiry 0) until its ttl
            expiries = sorted([int(await raw.get(k) or -1) for k in leases])
            assert expiries == [0, round(retry.expires_at * 1e6)]
        finally:
            await raw.aclose()


async def test_a_begin_arriving_after_its_undo_changes_nothing(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A begin times out before its BEGIN reached the server; the undo runs first, the
    BEGIN (on another connection) after it: it finds its lease id dead and takes nothing."""
    from redis.exceptions import ResponseError

    reg = await RedisRegistry.connect(redis_server.url, namespace=f"late-{uuid.uuid4().hex}", timeout=0.5)
    real = reg._begin
    sent: list[dict[str, Any]] = []

    async def delayed(**kwargs: Any) -> Any:
        sent.append(kwargs)
        await asyncio.Event().wait()  # still on its way when the caller gives up

    async with reg:
        monkeypatch.setattr(reg, "_begin", delayed)
        with pytest.raises(RegistryUnavailableError, match="no reply"):
            await reg.begin([7], owner="a", ttl=30)
        monkeypatch.setattr(reg, "_begin", real)
        with pytest.raises(ResponseError, match="already in use"):
            await real(**sent[0])  # the late BEGIN
        assert (await reg.begin([7], owner="b", ttl=30)).started == (7,)


async def test_name_blocks_frees_its_lease_when_cancelled_again_while_releasing(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """name_blocks releases its lease after a cancelled commit; a second cancellation (a
    bridge closing, a task group) arriving during that release must not stop it."""
    from kvwire.integrations.prefix import name_blocks, prefix_block_ids

    blocks = prefix_block_ids(list(range(64)), 16, 4, salt=b"m")
    reg = await RedisRegistry.connect(redis_server.url, namespace=f"nb-{uuid.uuid4().hex}")
    committing, releasing = asyncio.Event(), asyncio.Event()
    real_release = reg._release

    async def hang(lease: Any) -> Any:
        committing.set()
        await asyncio.Event().wait()

    async def slow_release(**kwargs: Any) -> Any:
        releasing.set()
        await asyncio.sleep(0.3)
        return await real_release(**kwargs)

    async with reg:
        monkeypatch.setattr(reg, "commit", hang)
        monkeypatch.setattr(reg, "_release", slow_release)
        naming = asyncio.create_task(name_blocks(reg, blocks, owner="p1", ttl=30))
        await asyncio.wait_for(committing.wait(), 5)
        naming.cancel()
        await asyncio.wait_for(releasing.wait(), 5)
        naming.cancel()  # again, while the lease is being released
        with pytest.raises(asyncio.CancelledError):
            await naming
        monkeypatch.undo()
        named = await name_blocks(reg, blocks, owner="p2", ttl=30)
        assert [b for b, _ in named] == blocks


async def test_a_begin_waits_for_releases_only(redis_server: RedisServer) -> None:
    """A begin waits for the registry's releases still running (its blocks may be among
    them), not for its other background work: a watcher's subscription being closed, here
    one that never ends, held every begin for the registry's whole timeout."""
    reg = await RedisRegistry.connect(redis_server.url, namespace=f"settle-{uuid.uuid4().hex}", timeout=60)
    async with reg:
        stuck = asyncio.Event()
        other = reg._spawn(stuck.wait())  # background work that is not a release
        lease = await asyncio.wait_for(reg.begin([b"blk"], owner="a", ttl=30), 10)
        assert lease.started == (b"blk",) and not other.done()
        await reg.release(lease)
        stuck.set()


class _ReplyDropper(RedisProxy):
    """A TCP proxy to Redis: once armed with a byte pattern, the first request holding it
    reaches Redis, but its reply is swallowed and the client's connection cut (a reply
    lost in transit after the command ran)."""

    def __init__(self, target_port: int) -> None:
        super().__init__(target_port)
        self.pattern: bytes | None = None
        self.dropped = 0

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        server_r, server_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        dropping = False

        async def forward() -> None:
            nonlocal dropping
            with contextlib.suppress(OSError):
                while data := await client_r.read(65536):
                    if self.pattern is not None and self.pattern in data:
                        self.pattern, dropping = None, True
                    server_w.write(data)
                    await server_w.drain()
            server_w.close()

        async def backward() -> None:
            with contextlib.suppress(OSError):
                while data := await server_r.read(65536):
                    if dropping:
                        self.dropped += 1
                        client_w.transport.abort()
                        return
                    client_w.write(data)
                    await client_w.drain()
            client_w.close()

        try:
            await asyncio.gather(forward(), backward())
        finally:
            server_w.close()
            client_w.close()
            self._tasks.discard(task)


async def test_a_wrapped_retrying_client_never_runs_a_script_twice(redis_server: RedisServer) -> None:
    """redis-py's default client retries a command after a connection error: a COMMIT whose
    reply was lost ran again, found its lease gone and reported LeaseExpiredError ("refused,
    changing nothing") though the first run committed; an INVALIDATE ran twice, handing out
    two versions.  The registry sends each command once: a lost reply raises
    RegistryUnavailableError (outcome unknown)."""
    import hashlib

    import redis.asyncio as aioredis

    from kvwire.consistency import redis_layout as lua

    namespace = f"once-{uuid.uuid4().hex}"
    async with _ReplyDropper(redis_server.port) as proxy:
        client = aioredis.Redis(host="127.0.0.1", port=proxy.port)  # redis-py's default retry
        reg = RedisRegistry(client, namespace=namespace, timeout=5.0)
        direct = await RedisRegistry.connect(redis_server.url, namespace=namespace)
        try:
            async with direct.watch() as watcher:
                await reg.commit(await reg.begin([b"warm"], owner="a"))  # the scripts are loaded
                await reg.invalidate(b"warm")
                lease = await reg.begin([b"blk"], owner="a")
                proxy.pattern = hashlib.sha1(lua.COMMIT.encode()).hexdigest().encode()
                with pytest.raises(RegistryUnavailableError):
                    await reg.commit(lease)
                assert proxy.dropped == 1
                [(_, committed)] = await direct.lookup([b"blk"])  # the one run landed
                proxy.pattern = hashlib.sha1(lua.INVALIDATE.encode()).hexdigest().encode()
                with pytest.raises(RegistryUnavailableError):
                    await reg.invalidate(b"blk")
                assert proxy.dropped == 2
                end = await direct.invalidate(b"end")
                seen = []
                while (item := await asyncio.wait_for(anext(watcher), 10)) != (b"end", end):
                    seen.append(item)
                # warm (commit, invalidate), blk's commit, and one invalidation of blk
                assert [b for b, _ in seen] == [b"warm", b"warm", b"blk", b"blk"]
                assert seen[2] == (b"blk", committed)
            assert await reg.lookup([b"blk"]) == []  # the registry goes on working
        finally:
            await reg.close()
            await client.aclose()
            await direct.close()


async def test_a_wrapped_retrying_clients_watcher_raises_when_its_subscription_breaks(
    redis_server: RedisServer,
) -> None:
    """With redis-py's default retry a broken subscription was re-made inside the read and
    the changes published meanwhile skipped without a word; the watcher raises
    NotificationsLostError, and its next read subscribes anew."""
    import redis.asyncio as aioredis

    name = f"w-{uuid.uuid4().hex}"
    namespace = f"rw-{uuid.uuid4().hex}"
    client = aioredis.Redis(host="127.0.0.1", port=redis_server.port, client_name=name)
    raw = aioredis.from_url(redis_server.url)
    reg = RedisRegistry(client, namespace=namespace)
    direct = await RedisRegistry.connect(redis_server.url, namespace=namespace)
    try:
        async with reg.watch() as watcher:
            reading = asyncio.ensure_future(anext(watcher))
            killed = 0
            for entry in await raw.client_list(_type="pubsub"):
                if entry.get("name") == name:
                    killed += await raw.client_kill_filter(_id=entry["id"])
            assert killed == 1
            await direct.invalidate(b"during")  # published while the subscription is gone
            with pytest.raises(NotificationsLostError):
                for _ in range(200):  # (a reconnecting watcher would yield "after")
                    done, _ = await asyncio.wait({reading}, timeout=0.05)
                    if done:
                        break
                    await direct.invalidate(b"after")
                await asyncio.wait_for(reading, 10)
            reading = asyncio.ensure_future(anext(watcher))
            for _ in range(200):  # bounded: until the new subscription is in place
                await direct.invalidate(b"later")
                done, _ = await asyncio.wait({reading}, timeout=0.05)
                if done:
                    break
            assert (await asyncio.wait_for(reading, 10))[0] == b"later"
    finally:
        await reg.close()
        await client.aclose()
        await raw.aclose()
        await direct.close()


@pytest.mark.parametrize("data", [b"garbage", b"12 x:1", b"\xff\xfe", b"-3 s:a", b"1e3 s:a"])
async def test_a_message_on_the_channel_that_is_not_a_change(redis_server: RedisServer, data: bytes) -> None:
    """Something else published on the notification channel: the watcher raises
    NotificationsLostError (it cannot tell what was meant; the reader re-reads), not a raw
    error, and goes on delivering."""
    import redis.asyncio as aioredis

    reg = await RedisRegistry.connect(redis_server.url, namespace=f"odd-{uuid.uuid4().hex}")
    raw = aioredis.from_url(redis_server.url)
    try:
        async with reg, reg.watch() as watcher:
            await raw.publish(reg.layout.channel, data)
            with pytest.raises(NotificationsLostError, match="not a change"):
                await asyncio.wait_for(anext(watcher), 10)
            v = await reg.invalidate("ok")
            assert await asyncio.wait_for(anext(watcher), 10) == ("ok", v)
    finally:
        await raw.aclose()


@pytest.mark.parametrize(
    ("url", "timeout"),
    [
        ("http://127.0.0.1:6379", 1.0),
        ("redis://127.0.0.1:notaport/0", 1.0),
        ("redis://127.0.0.1:6379/0", 0),
        ("redis://127.0.0.1:6379/0", -1.0),
        ("redis://127.0.0.1:6379/0", float("inf")),
        ("redis://127.0.0.1:6379/0", float("nan")),
        ("redis://127.0.0.1:6379/0", None),
        ("redis://127.0.0.1:6379/0", "5"),
    ],
)
async def test_connect_refuses_bad_arguments(url: str, timeout: Any) -> None:
    with pytest.raises(UsageError):
        await RedisRegistry.connect(url, timeout=timeout)


async def test_bad_namespace_and_timeout_are_usage_errors(redis_server: RedisServer) -> None:
    import redis.asyncio as aioredis

    from kvwire.consistency.redis_layout import KeyLayout

    with pytest.raises(UsageError):
        KeyLayout(b"kv")
    with pytest.raises(UsageError):
        await RedisRegistry.connect(redis_server.url, namespace=b"kv")  # type: ignore[arg-type]
    client = aioredis.from_url(redis_server.url)
    try:
        for timeout in (0, -1, float("inf"), None):
            with pytest.raises(UsageError):
                RedisRegistry(client, timeout=timeout)  # type: ignore[arg-type]
    finally:
        await client.aclose()


async def test_a_renew_after_redis_restarted_from_a_snapshot_ends_the_lease(
    redis_binary: str, tmp_path: Path
) -> None:
    """A lease begun before the snapshot Redis restarted from holds nothing in the new
    server lifetime (its blocks are neither busy nor committable there): renew says so
    (LeaseExpiredError) instead of extending it, and the blocks are free."""
    server = start_redis(redis_binary, tmp_path)
    reg = await RedisRegistry.connect(server.url, namespace="rn", timeout=2.0)
    try:
        lease = await reg.begin([b"blk"], owner="a", ttl=600)
        await reg.client.save()
        server.process.kill()
        server.process.wait(5)
        server = start_redis(redis_binary, tmp_path, port=server.port)  # loads the snapshot
        with pytest.raises(LeaseExpiredError):
            await _answered(lambda: reg.renew(lease))
        with pytest.raises(LeaseExpiredError):
            await reg.commit(lease)
        assert (await reg.begin([b"blk"], owner="b")).started == (b"blk",)
    finally:
        await reg.close()
        server.stop()
