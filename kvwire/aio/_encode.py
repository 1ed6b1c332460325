"""Encoding chunks of K or V for the wire: on the host (quantizing codecs off the event
loop) or on the GPU that holds the tensor (``kvwire/aio/_gpu.py``).

Both yield ``(kind, token_start, token_count, codec, encoded)`` per chunk of a plan, and feed the
measured encode speed and size to the ``auto`` codec chooser when there is one.

With ``raw_fallback`` (the codecs are ``auto``'s choices) a chunk whose values the chosen
quantizer refuses (:class:`~kvwire.errors.UnrepresentableValuesError`: NaN or infinity;
int4: a group's range past float32) goes raw instead, and is yielded with ``raw`` as its
codec; a codec the caller named still refuses it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable
from typing import Any

from kvwire.aio._workers import in_worker
from kvwire.codec import EncodedChunk, TensorKind, get_codec, numpy_dtype
from kvwire.control import CodecChooser
from kvwire.errors import UnrepresentableValuesError
from kvwire.paged import BlockRows
from kvwire.wire.frames import payload_nbytes

#: Chunks of a host array submitted for encoding before the consumer takes them
ENCODE_AHEAD = 2
#: (kind, token_start, token_count, codec, encoded) of one chunk
Encoded = tuple[TensorKind, int, int, Any, Any]
#: (kind, array, plan) of K or V: the chunks' (token_start, token_count) in order
Part = tuple[TensorKind, Any, list[tuple[int, int]]]


def encode_host(codec: Any, x: Any, kind: TensorKind) -> Any:
    """``codec.encode(x, kind)`` of a host chunk.  Rows of a paged cache's blocks
    (:class:`~kvwire.paged.BlockRows`) go raw as they lie (the payload is their blocks'
    buffers), are quantized where they lie by a codec that can
    (``Codec.encode_ranges``), and are gathered into one array for any other."""
    if isinstance(x, BlockRows):
        ranges = x.byte_ranges()
        if codec.name == "raw":
            return EncodedChunk(codec.codec_id, b"", ranges)
        enc = codec.encode_ranges(ranges.base, ranges.spans, x.shape, x.dtype.name, kind)
        if enc is not None:
            return enc
        x = x.gather()
    return codec.encode(x, kind)


def encodes_inline(codec: Any) -> bool:
    """``raw`` makes its payload (a view of the input) at once, on the loop; every other
    codec quantizes or compresses on a worker thread."""
    return bool(codec.lossless) and "+" not in codec.name


async def encode(codec: Any, x: Any, kind: TensorKind, chooser: CodecChooser | None) -> Any:
    """Encode one chunk; quantizing codecs run off the event loop so acks keep flowing."""
    if encodes_inline(codec):
        return encode_host(codec, x, kind)
    return await finish_encode(start_encode(codec, x, kind)[0], codec, x, chooser)


def start_encode(
    codec: Any, x: Any, kind: TensorKind, after: threading.Event | None = None,
    stop: threading.Event | None = None,
) -> tuple[asyncio.Future[tuple[Any, float]], threading.Event]:
    """Submit a worker-thread encode now (running, or queued, before the caller yields);
    with ``after``, the worker starts it once the encode that sets ``after`` has ended, so
    chained encodes follow each other on the workers without waiting for the loop; once
    ``stop`` is set, one not yet started never starts (nobody will take it).
    Returns the future and the event set when this encode has ended."""
    ended = threading.Event()

    def job() -> tuple[Any, float]:
        try:
            if after is not None:
                after.wait()
            if stop is not None and stop.is_set():
                raise asyncio.CancelledError  # its future was cancelled: nothing reads this
            return _timed_encode(codec, x, kind)
        finally:
            ended.set()

    # (at interpreter exit the pool refuses work: encoded on the loop, after the encode
    # before it, which a worker runs)
    return in_worker(asyncio.get_running_loop(), job), ended


async def finish_encode(
    fut: asyncio.Future[tuple[Any, float]], codec: Any, x: Any, chooser: CodecChooser | None,
) -> Any:
    """The encoded chunk of :func:`start_encode`, its speed and size told to the chooser."""
    enc, seconds = await fut
    if chooser is not None:
        fp16_bytes = x.nbytes * 2 // x.itemsize
        chooser.observe_encode(codec.name, fp16_bytes, seconds)
        chooser.observe_size(codec.name, fp16_bytes, payload_nbytes(enc.payload) + len(enc.params))
    return enc


def _timed_encode(codec: Any, x: Any, kind: TensorKind) -> tuple[Any, float]:
    """The encode and the worker thread's CPU time in it: the wait for a free worker, for
    the loop to pick the result up, and for a core while other work had it are not the
    codec's cost. (Timed on the clock, the speeds of one codec on a host shared by three
    processes spread 2.5-4.7 GB/s, and a codec measured in a slow moment and then not sent
    kept that speed; on its CPU time the same chunks measured 3.7-4.7. The transport's
    and the receiver's decode costs are CPU time too.)"""
    t0 = time.thread_time()
    enc = encode_host(codec, x, kind)
    return enc, time.thread_time() - t0


def raw_based(name: str) -> bool:
    """``raw`` or ``raw+<entropy stage>``: nothing for a GPU kernel to quantize."""
    return name.split("+")[0] == "raw"


