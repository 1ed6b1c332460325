"""Paged sources and destinations on torch tensors (CPU), over real loopback sockets.

Collected where vLLM (and so torch) is installed: ``bash .ci/vllm``.
"""

from __future__ import annotations

import asyncio

import pytest

import kvwire
from kvwire.errors import UsageError
from kvwire.paged import PagedDestination, PagedSource, PagedSpec, gather_layer, layer_rows

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.timeout(60)
SECRET = b"torch-paged-secret"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
async def test_torch_caches_round_trip_block_for_block(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    # vLLM's CPU layout: [num_blocks, num_kv_heads, block_size, 2 * head_dim]
    src = [torch.randn(10, 2, 128, 64).to(dtype) for _ in range(3)]
    dst = [torch.zeros(12, 2, 128, 64, dtype=dtype) for _ in range(3)]
    spec = PagedSpec.of(src[0], num_layers=3, model="tiny")
    assert spec.dtype == str(dtype).removeprefix("torch.")
    src_ids, dst_ids = [9, 0, 4], [2, 11, 5]
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, streams=2, chunk_bytes=40_000) as peer:
            waiting = asyncio.create_task(server.expect("r", into=PagedDestination(spec, dst, dst_ids), timeout=10))
            await asyncio.sleep(0)
            await peer.send("r", spec.wire_spec(), PagedSource(spec, src, src_ids))
            transfer = await waiting
            assert [layer.index async for layer in transfer] == [0, 1, 2]
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[dst_ids], s[src_ids])
        untouched = [i for i in range(12) if i not in dst_ids]
        assert not d[untouched].any()


@pytest.mark.parametrize(("have", "spec_dtype"), [
    ("bfloat16", "float16"), ("bfloat16", "float32"), ("float16", "bfloat16"), ("float32", "float16"),
])
def test_a_torch_cache_of_another_dtype_is_refused_not_reinterpreted(have: str, spec_dtype: str) -> None:
    # A bfloat16 cache is read through its int16 bits only under a bfloat16 spec: with
    # float16 (PagedSpec's default) its bits were taken as float16 values, and quantized so.
    spec = PagedSpec(num_layers=1, block_shape=(2, 8), dtype=spec_dtype)
    cache = torch.ones(4, 2, 8, dtype=getattr(torch, have))
    for make in (lambda: gather_layer(spec, cache, [0]), lambda: layer_rows(spec, cache, [0]),
                 lambda: PagedSource(spec, [cache], [0]), lambda: PagedDestination(spec, [cache], [0])):
        with pytest.raises(UsageError, match=f"cache has dtype {have}, the spec says {spec_dtype}"):
            make()
    assert torch.equal(cache, torch.ones(4, 2, 8, dtype=getattr(torch, have)))


def test_block_ids_in_a_tensor_off_the_host_are_a_usage_error() -> None:
    spec = PagedSpec(num_layers=1, block_shape=(2, 8), dtype="float32")
    cache = torch.zeros(4, 2, 8)
    ids = torch.tensor([0, 1], device="meta")  # stands for a CUDA block table
    for make in (lambda: PagedDestination(spec, [cache], ids), lambda: PagedSource(spec, [cache], ids)):
        with pytest.raises(UsageError, match="block ids must be integers in host memory"):
            make()
    assert PagedDestination(spec, [cache], torch.tensor([0, 1])).block_ids.tolist() == [0, 1]
