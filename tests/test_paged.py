"""Paged KV caches: gather by block id, scatter into named blocks, over real loopback sockets."""

from __future__ import annotations

import asyncio
import gc
import itertools
import sys
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvwire
from kvwire._extensions import extensions_disabled
from kvwire.aio import _stream
from kvwire.aio._arrays import as_device_array
from kvwire.codec import Fp8Codec, Int4Codec, Int8Codec, TensorKind, _host, get_codec, numpy_dtype
from kvwire.errors import ErrorCode, IncompatiblePeerError, KvwireError, UsageError
from kvwire.paged import (
    DROP,
    BlockRows,
    PagedDestination,
    PagedSource,
    PagedSpec,
    gather_layer,
    layer_rows,
)
from tests.conftest import SECRET, require_extension

pytestmark = pytest.mark.timeout(60)


def caches(spec: PagedSpec, num_blocks: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    dt = numpy_dtype(spec.dtype)
    return [
        rng.standard_normal((num_blocks, *spec.block_shape), dtype=np.float32).astype(dt)
        for _ in range(spec.num_layers)
    ]


def scatter(dest: PagedDestination, layers: list[tuple[Any, Any]], cuts: list[int]) -> None:
    """Feed ``layers`` to ``dest`` the way the server does: per chunk a direct view, else write."""
    tokens = dest.layer_tokens
    bounds = sorted({0, tokens, *(c % tokens for c in cuts)})
    for li, (k, v) in enumerate(layers):
        for kind, part in enumerate((k, v)):
            for start, end in itertools.pairwise(bounds):
                view = dest.view(li, kind, start, end - start, tokens)
                if view is not None:
                    view[...] = part[start:end]
                else:
                    dest.write(li, kind, start, part[start:end], tokens)


block_shapes = st.lists(st.integers(1, 6), min_size=1, max_size=4).map(tuple).filter(
    lambda s: int(np.prod(s)) % 2 == 0
)


@settings(max_examples=60, deadline=None)
@given(
    shape=block_shapes,
    dtype=st.sampled_from(["float16", "bfloat16", "float32"]),
    num_layers=st.integers(1, 3),
    data=st.data(),
)
def test_gather_then_scatter_copies_blocks_exactly(shape: tuple[int, ...], dtype: str, num_layers: int, data: st.DataObject) -> None:
    spec = PagedSpec(num_layers=num_layers, block_shape=shape, dtype=dtype)
    src_blocks = data.draw(st.integers(1, 12))
    dst_blocks = data.draw(st.integers(1, 12))
    n = data.draw(st.integers(1, dst_blocks))
    src_ids = data.draw(st.lists(st.integers(0, src_blocks - 1), min_size=n, max_size=n))
    dst_ids = data.draw(st.permutations(range(dst_blocks)))[:n]
    cuts = data.draw(st.lists(st.integers(0, 10_000), max_size=6))
    src = caches(spec, src_blocks, seed=1)
    dst = caches(spec, dst_blocks, seed=2)
    before = [c.copy() for c in dst]
    layers = list(PagedSource(spec, src, src_ids))
    scatter(PagedDestination(spec, dst, dst_ids), layers, cuts)
    for li in range(num_layers):
        for s, d in zip(src_ids, dst_ids, strict=True):
            assert dst[li][d].tobytes() == src[li][s].tobytes()
        untouched = sorted(set(range(dst_blocks)) - set(dst_ids))
        assert dst[li][untouched].tobytes() == before[li][untouched].tobytes()


def test_wire_spec_fingerprint_covers_block_geometry() -> None:
    a = PagedSpec(num_layers=2, block_shape=(4, 16, 64), dtype="float16")
    same_elems = PagedSpec(num_layers=2, block_shape=(8, 8, 64), dtype="float16")
    assert a.wire_spec().fingerprint != same_elems.wire_spec().fingerprint
    assert a.wire_spec().fingerprint == PagedSpec(num_layers=2, block_shape=(4, 16, 64)).wire_spec().fingerprint
    assert a.rows_per_block * a.row_elems * 2 == a.block_elems
    with pytest.raises(IncompatiblePeerError) as err:
        PagedDestination(a, caches(a, 4, 0), [0, 1]).check(same_elems.wire_spec(), 2 * a.rows_per_block)
    assert err.value.code == ErrorCode.INCOMPATIBLE_SPEC


def test_block_id_errors_are_clear() -> None:
    spec = PagedSpec(num_layers=1, block_shape=(2, 8), dtype="float32")
    cache = caches(spec, 4, 0)
    with pytest.raises(UsageError, match="block id 4 is out of range for a cache of 4 blocks"):
        gather_layer(spec, cache[0], [0, 4])
    with pytest.raises(UsageError, match="block id -1 is out of range"):
        PagedSource(spec, cache, [-1])
    with pytest.raises(UsageError, match="block id 2 is named twice"):
        PagedDestination(spec, cache, [2, 1, 2])
    with pytest.raises(UsageError, match="blocks shaped"):
        PagedDestination(PagedSpec(num_layers=1, block_shape=(4, 4), dtype="float32"), cache, [0])
    with pytest.raises(UsageError, match="dtype"):
        PagedDestination(PagedSpec(num_layers=1, block_shape=(2, 8), dtype="float16"), cache, [0])
    with pytest.raises(UsageError, match="1 caches given"):
        PagedSource(PagedSpec(num_layers=2, block_shape=(2, 8), dtype="float32"), cache, [0])
    with pytest.raises(UsageError, match="even number"):
        PagedSpec(num_layers=1, block_shape=(3, 3))
    dest = PagedDestination(spec, cache, [0, 1])
    with pytest.raises(IncompatiblePeerError, match="3 blocks per layer, the destination names 2"):
        dest.check(spec.wire_spec(), spec.tokens(3))
    assert dest.view(0, 0, 0, 1, spec.tokens(3)) is None  # a mismatched header gets no memory


async def _send_paged(spec: PagedSpec, src: list[np.ndarray], src_ids: list[int], dst: list[np.ndarray], dst_ids: list[int], *, early: bool, codec: str = "raw", chunk_bytes: int = 4096) -> kvwire.Transfer:
    dest = PagedDestination(spec, dst, dst_ids)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, streams=2, codec=codec, chunk_bytes=chunk_bytes) as peer:
            if early:
                waiting = asyncio.create_task(server.expect("req", into=dest, timeout=10))
                await asyncio.sleep(0)
                await peer.send("req", spec.wire_spec(), PagedSource(spec, src, src_ids))
                transfer = await waiting
            else:
                await peer.send("req", spec.wire_spec(), PagedSource(spec, src, src_ids))
                transfer = await server.expect("req", into=dest, timeout=10)
            got = sorted([layer async for layer in transfer], key=lambda layer: layer.index)  # completion order
    assert [layer.index for layer in got] == list(range(spec.num_layers))
    assert all(layer.k is dst[layer.index] and list(layer.v) == dst_ids for layer in got)
    return transfer


