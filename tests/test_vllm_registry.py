"""Prefix-block naming and versions for engine connectors (kvwire.integrations.prefix),
without an engine: block ids from token ids, naming through a real Redis registry, the
receiver's check, and a paged transfer refused once a named block went stale."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.consistency import BlockId
from kvwire.errors import RegistryUnavailableError, StaleVersionError, UsageError
from kvwire.integrations.prefix import SyncRegistry, prefix_block_ids
from kvwire.paged import PagedDestination, PagedSpec, gather_layer
from kvwire.sync import Bridge, SyncPeer, SyncServer
from tests.conftest import SECRET
from tests.consistency.conftest import RedisServer, start_redis

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def link(redis_url: str) -> Iterator[SyncRegistry]:
    bridge = Bridge("test-registry")
    reg = SyncRegistry.connect(redis_url, bridge, namespace=f"t-{uuid.uuid4().hex}")
    try:
        yield reg
    finally:
        reg.close()
        bridge.close()


# -- block ids ---------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**31), min_size=0, max_size=40),
    block_size=st.integers(1, 8),
    salt=st.binary(max_size=8),
)
def test_block_ids_name_the_prefix_up_to_each_block(tokens: list[int], block_size: int, salt: bytes) -> None:
    n = len(tokens) // block_size
    ids = prefix_block_ids(tokens, block_size, n, salt=salt)
    assert len(ids) == n and len(set(ids)) == n
    assert all(isinstance(i, bytes) and len(i) == 32 for i in ids)
    # a prompt that shares the first k blocks shares exactly their ids
    for k in range(n + 1):
        assert prefix_block_ids(tokens[:k * block_size] + [7] * block_size, block_size, k, salt=salt) == ids[:k]
    if n:
        changed = list(tokens)
        changed[0] += 1  # a token of block 0 changes every id after it
        assert set(prefix_block_ids(changed, block_size, n, salt=salt)).isdisjoint(ids)
        assert prefix_block_ids(tokens, block_size, n, salt=salt + b"x") != ids  # another model
    if n >= 2:
        changed = list(tokens)
        changed[block_size] += 1  # block 1 changes: block 0 keeps its id
        again = prefix_block_ids(changed, block_size, n, salt=salt)
        assert again[0] == ids[0] and again[1] != ids[1]


def test_block_ids_depend_on_block_size_and_refuse_bad_arguments() -> None:
    tokens = list(range(16))
    assert prefix_block_ids(tokens, 4, 2)[0] != prefix_block_ids(tokens, 8, 1)[0]
    with pytest.raises(UsageError):
        prefix_block_ids(tokens, 4, 5)
    with pytest.raises(UsageError):
        prefix_block_ids(tokens, 0, 1)


def _reference_ids(tokens: list[int], block_size: int, num_blocks: int, salt: bytes = b"") -> list[bytes]:
    """The ids as first defined: each token a little-endian int64, blocks chained."""
    h = hashlib.sha256(b"kvwire-prefix-v1" + block_size.to_bytes(8, "little") + hashlib.sha256(salt).digest()).digest()
    ids = []
    for i in range(num_blocks):
        block = tokens[i * block_size:(i + 1) * block_size]
        h = hashlib.sha256(h + b"".join(t.to_bytes(8, "little", signed=True) for t in block)).digest()
        ids.append(h)
    return ids


@pytest.mark.parametrize("dtype", ["int64", "int32", "int16", "uint32", "uint64", "object"])
def test_block_ids_of_arrays_and_lists_are_the_ids_of_their_token_values(dtype: str) -> None:
    tokens = [0, 5, 127, 32000, 7, 9, 2**15 - 1, 1, 3, 4, 100, 11, 12, 13, 14, 15]
    expected = _reference_ids(tokens, 4, 4, b"m")
    assert prefix_block_ids(tokens, 4, 4, salt=b"m") == expected
    assert prefix_block_ids(tuple(tokens), 4, 4, salt=b"m") == expected
    array = np.array(tokens, dtype=dtype)
    assert prefix_block_ids(array, 4, 4, salt=b"m") == expected
    assert prefix_block_ids(list(array), 4, 4, salt=b"m") == expected  # numpy scalars
    assert prefix_block_ids(tokens, np.int64(4), np.int32(4), salt=b"m") == expected
    wide = [-(2**63), 2**63 - 1, -1, 0]
    assert prefix_block_ids(wide, 2, 2) == _reference_ids(wide, 2, 2)
    assert prefix_block_ids(np.array(wide), 2, 2) == _reference_ids(wide, 2, 2)
    assert prefix_block_ids([1, 2, "x"], 2, 1) == _reference_ids([1, 2], 2, 1)  # type: ignore[list-item]  # only read: the blocks named


@pytest.mark.parametrize(
    "tokens, block_size, num_blocks, salt",
    [
        ([1] * 8, 4, 2, "llama"),  # salt as str: TypeError from hashlib
        ([1] * 8, 4.0, 2, b""),  # AttributeError: float has no to_bytes
        ([1] * 8, None, 2, b""),  # TypeError: '<=' between NoneType and int
        ([1] * 8, True, 2, b""),  # a bool is not a block size
        ([1] * 8, 4, 2.0, b""),
        ([1] * 8, 2**64, 0, b""),  # OverflowError from to_bytes
        ([2**64] * 8, 4, 2, b""),  # OverflowError: int too big to convert
        ([2**63] * 8, 4, 2, b""),
        (np.array([2**63] * 8, dtype=np.uint64), 4, 2, b""),
        ([-(2**63) - 1] * 8, 4, 2, b""),
        ([1.5] * 8, 4, 2, b""),  # truncated to the ids of token 1
        (np.array([1.0] * 8), 4, 2, b""),
        ([1, 2, 3, None], 2, 2, b""),
        ([1, 2, 3, "4"], 2, 2, b""),
        ([True, False], 1, 2, b""),
        ([True, 5], 1, 2, b""),  # numpy read it as [1, 5]
        ([np.True_, 5], 1, 2, b""),
        ([[1, 2], [3, 4]], 1, 2, b""),
        (np.ones((2, 4), dtype=np.int64), 4, 2, b""),
        ("abcd", 2, 2, b""),
        (b"\x01\x02", 1, 2, b""),
        ({0: 1, 1: 2}, 1, 2, b""),
        (iter([1, 2]), 1, 2, b""),
    ],
)
def test_block_ids_refuse_what_is_not_a_token_id_or_a_count(tokens: Any, block_size: Any, num_blocks: Any, salt: Any) -> None:
    with pytest.raises(UsageError):
        prefix_block_ids(tokens, block_size, num_blocks, salt=salt)


# -- naming and checking through Redis ---------------------------------------------------------


def test_sender_names_blocks_and_receiver_refuses_them_once_stale(link: SyncRegistry) -> None:
    ids = prefix_block_ids(list(range(40)), 8, 5)
    named = link.name(ids, owner="prefill")
    assert [b for b, _ in named] == ids
    versions = [v for _, v in named]
    assert all(v > 0 for v in versions) and len(set(versions)) == len(versions)
    # complete blocks keep their version when named again (another prefill of the same prompt)
    assert link.name(ids, owner="prefill-2") == named
    assert link.verify(ids, named) is None
    # a cache of another prompt, or of fewer blocks, is not this prompt's cache
    assert link.verify(prefix_block_ids(list(range(1, 41)), 8, 5), named) is not None
    assert link.verify(ids, named[:4]) is not None
    assert link.verify(ids, []) is not None
    # a version the registry never issued is stale
    assert link.verify(ids, [*named[:4], (ids[4], versions[4] + 1000)]) is not None
    # invalidate one block after the send: the cache is refused
    new = link.bridge.run(link.registry.invalidate(ids[2]))
    assert new > max(versions)
    reason = link.verify(ids, named)
    assert reason is not None and "stale" in reason
    # naming again recomputes that block at a newer version; the rest keep theirs
    renamed = link.name(ids, owner="prefill")
    assert [v for _, v in renamed][:2] == versions[:2] and renamed[2][1] > new
    assert link.verify(ids, renamed) is None


def test_naming_stops_at_a_block_another_prefill_is_computing(link: SyncRegistry) -> None:
    ids = prefix_block_ids(list(range(24)), 8, 3)
    other = link.bridge.run(link.registry.begin([ids[1]], owner="other", ttl=60.0))
    assert other.started == (ids[1],)
    named = link.name(ids, owner="prefill")
    assert [b for b, _ in named] == ids[:1]
    assert link.verify(ids, named) is not None  # a partly named cache is not used


def test_naming_on_a_stalled_redis_fails_as_the_registry_unavailable(redis_binary: str, tmp_path: Path) -> None:
    """A Redis that stops answering: each name() raised the bridge's TransferTimeoutError
    ('not done in 2.0 s', at twice the registry's timeout) before the registry's own
    timeouts (a begin: its BEGIN, then the release of its lease) could fire."""
    server: RedisServer = start_redis(redis_binary, tmp_path)
    bridge = Bridge("test-stall")
    try:
        link = SyncRegistry.connect(server.url, bridge, namespace=f"t-{uuid.uuid4().hex}", timeout=0.5)
        try:
            assert [b for b, _ in link.name([b"a"], owner="o")] == [b"a"]
            os.kill(server.process.pid, signal.SIGSTOP)
            try:
                for i in range(3):  # later ones wait for the releases of earlier ones too
                    with pytest.raises(RegistryUnavailableError, match="no reply within"):
                        link.name([b"b%d" % i], owner="o")
            finally:
                os.kill(server.process.pid, signal.SIGCONT)
        finally:
            link.close()
    finally:
        bridge.close()
        server.stop()


def test_a_name_through_every_step_of_a_stalled_registry_fails_as_unavailable(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A begin answered late, a commit and the release after it not at all: nearly three
    of the registry's timeouts, past the bound of two the bridge used to give (its
    TransferTimeoutError came first)."""
    bridge = Bridge("test-stall-steps")
    try:
        link = SyncRegistry.connect(redis_url, bridge, namespace=f"t-{uuid.uuid4().hex}", timeout=0.5)
        registry: Any = link.registry
        real_begin = registry._begin

        async def late(**kwargs: Any) -> Any:
            await asyncio.sleep(0.4)
            return await real_begin(**kwargs)

        async def silent(**kwargs: Any) -> Any:
            await asyncio.Event().wait()

        monkeypatch.setattr(registry, "_begin", late)
        monkeypatch.setattr(registry, "_commit", silent)
        monkeypatch.setattr(registry, "_release", silent)
        try:
            with pytest.raises(RegistryUnavailableError, match="commit: no reply within"):
                link.name([b"c"], owner="o")
        finally:
            monkeypatch.undo()
            link.close()
    finally:
        bridge.close()


def test_a_sync_registry_past_its_own_bound_fails_as_unavailable(link: SyncRegistry) -> None:
    """A registry of the caller's that hangs: the bridge's bound fires, as a
    RegistryUnavailableError, and the call is cancelled."""

    class Hanging:
        async def check_many(self, pairs: Any) -> list[Any]:
            await asyncio.Event().wait()
            return []

    hanging = SyncRegistry(Hanging(), link.bridge, timeout=0.2)  # type: ignore[arg-type]
    with pytest.raises(RegistryUnavailableError, match=r"not done within 0\.2 s"):
        hanging.verify([b"a"], [(b"a", 1)])


@pytest.mark.parametrize(("max_connections", "size"), [(None, 100), (7, 7), (1, 1)])
def test_connect_sizes_the_registrys_pool(redis_url: str, max_connections: int | None, size: int) -> None:
    """max_connections reaches the Redis registry's pool (a max_connections in the URL
    gives way to it; None: the registry's default)."""
    bridge = Bridge("test-registry-pool")
    try:
        reg = SyncRegistry.connect(redis_url + "?max_connections=50", bridge,
                                   namespace=f"t-{uuid.uuid4().hex}", max_connections=max_connections)
        try:
            pool: Any = reg.registry.client.connection_pool  # (white box) the calls' pool
            assert pool.max_connections == size
            assert len(reg.name([b"c" * 32], owner="test")) == 1
        finally:
            reg.close()
    finally:
        bridge.close()


@pytest.mark.parametrize("max_connections", [0, -1, True, 2.5])
def test_connect_refuses_a_pool_size_not_an_int_from_1(redis_url: str, max_connections: Any) -> None:
    bridge = Bridge("test-registry-pool")
    try:
        with pytest.raises(UsageError, match="max_connections"):
            SyncRegistry.connect(redis_url, bridge, max_connections=max_connections)
    finally:
        bridge.close()


# -- on the wire: the receiving server checks the named versions ---------------------------------


SPEC = PagedSpec(num_layers=2, block_shape=(2, 8, 16), dtype="float16")


def _send(link: SyncRegistry, server: SyncServer, request_id: str, blocks: list[tuple[BlockId, int]],
          src: list[np.ndarray], dst: list[np.ndarray]) -> tuple[object, object]:
    with SyncPeer("127.0.0.1", server.port, secret=SECRET, bridge=link.bridge) as peer:
        h = server.expect(request_id, into=PagedDestination(SPEC, dst, [3, 0]), num_layers=2)
        s = peer.begin(request_id, SPEC.wire_spec(), blocks=blocks)
        for layer in range(2):
            s.send_layer(*gather_layer(SPEC, src[layer], [1, 2]))
        try:
            receipt: object = s.wait(30)
        except StaleVersionError as exc:
            receipt = exc
        try:
            h.wait(5)
            received: object = h.transfer.blocks
        except Exception as exc:
            received = exc
            h.abort("test over")
    return receipt, received


def test_server_with_registry_takes_fresh_blocks_and_refuses_stale_ones(link: SyncRegistry) -> None:
    rng = np.random.default_rng(0)
    src = [rng.standard_normal((4, 2, 8, 16)).astype(np.float16) for _ in range(2)]
    dst = [np.zeros((4, 2, 8, 16), np.float16) for _ in range(2)]
    ids = prefix_block_ids(list(range(16)), 8, 2)
    named = link.name(ids, owner="prefill")
    with SyncServer(secret=SECRET, bridge=link.bridge, registry=link.registry) as server:
        receipt, received = _send(link, server, "fresh", named, src, dst)
        assert not isinstance(receipt, Exception)
        assert received == named and link.verify(ids, received) is None  # what the consumer checks
        assert dst[0][[3, 0]].tobytes() == src[0][[1, 2]].tobytes()
        # bumped before the send: refused at BEGIN, no data lands
        link.bridge.run(link.registry.invalidate(ids[1]))
        dst2 = [np.zeros_like(d) for d in dst]
        receipt, received = _send(link, server, "stale", named, src, dst2)
        assert isinstance(receipt, StaleVersionError)
        assert isinstance(received, Exception)
        assert not any(d.any() for d in dst2)
