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
GPU = gpu_available()


def needs_gpu(fn: Any) -> Any:
    return pytest.mark.gpu(pytest.mark.skipif(not GPU, reason="needs CuPy and a CUDA device")(fn))


class FakeCudaTensor:
    """Anything whose DLPack device is CUDA (kDLCUDA = 2)."""

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, 0)

    def __dlpack__(self, stream: Any = None) -> Any:
        raise BufferError("not really on a GPU")


async def test_gpu_server_without_a_gpu_is_a_clear_error() -> None:
    with pytest.raises(kvwire.UsageError, match="'cpu', 'gpu' or 'gpu:N'"):
        kvwire.serve("127.0.0.1", 0, secret=SECRET, device="cuda")
    if GPU:
        with pytest.raises(kvwire.UsageError, match="CUDA device"):
            kvwire.serve("127.0.0.1", 0, secret=SECRET, device="gpu:99")
        return
    for device in ("gpu", "gpu:1"):
        with pytest.raises(kvwire.UsageError, match="CuPy and a CUDA device"):
            kvwire.serve("127.0.0.1", 0, secret=SECRET, device=device)


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
@pytest.mark.parametrize("codec", ["raw", "fp8", "int8", "int4", "fp8+zstd", "raw+lz4", "auto"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("depth", [1, 4])
async def test_cupy_cache_round_trip_matches_the_numpy_codecs(codec: str, dtype: str, depth: int, monkeypatch: pytest.MonkeyPatch) -> None:
    import cupy

    from kvwire.aio import _gpu

    monkeypatch.setattr(_gpu, "PIPELINE_DEPTH", depth)
    spec = kvwire.KVSpec(num_layers=3, num_kv_heads=4, head_dim=64, dtype=dtype)
    host = make_layers(3, 200, 4, 64, dtype=dtype)
    bits = np.uint16 if dtype == "bfloat16" else None
    device = [(cupy.asarray(k.view(bits) if bits else k), cupy.asarray(v.view(bits) if bits else v)) for k, v in host]
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, device="gpu:0") as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, codec=codec, chunk_bytes=1 << 16) as peer:
            recv = asyncio.create_task(server.accept())
            receipt = await peer.send("g", spec, device, timeout=60)
            cache = await (await recv).collect(device="gpu", timeout=60)
    used = receipt.extra["chunks_by_codec"]
    for (k, v), (k2, v2) in zip(host, cache.layers, strict=True):
        assert isinstance(k2, cupy.ndarray)
        for x, y, kind in ((k, k2, TensorKind.K), (v, v2, TensorKind.V)):
            if codec == "auto":
                continue  # the codec per chunk is the chooser's; checked by the fixed ones
            # The GPU result equals what the numpy reference produces for the same chunks.
            c = get_codec(codec)
            ref = np.concatenate([
                c.decode(*(lambda e: (e.params, e.payload))(c.encode(x[s : s + 128], kind)),
                         shape=x[s : s + 128].shape, dtype=dtype, kind=kind)
                for s in range(0, x.shape[0], 128)
            ])
            assert cupy.asnumpy(y).tobytes() == ref.tobytes()
    assert sum(used.values()) == 3 * 2 * 2


@needs_gpu
async def test_nan_on_the_gpu_is_refused_before_sending() -> None:
    import cupy

    spec = kvwire.KVSpec(num_layers=1, num_kv_heads=4, head_dim=64)
    k, v = make_layers(1, 64, 4, 64)[0]
    v[10, 2, 3] = np.nan
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, device="gpu") as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, codec="fp8") as peer:
            with pytest.raises(kvwire.UsageError, match="NaN"):
                await peer.send("n", spec, [(cupy.asarray(k), cupy.asarray(v))], timeout=30)
