"""A Redis watcher whose every new subscription is dropped as soon as Redis confirms it
pauses before subscribing anew, after the second loss in a row: a capped exponential
backoff with jitter.  It subscribed anew at once after every loss, so a reader following
the docs' recipe (re-read, read on) drove one SUBSCRIBE after another against Redis."""

from __future__ import annotations

import asyncio
import contextlib
import re
import uuid
from typing import Any

import pytest

from kvwire.aio.registry_redis import _POLL_S, RedisRegistry
from kvwire.consistency import NotificationsLostError
from tests.consistency.conftest import RedisServer
from tests.consistency.proxy import RedisProxy

pytestmark = pytest.mark.timeout(90)

_CONFIRMATION = b"$9\r\nsubscribe\r\n"


class _DropsSubscriptions(RedisProxy):
    """Forwards to Redis, but closes a client connection as soon as Redis's SUBSCRIBE
    confirmation has been passed on to it (other connections are left alone);
    ``confirmed`` counts the confirmations passed on."""

    def __init__(self, target_port: int) -> None:
        super().__init__(target_port)
        self.confirmed = 0

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, drop: bool) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
            if drop and _CONFIRMATION in data:
                self.confirmed += 1
                writer.transport.abort()
                return

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        server_w: asyncio.StreamWriter | None = None
        try:
            server_r, server_w = await asyncio.open_connection("127.0.0.1", self.target_port)
            pumps = {
                asyncio.ensure_future(self._pump(client_r, server_w, drop=False)),
                asyncio.ensure_future(self._pump(server_r, client_w, drop=True)),
            }
            try:
                await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for pump in pumps:
                    pump.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            if server_w is not None:
                server_w.close()
            client_w.close()
            self._tasks.discard(task)


class _FakeClock:
    """The watcher's sleep: returns at once, adding up what was asked for; ``before``
    holds, for each new subscription (``_new_pubsub``), the time slept since the one
    before."""

    def __init__(self, registry: RedisRegistry) -> None:
        self.slept = 0.0
        self.before: list[float] = []
        self._make = registry._new_pubsub
        registry._new_pubsub = self._counted  # type: ignore[method-assign]

    async def sleep(self, seconds: float) -> None:
        self.slept += seconds
        await asyncio.sleep(0)

    def _counted(self) -> Any:
        self.before.append(self.slept)
        self.slept = 0.0
        return self._make()


async def test_a_watcher_whose_subscriptions_are_dropped_at_once_backs_off(
    redis_server: RedisServer,
) -> None:
    """Every subscription is confirmed, then its connection closed.  The reader re-reads
    and reads on, 12 times.  Before: each read subscribed anew at once (12 new
    subscriptions, no pause between any).  Now the first loss is answered at once, each
    later one in a row after a pause drawn between half and all of 0.2 s, 0.4 s, ...,
    capped at the registry's timeout; each error still says "subscribed again" (the
    new subscription is in place before it is raised) and names the pause."""
    timeout = 3.0  # the cap; a subscription counts as dropped at once if lost within it
    async with _DropsSubscriptions(redis_server.port) as proxy:
        reg = await RedisRegistry.connect(
            f"redis://127.0.0.1:{proxy.port}/0", namespace=f"drop-{uuid.uuid4().hex}", timeout=timeout
        )
        clock = _FakeClock(reg)
        errors: list[str] = []
        try:
            watcher = reg.watch()
            watcher._sleep = clock.sleep  # (white box) the injectable sleep
            async with watcher:
                for _ in range(12):
                    with pytest.raises(NotificationsLostError, match="subscribed again") as info:
                        await asyncio.wait_for(anext(watcher), 20)
                    assert "not subscribed again" not in str(info.value)
                    errors.append(str(info.value))
                    assert await reg.lookup([b"a"]) == []  # the docs' re-read
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(reg.close(), 20)
    # The first subscription (async with), then one per read.
    assert len(clock.before) == 13, clock.before
    assert proxy.confirmed >= 12
    pauses = clock.before[1:]
    assert pauses[0] == 0.0, pauses  # the first loss: subscribed anew at once
    for k, got in enumerate(pauses[1:]):
        step = min(_POLL_S * 2**k, timeout)
        assert step * 0.5 - 1e-9 <= got <= step + 1e-9, (k, pauses)
        said = re.search(r"after a pause of ([0-9.e+-]+) s \((\d+) subscriptions in a row", errors[k + 1])
        assert said is not None, errors[k + 1]
        assert float(said.group(1)) == pytest.approx(got, rel=1e-2)
        assert int(said.group(2)) == k + 2
    assert "after a pause" not in errors[0]
    # Capped: the last ones are bounded by the timeout, not doubled past it.
    assert max(pauses) <= timeout + 1e-9
    assert pauses[-1] >= timeout * 0.5 - 1e-9


