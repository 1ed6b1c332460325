"""Behaviour every backend shares; each test runs against memory and Redis."""

from __future__ import annotations

import asyncio
import dataclasses
import gc

import pytest

import kvwire
from kvwire.aio.registry_memory import MemoryRegistry
from kvwire.aio.registry_redis import RedisRegistry
from kvwire.consistency import LeaseExpiredError, Registry
from kvwire.errors import StaleVersionError, UsageError

pytestmark = pytest.mark.timeout(30)


async def test_begin_commit_lookup(registry: Registry) -> None:
    lease = await registry.begin([1, 2, 3], owner="prefill-a", ttl=30.0)
    assert lease.started == (1, 2, 3) and lease.busy == () and lease.complete == ()
    assert await registry.lookup([1, 2, 3]) == []
    versions = await registry.commit(lease)
    assert [b for b, _ in versions] == [1, 2, 3]
    assert [v for _, v in versions] == sorted({v for _, v in versions})
    assert await registry.lookup([1, 2, 3, 4]) == versions
    assert await registry.lookup([2, 3]) == versions[1:]
    assert await registry.lookup([4, 1]) == []
    for block, version in versions:
        await registry.check(block, version)


async def test_second_begin_is_busy_then_complete(registry: Registry) -> None:
    a = await registry.begin([b"\x01", "x", 7], owner="a")
    b = await registry.begin([7, 8], owner="b")
    assert b.started == (8,) and b.busy == (7,)
    versions = dict(await registry.commit(a))
    c = await registry.begin([7, 8, 9], owner="c")
    assert c.started == (9,) and c.busy == (8,) and c.complete == ((7, versions[7]),)
    # committing b only completes the block it started
    assert [blk for blk, _ in await registry.commit(b)] == [8]
    await registry.release(c)
    d = await registry.begin([9], owner="d")
    assert d.started == (9,)


async def test_duplicates_and_types(registry: Registry) -> None:
    lease = await registry.begin([5, 5, bytearray(b"ab"), b"ab", "5"], owner="a")
    assert lease.started == (5, b"ab", "5")
    versions = await registry.commit(lease)
    assert await registry.lookup([5, memoryview(b"ab"), "5"]) == versions
    # duplicates are dropped, first occurrence kept, as in begin and invalidate_many
    assert await registry.lookup([5, 5, bytearray(b"ab"), b"ab", "5", 5]) == versions
    assert await registry.lookup(["5", 5, "5"]) == [versions[2], versions[0]]
    with pytest.raises(UsageError):
        await registry.lookup("abc")
    with pytest.raises(UsageError):
        await registry.begin([True], owner="a")
    with pytest.raises(UsageError):
        await registry.begin("abc", owner="a")
    with pytest.raises(UsageError):
        await registry.begin([1.5], owner="a")  # type: ignore[list-item]
    with pytest.raises(UsageError):
        await registry.begin([1], owner="a", ttl=0)
    with pytest.raises(UsageError, match="up to"):  # past what Redis can store: refused before any write
        await registry.begin([7], owner="a", ttl=1e16)
    assert (await registry.begin([7], owner="b")).started == (7,)  # nothing was left holding it


async def test_invalidate_makes_holders_stale(registry: Registry) -> None:
    [(_, v1)] = await registry.commit(await registry.begin([42], owner="a"))
    v2 = await registry.invalidate(42)
    assert v2 > v1
    with pytest.raises(StaleVersionError):
        await registry.check(42, v1)
    with pytest.raises(StaleVersionError):
        await registry.check(42, v2)  # no data exists at an invalidation's version
    assert await registry.lookup([42]) == []
    lease = await registry.begin([42], owner="b")
    assert lease.started == (42,)
    [(_, v3)] = await registry.commit(lease)
    assert v3 > v2
    await registry.check(42, v3)
    assert await registry.check_many([(42, v1), (42, v3), (43, 1)]) == [42, 43]


async def test_check_unknown_and_future(registry: Registry) -> None:
    with pytest.raises(StaleVersionError, match="unknown"):
        await registry.check("never", 1)
    [(_, v)] = await registry.commit(await registry.begin(["b"], owner="a"))
    with pytest.raises(StaleVersionError, match="never issued"):
        await registry.check("b", v + 1)
    with pytest.raises(kvwire.KvwireError):
        await registry.check("b", v - 1)
    assert await registry.check_many([]) == []


