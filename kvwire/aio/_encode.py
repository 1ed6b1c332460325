"""Encoding chunks of K or V for the wire: on the host (quantizing codecs off the event
loop) or on the GPU that holds the tensor (``kvwire/aio/_gpu.py``).

Both yield ``(token_start, token_count, codec, encoded)`` per chunk of a plan, and feed the
measured encode speed and size to the ``auto`` codec chooser when there is one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from kvwire.codec import TensorKind, numpy_dtype
from kvwire.control import CodecChooser

Encoded = tuple[int, int, Any, Any]


def payload_size(enc: Any) -> int:
    payload = enc.payload
    return int(payload.nbytes) if hasattr(payload, "nbytes") else len(payload)


async def encode(codec: Any, x: Any, kind: TensorKind, chooser: CodecChooser | None) -> Any:
    """Encode one chunk; quantizing codecs run off the event loop so acks keep flowing."""
    if codec.lossless and "+" not in codec.name:
        return codec.encode(x, kind)
    enc, seconds = await asyncio.get_running_loop().run_in_executor(None, _timed_encode, codec, x, kind)
    if chooser is not None:
        fp16_bytes = x.nbytes * 2 // x.itemsize
        chooser.observe_encode(codec.name, fp16_bytes, seconds)
        chooser.observe_size(codec.name, fp16_bytes, payload_size(enc) + len(enc.params))
    return enc


def _timed_encode(codec: Any, x: Any, kind: TensorKind) -> tuple[Any, float]:
    """The encode and its own duration, timed on the worker thread: the wait for a free
    worker and for the loop to pick the result up are not the codec's cost."""
    t0 = time.perf_counter()
    enc = codec.encode(x, kind)
    return enc, time.perf_counter() - t0


def raw_based(name: str) -> bool:
    """``raw`` or ``raw+<entropy stage>``: nothing for a GPU kernel to quantize."""
    return name.split("+")[0] == "raw"


async def host_chunks(
    arr: Any, kind: TensorKind, plan: list[tuple[int, int]], pick: Callable[[], Any], chooser: CodecChooser | None,
) -> AsyncIterator[Encoded]:
    """Chunks of a host array, each with the codec ``pick()`` chooses for it."""
    for start, count in plan:
        codec = pick()
        yield start, count, codec, await encode(codec, arr[start : start + count], kind, chooser)


async def device_chunks(
    codec: Any, x: Any, kind: TensorKind, plan: list[tuple[int, int]], dtype: str, chooser: CodecChooser | None,
) -> AsyncIterator[Encoded]:
    """Chunks of a CuPy tensor: quantized on its GPU in one launch, the payloads copied to
    pinned host memory overlapped with sending.

    ``raw`` (and ``raw+...``) has no kernel: the chunks are copied to the host as they are.
    """
    from kvwire.aio import _gpu

    if raw_based(codec.name):
        async for start, count, host in _gpu.copy_raw_chunks(x, plan):
            if dtype == "bfloat16":
                host = host.view(numpy_dtype("bfloat16"))
            yield start, count, codec, await encode(codec, host, kind, chooser)
        return
    t0 = time.perf_counter()
    async for start, count, enc in _gpu.encode_chunks(codec, x, kind, plan, dtype):
        if start == 0 and chooser is not None:
            chooser.observe_encode(codec.name, x.size * 2, time.perf_counter() - t0)
        yield start, count, codec, enc


__all__ = ["Encoded", "device_chunks", "encode", "host_chunks", "payload_size", "raw_based"]