@pytest.mark.parametrize("early", [True, False])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
async def test_paged_transfer_lands_in_the_named_blocks(early: bool, dtype: str) -> None:
    # Blocks of 2 x 4 x 32 elements; 4 KiB chunks cover whole blocks, parts of blocks and spans.
    spec = PagedSpec(num_layers=3, block_shape=(2, 4, 32), dtype=dtype, model="tiny")
    src = caches(spec, 20, seed=3)
    dst = caches(spec, 16, seed=4)
    src_ids, dst_ids = [7, 3, 19, 0, 12], [15, 2, 9, 4, 11]
    await _send_paged(spec, src, src_ids, dst, dst_ids, early=early, chunk_bytes=3000)
    for li in range(3):
        for s, d in zip(src_ids, dst_ids, strict=True):
            assert dst[li][d].tobytes() == src[li][s].tobytes()


async def test_paged_transfer_with_fp8_codec_is_close() -> None:
    spec = PagedSpec(num_layers=2, block_shape=(4, 64), dtype="float32")
    src = caches(spec, 6, seed=5)
    dst = [np.zeros_like(c) for c in caches(spec, 6, seed=6)]
    await _send_paged(spec, src, [1, 2, 3], dst, [5, 0, 4], early=True, codec="fp8")
    for li in range(2):
        for s, d in zip([1, 2, 3], [5, 0, 4], strict=True):
            np.testing.assert_allclose(dst[li][d], src[li][s], rtol=0.13, atol=0.05)


async def test_block_count_mismatch_fails_both_sides() -> None:
    spec = PagedSpec(num_layers=2, block_shape=(2, 16), dtype="float16")
    src = caches(spec, 8, seed=7)
    dst = caches(spec, 8, seed=8)
    before = [c.copy() for c in dst]
    dest = PagedDestination(spec, dst, [0, 1])
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            waiting = asyncio.create_task(server.expect("req", into=dest, timeout=10))
            await asyncio.sleep(0)
            with pytest.raises(IncompatiblePeerError) as sent:
                await peer.send("req", spec.wire_spec(), PagedSource(spec, src, [0, 1, 2]))
            assert sent.value.code == ErrorCode.INCOMPATIBLE_SPEC
            transfer = await waiting
            # The same class on both peers (errors.py): not a bare KvwireError here.
            with pytest.raises(IncompatiblePeerError, match="3 blocks per layer, the destination names 2") as got:
                async for _ in transfer:
                    pass
            assert got.value.code == ErrorCode.INCOMPATIBLE_SPEC
    assert all(a.tobytes() == b.tobytes() for a, b in zip(dst, before, strict=True))


async def test_geometry_mismatch_refused_when_the_destination_is_named() -> None:
    spec = PagedSpec(num_layers=1, block_shape=(4, 16), dtype="float16")
    other = PagedSpec(num_layers=1, block_shape=(2, 32), dtype="float16")
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            sending = asyncio.create_task(peer.send("req", other.wire_spec(), PagedSource(other, caches(other, 2, 0), [0])))
            transfer_err = None
            try:
                await server.expect("req", into=PagedDestination(spec, caches(spec, 2, 1), [1]), timeout=10)
            except KvwireError as exc:
                transfer_err = exc
            assert isinstance(transfer_err, IncompatiblePeerError)
            assert transfer_err.code == ErrorCode.INCOMPATIBLE_SPEC
            with pytest.raises(IncompatiblePeerError):
                await asyncio.wait_for(sending, 10)