BAD_PAIRS = [
    ([(1,)], r"pairs\[0\] is not a \(block id, version\) pair: \(1,\)"),
    ([("a", 1), ("a", 1, 2)], r"pairs\[1\] is not a \(block id, version\) pair: \('a', 1, 2\)"),
    (["ab"], r"pairs\[0\] is not a \(block id, version\) pair: 'ab'"),  # not ("a", "b")
    ([5], r"pairs\[0\] is not a \(block id, version\) pair: 5"),
    ("ab", r"not a single str"),
    (b"ab", r"not a single bytes"),
    (5, r"not int"),
]


@pytest.mark.parametrize("method", ["check_many", "superseded", "publish"])
@pytest.mark.parametrize("pairs, message", BAD_PAIRS)
async def test_malformed_pairs_are_usage_errors_naming_the_entry(
    registry: Registry, method: str, pairs: object, message: str
) -> None:
    [(_, v)] = await registry.commit(await registry.begin(["a"], owner="a"))
    with pytest.raises(UsageError, match=message):
        await getattr(registry, method)(pairs)
    assert await registry.check_many([("a", v)]) == []


async def test_invalidate_in_flight_fails_commit(registry: Registry) -> None:
    lease = await registry.begin([1, 2], owner="a")
    await registry.invalidate(2)
    with pytest.raises(StaleVersionError, match="in flight") as info:
        await registry.commit(lease)
    assert not isinstance(info.value, LeaseExpiredError)
    assert await registry.lookup([1]) == []
    # the failed commit freed the other block, and the lease is gone
    assert (await registry.begin([1], owner="b")).started == (1,)
    with pytest.raises(LeaseExpiredError):
        await registry.commit(lease)


async def test_commit_twice_refused(registry: Registry) -> None:
    lease = await registry.begin([1], owner="a")
    await registry.commit(lease)
    with pytest.raises(LeaseExpiredError):
        await registry.commit(lease)
    assert await registry.commit(await registry.begin([1], owner="b")) == []


async def test_lease_expiry(registry: Registry) -> None:
    lease = await registry.begin([1, 2], owner="dead", ttl=0.2)
    assert (await registry.begin([1], owner="b", ttl=0.2)).busy == (1,)
    await asyncio.sleep(0.3)
    # the owner died: its blocks are free again
    other = await registry.begin([1], owner="b")
    assert other.started == (1,)
    # a late commit must not overwrite what the new owner computes
    with pytest.raises(LeaseExpiredError):
        await registry.commit(lease)
    assert [b for b, _ in await registry.commit(other)] == [1]
    assert await registry.lookup([1, 2]) == [(1, (await registry.lookup([1]))[0][1])]


async def test_expired_lease_not_rebegun_still_refused(registry: Registry) -> None:
    lease = await registry.begin([3], owner="slow", ttl=0.2)
    await asyncio.sleep(0.3)
    with pytest.raises(LeaseExpiredError):
        await registry.commit(lease)
    assert await registry.lookup([3]) == []


async def test_renew_keeps_lease_alive(registry: Registry) -> None:
    lease = await registry.begin([1], owner="a", ttl=0.3)
    await asyncio.sleep(0.15)
    lease = await registry.renew(lease, 1.0)
    await asyncio.sleep(0.25)
    assert (await registry.begin([1], owner="b")).busy == (1,)
    assert len(await registry.commit(lease)) == 1
    expired = await registry.begin([2], owner="c", ttl=0.1)
    await asyncio.sleep(0.2)
    with pytest.raises(LeaseExpiredError):
        await registry.renew(expired)


async def test_renew_of_a_lease_that_started_nothing_moves_its_expiry(registry: Registry) -> None:
    """A lease that started nothing holds nothing: renew never refuses it and, as for a
    lease that started blocks (and as begin gives it), its expiry becomes now + ttl on the
    registry's clock; Redis kept the old expiry, so a caller renewing by the expiry it was
    given would renew again at once, forever."""
    await registry.commit(await registry.begin(["done"], owner="a"))
    lease = await registry.begin(["done"], owner="b", ttl=0.2)
    assert lease.started == ()
    renewed = await registry.renew(lease, 30.0)
    # now + 30 at the renew, no earlier than (begin's now) + 30 = lease.expires_at - 0.2 + 30
    assert renewed.ttl == 30.0 and renewed.expires_at - lease.expires_at >= 29.0
    assert (renewed.busy, renewed.complete) == (lease.busy, lease.complete)
    assert await registry.commit(renewed) == []


