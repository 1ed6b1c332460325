"""The sans-IO core driven with exact clock values, and the layering rule."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvwire.consistency import (
    LeaseExpiredError,
    RegistryCore,
    block_from_key,
    block_key,
    canonical,
)
from kvwire.errors import StaleVersionError, UsageError

ROOT = Path(__file__).resolve().parents[2]


def test_block_keys_are_type_tagged_and_reversible() -> None:
    assert block_key(1) == "i:1"
    assert block_key(-5) == "i:-5"
    assert block_key(b"\x01\xff") == "b:01ff"
    assert block_key(bytearray(b"\x01")) == block_key(memoryview(b"\x01")) == "b:01"
    assert block_key("1") == "s:1"
    assert len({block_key(1), block_key(b"1"), block_key("1")}) == 3
    for block in (0, 2**80, b"", b"abc", "", "é x:y"):
        assert block_from_key(block_key(block)) == block
    assert canonical(bytearray(b"z")) == b"z"
    for bad in (True, 1.0, None, "\udc80", "x" * 5000):
        with pytest.raises(UsageError):
            block_key(bad)
    with pytest.raises(UsageError):
        block_from_key("q:1")


@pytest.mark.parametrize("key", ["i:01", "i:+1", "i:-0", "i:1_0", "i: 1", "i:1 ", "i:\u0661", "i:", "i:-",
                                 "b:AB", "b:0", "b:a b", "b: 01", "x:1", "i1", ""])
def test_only_the_canonical_key_names_a_block(key: str) -> None:
    """Python's int() and bytes.fromhex() read these too: one block had several keys
    (protocol.md 7.3: a key not of the canonical form is PROTOCOL_ERROR)."""
    with pytest.raises(UsageError, match="canonical"):
        block_from_key(key)


@given(st.text(max_size=12) | st.from_regex(r"\A[ib]:[-+ 0-9a-fA-F_]{0,6}\Z"))
def test_a_key_read_back_is_the_key_of_its_block(key: str) -> None:
    try:
        block = block_from_key(key)
    except UsageError:
        return
    assert block_key(block) == key


def test_an_int_block_id_too_long_is_a_usage_error() -> None:
    """An int whose decimal key would pass 4096 characters is refused like any over-long
    id, however large (Python refuses to format past 4300 digits with a ValueError)."""
    assert block_key(10**4093) == "i:1" + "0" * 4093  # 4096 key characters: the longest
    for bad in (10**4094, -(10**4093), 2**13653, 10**5000, -(10**5000), 2**100_000):
        with pytest.raises(UsageError, match="too long"):
            block_key(bad)
    old = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(640)  # an application's lower limit
    try:
        assert block_key(10**600) == "i:1" + "0" * 600
        with pytest.raises(UsageError, match="too long"):
            block_key(10**700)
    finally:
        sys.set_int_max_str_digits(old)


def test_expiry_is_exact() -> None:
    core = RegistryCore()
    lease = core.begin([1, 2], owner="a", ttl=10.0, now=100.0)
    assert core.begin([1], owner="b", ttl=1.0, now=109.999).busy == (1,)
    assert core.next_expiry() == 110.0
    # expiry is inclusive: at now == expires_at the lease is dead
    other = core.begin([1], owner="b", ttl=5.0, now=110.0)
    assert other.started == (1,)
    with pytest.raises(LeaseExpiredError):
        core.commit(lease, now=110.0)
    assert [b for b, _ in core.commit(other, now=114.0)] == [1]
    assert core.live_leases(114.0) == {}


def test_renew_moves_expiry() -> None:
    core = RegistryCore()
    lease = core.begin([1], owner="a", ttl=1.0, now=0.0)
    lease = core.renew(lease, ttl=5.0, now=0.5)
    assert lease.expires_at == 5.5
    assert core.begin([1], owner="b", ttl=1.0, now=3.0).busy == (1,)
    assert core.commit(lease, now=5.4)[0][0] == 1
    with pytest.raises(LeaseExpiredError):
        core.renew(lease, ttl=1.0, now=5.5)


def test_the_expiry_heap_stays_bounded_by_the_live_leases() -> None:
    """Renewing a lease, or committing leases long before their ttl, leaves outdated expiry
    entries behind; they must not pile up with the number of calls."""
    core = RegistryCore()
    kept = core.begin([0], owner="a", ttl=10.0, now=0.0)
    now = 0.0
    for i in range(1, 20_001):
        now = i * 1e-3
        kept = core.renew(kept, ttl=10.0, now=now)  # one more entry each time
        core.commit(core.begin([i], owner="b", ttl=3600.0, now=now), now=now)  # and another
        assert len(core._expiries) <= 2 * len(core.live_leases(now)) + 64 + 1
    # expiry is still exact after the rebuilds
    assert core.next_expiry() == kept.expires_at == now + 10.0
    assert core.begin([0], owner="c", ttl=1.0, now=kept.expires_at - 1e-6).busy == (0,)
    assert core.expire(kept.expires_at) == [kept.lease_id]
    assert core.next_expiry() is None


def test_versions_unique_and_growing() -> None:
    core = RegistryCore()
    seen: list[int] = []
    for i in range(20):
        lease = core.begin([i % 3, 10 + i], owner="a", ttl=1.0, now=float(i))
        seen += [v for _, v in core.commit(lease, now=float(i))]
        seen.append(core.invalidate(i % 3))
    assert seen == sorted(seen) and len(set(seen)) == len(seen)
    assert core.take_events() and not core.take_events()


def test_stale_reasons() -> None:
    core = RegistryCore()
    with pytest.raises(StaleVersionError, match="unknown"):
        core.check(1, 1)
    [(_, v)] = core.commit(core.begin([1], owner="a", ttl=1.0, now=0.0), now=0.0)
    core.check(1, v)
    with pytest.raises(StaleVersionError, match="never issued"):
        core.check(1, v + 1)
    w = core.invalidate(1)
    with pytest.raises(StaleVersionError, match="older"):
        core.check(1, v)
    with pytest.raises(StaleVersionError, match="invalidated"):
        core.check(1, w)
    with pytest.raises(UsageError):
        core.check(1, 2**53)


FORBIDDEN = {"asyncio", "socket", "ssl", "selectors", "time", "threading", "uvloop"}


def test_core_has_no_io_imports() -> None:
    for path in sorted((ROOT / "kvwire" / "consistency").glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in FORBIDDEN, f"{path.name} imports {name}"
                assert not name.startswith("kvwire.aio"), f"{path.name} imports {name}"


def test_backends_reexported_lazily() -> None:
    import kvwire.consistency as consistency

    assert (
        consistency.MemoryRegistry
        is importlib.import_module("kvwire.aio.registry_memory").MemoryRegistry
    )
    assert consistency.RedisRegistry.__module__ == "kvwire.aio.registry_redis"
    with pytest.raises(AttributeError):
        _ = consistency.NoSuchThing
    assert "kvwire.consistency" in sys.modules


def test_a_narrowed_commit_frees_the_blocks_it_left_out_at_once() -> None:
    """Committing a lease narrowed with dataclasses.replace completes the blocks it names and
    frees the lease's others at once: they were left busy for ever (the lease record was
    deleted, the blocks still named it)."""
    core = RegistryCore()
    lease = core.begin([1, 2, 3], owner="a", ttl=10.0, now=0.0)
    assert [b for b, _ in core.commit(dataclasses.replace(lease, started=(1,)), now=1.0)] == [1]
    assert core.state(2).lease_id is None and core.state(3).lease_id is None
    assert core.live_leases(1.0) == {}
    assert core.begin([2, 3], owner="b", ttl=10.0, now=1.0).started == (2, 3)


def test_a_commit_naming_a_block_never_begun_is_stale_not_a_key_error() -> None:
    core = RegistryCore()
    lease = core.begin([1, 2], owner="a", ttl=10.0, now=0.0)
    with pytest.raises(StaleVersionError, match="'x'"):
        core.commit(dataclasses.replace(lease, started=(1, "x")), now=1.0)
    # nothing committed, every block the lease held freed
    assert core.lookup([1]) == []
    assert core.begin([1, 2], owner="b", ttl=10.0, now=1.0).started == (1, 2)


@pytest.mark.parametrize("ttl", [None, "5", [1], True, float("nan"), float("inf"), 0, -1.0])
def test_a_bad_ttl_is_a_usage_error(ttl: object) -> None:
    core = RegistryCore()
    with pytest.raises(UsageError):
        core.begin([1], owner="a", ttl=ttl, now=0.0)  # type: ignore[arg-type]
    assert core.begin([1], owner="a", ttl=1, now=0.0).started == (1,)  # an int is seconds


@pytest.mark.parametrize("blocks", [None, 5, 1.5, object()])
def test_blocks_that_are_not_a_list_are_a_usage_error(blocks: object) -> None:
    core = RegistryCore()
    with pytest.raises(UsageError, match="list of block ids"):
        core.begin(blocks, owner="a", ttl=1.0, now=0.0)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="list of block ids"):
        core.lookup(blocks)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="list of block ids"):
        core.invalidate_many(blocks)  # type: ignore[arg-type]
