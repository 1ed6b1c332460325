"""name_blocks and verify_blocks (kvwire.integrations.prefix) on both backends: arguments
read once (a generator names and checks as a list does), block ids in their canonical
form, bad ids refused before anything is begun."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvwire.consistency import Registry
from kvwire.errors import UsageError
from kvwire.integrations.prefix import name_blocks, verify_blocks

pytestmark = pytest.mark.timeout(30)


async def test_name_blocks_reads_a_generator_once_and_names_every_block(registry: Registry) -> None:
    """An iterator was consumed by begin: every block was committed, none named ([])."""
    named = await asyncio.wait_for(name_blocks(registry, iter([b"q0", b"q1"]), owner="p"), 10)
    assert [b for b, _ in named] == [b"q0", b"q1"]
    assert await registry.lookup([b"q0", b"q1"]) == named
    again = await asyncio.wait_for(name_blocks(registry, (b for b in [b"q0", b"q1", b"q2"]), owner="p"), 10)
    assert again[:2] == named and [b for b, _ in again] == [b"q0", b"q1", b"q2"]


async def test_verify_blocks_checks_generators_as_lists(registry: Registry) -> None:
    """A generator of announced pairs was consumed building the names: check_many checked
    nothing and stale blocks were approved (None)."""
    ids = [b"p0", b"p1"]
    named = await name_blocks(registry, ids, owner="prefill")
    assert await verify_blocks(registry, iter(ids), ((b, v) for b, v in named)) is None
    await registry.invalidate(b"p0")  # new weights: p0 is stale now
    for announced in (list(named), ((b, v) for b, v in named), iter(named)):
        reason = await asyncio.wait_for(verify_blocks(registry, (b for b in ids), announced), 10)
        assert reason is not None and "1 of its 2 prefix blocks are stale" in reason
    reason = await verify_blocks(registry, ids, iter(named[:1]))
    assert reason is not None and "not the 2 of this prompt" in reason


@pytest.mark.parametrize("make", [bytearray, lambda b: memoryview(bytearray(b)), memoryview])
async def test_name_blocks_takes_bytes_like_ids_and_names_them_as_bytes(registry: Registry, make: Any) -> None:
    """A bytearray id raised TypeError (unhashable) after its blocks were committed."""
    named = await name_blocks(registry, [make(b"a"), make(b"b")], owner="x")
    assert [b for b, _ in named] == [b"a", b"b"] and all(type(b) is bytes for b, _ in named)
    assert await registry.lookup([b"a", b"b"]) == named
    # already complete: named at the same versions, the ids as given compare alike
    assert await name_blocks(registry, [make(b"a"), b"b"], owner="y") == named
    assert await verify_blocks(registry, [make(b"a"), make(b"b")], named) is None


@pytest.mark.parametrize("bad", [[b"a", 1.5], [b"a", None], [b"a", True], b"ab", "ab", 5, None])
async def test_name_blocks_refuses_bad_ids_before_beginning_anything(registry: Registry, bad: Any) -> None:
    with pytest.raises(UsageError):
        await name_blocks(registry, bad, owner="x")
    assert await registry.lookup([b"a"]) == []
    assert (await registry.begin([b"a"], owner="other")).started == (b"a",)  # not left in flight


@pytest.mark.parametrize("announced", [[(b"a",)], [b"ab"], 5, "ab", [(b"a", 1, 2)]])
async def test_verify_blocks_refuses_malformed_pairs(registry: Registry, announced: Any) -> None:
    with pytest.raises(UsageError):
        await verify_blocks(registry, [b"a"], announced)