async def test_publish(registry: Registry) -> None:
    [(_, v)] = await registry.commit(await registry.begin(["p"], owner="a"))
    assert await registry.publish([("p", v)]) == []  # idempotent
    assert await registry.publish([("p", v - 1)]) == ["p"]  # older: refused
    w = await registry.invalidate("w")  # a newer version, issued (for another block)
    assert await registry.publish([("q", v), ("p", w)]) == ["q", "p"]  # not theirs: refused
    assert await registry.lookup(["p"]) == [("p", v)]
    assert await registry.lookup(["q"]) == []
    inv = await registry.invalidate("r")
    assert await registry.publish([("r", inv)]) == ["r"]  # no data at an invalidation version
    with pytest.raises(UsageError):
        await registry.publish([("r", -1)])


async def test_watch_delivers(registry: Registry) -> None:
    async with registry.watch() as watcher:
        [(_, v1)] = await registry.commit(await registry.begin([b"k"], owner="a"))
        v2 = await registry.invalidate(b"k")
        got = [await asyncio.wait_for(anext(watcher), 5) for _ in range(2)]
    assert got == [(b"k", v1), (b"k", v2)]


async def test_publish_refuses_a_version_never_issued(registry: Registry) -> None:
    """Publish confirms versions the registry handed out: one above the last (a peer's
    made-up ``2**53 - 1``, a version from another registry) is a UsageError and changes
    nothing, so it can neither push the counter to 2**53 (the next commit's version refused
    by check) nor make Redis round two commits to one version."""
    async with registry.watch() as watcher:
        with pytest.raises(UsageError, match="above the last one it handed out"):
            await registry.publish([("x", 2**53 - 1)])  # nothing handed out yet
        [(_, v)] = await registry.commit(await registry.begin(["a"], owner="o"))
        for pairs in ([("x", 2**53 - 1)], [("x", v + 1)], [("a", v), ("x", v + 1)]):
            with pytest.raises(UsageError, match="above the last one it handed out"):
                await registry.publish(pairs)
        assert await registry.superseded([("x", v + 1), ("a", v)]) == ["x"]  # publish would refuse it
        versions = []
        for block in ("b", "c", "d"):
            versions += await registry.commit(await registry.begin([block], owner="o"))
        # nothing was published: the first notifications are the commits
        got = [await asyncio.wait_for(anext(watcher), 5) for _ in range(4)]
        assert got == [("a", v), *versions]
    assert await registry.lookup(["x"]) == []
    # the counter did not move: the versions are the next ones, distinct and valid
    assert [vv for _, vv in versions] == sorted({vv for _, vv in versions})
    assert v < versions[0][1] < 2**53
    assert await registry.check_many(versions) == []
    assert await registry.publish([versions[-1]]) == []  # the block's own version: confirmed
    assert await registry.publish([("x", versions[-1][1])]) == ["x"]  # issued, to another block


async def _set_counter(registry: Registry, last: int) -> None:
    """Make ``last`` the last version ``registry`` handed out (white box)."""
    if isinstance(registry, MemoryRegistry):
        registry.core._seq = last
    else:
        assert isinstance(registry, RedisRegistry)
        await registry.client.set(registry.layout.seq, last)


async def test_no_version_past_2_53_is_handed_out(registry: Registry) -> None:
    """A commit or invalidation that would need a version past 2**53 - 1 (inexact in Lua,
    refused by check) is a LimitExceededError and changes nothing; the last one still works."""
    await _set_counter(registry, 2**53 - 3)
    lease = await registry.begin(["a", "b", "c"], owner="o")
    with pytest.raises(kvwire.LimitExceededError, match="exhausted"):
        await registry.commit(lease)
    with pytest.raises(kvwire.LimitExceededError, match="exhausted"):
        await registry.invalidate_many(["x", "y", "z"])
    assert await registry.lookup(["a"]) == [] and await registry.check_many([("x", 0)]) == ["x"]
    assert (await registry.begin(["a"], owner="p")).busy == ("a",)  # still the lease's
    await registry.release(lease)
    assert await registry.invalidate_many(["x", "y"]) == [("x", 2**53 - 2), ("y", 2**53 - 1)]
    lease = await registry.begin(["a"], owner="o")
    with pytest.raises(kvwire.LimitExceededError):
        await registry.commit(lease)
    with pytest.raises(kvwire.LimitExceededError):
        await registry.invalidate("z")
    assert await registry.publish([("y", 2**53 - 1)]) == ["y"]  # invalidated: no data there
    assert await registry.check_many([("y", 2**53 - 1)]) == ["y"]


