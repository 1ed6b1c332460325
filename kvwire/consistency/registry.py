"""The async interface every registry backend implements (typing only; no I/O here)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from types import TracebackType
from typing import Protocol, Self, runtime_checkable

from kvwire.consistency.blocks import BlockId, BlockLike
from kvwire.consistency.core import Lease, VersionedBlock

DEFAULT_TTL = 30.0
"""Default lease lifetime in seconds."""


@runtime_checkable
class Watcher(Protocol):
    """An async iterator of ``(block, version)`` changes; close it when done (one abandoned
    unclosed is released when garbage collected: the registry holds watchers weakly).

    ``async with reg.watch() as w`` subscribes before the body runs, so every change made
    after entering is delivered; a bare ``async for`` subscribes on the first iteration.
    Notifications are hints for cache eviction, not proof of freshness: use ``check``.
    """

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...

    def __aiter__(self) -> AsyncIterator[VersionedBlock]: ...

    async def __anext__(self) -> VersionedBlock: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class Registry(Protocol):
    """A versioned prefix-block registry (``MemoryRegistry``, ``RedisRegistry``)."""

    async def begin(
        self, blocks: Iterable[BlockLike], *, owner: str, ttl: float = DEFAULT_TTL
    ) -> Lease: ...

    async def commit(self, lease: Lease) -> list[VersionedBlock]: ...

    async def renew(self, lease: Lease, ttl: float | None = None) -> Lease: ...

    async def release(self, lease: Lease) -> None: ...

    async def lookup(self, blocks: Iterable[BlockLike]) -> list[VersionedBlock]: ...

    async def invalidate(self, block: BlockLike) -> int: ...

    async def invalidate_many(self, blocks: Iterable[BlockLike]) -> list[VersionedBlock]: ...

    async def check(self, block: BlockLike, version: int) -> None: ...

    async def check_many(self, pairs: Iterable[tuple[BlockLike, int]]) -> list[BlockId]: ...

    async def superseded(self, pairs: Iterable[tuple[BlockLike, int]]) -> list[BlockId]: ...

    async def publish(self, pairs: Iterable[tuple[BlockLike, int]]) -> list[BlockId]: ...

    def watch(self) -> Watcher: ...

    async def close(self) -> None: ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


__all__ = ["DEFAULT_TTL", "Registry", "Watcher"]
