"""In-process registry: the sans-IO core driven by the event loop's clock.

For one process (tests, a single serving node, an embedded default). Every coroutine runs
without awaiting in between, so each operation is atomic with respect to other tasks.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Self

from kvwire.consistency.blocks import BlockId, BlockLike
from kvwire.consistency.core import Lease, RegistryCore, VersionedBlock, check_lease
from kvwire.consistency.errors import NotificationsLostError
from kvwire.consistency.registry import DEFAULT_TTL
from kvwire.errors import UsageError

DEFAULT_WATCH_BUFFER = 10_000


class MemoryWatcher:
    """Notifications of one :class:`MemoryRegistry`, buffered up to ``maxlen`` entries.

    The registry holds its watchers weakly: one abandoned without ``aclose`` (a ``break``
    out of a bare ``async for``) stops buffering once it is garbage collected.
    """

    def __init__(self, registry: MemoryRegistry, maxlen: int) -> None:
        self._registry = registry
        self._maxlen = maxlen
        self._buffer: deque[VersionedBlock] = deque()
        self._wakeup = asyncio.Event()
        self._subscribed = False
        self._closed = False
        self._overflowed = False

    def _subscribe(self) -> None:
        if not self._subscribed and not self._closed:
            # As watch() on a closed registry: a watcher made before close() and first used
            # after it would otherwise wait for changes that can no longer come.
            self._registry._live()
            self._subscribed = True
            self._registry._watchers.add(self)

    def _push(self, item: VersionedBlock) -> None:
        if len(self._buffer) >= self._maxlen:
            # Dropping silently would let a reader keep trusting a block it missed an
            # invalidation for; it is told instead and must re-read the state.
            self._overflowed = True
        else:
            self._buffer.append(item)
        self._wakeup.set()

    def _end(self) -> None:
        # What is buffered is not delivered: a closed watcher ends at once, as the Redis
        # registry's does (docs/consistency.md: close ends the watchers).
        self._closed = True
        self._buffer.clear()
        self._overflowed = False
        self._wakeup.set()

    async def __aenter__(self) -> Self:
        self._subscribe()
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
        self._subscribe()
        while True:
            if self._closed:
                raise StopAsyncIteration
            if self._overflowed:
                # Told at once, not once the buffer drains: a reader that stays behind would
                # never learn of the gap.  What is buffered predates the re-read the reader
                # now does, so it goes too.
                self._overflowed = False
                self._buffer.clear()
                raise NotificationsLostError(
                    f"watcher fell more than {self._maxlen} notifications behind"
                )
            if self._buffer:
                return self._buffer.popleft()
            self._wakeup.clear()
            await self._wakeup.wait()

    async def aclose(self) -> None:
        self._registry._watchers.discard(self)
        self._end()


class MemoryRegistry:
    """The embedded registry. ``clock`` defaults to the running loop's ``time()``."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] | None = None,
        watch_buffer: int = DEFAULT_WATCH_BUFFER,
    ) -> None:
        if isinstance(watch_buffer, bool) or not isinstance(watch_buffer, int) or watch_buffer < 1:
            raise UsageError(f"watch_buffer must be an int of at least 1, not {watch_buffer!r}")
        self.core = RegistryCore()
        self._clock = clock
        self._watch_buffer = watch_buffer
        # Weak: an abandoned watcher must not buffer (and be visited) until close().
        self._watchers: weakref.WeakSet[MemoryWatcher] = weakref.WeakSet()
        self._closed = False

    def _live(self) -> None:
        if self._closed:
            raise UsageError("the registry is closed")

    def _now(self) -> float:
        self._live()
        if self._clock is not None:
            return self._clock()
        return asyncio.get_running_loop().time()

    def _notify(self) -> None:
        for item in self.core.take_events():
            for watcher in tuple(self._watchers):
                watcher._push(item)

    async def begin(
        self, blocks: Iterable[BlockLike], *, owner: str, ttl: float = DEFAULT_TTL
    ) -> Lease:
        return self.core.begin(blocks, owner=owner, ttl=ttl, now=self._now())

    async def commit(self, lease: Lease) -> list[VersionedBlock]:
        try:
            return self.core.commit(lease, now=self._now())
        finally:
            self._notify()

    async def renew(self, lease: Lease, ttl: float | None = None) -> Lease:
        check_lease(lease)
        return self.core.renew(lease, ttl=lease.ttl if ttl is None else ttl, now=self._now())

    async def release(self, lease: Lease) -> None:
        self.core.release(lease, now=self._now())

    async def lookup(self, blocks: Iterable[BlockLike]) -> list[VersionedBlock]:
        self._now()
        return self.core.lookup(blocks)

    async def invalidate(self, block: BlockLike) -> int:
        return (await self.invalidate_many([block]))[0][1]

    async def invalidate_many(self, blocks: Iterable[BlockLike]) -> list[VersionedBlock]:
        self._now()
        try:
            return self.core.invalidate_many(blocks)
        finally:
            self._notify()

    async def check(self, block: BlockLike, version: int) -> None:
        self._now()
        self.core.check(block, version)

    async def check_many(self, pairs: Iterable[tuple[BlockLike, int]]) -> list[BlockId]:
        self._now()
        return self.core.stale(pairs)

    async def superseded(self, pairs: Iterable[tuple[BlockLike, int]]) -> list[BlockId]:
        """The blocks :meth:`publish` would reject now (a read-only dry run)."""
        self._now()
        return self.core.superseded(pairs)

    async def publish(self, pairs: Iterable[tuple[BlockLike, int]]) -> list[BlockId]:
        self._now()
        return self.core.publish(pairs)

    def watch(self) -> MemoryWatcher:
        self._live()
        return MemoryWatcher(self, self._watch_buffer)

    async def close(self) -> None:
        self._closed = True
        for watcher in tuple(self._watchers):
            watcher._end()
        self._watchers.clear()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


__all__ = ["MemoryRegistry", "MemoryWatcher"]
