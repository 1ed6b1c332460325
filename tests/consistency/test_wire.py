"""Block versions enforced on the wire: a server with a registry never hands out stale data."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import kvwire
from tests.conftest import SECRET, make_layers, same_cache

pytestmark = pytest.mark.timeout(60)
SPEC = kvwire.KVSpec(num_layers=4, num_kv_heads=2, head_dim=16)


async def test_fresh_blocks_are_accepted_and_published(registry: Any) -> None:
    lease = await registry.begin([101, 102], owner="prefill-a", ttl=30)
    versions = await registry.commit(lease)
    layers = make_layers(4, 40, 2, 16)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, registry=registry) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            recv = asyncio.create_task(server.expect("ok"))
            await peer.send("ok", SPEC, layers, blocks=versions, timeout=10)
            t = await recv
            assert same_cache((await t.collect(timeout=10)).layers, layers)
            assert t.blocks == versions
    assert await registry.lookup([101, 102]) == versions


async def test_never_issued_versions_are_refused_and_never_published(registry: Any) -> None:
    # What a receiver sees after its registry lost its data, or from a peer making versions
    # up: the block is unknown, or the version is above anything issued.  Fail closed.
    lease = await registry.begin(["blk-y"], owner="a", ttl=30)
    [(_, vy)] = await registry.commit(lease)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, registry=registry) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            for blocks in ([("blk-x", 7)], [("blk-y", vy + 1000)], [("blk-y", 2**53 - 1)], [("blk-y", 2**53)],
                           [("blk-y", 2**60)]):
                # the block named as the sender gave it, not by its key on the wire (b's:blk-y')
                name = repr(blocks[0][0])
                with pytest.raises(kvwire.StaleVersionError, match=f"^stale prefix blocks.*: {name}$"):
                    await peer.send("made-up", SPEC, make_layers(4, 8, 2, 16), blocks=blocks, timeout=10)
            assert server.statistics()["transfers_refused"] == 5
            # nothing was published: the registry still holds what it issued, and a later
            # commit is not poisoned by the huge version a peer announced
            assert await registry.lookup(["blk-y"]) == [("blk-y", vy)]
            assert await registry.check_many([("blk-x", 7)]) == ["blk-x"]
            await registry.invalidate("blk-y")
            lease = await registry.begin(["blk-y"], owner="a", ttl=30)
            [(_, v2)] = await registry.commit(lease)
            assert vy < v2 < 2**53 - 1
            await peer.send("fresh", SPEC, make_layers(4, 8, 2, 16), blocks=[("blk-y", v2)], timeout=10)


@pytest.mark.parametrize("with_registry", [True, False], ids=["registry", "no-registry"])
async def test_malformed_blocks_are_usage_errors_before_anything_is_sent(registry: Any, with_registry: bool) -> None:
    lease = await registry.begin(["a"], owner="a", ttl=30)
    versions = await registry.commit(lease)
    bad: list[tuple[Any, str]] = [
        ([("a", 1, 2)], r"blocks\[0\] is not a \(block id, version\) pair: \('a', 1, 2\)"),
        ([*versions, "a"], r"blocks\[1\] is not a \(block id, version\) pair: 'a'"),
        ("ab", "blocks is a list of \\(block id, version\\) pairs, not a single str"),
        ([5], r"blocks\[0\] is not a \(block id, version\) pair: 5"),
        (7, "not int"),
    ]
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, registry=registry if with_registry else None) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            for blocks, message in bad:
                with pytest.raises(kvwire.UsageError, match=message):
                    await peer.send("bad", SPEC, make_layers(4, 8, 2, 16), blocks=blocks, timeout=10)
            stats = server.statistics()
            assert stats["transfers_accepted"] == 0 and stats["transfers_refused"] == 0
            layers = make_layers(4, 8, 2, 16)
            recv = asyncio.create_task(server.expect("good"))
            await peer.send("good", SPEC, layers, blocks=versions, timeout=10)  # the session is still usable
            assert same_cache((await (await recv).collect(timeout=10)).layers, layers)


async def test_stale_transfer_is_refused_on_both_sides_before_data_moves(registry: Any) -> None:
    lease = await registry.begin([5], owner="a", ttl=30)
    [(_, v1)] = await registry.commit(lease)
    await registry.invalidate(5)  # the cache at v1 is now stale everywhere
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, registry=registry) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            with pytest.raises(kvwire.StaleVersionError):
                await peer.send("stale", SPEC, make_layers(4, 8, 2, 16), blocks=[(5, v1)], timeout=10)
            with pytest.raises(kvwire.TransferTimeoutError):
                await server.expect("stale", timeout=0.3)  # never handed to the application
            assert server.statistics()["transfers_refused"] == 1
            # an expect() already waiting is told at once, not at its own timeout; a second
            # expect() of the same id waits on for the next transfer of that id
            waiting = asyncio.create_task(server.expect("stale-again", timeout=30))
            second = asyncio.create_task(server.expect("stale-again", timeout=30))
            await asyncio.sleep(0)
            with pytest.raises(kvwire.StaleVersionError):
                await peer.send("stale-again", SPEC, make_layers(4, 8, 2, 16), blocks=[(5, v1)], timeout=10)
            with pytest.raises(kvwire.StaleVersionError):
                await asyncio.wait_for(waiting, 10)
            assert not second.done()
            fresh = make_layers(4, 8, 2, 16, seed=3)
            await peer.send("stale-again", SPEC, fresh, timeout=10)
            assert same_cache((await (await asyncio.wait_for(second, 10)).collect(timeout=10)).layers, fresh)
            # the session is still usable
            await peer.send("after", SPEC, make_layers(4, 8, 2, 16), timeout=10)


async def test_block_invalidated_mid_transfer_never_completes(registry: Any) -> None:
    lease = await registry.begin([9], owner="a", ttl=30)
    versions = await registry.commit(lease)
    layers = make_layers(4, 16, 2, 16)
    gate = asyncio.Event()

    async def produce():  # type: ignore[no-untyped-def]
        for i, kv in enumerate(layers):
            yield kv
            if i == 0:
                await gate.wait()

    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, registry=registry) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            send = asyncio.create_task(peer.send("mid", SPEC, produce(), blocks=versions, timeout=10))
            t = await server.expect("mid", timeout=5)
            await registry.invalidate(9)  # newer data exists now
            gate.set()
            seen = []
            with pytest.raises(kvwire.StaleVersionError):
                async for layer in t:
                    seen.append(layer.index)
            assert len(seen) < 4  # the last layer is withheld
            with pytest.raises(kvwire.StaleVersionError):
                await send