async def test_an_abandoned_watcher_is_released(registry: Registry) -> None:
    """A watcher left by ``break`` out of a bare ``async for`` (never closed) stops being
    served once collected: memory no longer buffers for it, Redis closes its subscription.
    One still referenced keeps receiving."""

    async def first_change() -> object:
        async for item in registry.watch():
            return item  # leaves the loop: the watcher is abandoned, not closed
        return None

    async with registry.watch() as kept:
        for _ in range(3):
            task = asyncio.create_task(first_change())
            while not task.done():  # a bare async for subscribes on its first iteration
                await registry.invalidate("x")
                await asyncio.sleep(0.05)
            assert (await task)[0] == "x"  # type: ignore[index]
        gc.collect()
        for _ in range(100):
            if len(registry._watchers) == 1:  # type: ignore[attr-defined]
                break
            await asyncio.sleep(0.05)
        assert list(registry._watchers) == [kept]  # type: ignore[attr-defined]
        if isinstance(registry, RedisRegistry):
            for _ in range(100):
                [(_, subscribers)] = await registry.client.pubsub_numsub(registry.layout.channel)
                if subscribers == 1:
                    break
                await asyncio.sleep(0.05)
            assert subscribers == 1  # only kept's
        v = await registry.invalidate("y")
        while (item := await asyncio.wait_for(anext(kept), 5)) != ("y", v):
            assert item[0] == "x"


async def test_watch_ends_on_close(registry: Registry) -> None:
    watcher = registry.watch()
    await watcher.__aenter__()

    async def drain() -> list[object]:
        return [item async for item in watcher]

    task = asyncio.create_task(drain())
    await asyncio.sleep(0.05)
    await registry.invalidate(1)
    await asyncio.sleep(0.05)
    await registry.close()
    assert len(await asyncio.wait_for(task, 5)) == 1
    with pytest.raises(UsageError):
        await registry.lookup([1])


async def test_context_manager(registry: Registry) -> None:
    async with registry as reg:
        assert await reg.lookup([]) == []
    with pytest.raises(UsageError):
        await registry.invalidate(1)


async def test_a_memory_watcher_behind_learns_of_an_overflow_at_its_next_read() -> None:
    """A change dropped because the buffer was full is reported at the next read, not once
    the buffer drains: a reader that stays one item behind (the writer always a step ahead)
    never emptied it, so it kept reading later changes without learning of the gap."""
    from kvwire.consistency import NotificationsLostError

    reg = MemoryRegistry(watch_buffer=2)
    async with reg, reg.watch() as watcher:
        await reg.invalidate_many(["a", "b"])
        await reg.invalidate("dropped")  # the buffer is full: this one is lost
        with pytest.raises(NotificationsLostError):
            await anext(watcher)
        v = await reg.invalidate("after")  # the reader re-read the state; later changes come
        assert await anext(watcher) == ("after", v)
        await reg.invalidate("n0")
        for i in range(5):  # one item behind within the buffer: nothing lost, no error
            await reg.invalidate(f"n{i + 1}")
            assert (await anext(watcher))[0] == f"n{i}"


async def test_a_watcher_made_before_close_and_first_read_after_it_is_refused(registry: Registry) -> None:
    """A watcher obtained before close() and first used after it is refused as watch() on
    the closed registry is (UsageError): it waited forever (memory), or subscribed on the
    closed registry's client and went on delivering (Redis)."""
    watcher = registry.watch()
    entered = registry.watch()
    await registry.close()
    with pytest.raises(UsageError, match="closed"):
        await asyncio.wait_for(anext(watcher), 5)
    with pytest.raises(UsageError, match="closed"):
        await asyncio.wait_for(entered.__aenter__(), 5)
    with pytest.raises(UsageError):
        registry.watch()
    await watcher.aclose()
    await entered.aclose()
    with pytest.raises(StopAsyncIteration):  # closed by its owner: ended, as ever
        await asyncio.wait_for(anext(watcher), 5)


