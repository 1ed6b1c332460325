"""Paged sources and destinations on GPU arrays (CuPy, and torch CUDA tensors through DLPack).

Skipped only where there is no CUDA device with CuPy.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

import kvwire
from kvwire.codec import numpy_dtype
from kvwire.codec.gpu import gpu_available
from kvwire.paged import DROP, PagedDestination, PagedSource, PagedSpec, gather_layer
from tests.conftest import SECRET

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a CUDA device"),
    pytest.mark.timeout(120),
]


def host_caches(spec: PagedSpec, num_blocks: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    dt = numpy_dtype(spec.dtype)
    return [rng.standard_normal((num_blocks, *spec.block_shape), dtype=np.float32).astype(dt) for _ in range(spec.num_layers)]


def to_gpu(x: np.ndarray) -> Any:
    import cupy

    return cupy.asarray(x.view(np.uint16) if x.dtype.itemsize == 2 and x.dtype.name == "bfloat16" else x)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_gather_on_gpu_matches_host(dtype: str) -> None:
    spec = PagedSpec(num_layers=1, block_shape=(2, 16, 64), dtype=dtype)
    host = host_caches(spec, 9, 0)[0]
    k, v = gather_layer(spec, to_gpu(host), [8, 2, 5])
    hk, hv = gather_layer(spec, host, [8, 2, 5])
    assert type(k).__module__.startswith("cupy")
    assert k.get().tobytes() == hk.tobytes() and v.get().tobytes() == hv.tobytes()


@pytest.mark.parametrize("drop", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
async def test_gpu_source_to_gpu_destination(dtype: str, drop: bool) -> None:
    """Blocks land in the GPU cache's named blocks; with ``DROP`` for the first, it is
    received and written nowhere."""
    spec = PagedSpec(num_layers=2, block_shape=(2, 16, 64), dtype=dtype)
    ids = [DROP, 0, 3] if drop else [7, 0, 3]
    src_host = host_caches(spec, 8, 1)
    dst_host = [np.zeros_like(c) for c in host_caches(spec, 8, 2)]
    src = [to_gpu(c) for c in src_host]
    dst = [to_gpu(c) for c in dst_host]
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, chunk_bytes=20_000) as peer:
            waiting = asyncio.create_task(server.expect("g", into=PagedDestination(spec, dst, ids), timeout=30))
            await asyncio.sleep(0)
            await peer.send("g", spec.wire_spec(), PagedSource(spec, src, [1, 6, 2]))
            transfer = await waiting
            assert [layer.index async for layer in transfer] == [0, 1]
    for s, d in zip(src_host, dst, strict=True):
        got = d.get()
        kept = [(b, a) for b, a in zip(ids, [1, 6, 2], strict=True) if b != DROP]
        assert got[[b for b, _ in kept]].tobytes() == s[[a for _, a in kept]].view(got.dtype).tobytes()
        assert not got[[b for b in range(8) if b not in ids]].any()


async def test_torch_cuda_tensors_through_dlpack() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    spec = PagedSpec(num_layers=1, block_shape=(2, 16, 64), dtype="bfloat16")
    src = [torch.randn(6, 2, 16, 64, device="cuda").to(torch.bfloat16)]
    dst = [torch.zeros(6, 2, 16, 64, device="cuda", dtype=torch.bfloat16)]
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            waiting = asyncio.create_task(server.expect("t", into=PagedDestination(spec, dst, [5, 1]), timeout=30))
            await asyncio.sleep(0)
            await peer.send("t", spec.wire_spec(), PagedSource(spec, src, [0, 4]))
            # collect() is refused for a transfer into a destination: iterate it
            assert [layer.index async for layer in await waiting] == [0]
    assert torch.equal(dst[0][[5, 1]], src[0][[0, 4]])
