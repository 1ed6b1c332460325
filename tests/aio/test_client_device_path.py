"""The client's GPU send path over real sockets, with the device side faked on the host:
a tensor that is not a numpy array goes through ``kvwire.aio._gpu`` (one encode per tensor,
chunks copied to host buffers, payloads in host arrays) and what arrives is what was sent."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import kvwire
from tests.aio.auto_helpers import FakeDevice, fake_device_path
from tests.conftest import SECRET, make_layers, same_cache

pytestmark = pytest.mark.timeout(60)

SPEC = kvwire.KVSpec(num_layers=3, num_kv_heads=2, head_dim=16)


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    fake_device_path(monkeypatch, calls)
    return calls


@pytest.mark.parametrize("codec", ["raw", "fp8"])
async def test_device_tensors_go_through_the_gpu_path_and_arrive(codec: str, fake_gpu: list[str]) -> None:
    layers = make_layers(SPEC.num_layers, 96, SPEC.num_kv_heads, SPEC.head_dim, seed=3)
    on_device = [(FakeDevice(k), FakeDevice(v)) for k, v in layers]
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, codec=codec, streams=2,
                                  chunk_bytes=1024) as peer:
            recv = asyncio.create_task(server.accept())
            receipt = await peer.send("dev", SPEC, on_device, timeout=20)
            cache = await (await recv).collect(timeout=20)
    assert fake_gpu == (["copy"] if codec == "raw" else [f"encode:{codec}"]) * (2 * SPEC.num_layers)
    assert receipt.kv_bytes == sum(k.nbytes + v.nbytes for k, v in layers)
    if codec == "raw":
        assert same_cache(cache.layers, layers)
    else:
        for (k, v), (k2, v2) in zip(layers, cache.layers, strict=True):
            for a, b in ((k, k2), (v, v2)):
                a32, b32 = a.astype(np.float32), b.astype(np.float32)
                assert b.shape == a.shape and b.dtype == a.dtype
                assert float(np.linalg.norm(a32 - b32) / np.linalg.norm(a32)) < 0.1
