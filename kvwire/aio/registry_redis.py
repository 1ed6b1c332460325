"""Registry backend on a shared Redis (redis-py asyncio client).

Every mutation is one Lua script (atomic on the server); so is every read (one consistent
snapshot).  A block is complete only under the Redis server tenure (``run_id`` and
``master_replid``: a restart or a promotion ends it) that committed it, decided inside the
scripts (see :mod:`kvwire.consistency.redis_layout`).
Notifications travel on a pub/sub channel published from inside the scripts.
Any Redis failure raises :class:`RegistryUnavailableError`: nothing is ever reported fresh
without Redis having confirmed it. Commands are not retried, because a reply lost in transit
leaves the outcome unknown; the caller decides (e.g. re-``begin``, which is safe).  That
holds for a wrapped client too, whatever its ``retry`` settings: every command is sent once
on a connection of the client's pool (a ``RedisCluster``'s: of the node owning the
namespace's slot), not through the client's retrying ``execute_command``,
and a watcher's subscription does not reconnect behind its reader's back.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import numbers
import random
import types
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from types import TracebackType
from typing import Any, Self, TypeVar

from kvwire.consistency import redis_layout as lua
from kvwire.consistency.blocks import BlockId, BlockLike, block_from_key, unique_keys
from kvwire.consistency.core import (
    Lease,
    VersionedBlock,
    check_lease,
    check_ttl,
    check_version,
    exhausted_error,
    explain_stale,
    never_issued_error,
    new_lease_id,
    pairs_keys,
    stale_error,
)
from kvwire.consistency.errors import (
    LeaseExpiredError,
    NotificationsLostError,
    RegistryUnavailableError,
)
from kvwire.consistency.registry import DEFAULT_TTL
from kvwire.errors import KvwireError, UsageError

try:
    import redis.asyncio as aioredis
    from redis.asyncio.client import PubSub
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import (
        MovedError,
        NoScriptError,
        RedisClusterException,
        RedisError,
        ResponseError,
        SlotNotCoveredError,
    )
    from redis.exceptions import TimeoutError as RedisTimeoutError
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        "kvwire's Redis registry needs redis-py: pip install 'kvwire[redis]'"
    ) from exc

T = TypeVar("T")

# Slack past a lease's expiry before Redis deletes its key; the scripts decide liveness by
# TIME, the key's own expiry only reclaims memory.
_LEASE_GRACE_MS = 1000

# How often a waiting watcher looks at its closed flag (seconds); also the first pause
# before a failed subscription (or a begin's undo whose RELEASE failed) is tried again, each
# later pause twice the one before, up to the registry's timeout.
_POLL_S = 0.2

# connect()'s pool for the calls: at most this many connections by default (a call finding
# them all in use waits for one, within its timeout).
DEFAULT_MAX_CONNECTIONS = 100

# The watchers' pool (connect()'s): no bound of its own, one connection per subscribed watcher.
_WATCH_CONNECTIONS = 2**31 - 1


async def _guard(what: str, awaitable: Awaitable[T], timeout: float) -> T:
    """``awaitable``'s result; Redis unreachable, failing or silent for ``timeout`` seconds
    is a :class:`RegistryUnavailableError`.  The bound is kept here as well as on the
    socket: a client the caller wrapped may have no ``socket_timeout`` at all.  (Not
    ``asyncio.wait_for``: on Python 3.11 it returns the result when the caller is cancelled
    in the iteration the reply arrives, and the cancel is lost.)"""
    try:
        async with asyncio.timeout(timeout):
            return await awaitable
    except TimeoutError as exc:
        raise RegistryUnavailableError(f"redis registry: {what}: no reply within {timeout:g} s") from exc
    except (RedisError, RedisClusterException, OSError) as exc:
        raise RegistryUnavailableError(f"redis registry: {what} failed: {exc}") from exc


def _reason(exc: BaseException, timeout: float) -> str:
    """What ``exc`` (a failed subscription's) says, for an error message: its class and its
    text (redis-py's own ``repr`` names the class only); a bare ``TimeoutError`` is the
    subscription's bound (:func:`_subscribed`) running out."""
    if type(exc) is TimeoutError:
        return f"no SUBSCRIBE confirmation within {timeout:g} s"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _next_pause(pause: float, timeout: float) -> float:
    """The pause before the next try after one that failed, ``pause`` the one before it (0:
    none yet): :data:`_POLL_S`, then twice the one before, at most ``timeout`` (or
    :data:`_POLL_S`, were ``timeout`` shorter)."""
    return min(max(2 * pause, _POLL_S), max(timeout, _POLL_S))


def _drop_pause(drops: int, timeout: float) -> float:
    """The pause before subscribing anew after ``drops`` subscriptions in a row were lost
    within ``timeout`` of being made: none after the first, then :data:`_POLL_S`, twice as
    long after each more, at most ``timeout`` (or :data:`_POLL_S`, were ``timeout``
    shorter), each with jitter (between half of it and all of it), so watchers that lost
    theirs together do not subscribe anew together."""
    if drops < 2:
        return 0.0
    step = min(_POLL_S * 2.0 ** min(drops - 2, 32), max(timeout, _POLL_S))
    return step * random.uniform(0.5, 1.0)


def _loop_time() -> float:
    """The running loop's clock (what its timeouts are kept by)."""
    return asyncio.get_running_loop().time()


async def _pause(
    seconds: float,
    closed: Callable[[], bool],
    sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
) -> None:
    """Sleep ``seconds`` (with ``sleep``), in slices of at most :data:`_POLL_S`; returns
    early once ``closed()``."""
    left = seconds
    while not closed() and left > 0:
        piece = min(left, _POLL_S)
        await sleep(piece)
        left -= piece


async def _execute_once(client: aioredis.Redis | aioredis.RedisCluster, route: str, *args: Any) -> Any:
    """Send one command on a connection of ``client``'s pool and return its parsed reply.

    Sent once, whatever the client's ``retry``: its own ``execute_command`` sends a command
    again after a connection error or timeout (redis-py retries by default), and a script
    run again after its reply was lost could commit twice or report a landed commit as
    refused.  A connection whose reply did not come is closed, never reused (redis-py's
    ``read_response`` closes it too).

    A :class:`redis.asyncio.RedisCluster` sends it to the primary node that owns ``route``'s
    slot (a key of the namespace: its keys share one slot), on a connection of that node.
    A redirect (MOVED, ASK: the slot is moving) is not followed: it is an error reply,
    raised (the caller's :class:`RegistryUnavailableError`); a MOVED updates the client's
    slot map first, so the next call goes to the new owner."""
    if isinstance(client, aioredis.RedisCluster):
        return await _execute_once_cluster(client, route, *args)
    pool = client.connection_pool
    conn = await pool.get_connection()  # type: ignore[no-untyped-call, unused-ignore]
    try:
        return await _send_once(conn, client.parse_response, args)
    finally:
        await pool.release(conn)


async def _send_once(conn: Any, parse: Any, args: tuple[Any, ...]) -> Any:
    """``args`` sent on ``conn`` and its reply parsed by ``parse(conn, command)``; a
    connection whose reply did not come whole is closed, never reused."""
    try:
        await conn.send_command(*args)
        return await parse(conn, args[0])
    except ResponseError:
        raise  # an error reply, read whole: the connection is in step
    except BaseException:
        with contextlib.suppress(Exception):  # the first error is the one to tell
            await conn.disconnect(nowait=True)
        raise


async def _execute_once_cluster(client: aioredis.RedisCluster, route: str, *args: Any) -> Any:
    """:func:`_execute_once` on a cluster client: once, on the node owning ``route``."""
    await client.initialize()  # at once unless the client has no topology yet
    node = client.get_node_from_key(route)
    if node is None:  # pragma: no cover - only when asking for a replica
        raise SlotNotCoveredError(f"no node serves the slot of {route!r}")
    conn = node.acquire_connection()
    try:
        reconnect = getattr(node, "disconnect_if_needed", None)  # redis-py 7: a connection marked stale
        if reconnect is not None:
            await reconnect(conn)
        return await _send_once(conn, node.parse_response, args)
    except MovedError as exc:
        with contextlib.suppress(Exception):  # the map is a hint; the error is what counts
            await client.nodes_manager.move_slot(exc)
        raise
    finally:
        node.release(conn)


class _Script:
    """A Lua script run with EVALSHA (EVAL where the server does not hold it yet), each
    command sent once (:func:`_execute_once`); called as redis-py's ``Script`` is, with
    ``keys`` and ``args``."""

    def __init__(self, client: aioredis.Redis | aioredis.RedisCluster, text: str) -> None:
        self.client = client
        self.text = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()

    async def __call__(self, *, keys: Sequence[str], args: Sequence[str | int]) -> Any:
        try:
            return await _execute_once(self.client, keys[0], "EVALSHA", self.sha, len(keys), *keys, *args)
        except NoScriptError:  # the script did not run: EVAL runs (and caches) it
            return await _execute_once(self.client, keys[0], "EVAL", self.text, len(keys), *keys, *args)


async def _execute_unretried(self: PubSub, conn: Any, command: Any, *args: Any, **kwargs: Any) -> Any:
    """A watcher's ``PubSub._execute``: one try, no reconnection.  redis-py's reconnects
    and re-subscribes after a connection error (retrying the read, with a client's default
    ``retry``), so changes published while the subscription was gone would be skipped
    without the reader knowing, and the reconnection would be bounded only by the client's
    own socket timeouts.  The connection is closed instead and the error raised: the
    watcher drops that subscription and makes a new one itself (see :class:`RedisWatcher`)."""
    try:
        return await command(*args, **kwargs)
    except (RedisConnectionError, RedisTimeoutError, OSError):
        await conn.disconnect(nowait=True)
        raise


async def _subscribed(pubsub: PubSub, channel: str, timeout: float) -> None:
    """Subscribe ``pubsub`` to ``channel`` and wait for the server's confirmation, so
    changes made after this returns are delivered (SUBSCRIBE and a later PUBLISH travel on
    different connections).  Connecting (its handshake included), SUBSCRIBE and the
    confirmation are bounded together by ``timeout`` (``TimeoutError``), whatever the
    client's socket timeouts."""
    async with asyncio.timeout(timeout):
        await pubsub.subscribe(channel)
        while True:
            msg = await pubsub.get_message(timeout=timeout)
            if msg is None:
                raise RegistryUnavailableError("redis registry: no SUBSCRIBE confirmation")
            if msg.get("type") == "subscribe":
                return


def _check_timeout(timeout: object) -> float:
    """``timeout`` as a float, or :class:`UsageError` unless it is a finite number > 0."""
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise UsageError(f"timeout must be a number of seconds, not {type(timeout).__name__}")
    value = float(timeout)
    if not (0.0 < value < math.inf):
        raise UsageError(f"timeout must be a finite number of seconds > 0, not {timeout!r}")
    return value


def _parse_event(data: Any) -> VersionedBlock:
    """The ``(block, version)`` of a message on the events channel: ``"<version> <key>"``."""
    version, _, key = _decode(data).partition(" ")
    return block_from_key(key), check_version(int(version))


def _ttl_args(ttl: float) -> tuple[int, int]:
    ttl_us = max(1, round(ttl * 1e6))
    return ttl_us, math.ceil(ttl * 1000) + _LEASE_GRACE_MS


def _decode(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisWatcher:
    """Notifications from one namespace's pub/sub channel.

    Pub/sub delivers at most once, and a watcher never reconnects behind its reader's back.
    Its subscription is lost when its connection breaks, or goes silent (a half-open
    connection, a stalled network): after ``timeout`` (the registry's) without hearing from
    the server the watcher sends a PING on its subscription, and counts it lost if nothing
    comes back within ``timeout`` more.  A lost subscription is closed and a new one made
    (a new connection, SUBSCRIBE and the server's confirmation, together bounded by
    ``timeout``) before the read raises :class:`NotificationsLostError`: changes made while
    it was lost may never arrive, every change made after the raise is delivered.  So the
    reader re-reads (``lookup``, ``check_many``) what it watches, after the error, and reads
    on.  If the new subscription cannot be made, the error says so and the next read tries
    again and raises :class:`NotificationsLostError` again, subscribed or not: a re-read
    made while no subscription was in place covers nothing.  That next read first pauses
    (:data:`_POLL_S`, 0.2 s, after the first failure, then twice as long after each
    failure in a row, up to ``timeout``): while Redis is down, a reader that re-reads and
    reads on makes at most one new connection per pause, not one after another.
    Subscriptions lost in a row within ``timeout`` of being made (a Redis, or a proxy, that
    confirms SUBSCRIBE and drops the connection at once) are made anew after a pause too:
    none after the first such loss, then :data:`_POLL_S` after the second, twice as long
    after each more, at most ``timeout``, each drawn between half of it and all of it
    (jitter); still before the read raises, which says "subscribed again" and names the
    pause.  A subscription that stood for ``timeout`` or longer starts the count anew.
    A read cancelled during that pause (a reader's own read timeout) leaves the rest of it
    to the next read, which waits it out before subscribing anew.  A try at subscribing
    anew cancelled before it ends (a reader's read timeout shorter than a try against a
    Redis that never answers) counts as a failed one for the retry pause.
    The registry holds its watchers weakly: one abandoned without ``aclose`` (a ``break``
    out of a bare ``async for``) closes its subscription once garbage collected.
    ``aclose`` (or the registry's ``close()``) ends a watcher whatever it is waiting for:
    a read, or a first read or ``async with`` still subscribing (connecting, or awaiting the
    server's confirmation), or a read subscribing anew, stops (``StopAsyncIteration``;
    ``async with`` enters the ended watcher), and its connection is closed.
    """

    def __init__(self, registry: RedisRegistry) -> None:
        self._registry = registry
        self._pubsub: PubSub | None = None
        self._reading: asyncio.Event | None = None
        self._subscribing: asyncio.Future[None] | None = None
        self._closed = False
        self._finalizer: weakref.finalize[Any, Any] | None = None
        # Why the last subscription was lost (and its error), while no new one is in place.
        self._lost: tuple[str, BaseException | None] | None = None
        # The pause before the next try at subscribing anew (0: the last try did not fail),
        # and the _clock() time that try failed: the pause ends _retry_pause after it, so a
        # read cancelled during the pause (a reader's own read timeout shorter than it)
        # leaves what is left of it to the next read, rather than the next read pausing
        # in full again (a reader whose timeout is shorter than the pause never tried).
        self._retry_pause = 0.0
        self._failed_at = 0.0
        # Subscriptions in a row lost within the registry's timeout of being made (a Redis
        # that confirms SUBSCRIBE and drops the connection at once): see _drop_pause.
        self._drops = 0
        self._since = 0.0  # _clock() time the subscription in place was confirmed
        # What the pauses before subscribing anew sleep with, and the clock their deadlines
        # and _since are kept by (the loop's; a test's fake clock).
        self._sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep
        self._clock: Callable[[], float] = _loop_time
        # The pause drawn after the last loss in a row (0: none), and the _clock() time it
        # ends: kept until a try at subscribing anew is made, so a read cancelled during
        # that pause (a reader's own read timeout) leaves it to the next read, which waits
        # out what is left of it rather than subscribing at once.
        self._drop_pause = 0.0
        self._resubscribe_at = 0.0
        self._heard = 0.0  # _clock() time the server was last heard from (a message, a reply)
        self._pinged: float | None = None  # _clock() time of the PING awaiting its reply

    async def _open(self) -> PubSub | None:
        """A new subscription (a new pubsub, so a new connection), confirmed by the server:
        :func:`_subscribed`, bounded by the registry's ``timeout``, in a task of its own,
        which :meth:`aclose` cancels (connecting and the confirmation are not bounded by
        ``_POLL_S`` as a read is, and aclose() must not close the connection under them, nor
        find none yet to close while the pool connects it).  ``None`` when the watcher is
        closed meanwhile; what subscribing failed with is raised; either way the new
        subscription is closed."""
        registry = self._registry
        pubsub = registry._new_pubsub()
        pubsub._execute = types.MethodType(_execute_unretried, pubsub)  # type: ignore[method-assign, unused-ignore]
        self._pubsub = pubsub
        registry._watchers.add(self)
        # Holds the pubsub and the registry, never this watcher: collected, it is closed.
        self._finalizer = weakref.finalize(self, _close_abandoned, asyncio.get_running_loop(), registry, pubsub)
        self._finalizer.atexit = False
        subscribing = asyncio.ensure_future(_subscribed(pubsub, registry.layout.channel, registry.timeout))
        self._subscribing = subscribing
        try:
            await subscribing  # a cancellation of the caller cancels it too
        except BaseException as exc:
            # Closed meanwhile (aclose() cancelled the subscription, or a connection it
            # closed failed it), unless this reader was cancelled itself.
            task = asyncio.current_task()
            ended = self._closed and (
                isinstance(exc, Exception)
                or (isinstance(exc, asyncio.CancelledError) and not (task is not None and task.cancelling()))
            )
            await self._close_pubsub()
            if ended:
                return None  # closed meanwhile: ended, as a subscribed watcher is by close()
            raise
        finally:
            self._subscribing = None
        if self._closed:  # closed as the confirmation came
            await self._close_pubsub()
            return None
        self._since = self._heard = self._clock()
        self._pinged = None
        return pubsub

    async def _subscribe(self) -> PubSub | None:
        """The watcher's subscription, made at its first use (a failure raises
        :class:`RegistryUnavailableError` and ends the watcher); ``None`` once the watcher
        is closed, when it is closed (its own :meth:`aclose`, the registry's ``close()``)
        while subscribing, and while a lost subscription awaits its replacement (which
        :meth:`__anext__` makes)."""
        if self._pubsub is not None or self._lost is not None:
            return self._pubsub
        if self._closed:
            return None
        # As watch() on a closed registry: a watcher made before close() and first used
        # after it would otherwise subscribe on the closed registry's client.
        self._registry._live()
        try:
            return await self._open()
        except BaseException as exc:
            await self.aclose()
            if isinstance(exc, (RedisError, OSError)):  # TimeoutError among them
                reason = _reason(exc, self._registry.timeout)
                raise RegistryUnavailableError(f"redis registry: subscribe failed: {reason}") from exc
            raise

    async def __aenter__(self) -> Self:
        await self._subscribe()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> VersionedBlock:
        pubsub = await self._subscribe()
        if pubsub is None and (self._lost is None or self._closed):
            raise StopAsyncIteration
        self._reading = asyncio.Event()
        timeout = self._registry.timeout
        try:
            if self._lost is not None:  # lost, and not subscribed again at the last read
                # Paused first (aclose() ends the pause within _POLL_S): a refused
                # connection fails at once, and the reader's loop would try again at once.
                # Only what is left of it, as of a pause after losses in a row: a read
                # cancelled during it (a reader's own read timeout) does not start it anew.
                left = max(self._failed_at + self._retry_pause, self._resubscribe_at) - self._clock()
                await _pause(left, lambda: self._closed or self._registry._closed, self._sleep)
                await self._replace(*self._lost)  # raises, unless closed meanwhile
            while not self._closed and (pubsub := self._pubsub) is not None:
                try:
                    connection = pubsub.connection
                    if connection is None or not getattr(connection, "is_connected", True):
                        # Closed under the subscription (a send cancelled midway): reading
                        # would reconnect it, unbounded, and resubscribe behind the reader.
                        raise RedisConnectionError("the subscription's connection is closed")
                    # A bounded wait, so aclose() from another task never has to tear the
                    # connection down under a pending read; it waits for this loop instead.
                    # (The outer bound: a read that does not end counts as a lost one.)
                    async with asyncio.timeout(timeout + _POLL_S):
                        msg = await pubsub.get_message(timeout=_POLL_S)
                    if msg is None and not self._closed:
                        lost = await self._check_alive(pubsub, self._clock(), timeout)
                        if lost is not None:
                            await self._replace(lost, None)  # raises, unless closed meanwhile
                            break
                except (RedisError, OSError) as exc:  # TimeoutError among them
                    if self._closed:
                        break
                    await self._replace(f"notification channel lost: {str(exc) or type(exc).__name__}", exc)
                    break
                if msg is None:
                    continue
                # Anything from the server (a change, a PING's reply) shows the connection
                # still delivers.
                self._heard, self._pinged = self._clock(), None
                if msg.get("type") == "message":
                    try:
                        return _parse_event(msg["data"])
                    except (KvwireError, ValueError, TypeError) as exc:
                        # Not a change as kvwire publishes it (another publisher on the
                        # channel): what it meant is unknown, so the reader re-reads.
                        raise NotificationsLostError(
                            f"redis registry: a message on the notification channel is not a "
                            f"change: {msg['data']!r:.80}"
                        ) from exc
        finally:
            reading, self._reading = self._reading, None
            reading.set()
        await self._close_pubsub()
        raise StopAsyncIteration

    async def _check_alive(self, pubsub: PubSub, now: float, timeout: float) -> str | None:
        """Nothing to read: after ``timeout`` of silence send a PING on the subscription;
        why the subscription counts as lost if the PING could not be sent, or its reply has
        not come, within ``timeout`` (changes published meanwhile may never arrive); else
        ``None``."""
        if self._pinged is None:
            if now - self._heard >= timeout:
                try:
                    async with asyncio.timeout(timeout):
                        await pubsub.ping()
                except TimeoutError:
                    return f"notification channel stalled: PING not sent within {timeout:g} s"
                self._pinged = now
            return None
        if now - self._pinged >= timeout:
            return f"notification channel silent: no reply to PING within {timeout:g} s"
        return None

    async def _replace(self, why: str, cause: BaseException | None) -> None:
        """The subscription is lost (``why``): close it, subscribe anew (:meth:`_open`), and
        raise :class:`NotificationsLostError`, saying whether the new subscription is in
        place (the reader's re-read after the error is then covered) or not (the next read
        tries again, after a pause, and raises again).  Returns only when the watcher (or
        its registry) was closed meanwhile."""
        self._lost = (why, cause)
        timeout = self._registry.timeout
        pause = 0.0
        if self._pubsub is not None:  # a subscription was in place (not a failed try's retry)
            now = self._clock()
            lived = now - self._since
            self._drops = self._drops + 1 if lived < timeout else 1
            pause = _drop_pause(self._drops, timeout)
            # Kept before the pause is taken: a read cancelled during it leaves the rest
            # of it to the next read (see __anext__), which comes back here, as a retry.
            self._drop_pause, self._resubscribe_at = pause, now + pause
        await self._close_pubsub()
        if pause > 0:
            # Lost again soon after it was made: a Redis (or proxy) that drops every
            # subscription at once would otherwise see one after another.
            await _pause(pause, lambda: self._closed or self._registry._closed, self._sleep)
        if self._closed or self._registry._closed:
            return
        pause = self._drop_pause  # taken, here or (the rest of it) by the read calling this
        try:
            pubsub = await self._open()
        except (RedisError, OSError, KvwireError) as exc:  # TimeoutError among them
            self._try_failed(timeout)
            raise NotificationsLostError(
                f"redis registry: {why}; not subscribed again ({_reason(exc, timeout)}): changes may "
                f"have been missed and are not watched yet; the next read tries again after "
                f"a pause of {self._retry_pause:g} s"
            ) from (cause if cause is not None else exc)
        except asyncio.CancelledError:
            # The try cancelled before it ended (a reader's own read timeout shorter than a
            # try against a Redis that accepts connections and never answers): it counts
            # as a failed one for the pause, else the next read would try again at once,
            # one try after another.  Not when the watcher is being closed.
            if not (self._closed or self._registry._closed):
                self._try_failed(timeout)
            raise
        if pubsub is None:
            return
        self._lost, self._retry_pause, self._drop_pause, self._failed_at = None, 0.0, 0.0, 0.0
        paused = (
            f" after a pause of {pause:.3g} s ({self._drops} subscriptions in a row lost within "
            f"{timeout:g} s of being made)"
            if pause > 0
            else ""
        )
        raise NotificationsLostError(
            f"redis registry: {why}; subscribed again{paused}: changes may have been missed, "
            "those from now on are delivered: re-read (lookup, check_many)"
        ) from cause

    def _try_failed(self, timeout: float) -> None:
        """Count a failed try at subscribing anew for the pause before the next (_next_pause)."""
        self._drop_pause = 0.0
        # when it failed is kept (the pause ends _retry_pause after it): see _failed_at
        self._failed_at, self._retry_pause = self._clock(), _next_pause(self._retry_pause, timeout)

    async def aclose(self) -> None:
        self._closed = True
        self._registry._watchers.discard(self)
        subscribing = self._subscribing
        if subscribing is not None and not subscribing.done():
            subscribing.cancel()  # its reader ends (StopAsyncIteration) once it has stopped
            await asyncio.wait({subscribing})
        if self._reading is not None:
            await self._reading.wait()
        await self._close_pubsub()

    async def _close_pubsub(self) -> None:
        pubsub, self._pubsub = self._pubsub, None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if pubsub is not None:
            await _close_quietly(pubsub)


async def _close_quietly(pubsub: PubSub) -> None:
    # The connection is being thrown away; a failure to close it changes nothing.
    with contextlib.suppress(RedisError, OSError):
        await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]  # typed from redis 8


def _close_abandoned(loop: asyncio.AbstractEventLoop, registry: RedisRegistry, pubsub: PubSub) -> None:
    """A watcher was garbage collected with its subscription open: close it on its loop
    (as a task the registry keeps; from whatever thread the collection ran in)."""
    with contextlib.suppress(RuntimeError):  # the loop is closed: so is the connection
        loop.call_soon_threadsafe(lambda: registry._spawn(_close_unwatched(pubsub)))


async def _close_unwatched(pubsub: PubSub) -> None:
    # Nobody awaits this task: whatever closing fails with (a client closed meanwhile
    # included) has nobody to tell.
    with contextlib.suppress(Exception):
        await _close_quietly(pubsub)


class RedisRegistry:
    """The registry on Redis. Create with :meth:`connect` (or wrap an existing client).

    A wrapped client is a ``redis.asyncio`` one (``Redis`` or ``RedisCluster``; a
    synchronous ``redis.Redis`` is a :class:`UsageError`) and may decode replies or not;
    ``timeout`` (seconds, finite, > 0) bounds every command's reply whatever the client's own
    socket timeouts, so each call but ``begin`` (and ``close``) ends within it; ``begin`` may
    take up to three times as long: it first waits (up to ``timeout``) for the undoing of
    an earlier ``begin`` that failed, or for a ``release`` still running, and when its own
    command fails it waits (up to ``timeout``) for the first try at undoing it.  A call in
    flight when :meth:`close` closes the client it made (:meth:`connect`'s) raises
    :class:`RegistryUnavailableError` saying so.  The client's ``retry`` settings do not
    apply: the registry sends each command once (a lost reply raises
    :class:`RegistryUnavailableError`, the outcome unknown), and a watcher does not
    reconnect silently.  Its pool is used as it is: each call takes one of its connections
    for the call's length, and each subscribed watcher one for as long as it is subscribed
    (redis-py's default ``ConnectionPool`` refuses a connection past its
    ``max_connections``, which fails the call with :class:`RegistryUnavailableError`; a
    ``BlockingConnectionPool`` makes the call wait, within ``timeout``).  A client
    :meth:`connect` makes has a waiting pool for the calls and puts each watcher on a
    connection of its own.
    """

    def __init__(
        self,
        client: aioredis.Redis | aioredis.RedisCluster,
        *,
        namespace: str = "kvwire",
        owns_client: bool = False,
        timeout: float = 5.0,
    ) -> None:
        if not isinstance(client, aioredis.Redis | aioredis.RedisCluster):
            # A synchronous redis.Redis (or anything else) would fail every call with a
            # TypeError of its own ('can't be used in an await expression').
            raise UsageError(
                "client must be a redis.asyncio client (redis.asyncio.Redis or RedisCluster), "
                f"not {type(client).__module__}.{type(client).__name__}"
            )
        self.layout = lua.KeyLayout(namespace)
        self.timeout = _check_timeout(timeout)
        self.client = client
        self._owns_client = owns_client
        # Weak: an abandoned watcher must not hold its subscription until close().
        self._watchers: weakref.WeakSet[RedisWatcher] = weakref.WeakSet()
        self._background: set[asyncio.Task[Any]] = set()
        self._releases: set[asyncio.Task[Any]] = set()  # those of _background a begin waits for
        self._closed = False
        # The watchers' connections, apart from the calls' pool (connect() makes it); None:
        # the client's own pool (its pubsub()).
        self._watch_pool: aioredis.ConnectionPool | None = None
        self._begin = _Script(client, lua.BEGIN)
        self._commit = _Script(client, lua.COMMIT)
        self._renew = _Script(client, lua.RENEW)
        self._release = _Script(client, lua.RELEASE)
        self._invalidate = _Script(client, lua.INVALIDATE)
        self._read_script = _Script(client, lua.READ)

    @classmethod
    async def connect(
        cls,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        namespace: str = "kvwire",
        timeout: float = 5.0,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
    ) -> Self:
        """Connect to ``url`` and verify Redis answers; :class:`RegistryUnavailableError` if not.

        ``timeout`` bounds connecting and every reply, in seconds (finite, > 0).  A ``url``
        redis-py cannot read (another scheme, a port that is not a number) raises
        :class:`UsageError`.

        The calls share a pool of at most ``max_connections`` connections (an int >= 1,
        else :class:`UsageError`; the URL's own ``max_connections`` and ``timeout`` options
        give way to these): each call holds one for its length, and a call finding them all
        in use waits for one, the wait counted in its ``timeout``
        (:class:`RegistryUnavailableError` when none came free in time).  Each watcher has a
        connection of its own, outside that pool, while it is subscribed.
        """
        timeout = _check_timeout(timeout)
        if isinstance(max_connections, bool) or not isinstance(max_connections, int) or max_connections < 1:
            raise UsageError(f"max_connections is an int >= 1, not {max_connections!r:.40}")
        lua.KeyLayout(namespace)  # refused before connecting
        if not isinstance(url, str):
            raise UsageError(f"url is a str (redis://host:port/db), not {type(url).__name__}")
        options: dict[str, Any] = {
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
            "retry": Retry(NoBackoff(), 0),
        }
        try:
            pool = aioredis.BlockingConnectionPool.from_url(url, **options)
            watch_pool = aioredis.ConnectionPool.from_url(url, **options)
        except ValueError as exc:
            raise UsageError(f"not a Redis URL redis-py reads: {url!r}: {exc}") from exc
        pool.max_connections, pool.timeout = max_connections, timeout
        watch_pool.max_connections = _WATCH_CONNECTIONS
        client = aioredis.Redis.from_pool(pool)
        registry = cls(client, namespace=namespace, owns_client=True, timeout=timeout)
        registry._watch_pool = watch_pool
        try:
            await _guard(f"connecting to {url}", client.ping(), timeout)
        except BaseException:
            await registry.close()
            raise
        return registry

    @property
    def namespace(self) -> str:
        return self.layout.namespace

    def _live(self) -> None:
        if self._closed:
            raise UsageError("the registry is closed")

    async def begin(
        self, blocks: Iterable[BlockLike], *, owner: str, ttl: float = DEFAULT_TTL
    ) -> Lease:
        self._live()
        ttl = check_ttl(ttl)
        keys = unique_keys(blocks)
        lease_id = new_lease_id()
        ttl_us, px = _ttl_args(ttl)
        rkeys = [self.layout.lease(lease_id), *(self.layout.block(k) for k in keys)]
        await self._settle()
        try:
            reply = await self._guard("begin", self._begin(keys=rkeys, args=[lease_id, ttl_us, px]))
            return self._lease(lease_id, owner, ttl, keys, reply)
        except (Exception, asyncio.CancelledError) as exc:
            # The script may have run (a reply lost or late, a cancellation after sending):
            # the caller, who never got the lease, could not release its blocks, and a new
            # begin would find them busy until the ttl.  Release it by id, leaving the lease
            # key dead for its ttl so a BEGIN still on its way changes nothing.  In a task
            # of its own: a cancellation is not delayed, and the next begin waits for its
            # first try (the tries after a failed one, until the ttl, run apart).
            undo = self._spawn(self._undo_begin(rkeys, [lease_id, px], ttl), release=True)
            if not isinstance(exc, asyncio.CancelledError):
                await asyncio.wait({undo}, timeout=self.timeout)
            raise

    def _lease(self, lease_id: str, owner: str, ttl: float, keys: list[str], reply: Any) -> Lease:
        """The lease of a BEGIN script's ``reply``."""
        started: list[BlockId] = []
        busy: list[BlockId] = []
        complete: list[VersionedBlock] = []
        for i, key in enumerate(keys):
            state, version = _decode(reply[1 + 2 * i]), int(reply[2 + 2 * i])
            block = block_from_key(key)
            if state == "s":
                started.append(block)
            elif state == "b":
                busy.append(block)
            else:
                complete.append((block, version))
        return Lease(
            lease_id=lease_id,
            owner=owner,
            ttl=ttl,
            expires_at=int(reply[0]) / 1e6,
            started=tuple(started),
            busy=tuple(busy),
            complete=tuple(complete),
        )

    def _lease_keys(self, lease: Lease) -> tuple[list[str], list[str]]:
        keys = unique_keys(lease.started)
        return keys, [self.layout.block(k) for k in keys]

    async def commit(self, lease: Lease) -> list[VersionedBlock]:
        self._live()
        check_lease(lease)
        keys, rkeys = self._lease_keys(lease)
        if not keys:
            # Nothing to commit; a lease narrowed to no blocks ends, as any narrowed lease
            # does (its blocks freed when its ttl passes).  Redis cannot tell it from a lease
            # that started nothing, whose key does not exist: deleting it changes nothing.
            await self._guard(
                "commit", self._release(keys=[self.layout.lease(lease.lease_id)], args=[lease.lease_id])
            )
            return []
        reply = await self._guard(
            "commit",
            self._commit(
                keys=[self.layout.lease(lease.lease_id), self.layout.seq, self.layout.seq_run, *rkeys],
                args=[lease.lease_id, self.layout.channel, *keys],
            ),
        )
        status = int(reply[0])
        if status == -1:
            raise LeaseExpiredError(f"lease {lease.lease_id} ({lease.owner}) is no longer live")
        if status == -2:
            lost = [block_from_key(keys[int(i) - 1]) for i in reply[1:]]
            raise stale_error(lost, "blocks changed while in flight")
        if status == -3:
            raise exhausted_error(len(keys))
        return [(block_from_key(k), int(v)) for k, v in zip(keys, reply[1:], strict=True)]

    async def renew(self, lease: Lease, ttl: float | None = None) -> Lease:
        self._live()
        check_lease(lease)
        ttl = check_ttl(lease.ttl if ttl is None else ttl)
        if not lease.started:
            # It holds nothing, so nothing can expire: the expiry is now + ttl (Redis's
            # clock), as begin gives such a lease and the memory registry renews it.
            secs, usecs = await self._guard("renew", _execute_once(self.client, self.layout.seq, "TIME"))
            return Lease(
                lease.lease_id,
                lease.owner,
                ttl,
                (int(secs) * 1_000_000 + int(usecs) + _ttl_args(ttl)[0]) / 1e6,
                (),
                lease.busy,
                lease.complete,
            )
        _, rkeys = self._lease_keys(lease)
        ttl_us, px = _ttl_args(ttl)
        reply = await self._guard(
            "renew",
            self._renew(
                keys=[self.layout.lease(lease.lease_id), *rkeys],
                args=[lease.lease_id, ttl_us, px],
            ),
        )
        if int(reply) < 0:
            raise LeaseExpiredError(f"lease {lease.lease_id} ({lease.owner}) is no longer live")
        return Lease(
            lease.lease_id,
            lease.owner,
            ttl,
            int(reply) / 1e6,
            lease.started,
            lease.busy,
            lease.complete,
        )

    async def release(self, lease: Lease) -> None:
        self._live()
        check_lease(lease)
        _, rkeys = self._lease_keys(lease)
        if not rkeys:
            return
        # In a task of its own, awaited shielded: a caller cancelled while releasing (e.g.
        # cleaning up after a cancelled commit) still gets its blocks freed.
        task = self._spawn(self._released([self.layout.lease(lease.lease_id), *rkeys], [lease.lease_id]), release=True)
        error = await asyncio.shield(task)
        if error is not None:
            raise error

    async def _released(self, keys: list[str], args: list[str | int]) -> Exception | None:
        """Run RELEASE; its error is returned, not raised (nobody may be waiting for it)."""
        try:
            await self._guard("release", self._release(keys=keys, args=args))
        except Exception as exc:
            return exc
        return None

    async def _undo_begin(self, keys: list[str], args: list[str | int], ttl: float) -> None:
        """Release the lease of a ``begin`` that failed (``args``: its id and the lease
        key's dead time).  Should this first try fail, RELEASE is tried again in a task of
        its own (:meth:`_release_until`) until it succeeds or ``ttl`` has passed (the blocks
        are free by then anyway) or the registry is closed: RELEASE changes nothing the
        second time."""
        deadline = asyncio.get_running_loop().time() + ttl
        if await self._released(keys, args) is not None and not self._closed:
            self._spawn(self._release_until(keys, args, deadline))

    async def _release_until(self, keys: list[str], args: list[str | int], deadline: float) -> None:
        """RELEASE tried again after a pause (:data:`_POLL_S`, then twice the one before,
        up to ``timeout``) until it succeeds, loop time ``deadline`` is reached or the
        registry is closed."""
        loop = asyncio.get_running_loop()
        pause = 0.0
        while True:
            pause = _next_pause(pause, self.timeout)
            await _pause(min(pause, deadline - loop.time()), lambda: self._closed)
            if self._closed or loop.time() >= deadline:
                return
            if await self._released(keys, args) is None:
                return

    async def _guard(self, what: str, awaitable: Awaitable[T]) -> T:
        """:func:`_guard` bounded by ``timeout``; a call that fails because :meth:`close`
        closed the client (connect()'s) under it says so."""
        try:
            return await _guard(what, awaitable, self.timeout)
        except RegistryUnavailableError as exc:
            if not (self._closed and self._owns_client):
                raise
            raise RegistryUnavailableError(
                f"redis registry: {what} failed: the registry was closed while the call was in flight"
            ) from exc.__cause__

    def _spawn(self, coro: Coroutine[Any, Any, T], *, release: bool = False) -> asyncio.Task[T]:
        """Run ``coro`` as a task the registry keeps (and :meth:`close` waits for; with
        ``release``, a lease's release, which a begin waits for too)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        if release:
            self._releases.add(task)
            task.add_done_callback(self._releases.discard)
        return task

    async def _settle(self) -> None:
        """Wait (at most ``timeout``) for the releases still running, so a begin after a
        begin or release that failed or was cancelled finds those blocks free (not for a
        watcher's subscription being closed)."""
        if self._releases:
            await asyncio.wait(set(self._releases), timeout=self.timeout)

    async def _read(self, keys: Sequence[str]) -> list[tuple[int, bool, bool]]:
        """``(version, complete, earlier)`` of each canonical key, from one consistent
        snapshot; ``earlier``: committed under another server tenure (so not complete)."""
        if not keys:
            return []
        return (await self._snapshot(keys, with_seq=False))[0]

    async def _snapshot(
        self, keys: Sequence[str], *, with_seq: bool
    ) -> tuple[list[tuple[int, bool, bool]], int]:
        """:meth:`_read`, and (unless ``with_seq`` is false: 0) the highest version that can
        have been handed out, in one consistent snapshot (the READ script): the counter if
        it moved in this server tenure, else the larger of it and the server's clock (a
        counter lost or restored from a snapshot says nothing of the versions handed out
        before; those are below the clock)."""
        reply = await self._guard(
            "read",
            self._read_script(
                keys=[self.layout.seq, self.layout.seq_run, *(self.layout.block(k) for k in keys)],
                args=["1" if with_seq else "0"],
            ),
        )
        states = [(int(reply[i]), int(reply[i + 1]) == 1, int(reply[i + 1]) == 2) for i in range(1, len(reply), 2)]
        return states, int(reply[0])

    async def lookup(self, blocks: Iterable[BlockLike]) -> list[VersionedBlock]:
        self._live()
        keys = unique_keys(blocks)  # duplicates dropped, first occurrence kept
        out: list[VersionedBlock] = []
        for key, (version, complete, _) in zip(keys, await self._read(keys), strict=True):
            if not complete:
                break
            out.append((block_from_key(key), version))
        return out

    async def invalidate(self, block: BlockLike) -> int:
        return (await self.invalidate_many([block]))[0][1]

    async def invalidate_many(self, blocks: Iterable[BlockLike]) -> list[VersionedBlock]:
        self._live()
        keys = unique_keys(blocks)
        if not keys:
            return []
        reply = await self._guard(
            "invalidate",
            self._invalidate(
                keys=[self.layout.seq, self.layout.seq_run, *(self.layout.block(k) for k in keys)],
                args=[self.layout.channel, *keys],
            ),
        )
        if int(reply[0]) == -3:
            raise exhausted_error(len(keys))
        return [(block_from_key(k), int(v)) for k, v in zip(keys, reply[1:], strict=True)]

    async def check(self, block: BlockLike, version: int) -> None:
        self._live()
        pairs = pairs_keys([(block, version)])
        [(current, complete, earlier)] = await self._read([pairs[0][0]])
        if not (complete and current == pairs[0][1]):
            raise explain_stale(block, version, current, complete, earlier_server=earlier)

    async def check_many(self, pairs: Iterable[tuple[BlockLike, int]]) -> list[BlockId]:
        self._live()
        items = pairs_keys(pairs)
        states = await self._read([k for k, _ in items])
        return [
            block_from_key(key)
            for (key, version), (current, complete, _) in zip(items, states, strict=True)
            if not (complete and current == version)
        ]

    async def superseded(self, pairs: Iterable[tuple[BlockLike, int]]) -> list[BlockId]:
        """The blocks :meth:`publish` would reject now (a read-only dry run); a version above
        the last one handed out (which publish refuses) is listed too."""
        return await self.check_many(pairs)

    async def publish(self, pairs: Iterable[tuple[BlockLike, int]]) -> list[BlockId]:
        """Confirm each ``(block, version)``: the rejected blocks, those not complete at
        exactly that version (a version above the block's own was issued to another block,
        or to none).  Writes nothing; one snapshot of the blocks and the counter.

        A version that cannot have been handed out raises :class:`UsageError`; after Redis
        lost its data (restart, flush, failover, fail-back) one handed out before is rejected."""
        self._live()
        items = pairs_keys(pairs)
        if not items:
            return []
        states, bound = await self._snapshot([k for k, _ in items], with_seq=True)
        for key, version in items:
            if version > bound:
                raise never_issued_error(block_from_key(key), version, bound)
        return [
            block_from_key(key)
            for (key, version), (current, complete, _) in zip(items, states, strict=True)
            if not (complete and current == version)
        ]

    def watch(self) -> RedisWatcher:
        self._live()
        return RedisWatcher(self)

    def _new_pubsub(self) -> PubSub:
        """A pubsub for a watcher's subscription: on a connection of the watchers' pool
        (:meth:`connect`'s registry), else of the client's."""
        if self._watch_pool is not None:
            return PubSub(self._watch_pool)
        return self.client.pubsub()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for watcher in tuple(self._watchers):
            await watcher.aclose()
        if self._background:  # releases still running: give them the time of one call
            _, pending = await asyncio.wait(set(self._background), timeout=self.timeout)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
        if self._owns_client:
            # Closing a broken connection: nothing is left to protect.
            with contextlib.suppress(RedisError, OSError):
                await self.client.aclose()
        if self._watch_pool is not None:
            with contextlib.suppress(RedisError, OSError):
                await self._watch_pool.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


__all__ = ["RedisRegistry", "RedisWatcher"]