async def test_a_narrowed_lease_commits_its_blocks_and_frees_the_others(registry: Registry) -> None:
    """A lease narrowed before committing (dataclasses.replace with fewer blocks) commits
    the blocks it names; the blocks it left out are freed (memory: at once; Redis: once
    the lease's ttl passes), not kept busy for ever as memory did."""
    lease = await registry.begin([b"b1", b"b2"], owner="a", ttl=0.3)
    [(block, version)] = await registry.commit(dataclasses.replace(lease, started=lease.started[:1]))
    assert block == b"b1"
    assert await registry.lookup([b"b1"]) == [(b"b1", version)]
    for _ in range(200):  # bounded: until the left-out block is free
        again = await registry.begin([b"b2"], owner="b", ttl=30)
        if again.started:
            break
        await asyncio.sleep(0.05)
    assert again.started == (b"b2",)
    assert [b for b, _ in await registry.commit(again)] == [b"b2"]


async def test_a_lease_narrowed_to_no_blocks_ends_when_committed(registry: Registry, backend: str) -> None:
    """Committed narrowed to no blocks, a lease commits nothing and ends, as any narrowed
    lease does: its blocks are freed (memory: at once; Redis: once its ttl passes).  Both
    returned [] before looking at the lease, which stayed live with its blocks busy."""
    lease = await registry.begin([b"c1", b"c2"], owner="a", ttl=1.0)
    assert await registry.commit(dataclasses.replace(lease, started=())) == []
    with pytest.raises(LeaseExpiredError):
        await registry.renew(lease)
    with pytest.raises(LeaseExpiredError):
        await registry.commit(lease)
    if backend == "memory":
        assert (await registry.begin([b"c1", b"c2"], owner="b", ttl=30)).started == (b"c1", b"c2")
        return
    for _ in range(200):  # bounded: until the lease's ttl has passed
        again = await registry.begin([b"c1", b"c2"], owner="b", ttl=30)
        if again.started:
            break
        await asyncio.sleep(0.05)
    assert again.started == (b"c1", b"c2")


async def test_a_commit_naming_a_block_the_lease_never_started_is_refused(registry: Registry) -> None:
    """A lease naming a block it never started is refused (StaleVersionError), committing
    nothing and freeing what the lease held; memory raised a raw KeyError."""
    lease = await registry.begin([b"b1"], owner="a", ttl=30)
    forged = dataclasses.replace(lease, started=(*lease.started, b"never-begun"))
    with pytest.raises(StaleVersionError, match="never-begun"):
        await registry.commit(forged)
    assert await registry.lookup([b"b1"]) == []
    assert (await registry.begin([b"b1"], owner="b", ttl=30)).started == (b"b1",)
    with pytest.raises(LeaseExpiredError):
        await registry.commit(lease)


@pytest.mark.parametrize(
    "call",
    [
        "begin_ttl_none",
        "begin_ttl_str",
        "begin_ttl_list",
        "begin_ttl_bool",
        "begin_none",
        "begin_int",
        "lookup_int",
        "invalidate_many_none",
        "commit_str",
        "renew_str",
        "release_none",
        "renew_ttl_str",
    ],
)
async def test_bad_arguments_are_usage_errors(registry: Registry, call: str) -> None:
    """Wrong types raise UsageError on both backends, not a raw TypeError, ValueError or
    AttributeError."""
    from typing import Any

    lease = await registry.begin([b"L"], owner="o", ttl=30)
    bad: Any = {
        "begin_ttl_none": lambda: registry.begin([b"a"], owner="o", ttl=None),
        "begin_ttl_str": lambda: registry.begin([b"a"], owner="o", ttl="soon"),
        "begin_ttl_list": lambda: registry.begin([b"a"], owner="o", ttl=[1]),
        "begin_ttl_bool": lambda: registry.begin([b"a"], owner="o", ttl=True),
        "begin_none": lambda: registry.begin(None, owner="o"),
        "begin_int": lambda: registry.begin(5, owner="o"),
        "lookup_int": lambda: registry.lookup(5),
        "invalidate_many_none": lambda: registry.invalidate_many(None),
        "commit_str": lambda: registry.commit("not a lease"),
        "renew_str": lambda: registry.renew("not a lease"),
        "release_none": lambda: registry.release(None),
        "renew_ttl_str": lambda: registry.renew(lease, ttl="x"),
    }[call]
    with pytest.raises(UsageError):
        await bad()
    assert (await registry.begin([b"a"], owner="o", ttl=30)).started == (b"a",)  # nothing held
    await registry.commit(lease)  # the lease is untouched
