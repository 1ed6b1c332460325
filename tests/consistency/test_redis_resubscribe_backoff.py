"""A Redis watcher whose every new subscription is dropped as soon as Redis confirms it
pauses before subscribing anew, after the second loss in a row: a capped exponential
backoff with jitter.  It subscribed anew at once after every loss, so a reader following
the docs' recipe (re-read, read on) drove one SUBSCRIBE after another against Redis."""

from __future__ import annotations

import asyncio
import contextlib
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio.client import PubSub

from kvwire.aio.registry_redis import _POLL_S, RedisRegistry
from kvwire.consistency import NotificationsLostError
from tests.consistency.conftest import RedisServer
from tests.consistency.proxy import RedisProxy, Switchboard

pytestmark = pytest.mark.timeout(90)

_CONFIRMATION = b"$9\r\nsubscribe\r\n"


class _DropsSubscriptions(Switchboard):
    """Forwards to Redis (the switchboard's pumps, never holed nor refusing), but closes a
    client connection as soon as Redis's SUBSCRIBE confirmation has been passed on to it
    (other connections are left alone); ``confirmed`` counts the confirmations passed on."""

    def __init__(self, target_port: int) -> None:
        super().__init__(target_port)
        self.confirmed = 0

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        to_client = writer in self._writers
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
            if to_client and _CONFIRMATION in data:
                self.confirmed += 1
                writer.transport.abort()
                return


@contextlib.asynccontextmanager
async def _registry(port: int, prefix: str, timeout: float) -> AsyncIterator[RedisRegistry]:
    """A registry connected through ``port`` in a namespace of its own, closed on exit
    (whatever its close raises)."""
    reg = await RedisRegistry.connect(
        f"redis://127.0.0.1:{port}/0", namespace=f"{prefix}-{uuid.uuid4().hex}", timeout=timeout
    )
    try:
        yield reg
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(reg.close(), 20)


async def _aclose_ends(watcher: Any, reading: asyncio.Future[Any]) -> None:
    """aclose() ends ``reading``, a read in flight: StopAsyncIteration (both bounded)."""
    await asyncio.wait_for(watcher.aclose(), 10)
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(reading, 10)


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
    async with _DropsSubscriptions(redis_server.port) as proxy, _registry(proxy.port, "drop", timeout) as reg:
        clock = _FakeClock(reg)
        errors: list[str] = []
        watcher = reg.watch()
        watcher._sleep = clock.sleep  # (white box) the injectable sleep
        async with watcher:
            for _ in range(12):
                with pytest.raises(NotificationsLostError, match="subscribed again") as info:
                    await asyncio.wait_for(anext(watcher), 20)
                assert "not subscribed again" not in str(info.value)
                errors.append(str(info.value))
                assert await reg.lookup([b"a"]) == []  # the docs' re-read
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
    async with _DropsSubscriptions(redis_server.port) as proxy, _registry(proxy.port, "drop", 3.0) as reg:
        clock = _FakeClock(reg)
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
    assert proxy.confirmed >= 5


async def test_aclose_ends_a_read_backing_off_before_it_subscribes_anew(
    redis_server: RedisServer,
) -> None:
    """A read pausing (after losses in a row) before it subscribes anew ends at aclose(),
    without subscribing."""
    async with _DropsSubscriptions(redis_server.port) as proxy, _registry(proxy.port, "drop", 60.0) as reg:
        clock = _FakeClock(reg)
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
            await _aclose_ends(watcher, reading)
            assert len(clock.before) == made  # no subscription tried


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
    async with _DropsSubscriptions(redis_server.port) as proxy, _registry(proxy.port, "drop", timeout) as reg:
        made = _FakeClock(reg)  # counts the subscriptions made (its own sleep unused)
        clock = _HeldClock()
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


async def test_aclose_ends_a_read_waiting_out_the_rest_of_a_cancelled_pause(
    redis_server: RedisServer,
) -> None:
    """The read after one cancelled during its pause waits out the rest of it; aclose()
    ends that wait too (StopAsyncIteration), without subscribing."""
    async with _DropsSubscriptions(redis_server.port) as proxy, _registry(proxy.port, "drop", 60.0) as reg:
        made = _FakeClock(reg)
        pausing = asyncio.Event()

        async def sleep(seconds: float) -> None:
            pausing.set()
            await asyncio.sleep(seconds)

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
            await _aclose_ends(watcher, reading)
            assert len(made.before) == subscriptions  # no subscription tried


