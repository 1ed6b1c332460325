"""Codecs chosen per transfer travel in chunk frames; the receiver dequantizes to spec.dtype."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import kvwire
from kvwire.aio import ClientOptions
from tests.conftest import SECRET, make_layers, same_cache

pytestmark = pytest.mark.timeout(60)
BOUNDS = {"fp8": 0.04, "int8": 0.01, "int4": 0.15, "fp8+zstd": 0.04, "raw+lz4": 0.0}


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    return float(np.linalg.norm(a32 - b32) / np.linalg.norm(a32))


@pytest.mark.parametrize("codec", sorted(BOUNDS))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
async def test_codec_round_trip_over_sockets(codec: str, dtype: str) -> None:
    spec = kvwire.KVSpec(num_layers=3, num_kv_heads=4, head_dim=32, dtype=dtype)
    layers = make_layers(3, 100, 4, 32, dtype)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, codec=codec, streams=2,
                                  chunk_bytes=8192) as peer:
            recv = asyncio.create_task(server.accept())
            receipt = await peer.send("c", spec, layers, timeout=20)
            cache = await (await recv).collect(timeout=20)
    assert receipt.codec == codec
    for (k, v), (k2, v2) in zip(layers, cache.layers, strict=True):
        assert k2.dtype == k.dtype and k2.shape == k.shape
        assert rel_err(k, k2) <= BOUNDS[codec] and rel_err(v, v2) <= BOUNDS[codec]
    if codec.startswith(("fp8", "int8")):
        assert receipt.wire_bytes < 0.75 * receipt.kv_bytes * 2 / spec.itemsize


async def test_per_send_override_and_refused_codec() -> None:
    spec = kvwire.KVSpec(num_layers=2, num_kv_heads=2, head_dim=16)
    layers = make_layers(2, 20, 2, 16)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, codecs=["raw", "int8"]) as server:
        with pytest.raises(kvwire.IncompatiblePeerError):
            async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, codec="fp8"):
                pass
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            r = await peer.send("a", spec, layers, codec="int8", timeout=10)
            assert r.codec == "int8"
            with pytest.raises(kvwire.IncompatiblePeerError):
                await peer.send("b", spec, layers, codec="int4")
            r2 = await peer.send("c", spec, layers, timeout=10)
            assert r2.codec == "raw"
            t = await server.expect("c", timeout=5)
            assert same_cache((await t.collect()).layers, layers)


@pytest.mark.parametrize("mode", ["model", "measured"])
async def test_auto_codec_delivers_within_the_coarsest_bound(mode: str) -> None:
    spec = kvwire.KVSpec(num_layers=8, num_kv_heads=4, head_dim=32)
    layers = make_layers(8, 256, 4, 32)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, codec="auto", chunk_bytes=16384,
                                  auto_codec=mode) as peer:
            recv = asyncio.create_task(server.accept())
            r = await peer.send("auto", spec, layers, timeout=20)
            cache = await (await recv).collect(timeout=20)
            chooser = peer.chooser
    assert chooser is not None and chooser.measures_goodput == (mode == "measured")
    # measured: the acknowledgements of 64 chunks were measured, at least the first codec's run
    assert bool(chooser.meter.measured) == (mode == "measured")
    assert sum(r.extra["chunks_by_codec"].values()) == r.chunks
    assert set(r.extra["chunks_by_codec"]) <= {"raw", "fp8", "int8", "int4"}
    for (k, v), (k2, v2) in zip(layers, cache.layers, strict=True):
        assert rel_err(k, k2) <= 0.15 and rel_err(v, v2) <= 0.15


def test_auto_codec_mode_is_checked() -> None:
    with pytest.raises(kvwire.UsageError, match="auto_codec"):
        ClientOptions(auto_codec="fastest")


async def test_deadline_needs_auto() -> None:
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            with pytest.raises(kvwire.UsageError):
                await peer.send("d", kvwire.KVSpec(num_layers=1, num_kv_heads=1, head_dim=8),
                                make_layers(1, 2, 1, 8), deadline=1.0)