async def host_chunks(
    parts: list[Part], pick: Callable[[], Any], chooser: CodecChooser | None, *, ahead: int = ENCODE_AHEAD,
    raw_fallback: bool = False,
) -> AsyncGenerator[Encoded, None]:
    """Chunks of host arrays (each part's plan in turn), each with the codec ``pick()``
    chooses for it (when its chunk is submitted); with ``raw_fallback``, ``raw`` for a
    chunk whose values that codec refuses (the chooser is told nothing of the encode that
    failed, and nothing of the raw chunk: raw encodes nothing).

    Encoded ahead: up to ``ahead`` chunks are submitted to the workers before the consumer
    takes them, each starting as soon as the one before has ended, so the encoder keeps
    working while the consumer sends; with ``ahead=0`` a chunk is encoded only once the
    consumer asks for it.  Close the iterator (``contextlib.aclosing``) to cancel what it
    submitted and nobody took.
    """
    items = [(kind, arr, start, count) for kind, arr, plan in parts for start, count in plan]
    # (codec, chunk, payload or future, the event its encode sets when it ended)
    pending: deque[tuple[Any, Any, Any, threading.Event | None]] = deque()
    last: threading.Event | None = None  # set when the latest submitted encode has ended
    stop = threading.Event()  # set once nobody takes the encodes not yet started
    submitted = 0
    total = len(items)

    def submit() -> None:
        nonlocal last, submitted
        kind, arr, s, c = items[submitted]
        submitted += 1
        codec = pick()
        x = arr[s : s + c]
        if encodes_inline(codec):
            pending.append((codec, x, encode_host(codec, x, kind), None))
            return
        fut, last = start_encode(codec, x, kind, after=last, stop=stop)
        pending.append((codec, x, fut, last))

    try:
        for kind, _arr, s, c in items:
            while submitted < total and (not pending or len(pending) < ahead):
                submit()
            codec, x, enc, _ended = pending.popleft()
            if isinstance(enc, asyncio.Future):
                try:
                    enc = await finish_encode(enc, codec, x, chooser)
                except UnrepresentableValuesError:
                    # the quantizer refused the chunk's values (every other UsageError of
                    # an encode is the caller's mistake, and raw's as well)
                    if not raw_fallback:
                        raise
                    codec = get_codec("raw")
                    enc = encode_host(codec, x, kind)
            if ahead and submitted < total:
                submit()  # the next encode is queued before this chunk is handed on
            yield kind, s, c, codec, enc
    finally:
        stop.set()  # before the chain is released below: what it starts encodes nothing
        for _codec, _x, fut, ended in pending:
            if isinstance(fut, asyncio.Future):
                if not fut.done():
                    fut.cancel()
                elif not fut.cancelled():
                    fut.exception()  # retrieved: the consumer stopped for a reason of its own
            if ended is not None:
                # A cancelled encode never runs to set it: the next in the chain, if a
                # worker has started it already, must not wait for it for ever.
                ended.set()


async def device_chunks(
    codec: Any, x: Any, kind: TensorKind, plan: list[tuple[int, int]], dtype: str, chooser: CodecChooser | None,
) -> AsyncGenerator[Encoded, None]:
    """Chunks of a CuPy tensor: quantized on its GPU in one launch, the payloads copied to
    pinned host memory overlapped with sending.

    ``raw`` (and ``raw+...``) has no kernel: the chunks are copied to the host as they are.
    Closing this iterator closes the copies' iterator at once (its pinned buffers, events
    and device buffers released before ``aclose()`` returns).
    """
    from kvwire.aio import _gpu

    if raw_based(codec.name):
        async with contextlib.aclosing(_gpu.copy_raw_chunks(x, plan)) as raw:
            async for start, count, host in raw:
                if dtype == "bfloat16":
                    host = host.view(numpy_dtype("bfloat16"))
                yield kind, start, count, codec, await encode(codec, host, kind, chooser)
        return
    t0 = time.perf_counter()
    async with contextlib.aclosing(_gpu.encode_chunks(codec, x, kind, plan, dtype)) as chunks:
        async for start, count, enc in chunks:
            if start == 0 and chooser is not None:
                chooser.observe_encode(codec.name, x.size * 2, time.perf_counter() - t0)
            yield kind, start, count, codec, enc


async def device_parts(
    parts: list[Part], pick: Callable[[], Any], dtype: str, chooser: CodecChooser | None, *,
    raw_fallback: bool = False,
) -> AsyncGenerator[Encoded, None]:
    """:func:`device_chunks` of each part in turn, the codec picked once per part; closing
    this iterator closes the part's at once.  With ``raw_fallback``, a part whose values
    the codec refuses goes raw (the kernel's flags, for the whole tensor, are read before
    its first chunk is yielded)."""
    for kind, x, plan in parts:
        codec = pick()
        sent = False
        try:
            async with contextlib.aclosing(device_chunks(codec, x, kind, plan, dtype, chooser)) as chunks:
                async for item in chunks:
                    sent = True
                    yield item
        except UnrepresentableValuesError:
            if sent or not raw_fallback:
                raise
        else:
            continue
        async with contextlib.aclosing(device_chunks(get_codec("raw"), x, kind, plan, dtype, chooser)) as chunks:
            async for item in chunks:
                yield item


__all__ = [
    "ENCODE_AHEAD", "Encoded", "Part", "device_chunks", "device_parts", "encode", "encode_host", "encodes_inline",
    "finish_encode", "host_chunks", "raw_based", "start_encode",
]