class _ReaderClock:
    """The watcher's sleep and clock: the clock advances only by what is slept.  A read
    made with :meth:`read` has a read timeout of its own (as a reader's ``wait_for``, in
    this clock's time): a sleep that would run past it stops the clock there and never
    returns, and the read is cancelled."""

    def __init__(self) -> None:
        self.now = 0.0
        self._deadline = float("inf")
        self._timed_out = asyncio.Event()

    def time(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        if self.now + seconds > self._deadline:
            self.now = self._deadline
            self._timed_out.set()
            await asyncio.Event().wait()  # cancelled by read()
        self.now += seconds
        await asyncio.sleep(0)

    async def read(self, watcher: Any, budget: float) -> str | None:
        """One read, with a read timeout of ``budget`` s: what it raised (the
        :class:`NotificationsLostError`'s text), or ``None`` when it timed out."""
        self._deadline = self.now + budget
        self._timed_out.clear()
        reading = asyncio.ensure_future(anext(watcher))
        timed_out = asyncio.ensure_future(self._timed_out.wait())
        await asyncio.wait({reading, timed_out}, timeout=20, return_when=asyncio.FIRST_COMPLETED)
        timed_out.cancel()
        reading.cancel()
        results = await asyncio.gather(reading, timed_out, return_exceptions=True)
        if isinstance(results[0], asyncio.CancelledError):
            return None
        assert isinstance(results[0], NotificationsLostError), results[0]
        return str(results[0])


async def test_a_read_cancelled_during_the_retry_pause_leaves_the_rest_of_it_to_the_next_read(
    redis_server: RedisServer,
) -> None:
    """After a failed try at subscribing anew each read paused for the whole retry pause
    before trying again: a reader whose own read timeout (1 s here) is shorter than the
    pause (up to the registry's timeout, 5 s here) cancelled every read during it, each
    next read started it anew, and the watcher never tried again, Redis back or not (its
    reads only timed out).  Now the pause ends its length after the failed try: the next
    read waits out only what is left of it, so the tries go on at the announced pauses,
    and once Redis is back a read subscribes anew."""
    clock = _ReaderClock()
    tries: list[float] = []  # the clock's time at each try at subscribing anew
    down = True
    async with _registry(redis_server.port, "retry", 5.0) as reg:
        watcher = reg.watch()
        watcher._sleep, watcher._clock = clock.sleep, clock.time  # (white box)
        async with watcher:
            subscribe = watcher._open

            async def refused() -> Any:
                tries.append(clock.now)
                if down:
                    raise ConnectionRefusedError("redis down")
                return await subscribe()

            watcher._open = refused  # type: ignore[method-assign]
            assert watcher._pubsub is not None and watcher._pubsub.connection is not None
            await watcher._pubsub.connection.disconnect()  # the subscription is lost
            said: list[str] = []
            for _ in range(20):
                outcome = await clock.read(watcher, 1.0)
                if outcome is not None:
                    assert "not subscribed again" in outcome, outcome
                    said.append(outcome)
            # Before: 4 tries (pauses of 0.2, 0.4 and 0.8 s between), then none.
            assert len(tries) >= 7, tries
            assert len(said) == len(tries)
            for k in range(len(tries) - 1):
                pause = re.search(r"after a pause of ([0-9.e+-]+) s", said[k])
                assert pause is not None, said[k]
                assert tries[k + 1] - tries[k] == pytest.approx(float(pause.group(1)), abs=1e-6), (k, tries)
            assert tries[-1] - tries[-2] == pytest.approx(5.0)  # at the cap: the timeout
            down = False  # Redis is back
            before = len(tries)
            outcome = None
            for _ in range(10):
                if (outcome := await clock.read(watcher, 1.0)) is not None:
                    break
            assert outcome is not None, "never tried again"
            assert "not subscribed again" not in outcome and "subscribed again" in outcome, outcome
            assert len(tries) == before + 1
            assert watcher._pubsub is not None and watcher._lost is None
            assert watcher._retry_pause == 0.0


class _Blackhole(RedisProxy):
    """A Redis that accepts connections, reads what it is sent and never answers (a
    blackholed, stalled or overloaded Redis): a try at subscribing to it lasts until it is
    cancelled.  ``sent`` is set once a connection has sent something (the try is waiting
    for a reply that never comes)."""

    def __init__(self) -> None:
        super().__init__(0)  # forwards nowhere
        self.sent = asyncio.Event()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            with contextlib.suppress(OSError):
                while await reader.read(65536):
                    self.sent.set()
        finally:
            writer.transport.abort()
            self._tasks.discard(task)


async def test_a_try_cancelled_by_the_readers_timeout_counts_as_a_failed_one_for_the_pause(
    redis_server: RedisServer,
) -> None:
    """Redis accepts connections and never answers, so each try at subscribing anew lasts
    longer than the reader's own read timeout (1 s) and is cancelled by it.  A cancelled
    try recorded no failure: the retry pause stayed 0 and every read tried again at once
    (20 tries in 20 reads, none apart).  Now a cancelled try counts as a failed one: the
    next try waits the pause (0.2 s, twice as long after each more, at most the registry's
    timeout, 5 s here) from the cancellation.  Once Redis answers again a read subscribes
    anew, and a change made after it is delivered."""
    clock = _ReaderClock()
    tries: list[float] = []  # the clock's time at each try at subscribing anew
    cancelled: list[float] = []  # and at each try's cancellation
    down = True
    async with _registry(redis_server.port, "stall", 5.0) as reg, _Blackhole() as blackhole:
        stalled = aioredis.ConnectionPool.from_url(f"redis://127.0.0.1:{blackhole.port}/0")
        make = reg._new_pubsub

        def new_pubsub() -> Any:
            tries.append(clock.now)
            return PubSub(stalled) if down else make()

        async def read() -> str | None:
            """One read, with a read timeout of 1 s on the clock; a try that reached the
            stalled Redis runs it out (the clock to the read's end) and is cancelled."""
            blackhole.sent.clear()
            stalled_try = asyncio.ensure_future(blackhole.sent.wait())
            started = clock.now

            async def stall_ends() -> None:
                await stalled_try
                clock.now = started + 1.0
                cancelled.append(clock.now)
                clock._timed_out.set()  # (white box) as a sleep past the read's end does

            ends = asyncio.ensure_future(stall_ends())
            try:
                return await clock.read(watcher, 1.0)
            finally:
                ends.cancel()
                stalled_try.cancel()
                await asyncio.gather(ends, stalled_try, return_exceptions=True)

        try:
            watcher = reg.watch()
            watcher._sleep, watcher._clock = clock.sleep, clock.time  # (white box)
            async with watcher:
                reg._new_pubsub = new_pubsub  # type: ignore[method-assign]
                assert watcher._pubsub is not None and watcher._pubsub.connection is not None
                await watcher._pubsub.connection.disconnect()  # the subscription is lost
                for _ in range(20):
                    outcome = await read()
                    assert outcome is None, outcome  # every read times out
                # Before: 20 tries, one per read, none apart.  Now tries at 0, 1.2, 2.4,
                # 3.8, 5.6, 9.2, 15 and 20 s: each the pause after the one cancelled before.
                assert len(tries) == len(cancelled) == 8, str((tries, cancelled))
                for k in range(len(tries) - 1):
                    pause = min(_POLL_S * 2**k, 5.0)
                    assert tries[k + 1] - cancelled[k] == pytest.approx(pause, abs=1e-6), (k, tries, cancelled)
                assert watcher._retry_pause == pytest.approx(5.0)  # at the cap
                down = False  # Redis answers again
                before = len(tries)
                outcome = None
                for _ in range(10):
                    if (outcome := await read()) is not None:
                        break
                assert outcome is not None, "never tried again"
                assert "not subscribed again" not in outcome and "subscribed again" in outcome, outcome
                assert len(tries) == before + 1
                assert watcher._pubsub is not None and watcher._lost is None
                assert watcher._retry_pause == 0.0
                version = await reg.invalidate(b"a")
                _, got = await asyncio.wait_for(anext(watcher), 20)
                assert got == version
        finally:
            await stalled.aclose()


async def test_a_try_cancelled_while_the_watcher_closes_records_no_failure(
    redis_server: RedisServer,
) -> None:
    """A try at subscribing anew, against a Redis that never answers, whose read is
    cancelled as aclose() runs counts as no failed try: no retry pause is recorded."""
    async with _registry(redis_server.port, "stall", 5.0) as reg, _Blackhole() as blackhole:
        stalled = aioredis.ConnectionPool.from_url(f"redis://127.0.0.1:{blackhole.port}/0")
        try:
            watcher = reg.watch()
            async with watcher:
                reg._new_pubsub = lambda: PubSub(stalled)  # type: ignore[method-assign]
                assert watcher._pubsub is not None and watcher._pubsub.connection is not None
                await watcher._pubsub.connection.disconnect()  # the subscription is lost
                reading = asyncio.ensure_future(anext(watcher))
                await asyncio.wait_for(blackhole.sent.wait(), 10)  # the try waits for a reply
                closing = asyncio.ensure_future(watcher.aclose())
                await asyncio.sleep(0)  # aclose() has begun
                reading.cancel()  # and the reader's own read timeout runs out
                results = await asyncio.wait_for(asyncio.gather(reading, closing, return_exceptions=True), 10)
                assert isinstance(results[0], (asyncio.CancelledError, StopAsyncIteration)), results
                assert results[1] is None, results
                assert watcher._retry_pause == 0.0 and watcher._failed_at == 0.0
        finally:
            await stalled.aclose()
