"""A Redis registry that cannot reach Redis tries again after a pause, not at once: a
watcher subscribing anew while Redis refuses connections (the reader following the docs'
recipe looped through thousands of connection attempts a second), and a begin's undo whose
RELEASE failed (it made one try, leaving the blocks busy for the whole ttl).  What a failed
subscription says names its cause (it said "network:ConnectionError"), and a call in flight
when close() closes the client says so (it said "Connection closed by server.")."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from kvwire.aio.registry_redis import RedisRegistry, RedisWatcher
from kvwire.consistency import NotificationsLostError
from kvwire.errors import RegistryUnavailableError
from tests.consistency.conftest import RedisServer, start_redis

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def own_server(redis_binary: str, tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of the test's own, which the test may stop."""
    server = start_redis(redis_binary, tmp_path / "redis")
    try:
        yield server
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server.process.pid, signal.SIGCONT)
        server.stop()


class _Attempts:
    """Counts the watcher's connection attempts: each new subscription is a new pubsub
    (a new connection), made by the registry's ``_new_pubsub``."""

    def __init__(self, registry: RedisRegistry) -> None:
        self.count = 0
        self._make = registry._new_pubsub
        registry._new_pubsub = self._counted  # type: ignore[method-assign]

    def _counted(self) -> Any:
        self.count += 1
        return self._make()


async def _lost_once(watcher: RedisWatcher) -> NotificationsLostError:
    """The NotificationsLostError of the watcher's next read (bounded)."""
    with pytest.raises(NotificationsLostError) as info:
        await asyncio.wait_for(anext(watcher), 30)
    return info.value


async def test_a_watcher_read_in_the_docs_loop_pauses_between_attempts_while_redis_refuses(
    own_server: RedisServer,
) -> None:
    """Redis stops (connections refused).  The reader does what the docs ask: on
    NotificationsLostError it re-reads (which fails: Redis is down) and reads on.  Each read
    tried to subscribe anew at once, and a refused connection fails in microseconds: the
    loop made thousands of attempts a second.  A read after a failed try pauses first
    (0.2 s, doubling): in 1.5 s of the loop, a handful of attempts.  (Load only makes the
    loop slower, so fewer attempts, never more.)"""
    reg = await RedisRegistry.connect(own_server.url, namespace=f"pause-{uuid.uuid4().hex}", timeout=5.0)
    attempts = _Attempts(reg)
    losses: list[NotificationsLostError] = []
    rereads_failed = 0

    async def follow(watcher: RedisWatcher) -> None:
        nonlocal rereads_failed
        while True:
            try:
                async for _ in watcher:
                    pass
                return
            except NotificationsLostError as exc:
                losses.append(exc)
                try:
                    await reg.lookup([b"a"])  # the docs' re-read
                except RegistryUnavailableError:
                    rereads_failed += 1

    try:
        async with reg.watch() as watcher:
            follower = asyncio.create_task(follow(watcher))
            own_server.stop()
            for _ in range(600):  # bounded: until the loss is seen
                if losses:
                    break
                await asyncio.sleep(0.05)
            assert losses, "the subscription's loss was never raised"
            seen = attempts.count
            await asyncio.sleep(1.5)
            made = attempts.count - seen
            # Pauses of 0.2, 0.4, 0.8 s: at most 3 more tries in 1.5 s (4 allowed).
            assert made <= 4, f"{made} connection attempts in 1.5 s"
            assert rereads_failed >= 1  # the recipe was followed: re-read after each error
            # Each says why it could not subscribe: the refused address, not the class alone.
            assert f"127.0.0.1:{own_server.port}" in str(losses[-1]), str(losses[-1])
            assert "not subscribed again" in str(losses[-1])
            await asyncio.wait_for(watcher.aclose(), 10)
            await asyncio.wait_for(follower, 10)
    finally:
        await asyncio.wait_for(reg.close(), 30)


async def test_aclose_ends_a_read_pausing_before_it_subscribes_anew(own_server: RedisServer) -> None:
    """A read pausing before its next try ends at aclose(), without trying (the pause is
    waited in slices that look at the closed flag)."""
    reg = await RedisRegistry.connect(own_server.url, namespace=f"pause-{uuid.uuid4().hex}", timeout=5.0)
    attempts = _Attempts(reg)
    try:
        async with reg.watch() as watcher:
            own_server.stop()
            error = await _lost_once(watcher)
            assert "not subscribed again" in str(error)
            tried = attempts.count
            watcher._retry_pause = 60.0  # (white box) a long pause, as after many failures
            reading = asyncio.ensure_future(anext(watcher))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(reading), 0.5)
            assert not reading.done(), "the read tried again at once"
            await asyncio.wait_for(watcher.aclose(), 10)
            with pytest.raises(StopAsyncIteration):
                await asyncio.wait_for(reading, 10)
            assert attempts.count == tried
    finally:
        await asyncio.wait_for(reg.close(), 30)


async def test_a_failed_first_subscription_names_the_refused_address(own_server: RedisServer) -> None:
    """redis-py's errors' repr is "network:ConnectionError": the message said nothing of
    where or why."""
    reg = await RedisRegistry.connect(own_server.url, namespace=f"why-{uuid.uuid4().hex}", timeout=5.0)
    try:
        own_server.stop()
        with pytest.raises(RegistryUnavailableError) as info:
            async with reg.watch():
                pass
        text = str(info.value)
        assert "subscribe failed: ConnectionError: " in text, text
        assert f"127.0.0.1:{own_server.port}" in text, text
    finally:
        await reg.close()


