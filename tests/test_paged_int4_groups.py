"""int4 keys of a paged cache are grouped per (head, channel), as an unpaged cache's are.

A block ``[2, block_size, num_kv_heads, head_size]`` used to travel as rows of one head's
vector each (``(token, head)`` pairs), so an int4 key group of 32 wire tokens took 4 tokens
of all 8 heads: one scale for 8 different channels, each with its own outliers.  On the
outlier-key fixture below the relative RMS error was about 1.5x the unpaged send's.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import kvwire
from kvwire.codec import Int4Codec, TensorKind, numpy_dtype
from kvwire.paged import PagedDestination, PagedSource, PagedSpec, gather_layer
from tests.conftest import SECRET

pytestmark = pytest.mark.timeout(60)

BLOCK, HEADS, DIM, BLOCKS = 16, 8, 128, 16


def outlier_keys(tokens: int, seed: int) -> np.ndarray:
    """Keys ``[tokens, HEADS, DIM]`` (float32) with per-(head, channel) scales drawn
    log-normally, per-channel offsets, and 4 outlier channels (8-20x) per head, each head
    its own."""
    rng = np.random.default_rng(seed)
    scales = np.exp(rng.normal(0.0, 0.5, (HEADS, DIM))).astype(np.float32)
    for h in range(HEADS):
        channels = rng.choice(DIM, 4, replace=False)
        scales[h, channels] *= rng.uniform(8.0, 20.0, 4).astype(np.float32)
    offsets = rng.normal(0.0, 0.5, (HEADS, DIM)).astype(np.float32) * scales
    return (rng.standard_normal((tokens, HEADS, DIM), dtype=np.float32) * scales + offsets).astype(np.float32)


def rel_rms(x: np.ndarray, y: np.ndarray) -> float:
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    return float(np.sqrt(np.mean((x64 - y64) ** 2) / np.mean(x64**2)))


def int4_keys(rows: np.ndarray, dtype: str) -> np.ndarray:
    codec = Int4Codec()
    enc = codec.encode_numpy(rows, TensorKind.K)
    return codec.decode_numpy(enc.params, enc.payload, shape=rows.shape, dtype=dtype, kind=TensorKind.K)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_paged_int4_key_error_matches_unpaged(dtype: str) -> None:
    # One cache per layer, blocks [2, block_size, heads, head_size]: K plane, V plane.
    dt = numpy_dtype(dtype)
    keys = outlier_keys(BLOCKS * BLOCK, seed=1).astype(dt)
    cache = np.zeros((BLOCKS, 2, BLOCK, HEADS, DIM), dt)
    cache[:, 0] = keys.reshape(BLOCKS, BLOCK, HEADS, DIM)
    spec = PagedSpec.of(cache, num_layers=1)
    k, _v = gather_layer(spec, cache, np.arange(BLOCKS))
    paged = int4_keys(np.asarray(k), dtype).reshape(keys.shape)
    unpaged = int4_keys(keys, dtype)
    base, got = rel_rms(keys, unpaged), rel_rms(keys, paged)
    assert got <= 1.10 * base, (got, base)
    err = np.abs(paged.astype(np.float32) - keys.astype(np.float32))
    assert err.max() <= 1.10 * np.abs(unpaged.astype(np.float32) - keys.astype(np.float32)).max()


def test_wire_rows_are_tokens_of_heads_for_kv_plane_blocks() -> None:
    # [2, block_size, heads..., head_size]: a wire token is one cache token, its heads the block's.
    for shape, heads, dim, rows in (((2, BLOCK, HEADS, DIM), HEADS, DIM, BLOCK),
                                    ((2, BLOCK, 1, 576), 1, 576, BLOCK),
                                    ((2, 4, 2, 4, 32), 8, 32, 4)):
        spec = PagedSpec(num_layers=2, block_shape=shape, dtype="float16")
        wire = spec.wire_spec()
        assert (wire.num_kv_heads, wire.head_dim, spec.rows_per_block) == (heads, dim, rows)
    # Other blocks keep rows of their last dimension, one head: vLLM's CPU layout
    # [num_kv_heads, block_size, 2 * head_size], blocks with no heads axis, and a K-only
    # [block_size, heads, head_size] (no K/V axis to tell its first axis is the tokens).
    for other, width in (((8, 128, 256), 256), ((2, 8), 8), ((2, 4, 32), 32), ((4, 64), 64),
                         ((BLOCK, HEADS, DIM), DIM)):
        wire = PagedSpec(num_layers=1, block_shape=other).wire_spec()
        assert (wire.num_kv_heads, wire.head_dim) == (1, width)


async def test_paged_int4_send_lands_the_reference_codes() -> None:
    # Over a real connection (the compiled codec reads the rows where they lie): the
    # received blocks hold exactly what the reference int4 makes of the blocks' K and V.
    spec = PagedSpec(num_layers=1, block_shape=(2, BLOCK, HEADS, DIM), dtype="float16")
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