async def test_a_subscription_that_stood_long_enough_resets_the_backoff(
    redis_server: RedisServer,
) -> None:
    """A subscription lost after standing for the registry's timeout or more counts as the
    first loss again: subscribed anew at once."""
    async with _DropsSubscriptions(redis_server.port) as proxy:
        reg = await RedisRegistry.connect(
            f"redis://127.0.0.1:{proxy.port}/0", namespace=f"drop-{uuid.uuid4().hex}", timeout=3.0
        )
        clock = _FakeClock(reg)
        try:
            watcher = reg.watch()
            watcher._sleep = clock.sleep
            async with watcher:
                for _ in range(4):
                    with pytest.raises(NotificationsLostError, match="subscribed again"):
                        await asyncio.wait_for(anext(watcher), 20)
                assert clock.before[-1] > 0  # backing off by now
                watcher._since -= 3.0  # (white box) the subscription in place stood 3 s
                with pytest.raises(NotificationsLostError, match="subscribed again") as info:
                    await asyncio.wait_for(anext(watcher), 20)
                assert "after a pause" not in str(info.value)
                assert clock.before[-1] == 0.0
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(reg.close(), 20)
    assert proxy.confirmed >= 5


async def test_aclose_ends_a_read_backing_off_before_it_subscribes_anew(
    redis_server: RedisServer,
) -> None:
    """A read pausing (after losses in a row) before it subscribes anew ends at aclose(),
    without subscribing."""
    async with _DropsSubscriptions(redis_server.port) as proxy:
        reg = await RedisRegistry.connect(
            f"redis://127.0.0.1:{proxy.port}/0", namespace=f"drop-{uuid.uuid4().hex}", timeout=60.0
        )
        clock = _FakeClock(reg)
        try:
            watcher = reg.watch()
            async with watcher:
                with pytest.raises(NotificationsLostError, match="subscribed again"):
                    await asyncio.wait_for(anext(watcher), 20)
                watcher._drops = 20  # (white box) a long pause (about 30 to 60 s) comes next
                made = len(clock.before)
                reading = asyncio.ensure_future(anext(watcher))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(reading), 0.5)
                assert not reading.done()
                await asyncio.wait_for(watcher.aclose(), 10)
                with pytest.raises(StopAsyncIteration):
                    await asyncio.wait_for(reading, 10)
                assert len(clock.before) == made  # no subscription tried
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(reg.close(), 20)