class CountingDestination(PagedDestination):
    """Counts the chunks that had to be decoded elsewhere and scattered."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.scattered = 0
        self.scattered_layers: set[int] = set()

    def write(self, layer: int, kind: int, start: int, data: Any, layer_tokens: int) -> None:
        view = self.view(layer, kind, start, int(data.shape[0]), layer_tokens)
        if view is None or not np.shares_memory(view, data):
            self.scattered += 1
            self.scattered_layers.add(layer)
        super().write(layer, kind, start, data, layer_tokens)


class WithoutRegions:
    """A destination as ``dest`` is, but for its ``regions()``: a raw chunk over several
    blocks is not read into them but decoded, then scattered by ``write()``."""

    def __init__(self, dest: PagedDestination) -> None:
        self._dest = dest

    def __getattr__(self, name: str) -> Any:
        if name == "regions":
            raise AttributeError(name)
        return getattr(self._dest, name)


@pytest.mark.parametrize(("chunk_bytes", "regions", "in_place"),
                         [(1024, True, True), (3000, True, True), (1024, False, True), (3000, False, False)])
async def test_chunks_inside_one_block_land_in_it_without_a_scatter(
    chunk_bytes: int, regions: bool, in_place: bool,
) -> None:
    # Half a block is 16 rows of 64 bytes: 1024-byte chunks are exactly half blocks, so each
    # is read (or decoded) straight into its destination block; 3000-byte ones span blocks:
    # a frame that small is copied into the places regions() names, or without them
    # decoded, then scattered.
    spec = PagedSpec(num_layers=2, block_shape=(4, 8, 32), dtype="float16")
    src = caches(spec, 8, seed=9)
    dst = caches(spec, 8, seed=10)
    dest = CountingDestination(spec, dst, [6, 1, 4])
    into = dest if regions else WithoutRegions(dest)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, chunk_bytes=chunk_bytes) as peer:
            waiting = asyncio.create_task(server.expect("req", into=into, timeout=10))
            await asyncio.sleep(0)
            await peer.send("req", spec.wire_spec(), PagedSource(spec, src, [0, 3, 5]))
            transfer = await waiting
            assert len([layer async for layer in transfer]) == 2
    for li in range(2):
        assert dst[li][[6, 1, 4]].tobytes() == src[li][[0, 3, 5]].tobytes()
    assert (dest.scattered == 0) == in_place


@pytest.mark.parametrize("codec_class", [Fp8Codec, Int8Codec, Int4Codec])
async def test_quantized_chunks_inside_a_dropped_block_are_not_decoded(
    codec_class: type, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Chunks of half a block, quantized, into a destination that drops a block: the kept
    blocks hold what a destination dropping nothing gets, and no chunk is decoded whole
    (into its view, which for a dropped block's chunk is scratch): each goes into the
    destination's ranges, where a dropped block's are skipped (by the compiled loops;
    without them every chunk is decoded whole)."""
    spec = PagedSpec(num_layers=2, block_shape=(4, 8, 32), dtype="float16")
    src = caches(spec, 8, seed=11)
    dst = caches(spec, 8, seed=12)
    ref = caches(spec, 8, seed=13)
    before = [c.copy() for c in dst]
    whole: list[tuple[int, ...]] = []
    decode = codec_class.decode

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        whole.append(kwargs["shape"])
        return decode(self, *args, **kwargs)

    monkeypatch.setattr(codec_class, "decode", counted)
    codec = codec_class.name
    for cache, ids in ((ref, [6, 2, 4]), (dst, [6, DROP, 4])):
        receipt, layers = await _send_into(spec, src, [0, 3, 5], PagedDestination(spec, cache, ids),
                                           chunk_bytes=1024, codec=codec)
        assert layers == 2 and receipt.codec == codec
    assert (whole == []) == (_host.ext is not None)
    for li in range(2):
        assert dst[li][[6, 4]].tobytes() == ref[li][[6, 4]].tobytes()
        for b in (0, 1, 2, 3, 5, 7):
            assert dst[li][b].tobytes() == before[li][b].tobytes()


async def _send_into(spec: PagedSpec, src: list[np.ndarray], src_ids: Any, dest: PagedDestination,
                     **options: Any) -> tuple[Any, int]:
    """``src``'s blocks sent into ``dest`` over loopback (the destination named before the
    send begins); the receipt and the number of layers received."""
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, **options) as peer:
            waiting = asyncio.create_task(server.expect("req", into=dest, timeout=10))
            await asyncio.sleep(0)
            receipt = await peer.send("req", spec.wire_spec(), PagedSource(spec, src, src_ids))
            transfer = await waiting
            return receipt, len([layer async for layer in transfer])


@pytest.mark.parametrize("compiled_queue", [True, False])
@pytest.mark.parametrize("streams", [1, 3])
async def test_large_chunks_spanning_blocks_are_read_straight_into_them(
    compiled_queue: bool, streams: int, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A large raw chunk over many blocks is read from the socket into those blocks (a
    scatter read over their places), not decoded elsewhere and copied; only the first
    layer's first chunks (sent before the receiver knows the layer size) are.  The
    sender writes it from its own blocks (no gather).  With or without the compiled send
    queue, the stream reads through a socket object of its own."""
    if not compiled_queue:
        monkeypatch.setattr(_stream, "_sendq", None)
    spec = PagedSpec(num_layers=3, block_shape=(2, 4, 8, 64), dtype="float16")  # 8 KiB blocks
    src = caches(spec, 80, seed=11)
    dst = caches(spec, 80, seed=12)
    rng = np.random.default_rng(13)
    src_ids, dst_ids = rng.choice(80, 64, replace=False), rng.choice(80, 64, replace=False)
    dest = CountingDestination(spec, dst, dst_ids)
    before = [c.copy() for c in dst]
    receipt, layers = await _send_into(spec, src, src_ids, dest, chunk_bytes=96 * 1024, streams=streams)
    assert layers == 3 and receipt.chunks > 12
    for li in range(3):
        assert dst[li][dst_ids].tobytes() == src[li][src_ids].tobytes()
        untouched = np.setdiff1d(np.arange(80), dst_ids)
        assert dst[li][untouched].tobytes() == before[li][untouched].tobytes()
    # Only chunks of the first layer sent before the receiver knew its size (the first, and
    # small ones after it) were decoded and scattered.
    assert dest.scattered_layers <= {0} and dest.scattered <= 3


def test_large_chunks_spanning_blocks_on_uvloop() -> None:
    """The same on uvloop (as ``kvwire.aio.run`` runs): the stream's scatter reads on its
    own socket object and uvloop's reads of the transport share one socket."""
    import uvloop

    spec = PagedSpec(num_layers=2, block_shape=(2, 4, 8, 64), dtype="float16")
    src = caches(spec, 80, seed=14)
    dst = [np.zeros_like(c) for c in src]
    rng = np.random.default_rng(15)
    src_ids, dst_ids = rng.choice(80, 64, replace=False), rng.choice(80, 64, replace=False)
    dest = CountingDestination(spec, dst, dst_ids)

    async def main() -> int:
        async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
            async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, chunk_bytes=96 * 1024,
                                      streams=2) as peer:
                waiting = asyncio.create_task(server.expect("req", into=dest, timeout=10))
                await asyncio.sleep(0)
                await peer.send("req", spec.wire_spec(), PagedSource(spec, src, src_ids), timeout=20)
                transfer = await waiting
                return len([layer async for layer in transfer])

    assert uvloop.run(main()) == 2
    for li in range(2):
        assert dst[li][dst_ids].tobytes() == src[li][src_ids].tobytes()
    assert dest.scattered_layers <= {0}


