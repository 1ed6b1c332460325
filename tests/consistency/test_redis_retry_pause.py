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
import re
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
    (a new connection), made by the registry's ``_new_pubsub``; ``times`` holds the loop
    time of each."""

    def __init__(self, registry: RedisRegistry) -> None:
        self.count = 0
        self.times: list[float] = []
        self._make = registry._new_pubsub
        registry._new_pubsub = self._counted  # type: ignore[method-assign]

    def _counted(self) -> Any:
        self.count += 1
        self.times.append(asyncio.get_running_loop().time())
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
    loop made thousands of attempts a second.  Each failed try's error announces the pause
    before the next one (0.2 s, doubling), and the next try comes no sooner: measured
    between the tries, so load (which only lengthens the gaps) cannot fail it."""
    reg = await RedisRegistry.connect(own_server.url, namespace=f"pause-{uuid.uuid4().hex}", timeout=5.0)
    attempts = _Attempts(reg)
    losses: list[NotificationsLostError] = []
    tried: list[int] = []  # attempts.count as each loss was raised: the try that failed
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
                tried.append(attempts.count)
                try:
                    await reg.lookup([b"a"])  # the docs' re-read
                except RegistryUnavailableError:
                    rereads_failed += 1

    try:
        async with reg.watch() as watcher:
            follower = asyncio.create_task(follow(watcher))
            own_server.stop()
            for _ in range(1200):  # bounded: until 3 more tries after the first failure
                if len(losses) >= 4:
                    break
                await asyncio.sleep(0.05)
            assert len(losses) >= 4, f"{len(losses)} losses raised"
            # One try per failure: each error is the failure of the try after the one before.
            assert tried[:4] == [tried[0] + k for k in range(4)], tried
            for k in range(3):
                said = re.search(r"after a pause of ([0-9.e+-]+) s", str(losses[k]))
                assert said is not None, f"no pause announced: {losses[k]}"
                gap = attempts.times[tried[k + 1] - 1] - attempts.times[tried[k] - 1]
                # 1 ms: clock granularity (the pause ends at its loop time, not before).
                assert gap >= float(said.group(1)) - 1e-3, (
                    f"try {k + 2} after the first failure came {gap:.4f} s after the one "
                    f"before, which announced a pause of {said.group(1)} s"
                )
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
        in_use = reg.client.connection_pool._in_use_connections  # type: ignore[union-attr]
        for _ in range(400):  # bounded: until both hold a connection (sent, awaiting replies)
            if len(in_use) == 2:
                break
            await asyncio.sleep(0.05)
        assert len(in_use) == 2, f"{len(in_use)} calls hold a connection"
        assert not any(call.done() for call in calls)
        await asyncio.wait_for(reg.close(), 20)
        outcomes = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 20)
        for outcome in outcomes:
            assert isinstance(outcome, RegistryUnavailableError), outcome
            assert "failed: the registry was closed while the call was in flight" in str(outcome), outcome
    finally:
        os.kill(own_server.process.pid, signal.SIGCONT)
        await reg.close()
