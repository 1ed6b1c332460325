"""``name_blocks``: a commit that fails or is cancelled gives its lease back, so another
producer can name the same blocks at once rather than after the lease's ttl."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvwire.aio.registry_memory import MemoryRegistry
from kvwire.errors import RegistryUnavailableError
from kvwire.integrations.prefix import name_blocks, prefix_block_ids, verify_blocks

pytestmark = pytest.mark.timeout(30)

BLOCKS = prefix_block_ids(list(range(64)), 16, 4, salt=b"m")


class BrokenCommit(MemoryRegistry):
    """A registry whose commits fail (``"fail"``) or never answer (``"hang"``) while set."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode: str | None = mode
        self.committing = asyncio.Event()

    async def commit(self, lease: Any) -> Any:
        if self.mode == "fail":
            raise RegistryUnavailableError("the registry went away mid-commit")
        if self.mode == "hang":
            self.committing.set()
            await asyncio.Event().wait()  # until cancelled
        return await super().commit(lease)


async def test_a_failed_commit_releases_the_lease() -> None:
    registry = BrokenCommit("fail")
    with pytest.raises(RegistryUnavailableError):
        await name_blocks(registry, BLOCKS, owner="prefill-1", ttl=30)
    registry.mode = None
    named = await name_blocks(registry, BLOCKS, owner="prefill-2", ttl=30)
    assert [b for b, _ in named] == BLOCKS
    assert await verify_blocks(registry, BLOCKS, named) is None


async def test_a_cancelled_commit_releases_the_lease() -> None:
    registry = BrokenCommit("hang")
    naming = asyncio.create_task(name_blocks(registry, BLOCKS, owner="prefill-1", ttl=30))
    await asyncio.wait_for(registry.committing.wait(), 10)
    naming.cancel()  # e.g. SyncRegistry.name()'s timeout
    with pytest.raises(asyncio.CancelledError):
        await naming
    registry.mode = None
    named = await name_blocks(registry, BLOCKS, owner="prefill-2", ttl=30)
    assert [b for b, _ in named] == BLOCKS
    assert await verify_blocks(registry, BLOCKS, named) is None