async def test_a_subscription_never_confirmed_says_so() -> None:
    """A server that accepts the connection and says nothing: the subscription's bound
    runs out, and the message said only "TimeoutError()"."""

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            await reader.read()  # until the client goes
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = aioredis.Redis(host="127.0.0.1", port=port)  # no socket timeouts of its own
    reg = RedisRegistry(client, namespace=f"why-{uuid.uuid4().hex}", timeout=0.3)
    try:
        with pytest.raises(RegistryUnavailableError, match=r"subscribe failed: no SUBSCRIBE confirmation within 0\.3 s"):
            async with reg.watch():
                pass
    finally:
        await reg.close()
        await client.aclose()
        server.close()
        await server.wait_closed()


@contextlib.asynccontextmanager
async def _flaky(reg: RedisRegistry, release_failures: int) -> AsyncIterator[list[int]]:
    """``reg``'s BEGIN runs but its reply is lost (a connection error after it ran), and its
    first ``release_failures`` RELEASE commands fail before reaching Redis; yields the count
    of RELEASE tries (a one-item list)."""
    real_begin, real_release = reg._begin, reg._release
    tries = [0]

    async def begin_reply_lost(**kwargs: Any) -> Any:
        await real_begin(**kwargs)
        raise RedisConnectionError("the reply was lost (test)")

    async def release(**kwargs: Any) -> Any:
        tries[0] += 1
        if tries[0] <= release_failures:
            raise RedisConnectionError("Redis unreachable (test)")
        return await real_release(**kwargs)

    reg._begin, reg._release = begin_reply_lost, release  # type: ignore[assignment]
    try:
        yield tries
    finally:
        reg._begin = real_begin


async def _background_done(reg: RedisRegistry) -> None:
    for _ in range(120):  # bounded
        if not reg._background:
            return
        await asyncio.wait(set(reg._background), timeout=0.5)
    raise AssertionError("the registry's background tasks did not end")


async def test_a_begin_whose_undo_failed_once_frees_its_blocks_long_before_the_ttl(
    redis_server: RedisServer,
) -> None:
    """begin's reply is lost, and so is its undo's first RELEASE: the undo made one try,
    and the blocks stayed busy for the whole ttl (60 s here).  RELEASE is tried again after
    a pause: the blocks are free once the registry's background work ends."""
    namespace = f"undo-{uuid.uuid4().hex}"
    reg = await RedisRegistry.connect(redis_server.url, namespace=namespace, timeout=2.0)
    direct = await RedisRegistry.connect(redis_server.url, namespace=namespace, timeout=5.0)
    try:
        async with _flaky(reg, release_failures=1) as tries:
            with pytest.raises(RegistryUnavailableError, match="reply was lost"):
                await reg.begin([b"b"], owner="x", ttl=60)
            await _background_done(reg)
        assert tries[0] == 2
        probe = await direct.begin([b"b"], owner="probe", ttl=5)
        assert probe.started == (b"b",), probe
        await direct.release(probe)
    finally:
        await reg.close()
        await direct.close()


async def test_a_begin_undo_that_keeps_failing_stops_at_the_ttl_or_at_close(redis_server: RedisServer) -> None:
    """RELEASE failing every time: tried again after pauses (0.2 s, doubling) until the
    ttl has passed, not once only and not forever; close() ends the tries of a longer one."""
    namespace = f"undo-{uuid.uuid4().hex}"
    reg = await RedisRegistry.connect(redis_server.url, namespace=namespace, timeout=2.0)
    try:
        async with _flaky(reg, release_failures=10**6) as tries:
            with pytest.raises(RegistryUnavailableError):
                await reg.begin([b"c"], owner="x", ttl=3)
            await _background_done(reg)  # the ttl (3 s) passed
            # Tries at 0, 0.2, 0.6, 1.4 s (then 3 s: the ttl): a few, more than one.
            assert 2 <= tries[0] <= 5, tries[0]
            with pytest.raises(RegistryUnavailableError):
                await reg.begin([b"d"], owner="x", ttl=600)
            before = tries[0]
            await asyncio.wait_for(reg.close(), 10)
            assert not reg._background
            assert tries[0] <= before + 1
    finally:
        await reg.close()


async def test_a_call_in_flight_when_close_closes_the_client_says_so(own_server: RedisServer) -> None:
    """Redis hangs (stopped), calls wait for their replies, and close() closes connect()'s
    client under them: they said "Connection closed by server."."""
    reg = await RedisRegistry.connect(own_server.url, namespace=f"close-{uuid.uuid4().hex}", timeout=30.0)
    await reg.check_many([(b"a", 1)])
    os.kill(own_server.process.pid, signal.SIGSTOP)
    try:
        calls = [
            asyncio.ensure_future(reg.check_many([(b"a", 1)])),
            asyncio.ensure_future(reg.invalidate(b"a")),
        ]
        await asyncio.sleep(0.3)  # both sent, awaiting their replies
        assert not any(call.done() for call in calls)
        await asyncio.wait_for(reg.close(), 20)
        outcomes = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 20)
        for outcome in outcomes:
            assert isinstance(outcome, RegistryUnavailableError), outcome
            assert "registry closed while the call was in flight" in str(outcome), outcome
    finally:
        os.kill(own_server.process.pid, signal.SIGCONT)
        await reg.close()