@settings(max_examples=80, deadline=None)
@given(shape=block_shapes, dtype=st.sampled_from(["float16", "bfloat16", "float32"]), data=st.data())
def test_regions_are_each_blocks_rows_in_wire_order(shape: tuple[int, ...], dtype: str, data: st.DataObject) -> None:
    """``regions()`` names, in order, where wire rows [start, start + count) of K or V lie:
    checked against the element positions the wire layout defines (block ``ids[r // rows]``,
    its K or V half, row ``r % rows``), on a cache whose every element holds its index."""
    spec = PagedSpec(num_layers=1, block_shape=shape, dtype=dtype)
    num_blocks = data.draw(st.integers(1, 8))
    ids = data.draw(st.permutations(range(num_blocks)).map(lambda p: p[: max(1, len(p) // 2 + 1)]))
    index = np.arange(num_blocks * spec.block_elems, dtype=np.int64).reshape(num_blocks, *shape)
    cache = np.zeros(index.shape, numpy_dtype(dtype))
    dest = PagedDestination(spec, [cache], ids)
    tokens = dest.layer_tokens
    kind = data.draw(st.sampled_from([0, 1]))
    start = data.draw(st.integers(0, tokens - 1))
    count = data.draw(st.integers(1, tokens - start))
    places = dest.regions(0, kind, start, count, tokens)
    assert places is not None and all(p.nbytes for p in places)
    # Write each place's position in the range, element by element, then read the cache.
    marks = np.arange(1, count * spec.row_elems + 1)
    flat = np.zeros(cache.size, np.int64)
    cache_bytes = memoryview(cache.reshape(-1).view(np.uint8))
    base = np.frombuffer(cache_bytes, np.uint8).ctypes.data
    itemsize, at = cache.itemsize, 0
    for p in places:
        first = (np.frombuffer(p, np.uint8).ctypes.data - base) // itemsize
        n = p.nbytes // itemsize
        flat[first : first + n] = marks[at : at + n]
        at += n
    assert at == marks.size
    rows, width, half = spec.rows_per_block, spec.row_elems, spec.block_elems // 2
    want = np.zeros(cache.size, np.int64)
    for r in range(start, start + count):
        block, row = ids[r // rows], r % rows
        first = block * spec.block_elems + kind * half + row * width
        want[first : first + width] = marks[(r - start) * width : (r - start + 1) * width]
    assert (flat == want).all()
    assert dest.regions(0, kind, start, tokens - start + 1, tokens) is None  # past the end
    assert dest.regions(0, 2, start, count, tokens) is None


@settings(max_examples=60, deadline=None)
@given(shape=block_shapes, dtype=st.sampled_from(["float16", "bfloat16", "float32"]), data=st.data())
def test_block_rows_are_the_gathered_layer_sent_from_the_blocks(shape: tuple[int, ...], dtype: str, data: st.DataObject) -> None:
    """What PagedSource yields for a host cache stands for gather_layer's arrays: the same
    shape, dtype and size, the same rows when gathered, and, as the buffers a raw chunk
    sends, the same bytes, for the whole layer and any slice of rows."""
    spec = PagedSpec(num_layers=2, block_shape=shape, dtype=dtype)
    num_blocks = data.draw(st.integers(1, 8))
    src = caches(spec, num_blocks, seed=data.draw(st.integers(0, 100)))
    ids = data.draw(st.lists(st.integers(0, num_blocks - 1), min_size=1, max_size=10))
    layers = list(PagedSource(spec, src, ids))
    assert len(layers) == 2
    for (k, v), cache in zip(layers, src, strict=True):
        for rows, want in zip((k, v), gather_layer(spec, cache, ids), strict=True):
            assert isinstance(rows, BlockRows)
            assert rows.shape == want.shape and rows.dtype == want.dtype and rows.nbytes == want.nbytes
            assert rows.gather().tobytes() == want.tobytes() == np.asarray(rows).tobytes()
            a = data.draw(st.integers(0, len(want) - 1))
            b = data.draw(st.integers(a, len(want)))
            part = rows[a:b]
            assert len(part) == b - a and part.gather().tobytes() == want[a:b].tobytes()
            assert b"".join(bytes(x) for x in part.byte_views()) == want[a:b].tobytes()
            if b > a:  # what a raw chunk sends: the same bytes, as ranges of the cache
                ranges = part.byte_ranges()
                assert ranges.nbytes == part.nbytes
                assert [bytes(x) for x in ranges.views()] == [bytes(x) for x in part.byte_views()]
    with pytest.raises(ValueError, match="step 1"):
        layers[0][0][::2]


# With KVWIRE_NO_EXTENSIONS=1 only the numpy path exists; otherwise the compiled case runs
# (skipped or failed without the extension by the rule test_extension_was_built follows).
@pytest.mark.parametrize("compiled", [False] if extensions_disabled() else [True, False])
@pytest.mark.parametrize("codec", ["fp8", "int8", "int4", "int8+zstd"])
async def test_quantized_chunks_read_and_land_where_the_blocks_lie(
    codec: str, compiled: bool, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """fp8, int8 and int4 chunks (and behind an entropy stage) over many blocks are
    quantized from the sender's blocks where they lie and decoded straight into the
    receiver's (the compiled loops over byte ranges): no gather, no decode elsewhere and
    scatter.  Without the extension both sides gather and scatter instead.  Either way
    each block holds exactly the codec's round trip of its rows (chunks are whole int4
    K groups of 32 rows, so the layer's round trip is the chunks')."""
    if not compiled:
        monkeypatch.setattr(_host, "ext", None)
    else:
        require_extension(_host.ext is not None, "kvwire.codec._hostcodec")

        def no_gather(self: BlockRows) -> np.ndarray:
            raise AssertionError("rows were gathered")

        monkeypatch.setattr(BlockRows, "gather", no_gather)
    spec = PagedSpec(num_layers=2, block_shape=(2, 16, 2, 64), dtype="bfloat16")  # 8 KiB blocks, opaque rows of 64 (no token_axis)
    src = caches(spec, 40, seed=16)
    dst = caches(spec, 40, seed=17)
    rng = np.random.default_rng(18)
    src_ids, dst_ids = rng.choice(40, 24, replace=False), rng.choice(40, 24, replace=False)
    dest = CountingDestination(spec, dst, dst_ids)
    receipt, layers = await _send_into(spec, src, src_ids, dest, chunk_bytes=64 * 1024, streams=2, codec=codec)
    assert layers == 2 and receipt.chunks >= 8 and receipt.codec == codec
    c = get_codec(codec.partition("+")[0])
    assert isinstance(c, Fp8Codec | Int8Codec | Int4Codec)
    for li in range(2):
        got = gather_layer(spec, dst[li], dst_ids)
        for kind, rows in enumerate(np.asarray(a) for a in gather_layer(spec, src[li], src_ids)):
            enc = c.encode_numpy(rows, TensorKind(kind))
            want = c.decode_numpy(enc.params, enc.payload, shape=rows.shape, dtype=spec.dtype, kind=TensorKind(kind))
            assert np.asarray(got[kind]).tobytes() == want.tobytes()
    assert (dest.scattered == 0) == compiled


@settings(max_examples=60, deadline=None)
@given(
    shape=block_shapes,
    dtype=st.sampled_from(["float16", "bfloat16", "float32"]),
    data=st.data(),
)
def test_dropped_blocks_are_written_nowhere(shape: tuple[int, ...], dtype: str, data: st.DataObject) -> None:
    """A destination naming ``DROP`` for some blocks: whatever the chunks' cuts, the kept
    blocks receive exactly their rows and no other block of the cache changes.  A dropped
    block's rows have places of their own in scratch (raw chunks are read into them; no
    two places of a range overlap, so a read's CRC over them holds); as byte ranges of the
    layer's buffer (what the compiled codecs decode into) they start at ``DROP``: written
    nowhere."""
    spec = PagedSpec(num_layers=2, block_shape=shape, dtype=dtype)
    n = data.draw(st.integers(1, 6), label="blocks")
    src = caches(spec, n, seed=1)
    dst = caches(spec, 12, seed=2)
    before = [c.copy() for c in dst]
    targets = data.draw(st.permutations(range(12)), label="targets")[:n]
    dropped = data.draw(st.lists(st.booleans(), min_size=n, max_size=n), label="dropped")
    ids = [DROP if d else t for t, d in zip(targets, dropped, strict=True)]
    dest = PagedDestination(spec, dst, ids)
    assert dest.layer_tokens == spec.tokens(n)
    layers = [tuple(np.asarray(a) for a in gather_layer(spec, src[li], list(range(n)))) for li in range(2)]
    cuts = data.draw(st.lists(st.integers(0, 4 * dest.layer_tokens), max_size=5), label="cuts")
    scatter(dest, layers, cuts)
    for li in range(2):
        for b in range(12):
            want = src[li][targets.index(b)] if b in ids else before[li][b]
            assert dst[li][b].tobytes() == want.tobytes()
    rows = spec.rows_per_block
    for slot, d in enumerate(dropped):
        touching = (slot * rows, rows)
        assert dest.view(0, 0, *touching, dest.layer_tokens) is not None
        where = dest.ranges(0, 1, *touching, dest.layer_tokens)
        assert where is not None and (np.frombuffer(where.spans, np.int64)[0] == DROP) == d
    tokens = dest.layer_tokens
    places = [np.frombuffer(p, np.uint8) for kind in (0, 1) for p in dest.regions(1, kind, 0, tokens, tokens) or []]
    assert sum(p.nbytes for p in places) == 2 * tokens * spec.row_elems * np.dtype(numpy_dtype(dtype)).itemsize
    assert not any(np.shares_memory(a, b) for a, b in itertools.combinations(places, 2))
    for p in places:  # what a raw chunk of the whole layer would read into them
        p[:] = 0x5A
    for li in range(2):
        for b in range(12):
            want = src[li][targets.index(b)] if b in ids else before[li][b]
            if li == 1 and b in ids:
                want = np.full(want.nbytes, 0x5A, np.uint8)
            assert dst[li][b].tobytes() == want.tobytes()


def test_dropped_blocks_scratch_comes_from_the_receive_pool() -> None:
    """A destination's scratch for its dropped blocks is leased from the receive pool (no
    fresh pages to fault in for every transfer) and goes back to it with the destination."""
    from kvwire.aio._pool import ReceivePool

    spec = PagedSpec(num_layers=1, block_shape=(2, 4, 2, 64), dtype="float16")
    cache = caches(spec, 8, 0)
    pool = ReceivePool(1 << 30)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("kvwire.aio._pool.default_pool", lambda: pool)
        first = PagedDestination(spec, cache, [DROP, 3, DROP])
        assert first.view(0, 1, 0, 4, first.layer_tokens) is not None  # a dropped block's place
        assert pool.misses == 1 and pool.leased_bytes >= 2 * 2 * spec.block_bytes // 2
        del first
        gc.collect()
        assert pool.leased_bytes == 0 and pool.idle_bytes > 0
        second = PagedDestination(spec, cache, [5, DROP, DROP])
        assert second.regions(0, 0, 0, second.layer_tokens, second.layer_tokens) is not None
        assert pool.hits == 1 and pool.idle_bytes == 0  # the same slab, leased again


def test_drop_is_the_only_negative_block_id() -> None:
    spec = PagedSpec(num_layers=1, block_shape=(2, 8), dtype="float32")
    cache = caches(spec, 4, 0)
    with pytest.raises(UsageError, match="block id -2 is out of range"):
        PagedDestination(spec, cache, [0, -2])
    with pytest.raises(UsageError, match="block id -1 is out of range"):
        layer_rows(spec, cache[0], [DROP, 1])  # a source names the blocks it sends
    assert list(PagedDestination(spec, cache, [DROP, 3, DROP]).block_ids) == [DROP, 3, DROP]
    with pytest.raises(UsageError, match=f"block id {2**64 - 1} is out of range"):  # not -1 once cast
        PagedDestination(spec, cache, np.array([1, 2**64 - 1], dtype=np.uint64))
    assert list(PagedDestination(spec, cache, np.array([3, 0], dtype=np.uint8)).block_ids) == [3, 0]


@pytest.mark.parametrize("codec", ["raw", "fp8", "int8", "int4", "int8+zstd"])
async def test_a_transfer_lands_in_its_kept_blocks_and_drops_the_others(codec: str) -> None:
    """Over loopback, a whole cache is sent into a destination that drops some of its
    blocks (the first ones, as a receiver whose prefix cache holds them, and one further
    on): each kept block holds its rows (raw: exactly; a quantized codec: its round trip),
    and every other block of the receiver's cache is as it was, whether its chunks went in
    place or through scratch (K and V in one chunk included).  Raw chunks are read
    straight into their places, the dropped blocks' in scratch; quantized ones are decoded
    straight into the kept blocks."""
    spec = PagedSpec(num_layers=3, block_shape=(2, 16, 2, 64), dtype="bfloat16")  # opaque rows of 64 (no token_axis)
    src = caches(spec, 40, seed=21)
    dst = caches(spec, 40, seed=22)
    before = [c.copy() for c in dst]
    rng = np.random.default_rng(23)
    src_ids, targets = rng.choice(40, 12, replace=False), rng.choice(40, 12, replace=False)
    ids = [DROP if slot in (0, 1, 2, 7) else int(t) for slot, t in enumerate(targets)]
    for chunk_bytes in (16 * 1024, 1 << 20):  # chunks of a few blocks; a layer's K and V in one
        dest = CountingDestination(spec, dst, ids)
        receipt, layers = await _send_into(spec, src, src_ids, dest, chunk_bytes=chunk_bytes, streams=2, codec=codec)
        assert layers == 3 and receipt.codec == codec
        if codec == "raw" and chunk_bytes > 64 * 1024:  # frames under 64 KiB are decoded and copied
            assert dest.scattered_layers <= {0}  # read into their places, but the first chunks
        if codec != "raw" and _host.ext is not None:
            assert dest.scattered == 0  # decoded into the kept blocks, the dropped rows skipped
        c = get_codec(codec.partition("+")[0])
        for li in range(3):
            want = [np.asarray(a) for a in gather_layer(spec, src[li], src_ids)]
            if c.name != "raw":
                want = [c.decode_numpy((e := c.encode_numpy(w, TensorKind(k))).params, e.payload, shape=w.shape,
                                       dtype=spec.dtype, kind=TensorKind(k)) for k, w in enumerate(want)]
            rows = spec.rows_per_block
            for slot, b in enumerate(ids):
                if b != DROP:
                    got = gather_layer(spec, dst[li], [b])
                    for kind in (0, 1):
                        assert np.asarray(got[kind]).tobytes() == want[kind][slot * rows : (slot + 1) * rows].tobytes()
            for b in set(range(40)) - set(ids):
                assert dst[li][b].tobytes() == before[li][b].tobytes()


@pytest.mark.parametrize("ids", [[0, 1], [0, DROP]])
@pytest.mark.parametrize("what", ["dtype", "wider", "narrower", "flat"])
def test_write_refuses_rows_of_another_dtype_or_shape(ids: list[int], what: str) -> None:
    # Rows are never reinterpreted, cast or cut: a float32 block's bytes are not float16's.
    spec = PagedSpec(num_layers=1, block_shape=(2, 4, 8), dtype="float16")
    rows, width = spec.rows_per_block, spec.row_elems
    data = {
        "dtype": np.full((rows, 1, width), 1.5, np.float32),
        "wider": np.full((rows, 1, 2 * width), 1.5, np.float16),
        "narrower": np.full((rows, 1, width // 2), 1.5, np.float16),
        "flat": np.full((rows, width), 1.5, np.float16),
    }[what]
    dst = [np.zeros((2, *spec.block_shape), np.float16)]
    dest = PagedDestination(spec, dst, ids)
    with pytest.raises(UsageError, match="write"):
        dest.write(0, 0, 0, data, spec.tokens(2))
    assert not dst[0].any()
    dest.write(0, 0, 0, np.full((rows, 1, width), 1.5, np.float16), spec.tokens(2))  # the rows it takes
    assert np.all(dst[0][0].reshape(-1)[: spec.block_elems // 2] == 1.5)


def test_write_outside_the_destination_is_an_incompatible_peer() -> None:
    # What a peer sent that does not fit: IncompatiblePeerError, the class the sender gets.
    spec = PagedSpec(num_layers=1, block_shape=(2, 4, 8), dtype="float16")
    rows, width = spec.rows_per_block, spec.row_elems
    dst = [np.zeros((2, *spec.block_shape), np.float16)]
    dest = PagedDestination(spec, dst, [0, 1])
    data = np.full((rows, 1, width), 1.5, np.float16)
    with pytest.raises(IncompatiblePeerError, match="outside the destination") as err:
        dest.write(1, 0, 0, data, spec.tokens(2))
    assert err.value.code == ErrorCode.INCOMPATIBLE_SPEC
    with pytest.raises(IncompatiblePeerError, match="outside the destination"):
        dest.write(0, 0, spec.tokens(2) - 1, data, spec.tokens(2))
    with pytest.raises(IncompatiblePeerError, match="blocks per layer"):
        dest.write(0, 0, 0, data, spec.tokens(3))
    assert not dst[0].any()


class _DeviceArray:
    """Stands for a tensor in device memory (DLPack device type 2, CUDA)."""

    shape = (4, 2, 16)
    dtype = "float16"

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, 0)


def test_a_device_cache_without_cupy_is_a_usage_error_naming_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # as if CuPy were not installed
    spec = PagedSpec(num_layers=1, block_shape=(2, 16), dtype="float16")
    for make in (lambda: PagedSource(spec, [_DeviceArray()], [0]), lambda: PagedDestination(spec, [_DeviceArray()], [0]),
                 lambda: as_device_array(_DeviceArray(), spec.wire_spec(), "k")):  # what send() is given
        with pytest.raises(UsageError, match=r"CuPy \(pip install kvwire\[gpu-cuda12\]"):
            make()


def test_what_is_not_a_cache_or_a_block_shape_is_a_usage_error() -> None:
    spec = PagedSpec(num_layers=1, block_shape=(2, 4, 8), dtype="float32")
    cache = caches(spec, 4, 0)[0]
    for make in (lambda: PagedDestination(spec, [cache.tolist()], [0]), lambda: PagedSource(spec, [None], [0]),
                 lambda: gather_layer(spec, 3.0, [0]), lambda: PagedSpec.of(cache.tolist(), num_layers=1)):
        with pytest.raises(UsageError, match=r"must be an array \[num_blocks, \*block_shape\]"):
            make()
    for caches_arg in (None, 7):
        with pytest.raises(UsageError, match="caches must be a sequence"):
            PagedDestination(spec, caches_arg, [0])  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="block_shape must be positive ints, got 16"):
        PagedSpec(num_layers=1, block_shape=16)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="num_layers"):
        PagedSpec(num_layers=True, block_shape=(2, 8))


class _IdsOnADevice:
    """Block ids held in device memory: numpy cannot take them (as CuPy refuses)."""

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise TypeError("Implicit conversion to a NumPy array is not allowed")


def test_block_ids_not_in_host_memory_are_a_usage_error() -> None:
    spec = PagedSpec(num_layers=1, block_shape=(2, 8), dtype="float32")
    cache = caches(spec, 4, 0)
    for make in (lambda: PagedDestination(spec, cache, _IdsOnADevice()), lambda: PagedSource(spec, cache, _IdsOnADevice()),
                 lambda: gather_layer(spec, cache[0], _IdsOnADevice())):
        with pytest.raises(UsageError, match="block ids must be integers in host memory"):
            make()


@pytest.mark.parametrize("ids", [[1, 3], [DROP, 3]])
def test_write_refuses_a_kind_other_than_k_or_v(ids: list[int]) -> None:
    spec = PagedSpec(num_layers=1, block_shape=(2, 4, 8), dtype="float32")
    dst = [np.zeros((4, *spec.block_shape), np.float32)]
    dest = PagedDestination(spec, dst, ids)
    rows = np.ones((spec.rows_per_block, 1, spec.row_elems), np.float32)
    for kind in (2, -1):
        with pytest.raises(UsageError, match=r"write\(\) takes kind 0 \(K\) or 1 \(V\)"):
            dest.write(0, kind, spec.rows_per_block, rows, spec.tokens(2))
    assert not dst[0].any()


def test_a_range_before_the_first_row_has_no_place() -> None:
    # write() refuses start=-1; view(), regions() and ranges() name no place for it either
    # (not the last block's rows, as a negative index would).
    spec = PagedSpec(num_layers=1, block_shape=(2, 4, 8), dtype="float32")
    dest = PagedDestination(spec, [np.zeros((4, *spec.block_shape), np.float32)], [1, 3])
    tokens = spec.tokens(2)
    for start in (-1, -spec.rows_per_block):
        assert dest.view(0, 0, start, 1, tokens) is None
        assert dest.regions(0, 0, start, 1, tokens) is None
        assert dest.ranges(0, 0, start, 1, tokens) is None
    assert dest.view(0, 0, 0, 1, tokens) is not None


class _RaisingProducer:
    """A CPU DLPack producer (neither numpy nor torch) numpy cannot read."""

    shape = (4, 2, 16)
    dtype = "bfloat16"

    def __init__(self, error: Exception) -> None:
        self.error = error

    def __dlpack__(self, **kwargs: Any) -> Any:
        raise self.error

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)


class _Bf16Producer:
    """A CPU DLPack producer of bfloat16 (as JAX's arrays are): numpy's DLPack has none."""

    dtype = "bfloat16"

    def __init__(self, arr: np.ndarray) -> None:
        self.arr = arr
        self.shape = arr.shape

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self.arr.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)


@pytest.mark.parametrize("producer", ["runtime", "buffer", "type", "bf16"])
def test_a_dlpack_cache_numpy_cannot_read_is_a_usage_error(producer: str) -> None:
    spec = PagedSpec(num_layers=1, block_shape=(2, 16), dtype="bfloat16")
    cache: Any = {
        "runtime": _RaisingProducer(RuntimeError("Unsupported dtype in DLTensor.")),
        "buffer": _RaisingProducer(BufferError("not exportable")),
        "type": _RaisingProducer(TypeError("no such keyword")),
        "bf16": _Bf16Producer(np.zeros((4, 2, 16), numpy_dtype("bfloat16"))),
    }[producer]
    for make in (lambda: gather_layer(spec, cache, [0]), lambda: PagedSource(spec, [cache], [0]),
                 lambda: PagedDestination(spec, [cache], [0])):
        with pytest.raises(UsageError, match="cannot read the cache through DLPack"):
            make()


@pytest.mark.parametrize(("have", "spec_dtype"), [("bfloat16", "float16"), ("float16", "bfloat16"), ("float32", "float16")])
def test_a_host_cache_of_another_dtype_is_never_reinterpreted(have: str, spec_dtype: str) -> None:
    # numpy's side of the check the torch tests make (tests/integration/test_paged_torch.py)
    spec = PagedSpec(num_layers=1, block_shape=(2, 16), dtype=spec_dtype)
    cache = np.zeros((4, 2, 16), numpy_dtype(have))
    for make in (lambda: gather_layer(spec, cache, [0]), lambda: PagedSource(spec, [cache], [0]),
                 lambda: PagedDestination(spec, [cache], [0]), lambda: layer_rows(spec, cache, [0])):
        with pytest.raises(UsageError, match=f"cache has dtype {have}, the spec says {spec_dtype}"):
            make()


def _fake_cupy() -> Any:
    """A stand-in for CuPy over numpy: enough of it for a cache to be taken as a GPU one."""
    import types

    class ndarray(np.ndarray):  # CuPy's name
        pass

    ndarray.__module__ = "cupy"
    mod = types.ModuleType("cupy")
    mod.ndarray = ndarray  # type: ignore[attr-defined]
    mod.uint16 = np.uint16  # type: ignore[attr-defined]
    mod.asarray = lambda x: np.asarray(x).view(ndarray)  # type: ignore[attr-defined]
    return mod


@pytest.mark.parametrize(("have", "spec_dtype"), [("float32", "float16"), ("float16", "bfloat16"), ("float16", "float32")])
def test_a_device_cache_of_another_dtype_is_refused(have: str, spec_dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A GPU cache's dtype is checked too: never cast on write nor read through another dtype.
    cupy = _fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    spec = PagedSpec(num_layers=1, block_shape=(2, 16), dtype=spec_dtype)
    cache = np.zeros((4, 2, 16), have).view(cupy.ndarray)
    for make in (lambda: PagedSource(spec, [cache], [0]), lambda: PagedDestination(spec, [cache], [0])):
        with pytest.raises(UsageError, match=f"cache has dtype {have}, the spec says {spec_dtype}"):
            make()
    right = PagedSpec(num_layers=1, block_shape=(2, 16), dtype=have)
    assert PagedDestination(right, [cache], [0]).layer_tokens == right.tokens(1)


@pytest.mark.parametrize("model", ["\udc80", "llama\ud800-3"])
def test_a_model_name_utf8_cannot_encode_is_a_usage_error_naming_the_field(model: str) -> None:
    # A lone surrogate raised UnicodeEncodeError from sizing the name.
    with pytest.raises(UsageError, match=r"PagedSpec\.model"):
        PagedSpec(num_layers=1, block_shape=(4,), model=model)
    with pytest.raises(UsageError, match=r"KVSpec\.model"):
        kvwire.KVSpec(num_layers=1, num_kv_heads=1, head_dim=8, model=model)


@pytest.mark.parametrize("model", [None, 0, b"m", ["m"]])
def test_a_model_that_is_not_a_str_is_refused(model: Any) -> None:
    # None travelled as 'paged:4:None', the fingerprint of model="None".
    with pytest.raises(UsageError, match=r"PagedSpec\.model must be a str"):
        PagedSpec(num_layers=1, block_shape=(4,), model=model)


def test_the_model_name_may_fill_the_field_past_the_geometry_prefix() -> None:
    # The limit named was KVSpec's 255 bytes, which the 'paged:<geometry>:' prefix shares.
    prefix = len("paged:2x16:")
    assert prefix == 11
    fits = PagedSpec(num_layers=1, block_shape=(2, 16), model="é" * 122)  # 244 bytes
    assert len(fits.wire_spec().model.encode()) == 255
    with pytest.raises(UsageError, match=rf"PagedSpec\.model must be a str of at most {255 - prefix} UTF-8 bytes, got 250"):
        PagedSpec(num_layers=1, block_shape=(2, 16), model="m" * 250)
    with pytest.raises(UsageError, match=r"PagedSpec\.model must be a str of at most 244 UTF-8 bytes, got 245"):
        PagedSpec(num_layers=1, block_shape=(2, 16), model="é" * 122 + "m")
    with pytest.raises(UsageError, match=r"PagedSpec\.block_shape .* has too many dimensions"):
        PagedSpec(num_layers=1, block_shape=(2,) * 130)


def test_block_rows_as_an_array_without_a_copy_is_refused() -> None:
    # np.asarray(rows, copy=False) returned a gathered copy: writes to it missed the cache.
    spec = PagedSpec(num_layers=1, block_shape=(2, 4))
    cache = np.arange(3 * 2 * 4, dtype=np.float16).reshape(3, 2, 4)
    k, _v = layer_rows(spec, cache, [1])
    with pytest.raises(ValueError, match="copy"):
        np.asarray(k, copy=False)
    assert np.asarray(k).tobytes() == np.asarray(k, copy=True).tobytes() == cache[1, :1].tobytes()
    assert np.asarray(k, dtype=np.float32).tolist() == cache[1, :1].astype(np.float32).reshape(1, 1, 4).tolist()