class _HeldClock:
    """The watcher's sleep and clock: the clock advances only by what is slept (or what a
    test adds); ``asked`` records each sleep; while ``hold`` is set a sleep never returns
    (``held`` is set once one is waiting), as a pause the reader's own read timeout
    outlasts."""

    def __init__(self) -> None:
        self.now = 0.0
        self.asked: list[float] = []
        self.hold = False
        self.held = asyncio.Event()

    def time(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.asked.append(seconds)
        if self.hold:
            self.held.set()
            await asyncio.Event().wait()
        self.now += seconds
        await asyncio.sleep(0)


_SAID = re.compile(r"after a pause of ([0-9.e+-]+) s \((\d+) subscriptions in a row")


async def test_a_read_cancelled_during_the_pause_leaves_the_rest_of_it_to_the_next_read(
    redis_server: RedisServer,
) -> None:
    """A read cancelled while it pauses before subscribing anew (a reader's own
    ``wait_for`` around each read) had closed the lost subscription already: the next read
    subscribed at once (no pause, none named, the SUBSCRIBE rate set by the reader's
    timeout).  Now the next read waits out what is left of that pause first, names it, and
    the count of losses in a row goes on (the next pause doubles)."""
    timeout = 3.0
    async with _DropsSubscriptions(redis_server.port) as proxy:
        reg = await RedisRegistry.connect(
            f"redis://127.0.0.1:{proxy.port}/0", namespace=f"drop-{uuid.uuid4().hex}", timeout=timeout
        )
        made = _FakeClock(reg)  # counts the subscriptions made (its own sleep unused)
        clock = _HeldClock()
        try:
            watcher = reg.watch()
            watcher._sleep, watcher._clock = clock.sleep, clock.time  # (white box)
            async with watcher:
                with pytest.raises(NotificationsLostError, match="subscribed again") as info:
                    await asyncio.wait_for(anext(watcher), 20)
                assert "after a pause" not in str(info.value)
                watcher._drops = 20  # (white box) a pause of 1.5 to 3 s comes next
                subscriptions = len(made.before)
                clock.hold = True
                reading = asyncio.ensure_future(anext(watcher))
                await asyncio.wait_for(clock.held.wait(), 20)
                reading.cancel()  # the reader's read timeout, during the pause
                with pytest.raises(asyncio.CancelledError):
                    await reading
                assert len(made.before) == subscriptions  # not subscribed anew yet
                clock.hold = False
                clock.now += 0.5  # the reader does something else for 0.5 s
                asked = len(clock.asked)
                with pytest.raises(NotificationsLostError, match="subscribed again") as info:
                    await asyncio.wait_for(anext(watcher), 20)
                said = _SAID.search(str(info.value))
                assert said is not None, str(info.value)
                pause = float(said.group(1))
                assert timeout * 0.5 - 1e-2 <= pause <= timeout + 1e-9
                assert int(said.group(2)) == 21
                # The rest of the pause, then one new subscription.
                assert sum(clock.asked[asked:]) == pytest.approx(pause - 0.5, abs=1e-2)
                assert clock.now == pytest.approx(pause, abs=1e-2)
                assert len(made.before) == subscriptions + 1
                # The next loss in a row counts on: the pause at the cap again, not none.
                asked = len(clock.asked)
                with pytest.raises(NotificationsLostError, match="subscribed again") as info:
                    await asyncio.wait_for(anext(watcher), 20)
                said = _SAID.search(str(info.value))
                assert said is not None, str(info.value)
                assert int(said.group(2)) == 22
                assert sum(clock.asked[asked:]) == pytest.approx(float(said.group(1)), abs=1e-2)
                assert sum(clock.asked[asked:]) >= timeout * 0.5 - 1e-2
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(reg.close(), 20)


async def test_aclose_ends_a_read_waiting_out_the_rest_of_a_cancelled_pause(
    redis_server: RedisServer,
) -> None:
    """The read after one cancelled during its pause waits out the rest of it; aclose()
    ends that wait too (StopAsyncIteration), without subscribing."""
    async with _DropsSubscriptions(redis_server.port) as proxy:
        reg = await RedisRegistry.connect(
            f"redis://127.0.0.1:{proxy.port}/0", namespace=f"drop-{uuid.uuid4().hex}", timeout=60.0
        )
        made = _FakeClock(reg)
        pausing = asyncio.Event()

        async def sleep(seconds: float) -> None:
            pausing.set()
            await asyncio.sleep(seconds)

        try:
            watcher = reg.watch()
            watcher._sleep = sleep  # (white box) the real sleep, observed
            async with watcher:
                with pytest.raises(NotificationsLostError, match="subscribed again"):
                    await asyncio.wait_for(anext(watcher), 20)
                watcher._drops = 20  # (white box) a long pause (about 30 to 60 s) comes next
                subscriptions = len(made.before)
                reading = asyncio.ensure_future(anext(watcher))
                await asyncio.wait_for(pausing.wait(), 20)
                reading.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await reading
                pausing.clear()
                reading = asyncio.ensure_future(anext(watcher))
                waiting = asyncio.ensure_future(pausing.wait())
                await asyncio.wait({reading, waiting}, timeout=20, return_when=asyncio.FIRST_COMPLETED)
                waiting.cancel()
                assert not reading.done(), reading.exception() if reading.done() else None
                await asyncio.wait_for(watcher.aclose(), 10)
                with pytest.raises(StopAsyncIteration):
                    await asyncio.wait_for(reading, 10)
                assert len(made.before) == subscriptions  # no subscription tried
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(reg.close(), 20)
