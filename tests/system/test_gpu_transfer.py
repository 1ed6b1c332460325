"""Device arrays through the transport: quantized on the sending GPU, dequantized on the receiving one.

The CUDA paths run wherever CuPy finds a device; elsewhere only the clear refusals are
checked (the kernels' arithmetic is checked on the host in tests/codec).
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

import kvwire
from kvwire.codec import TensorKind, get_codec
from kvwire.codec.gpu import gpu_available
from tests.conftest import SECRET, make_layers

pytestmark = pytest.mark.timeout(120)
needs_gpu = pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a CUDA device")


class FakeCudaTensor:
    """Anything whose DLPack device is CUDA (kDLCUDA = 2)."""

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, 0)

    def __dlpack__(self, stream: Any = None) -> Any:
        raise BufferError("not really on a GPU")


async def test_gpu_server_without_a_gpu_is_a_clear_error() -> None:
    if gpu_available():
        pytest.skip("a GPU is present")
    with pytest.raises(kvwire.UsageError, match="CuPy and a CUDA device"):
        kvwire.serve("127.0.0.1", 0, secret=SECRET, device="gpu")


async def test_device_tensor_without_cupy_is_a_clear_error() -> None:
    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy is installed")
    except ImportError:
        pass
    spec = kvwire.KVSpec(num_layers=1, num_kv_heads=1, head_dim=8)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            with pytest.raises(kvwire.UsageError, match="GPU"):
                await peer.send("d", spec, [(FakeCudaTensor(), FakeCudaTensor())])


@needs_gpu
@pytest.mark.parametrize("codec", ["raw", "fp8", "int8", "int4", "fp8+zstd"])
async def test_cupy_cache_round_trip_matches_the_numpy_codecs(codec: str) -> None:
    import cupy

    spec = kvwire.KVSpec(num_layers=3, num_kv_heads=4, head_dim=64)
    host = make_layers(3, 200, 4, 64)
    device = [(cupy.asarray(k), cupy.asarray(v)) for k, v in host]
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, device="gpu") as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, codec=codec, chunk_bytes=1 << 16) as peer:
            recv = asyncio.create_task(server.accept())
            await peer.send("g", spec, device, timeout=60)
            cache = await (await recv).collect(device="gpu", timeout=60)
    c = get_codec(codec)
    for (k, v), (k2, v2) in zip(host, cache.layers, strict=True):
        assert isinstance(k2, cupy.ndarray)
        for x, y, kind in ((k, k2, TensorKind.K), (v, v2, TensorKind.V)):
            # The GPU result equals what the numpy reference produces for the same chunks.
            ref = np.concatenate([
                c.decode(*(lambda e: (e.params, e.payload))(c.encode(x[s : s + 128], kind)),
                         shape=x[s : s + 128].shape, dtype="float16", kind=kind)
                for s in range(0, x.shape[0], 128)
            ])
            assert np.array_equal(cupy.asnumpy(y), ref)
