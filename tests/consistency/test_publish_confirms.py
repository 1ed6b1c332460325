"""Publish confirms a block's own version; it never makes a block fresh at a version the
registry did not give that block.  Versions come from one registry-wide counter, and only a
commit or an invalidation gives a block one, so a version above the block's current one
was issued to another block, or to none: a writer that holds no such version for the block
(a stale copy from before an invalidation, a version handed to someone else, a number made
up below the counter) is refused.  Each test runs against memory and Redis."""

from __future__ import annotations

import asyncio

import pytest

from kvwire.consistency import Registry
from kvwire.errors import StaleVersionError

pytestmark = pytest.mark.timeout(30)


async def test_a_stale_copy_under_another_blocks_version_is_refused(registry: Registry) -> None:
    """A writer holding a block's data from before its invalidation publishes it under a
    later version, one issued to another block: refused, and the block stays invalidated
    (its stale data does not become fresh)."""
    [(_, v)] = await registry.commit(await registry.begin(["p"], owner="a"))
    w = await registry.invalidate("p")
    [(_, x)] = await registry.commit(await registry.begin(["q"], owner="b"))  # issued to q
    assert v < w < x
    assert await registry.publish([("p", x)]) == ["p"]
    assert await registry.publish([("p", w + 1)]) == ["p"]  # a number made up below the counter
    assert await registry.lookup(["p"]) == []
    assert await registry.check_many([("p", x)]) == ["p"]
    with pytest.raises(StaleVersionError):
        await registry.check("p", x)
    assert await registry.superseded([("p", x), ("q", x)]) == ["p"]  # the dry run agrees


async def test_a_publish_does_not_take_a_block_from_its_lease(registry: Registry) -> None:
    """A block recomputed under a live lease: a publish at a version issued to someone
    else neither completes it nor takes it from the lease, whose commit then succeeds."""
    lease = await registry.begin(["r"], owner="a")
    x = await registry.invalidate("other")
    assert await registry.publish([("r", x)]) == ["r"]
    assert (await registry.begin(["r"], owner="b")).busy == ("r",)
    [(_, v)] = await registry.commit(lease)
    assert v > x
    await registry.check("r", v)


async def test_only_the_blocks_own_version_is_confirmed(registry: Registry) -> None:
    """The block's own version is confirmed (idempotent); nothing a publish confirms is
    notified, since nothing changed."""
    [(_, v)] = await registry.commit(await registry.begin(["s"], owner="a"))
    x = await registry.invalidate("t")
    async with registry.watch() as watcher:
        assert await registry.publish([("s", v), ("u", x)]) == ["u"]
        y = await registry.invalidate("marker")
        assert await asyncio.wait_for(anext(watcher), 5) == ("marker", y)  # the first change seen
    assert await registry.lookup(["s"]) == [("s", v)]
    assert await registry.lookup(["u"]) == []
