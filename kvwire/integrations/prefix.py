"""A prompt's prefix blocks, named and versioned in the registry, for engine connectors.

An engine connector that is given a registry (:mod:`kvwire.consistency`) names the full
prompt blocks it sends, so the receiving side can refuse a cache whose blocks were
invalidated meanwhile (new weights, an evicted prefix):

- :func:`prefix_block_ids`: block ``i``'s id is a chained SHA-256 over the token ids of
  blocks ``0..i`` (so it names the whole prefix up to it), seeded with the block size and
  an optional salt (e.g. the model name).  Both sides derive the same ids from the prompt.
- :func:`name_blocks` (sender): ``begin`` + ``commit`` on the registry; blocks already
  complete keep their version, the others get a new one.  Returns ``(block, version)``
  for the longest run of blocks it could name (it stops at a block another lease is
  computing): the ``blocks=`` of :meth:`kvwire.Peer.send`.
- :func:`verify_blocks` (receiver): the reason to refuse a received cache, or None when
  it names exactly the expected blocks and the registry holds every one fresh at the
  announced version (``check_many``; fails closed).
- :class:`SyncRegistry`: the same on a :class:`kvwire.sync.Bridge`, for synchronous hooks.

No engine is imported here.  See docs/integrations.md.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Sequence
from typing import Any

from kvwire.consistency import BlockId, Lease, Registry
from kvwire.errors import KvwireError, UsageError
from kvwire.sync import Bridge

_SEED = b"kvwire-prefix-v1"


def prefix_block_ids(tokens: Sequence[int], block_size: int, num_blocks: int, *, salt: bytes = b"") -> list[bytes]:
    """The ids of the first ``num_blocks`` blocks of ``tokens`` (``block_size`` tokens each)."""
    if block_size <= 0 or num_blocks < 0:
        raise UsageError("block_size must be positive and num_blocks not negative")
    if num_blocks * block_size > len(tokens):
        raise UsageError(f"{num_blocks} blocks of {block_size} need {num_blocks * block_size} tokens, got {len(tokens)}")
    h = hashlib.sha256(_SEED + block_size.to_bytes(8, "little") + hashlib.sha256(salt).digest()).digest()
    ids = []
    for i in range(num_blocks):
        block = tokens[i * block_size:(i + 1) * block_size]
        h = hashlib.sha256(h + b"".join(int(t).to_bytes(8, "little", signed=True) for t in block)).digest()
        ids.append(h)
    return ids


async def name_blocks(registry: Registry, blocks: Sequence[BlockId], *, owner: str, ttl: float = 30.0) -> list[tuple[BlockId, int]]:
    """``(block, version)`` for the blocks a sender holds: complete ones at their version,
    the others committed now at a new one; stops at the first block another live lease is
    computing.  Raises :class:`~kvwire.StaleVersionError` if a block changed meanwhile.

    A commit that fails or is cancelled (a caller's timeout) releases the lease before the
    error goes on, so its blocks are not left in flight, unnameable by other producers,
    for the rest of ``ttl``."""
    lease = await registry.begin(list(blocks), owner=owner, ttl=ttl)
    versions: dict[Any, int] = dict(lease.complete)
    if lease.started:
        try:
            versions.update(await registry.commit(lease))
        except BaseException:
            await _release(registry, lease)
            raise
    named: list[tuple[BlockId, int]] = []
    for block in blocks:
        if block not in versions:
            break
        named.append((block, versions[block]))
    return named


async def _release(registry: Registry, lease: Lease) -> None:
    """Release ``lease`` after its commit failed or was cancelled (errors ignored: the
    lease then ends with its ttl).  Not shielded here (this package imports no asyncio):
    the registries kvwire ships finish a release that a second cancellation interrupts
    (``MemoryRegistry.release`` never suspends; ``RedisRegistry.release`` runs in a task of
    its own).  With another registry, a second cancellation may leave the lease to its ttl."""
    with contextlib.suppress(Exception):
        await registry.release(lease)


async def verify_blocks(registry: Registry, expected: Sequence[BlockId], announced: Sequence[tuple[BlockId, int]]) -> str | None:
    """None if ``announced`` names exactly ``expected`` (in order), every one fresh; else why not."""
    names = [b for b, _ in announced]
    if names != list(expected):
        return f"the cache names {len(names)} prefix blocks that are not the {len(expected)} of this prompt"
    stale = await registry.check_many(announced)
    if stale:
        return f"{len(stale)} of its {len(expected)} prefix blocks are stale"
    return None


class SyncRegistry:
    """A registry used from synchronous code: its calls run on ``bridge``'s loop."""

    def __init__(self, registry: Registry, bridge: Bridge, *, timeout: float = 10.0) -> None:
        self.registry = registry
        self.bridge = bridge
        self.timeout = timeout

    @classmethod
    def connect(cls, url: str, bridge: Bridge, *, namespace: str = "kvwire", timeout: float = 5.0) -> SyncRegistry:
        """A :class:`~kvwire.consistency.RedisRegistry` at ``url`` on ``bridge``."""
        from kvwire.aio.registry_redis import RedisRegistry

        registry = bridge.run(RedisRegistry.connect(url, namespace=namespace, timeout=timeout), timeout + 5.0)
        return cls(registry, bridge, timeout=2 * timeout)

    def name(self, blocks: Sequence[BlockId], *, owner: str, ttl: float = 30.0) -> list[tuple[BlockId, int]]:
        return self.bridge.run(name_blocks(self.registry, blocks, owner=owner, ttl=ttl), self.timeout)

    def verify(self, expected: Sequence[BlockId], announced: Sequence[tuple[BlockId, int]]) -> str | None:
        return self.bridge.run(verify_blocks(self.registry, expected, announced), self.timeout)

    def close(self) -> None:
        """Close the registry's connection (errors while closing are ignored)."""
        if not self.bridge.closed:
            with contextlib.suppress(KvwireError):
                self.bridge.run(self.registry.close(), self.timeout)


__all__ = ["SyncRegistry", "name_blocks", "prefix_block_ids", "verify_blocks"]
