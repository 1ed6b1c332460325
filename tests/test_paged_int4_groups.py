"""int4 keys of a paged cache are grouped per (head, channel), as an unpaged cache's are,
when the spec says which axis of the block holds its tokens (``token_axis=1``).

A block ``[2, block_size, num_kv_heads, head_size]`` travels by default as rows of one
head's vector each (``(token, head)`` pairs), so an int4 key group of 32 wire tokens takes
4 tokens of all 8 heads: one scale for 8 different channels, each with its own outliers.
On the outlier-key fixture below the relative RMS error is about 1.5x the unpaged send's.
With ``token_axis=1`` a wire row is one cache token of all its heads and the error is the
unpaged send's.  The shape alone cannot tell that layout (NHD) from ``[2, num_kv_heads,
block_size, head_size]`` (HND), whose axis 1 is the heads, and a count of tokens could not
either when ``num_kv_heads == block_size``: an axis can.  HND (``token_axis=2``), and any
spec without ``token_axis=1``, keeps the opaque rows.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import kvwire
from kvwire.codec import Fp8Codec, Int4Codec, Int8Codec, TensorKind, numpy_dtype
from kvwire.errors import IncompatiblePeerError, UsageError
from kvwire.paged import DROP, PagedDestination, PagedSource, PagedSpec, gather_layer
from tests.conftest import SECRET

pytestmark = pytest.mark.timeout(60)

BLOCK, HEADS, DIM, BLOCKS = 16, 8, 128, 16


def outlier_keys(tokens: int, seed: int, heads: int = HEADS) -> np.ndarray:
    """Keys ``[tokens, heads, DIM]`` (float32) with per-(head, channel) scales drawn
    log-normally, per-channel offsets, and 4 outlier channels (8-20x) per head, each head
    its own."""
    rng = np.random.default_rng(seed)
    scales = np.exp(rng.normal(0.0, 0.5, (heads, DIM))).astype(np.float32)
    for h in range(heads):
        channels = rng.choice(DIM, 4, replace=False)
        scales[h, channels] *= rng.uniform(8.0, 20.0, 4).astype(np.float32)
    offsets = rng.normal(0.0, 0.5, (heads, DIM)).astype(np.float32) * scales
    return (rng.standard_normal((tokens, heads, DIM), dtype=np.float32) * scales + offsets).astype(np.float32)


def rel_rms(x: np.ndarray, y: np.ndarray) -> float:
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    return float(np.sqrt(np.mean((x64 - y64) ** 2) / np.mean(x64**2)))


def int4_keys(rows: np.ndarray, dtype: str) -> np.ndarray:
    codec = Int4Codec()
    enc = codec.encode_numpy(rows, TensorKind.K)
    return codec.decode_numpy(enc.params, enc.payload, shape=rows.shape, dtype=dtype, kind=TensorKind.K)


def nhd_cache(keys: np.ndarray) -> np.ndarray:
    """Blocks ``[2, block_size, heads, head_size]`` (K plane, V plane) holding ``keys``
    (``[tokens, heads, head_size]``)."""
    heads = keys.shape[1]
    cache = np.zeros((BLOCKS, 2, BLOCK, heads, DIM), keys.dtype)
    cache[:, 0] = keys.reshape(BLOCKS, BLOCK, heads, DIM)
    return cache


def hnd_cache(keys: np.ndarray) -> np.ndarray:
    """Blocks ``[2, heads, block_size, head_size]`` holding ``keys``."""
    heads = keys.shape[1]
    cache = np.zeros((BLOCKS, 2, heads, BLOCK, DIM), keys.dtype)
    cache[:, 0] = keys.reshape(BLOCKS, BLOCK, heads, DIM).transpose(0, 2, 1, 3)
    return cache


def opaque_rows(cache: np.ndarray) -> np.ndarray:
    """The K rows of the opaque rule (kvwire before rows of tokens): each block's K half
    as rows of its last dimension, one wire head."""
    return np.ascontiguousarray(cache[:, 0]).reshape(-1, 1, cache.shape[-1])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_paged_int4_key_error_matches_unpaged(dtype: str) -> None:
    # One cache per layer, blocks [2, block_size, heads, head_size]: K plane, V plane.
    dt = numpy_dtype(dtype)
    keys = outlier_keys(BLOCKS * BLOCK, seed=1).astype(dt)
    cache = nhd_cache(keys)
    spec = PagedSpec.of(cache, num_layers=1, token_axis=1)
    assert spec.row_shape == (HEADS, DIM)
    k, _v = gather_layer(spec, cache, np.arange(BLOCKS))
    paged = int4_keys(np.asarray(k), dtype).reshape(keys.shape)
    unpaged = int4_keys(keys, dtype)
    base, got = rel_rms(keys, unpaged), rel_rms(keys, paged)
    assert got <= 1.10 * base, (got, base)
    err = np.abs(paged.astype(np.float32) - keys.astype(np.float32))
    assert err.max() <= 1.10 * np.abs(unpaged.astype(np.float32) - keys.astype(np.float32)).max()
    # Without token_axis the same block keeps the opaque rows and their error (~1.5x).
    old = PagedSpec.of(cache, num_layers=1)
    k_old, _v = gather_layer(old, cache, np.arange(BLOCKS))
    assert np.asarray(k_old).tobytes() == opaque_rows(cache).tobytes()
    assert rel_rms(keys, int4_keys(np.asarray(k_old), dtype).reshape(keys.shape)) > 1.3 * base


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("heads", [HEADS, BLOCK])
@pytest.mark.parametrize("token_axis", [None, 2])
def test_hnd_blocks_keep_the_opaque_rows(dtype: str, heads: int, token_axis: int | None) -> None:
    # [2, heads, block_size, head_size]: axis 1 is the heads.  With token_axis=2 (its tokens'
    # heads are not contiguous) or none, the rows are one head's vector as before rows of
    # tokens, also when heads == block_size ([2, 16, 16, 128]), where a count of tokens per
    # block (16) would read the block as NHD: the heads would become wire tokens and K groups
    # would span heads (rel RMS 0.1143 with a head's tokens as wire heads against 0.0866 opaque).
    dt = numpy_dtype(dtype)
    keys = outlier_keys(BLOCKS * BLOCK, seed=1, heads=heads).astype(dt)
    cache = hnd_cache(keys)
    if token_axis is None:  # (the spec as any caller made it before token_axis)
        spec = PagedSpec.of(cache, num_layers=1)
    else:
        spec = PagedSpec.of(cache, num_layers=1, token_axis=token_axis)
    wire = spec.wire_spec()
    assert (spec.row_shape, spec.rows_per_block, spec.tokens_are_rows) == ((1, DIM), heads * BLOCK, False)
    assert (wire.num_kv_heads, wire.head_dim) == (1, DIM)
    assert wire.model == f"paged:2x{heads}x{BLOCK}x{DIM}:"  # the opaque rows' prefix, unchanged
    assert wire.fingerprint == PagedSpec(num_layers=1, block_shape=spec.block_shape, dtype=dtype).wire_spec().fingerprint
    k, _v = gather_layer(spec, cache, np.arange(BLOCKS))
    rows = opaque_rows(cache)
    assert np.asarray(k).tobytes() == rows.tobytes()
    got = rel_rms(rows, int4_keys(np.asarray(k), dtype))
    assert got == rel_rms(rows, int4_keys(rows, dtype))
    tokens_as_heads = rows.reshape(-1, BLOCK, DIM)  # 0f58358's rows: a head's tokens as wire heads
    assert got < 0.85 * rel_rms(tokens_as_heads, int4_keys(tokens_as_heads, dtype))


def test_wire_rows_are_tokens_of_heads_for_kv_plane_blocks() -> None:
    # [2, block_size, heads..., head_size] with token_axis=1: a wire token is one cache
    # token, its heads the block's, and the model prefix says so ('/t1').
    for shape, heads, dim, rows in (((2, BLOCK, HEADS, DIM), HEADS, DIM, BLOCK),
                                    ((2, BLOCK, BLOCK, DIM), BLOCK, DIM, BLOCK),
                                    ((2, 4, 2, 4, 32), 8, 32, 4)):
        spec = PagedSpec(num_layers=2, block_shape=shape, dtype="float16", token_axis=1)
        wire = spec.wire_spec()
        assert spec.tokens_are_rows
        assert (wire.num_kv_heads, wire.head_dim, spec.rows_per_block) == (heads, dim, rows)
        geometry = "x".join(map(str, shape))
        assert wire.model == f"paged:{geometry}/t1:"
        opaque = PagedSpec(num_layers=2, block_shape=shape, dtype="float16")
        assert (opaque.wire_spec().num_kv_heads, opaque.wire_spec().head_dim) == (1, shape[-1])
        assert opaque.wire_spec().model == f"paged:{geometry}:"
        assert opaque.wire_spec().fingerprint != wire.fingerprint
    # Other blocks keep rows of their last dimension, one head, whatever token_axis says:
    # vLLM's CPU layout [num_kv_heads, block_size, 2 * head_size], HND blocks (tokens on
    # axis 2), blocks with no heads axis, a K-only [block_size, heads, head_size] (no K/V
    # axis), a token too wide for one row, and any axis other than 1.
    for other, axis, width in (((8, 128, 256), 1, 256), ((2, 8), 1, 8), ((2, 4, 32), 1, 32),
                               ((4, 64), 0, 64), ((BLOCK, HEADS, DIM), 0, DIM), ((BLOCK, HEADS, DIM), 1, DIM),
                               ((2, HEADS, BLOCK, DIM), 2, DIM), ((2, 2, 8, 64), 2, 64),
                               ((2, BLOCK, HEADS, DIM), 0, DIM), ((2, BLOCK, HEADS, DIM), 3, DIM),
                               ((4, BLOCK, HEADS, DIM), 1, DIM), ((2, 2, 256, 256), 1, 256)):
        for given in (None, axis):
            spec = PagedSpec(num_layers=1, block_shape=other, token_axis=given)
            wire = spec.wire_spec()
            assert (wire.num_kv_heads, wire.head_dim, spec.tokens_are_rows) == (1, width, False)
            assert wire.model == "paged:" + "x".join(map(str, other)) + ":"


@pytest.mark.parametrize("shape", [(2, BLOCK, 1, DIM), (2, BLOCK, 1, 576), (2, BLOCK, 1, 1, DIM)])
def test_one_head_blocks_are_the_same_with_token_axis(shape: tuple[int, ...]) -> None:
    # One KV head: the opaque rows already are one cache token each, so token_axis=1
    # changes neither the rows, nor their bytes, nor the model prefix and fingerprint: a
    # peer that does not give it is not refused.
    plain = PagedSpec(num_layers=2, block_shape=shape, dtype="bfloat16", model="m")
    tokens = PagedSpec(num_layers=2, block_shape=shape, dtype="bfloat16", model="m", token_axis=1)
    assert not tokens.tokens_are_rows
    assert (tokens.row_shape, tokens.rows_per_block) == (plain.row_shape, plain.rows_per_block) == ((1, shape[-1]), BLOCK)
    assert tokens.wire_spec() == plain.wire_spec()
    assert tokens.wire_spec().model == "paged:" + "x".join(map(str, shape)) + ":m"
    assert tokens.wire_spec().fingerprint == plain.wire_spec().fingerprint
    cache = np.random.default_rng(5).standard_normal((3, *shape), dtype=np.float32).astype(numpy_dtype("bfloat16"))
    for a, b in zip(gather_layer(tokens, cache, [2, 0]), gather_layer(plain, cache, [2, 0]), strict=True):
        assert np.asarray(a).shape == np.asarray(b).shape and np.asarray(a).tobytes() == np.asarray(b).tobytes()
    dest = PagedDestination(tokens, [np.zeros_like(cache), np.zeros_like(cache)], [0, 1])
    dest.check(plain.wire_spec(), plain.tokens(2))  # not refused


def test_token_axis_is_checked() -> None:
    shape = (2, BLOCK, HEADS, DIM)
    for bad in (4, -1, 16, True, False, 1.0, "1"):
        with pytest.raises(UsageError, match=r"token_axis must be None or an axis of block_shape \(2, 16, 8, 128\) "
                                             r"\(an int in \[0, 4\)\), got"):
            PagedSpec(num_layers=1, block_shape=shape, token_axis=bad)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=r"token_axis must be None or an axis of block_shape \(8, 128, 256\)"):
        PagedSpec.of(np.zeros((1, 8, 128, 256), np.float16), num_layers=1, token_axis=3)
    for axis in range(len(shape)):
        assert PagedSpec(num_layers=1, block_shape=shape, token_axis=axis).token_axis == axis
    # The '/t1' mark counts in the 255-byte budget of the model field, only where it applies.
    room = 255 - len("paged:2x16x8x128:")
    PagedSpec(num_layers=1, block_shape=shape, model="m" * room)
    PagedSpec(num_layers=1, block_shape=shape, model="m" * (room - 3), token_axis=1)
    with pytest.raises(UsageError, match=r"PagedSpec\.model"):
        PagedSpec(num_layers=1, block_shape=shape, model="m" * (room - 2), token_axis=1)
    PagedSpec(num_layers=1, block_shape=(2, BLOCK, 1, DIM), model="m" * room, token_axis=1)  # one head: no mark


def test_destination_refusal_names_the_row_geometry() -> None:
    # A peer on the opaque rows of the same block shape: the refusal says the rows differ.
    shape = (2, BLOCK, HEADS, DIM)
    new = PagedSpec(num_layers=1, block_shape=shape, model="m", token_axis=1)
    old = PagedSpec(num_layers=1, block_shape=shape, model="m")
    for here, there in ((new, old), (old, new)):
        dest = PagedDestination(here, [np.zeros((4, *shape), np.float16)], [0, 1])
        with pytest.raises(IncompatiblePeerError) as err:
            dest.check(there.wire_spec(), there.tokens(2))
        text = str(err.value)
        assert "paged:2x16x8x128/t1:m" in text and "paged:2x16x8x128:m" in text
        assert "the same block shape with other wire rows" in text and "same token_axis" in text
        assert "rows of tokens, token_axis=1" in text and "opaque rows" in text
    other = PagedSpec(num_layers=1, block_shape=(2, 8, HEADS, DIM), model="m")
    dest = PagedDestination(old, [np.zeros((4, *shape), np.float16)], [0, 1])
    with pytest.raises(IncompatiblePeerError) as err:
        dest.check(other.wire_spec(), 2 * other.rows_per_block)
    assert "other wire rows" not in str(err.value)


async def test_paged_int4_send_lands_the_reference_codes() -> None:
    # Over a real connection (the compiled codec reads the rows where they lie): the
    # received blocks hold exactly what the reference int4 makes of the blocks' K and V.
    spec = PagedSpec(num_layers=1, block_shape=(2, BLOCK, HEADS, DIM), dtype="float16", token_axis=1)
    assert spec.row_shape == (HEADS, DIM)
    rng = np.random.default_rng(3)
    src = np.empty((6, *spec.block_shape), np.float16)
    src[:, 0] = outlier_keys(6 * BLOCK, seed=4).reshape(6, BLOCK, HEADS, DIM).astype(np.float16)
    src[:, 1] = rng.standard_normal((6, BLOCK, HEADS, DIM), dtype=np.float32).astype(np.float16)
    dst = np.zeros((6, *spec.block_shape), np.float16)
    src_ids, dst_ids = [4, 1, 5], [0, 3, 2]
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            dest = PagedDestination(spec, [dst], dst_ids)
            waiting = asyncio.create_task(server.expect("req", into=dest, timeout=10))
            await asyncio.sleep(0)
            receipt = await peer.send("req", spec.wire_spec(), PagedSource(spec, [src], src_ids), codec="int4")
            transfer = await waiting
            async for _ in transfer:
                pass
    assert receipt.codec == "int4"
    got = gather_layer(spec, dst, dst_ids)
    for kind, rows in enumerate(gather_layer(spec, src, src_ids)):
        codec = Int4Codec()
        enc = codec.encode_numpy(rows, TensorKind(kind))
        want = codec.decode_numpy(enc.params, enc.payload, shape=rows.shape, dtype="float16", kind=TensorKind(kind))
        assert np.asarray(got[kind]).tobytes() == want.tobytes()


@pytest.mark.parametrize("chunk_bytes", [None, 16384])
@pytest.mark.parametrize("codec", ["raw", "fp8", "int8", "int4", "int4+zstd"])
async def test_token_rows_land_in_kept_blocks_and_skip_dropped_ones(codec: str, chunk_bytes: int | None) -> None:
    # Rows of tokens (token_axis=1) over a real connection, two layers, into destination
    # ids with DROP slots: each kept block holds exactly what the codec's reference makes
    # of the same rows, and the dropped slots' and unnamed blocks stay untouched.
    spec = PagedSpec(num_layers=2, block_shape=(2, BLOCK, HEADS, DIM), dtype="float16", token_axis=1)
    rng = np.random.default_rng(1)
    src = [rng.standard_normal((6, *spec.block_shape), dtype=np.float32).astype(np.float16) for _ in range(2)]
    dst = [np.zeros((6, *spec.block_shape), np.float16) for _ in range(2)]
    src_ids, dst_ids = [4, 1, 5, 0], [0, DROP, 2, DROP]
    options = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, **options) as peer:
            dest = PagedDestination(spec, dst, dst_ids)
            waiting = asyncio.create_task(server.expect("req", into=dest, timeout=10))
            await asyncio.sleep(0)
            receipt = await peer.send("req", spec.wire_spec(), PagedSource(spec, src, src_ids), codec=codec)
            transfer = await waiting
            async for _ in transfer:
                pass
    assert receipt.codec == codec
    reference = {"fp8": Fp8Codec, "int8": Int8Codec, "int4": Int4Codec, "int4+zstd": Int4Codec}
    for layer in range(2):
        got = gather_layer(spec, dst[layer], [0, 2])
        for kind, rows in enumerate(gather_layer(spec, src[layer], src_ids)):
            rows = np.asarray(rows)
            if codec == "raw":
                want = rows
            else:
                # each chunk is encoded alone (int4 key groups end with it): chunk_bytes
                # of float16 rows of HEADS x DIM, 8 rows a chunk at 16384
                ref, parts = reference[codec](), []
                step = len(rows) if chunk_bytes is None else chunk_bytes // (HEADS * DIM * 2)
                for start in range(0, len(rows), step):
                    part = np.ascontiguousarray(rows[start : start + step])
                    enc = ref.encode_numpy(part, TensorKind(kind))
                    parts.append(ref.decode_numpy(enc.params, enc.payload, shape=part.shape, dtype="float16",
                                                  kind=TensorKind(kind)))
                want = np.concatenate(parts)
            want = np.asarray(want).reshape(4, BLOCK, HEADS, DIM)[[0, 2]]  # the kept slots
            assert np.asarray(got[kind]).reshape(want.shape).tobytes() == want.tobytes(), (layer, kind)
        assert not dst[layer][[1, 3, 4, 5]].any()  # dropped and unnamed blocks untouched
