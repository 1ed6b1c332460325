"""The transport's GPU paths: encoding CuPy layers for the wire, decoding chunks onto a GPU.

Sending: each K or V tensor is encoded in one launch on a non-blocking CUDA stream of its
own device (ordered after the caller's current stream), then its chunk payloads are
copied into page-locked host buffers, up to :data:`PIPELINE_DEPTH` ahead of the chunk
being sent, each copy followed by an event; a chunk goes on the wire once its event has
fired, so the copy of chunk i+1 runs while chunk i is sent.  The buffers come from CuPy's
pinned pool and go back to it when the transport drops the chunk (after its ack).

Receiving (``serve(device="gpu")`` or ``"gpu:N"``): layer arrays live on that device,
allocated on the current stream (on a kvwire.sync bridge's loop thread: on the stream that
was current there before its own stream was installed, :func:`allocate_layers_on`); each
chunk is validated on the host (params, lengths, scales) and its codes decoded by the
kernel straight into the layer, on a non-blocking stream of that device ordered after the
allocating one, and waited for.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
import threading
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from kvwire.aio._workers import in_worker
from kvwire.codec import gpu
from kvwire.codec.base import Codec, EncodedChunk, TensorKind
from kvwire.errors import UsageError

#: chunk copies queued ahead of the chunk being sent (1: copy, then send, no overlap)
PIPELINE_DEPTH = 4

INSTALL_HINT = gpu.INSTALL_HINT


def check_device_name(device: object) -> re.Match[str] | None:
    """UsageError unless ``device`` is "cpu", "gpu" or "gpu:N" (the name only: nothing is
    probed); the match of a GPU name, None for "cpu"."""
    if device == "cpu":
        return None
    m = re.fullmatch(r"gpu(?::(\d+))?", device) if isinstance(device, str) else None
    if m is None:
        raise UsageError(f"device must be 'cpu', 'gpu' or 'gpu:N', got {device!r}")
    return m


def parse_device(device: str) -> int | None:
    """``None`` for "cpu"; the CUDA device number for "gpu" (the current one) or "gpu:N".

    UsageError for anything else, and for a GPU that CuPy cannot use.
    """
    m = check_device_name(device)
    if m is None:
        return None
    if not gpu.gpu_available():
        raise UsageError(f"device={device!r} needs CuPy and a CUDA device ({INSTALL_HINT})")
    import cupy

    index = int(m.group(1)) if m.group(1) is not None else int(cupy.cuda.runtime.getDevice())
    count = gpu.device_count()
    if index >= count:
        raise UsageError(f"device={device!r}: CuPy sees {count} CUDA device(s)")
    return index


_STREAMS: dict[int, Any] = {}


def stream_for(device_id: int) -> Any:
    """This process's non-blocking transfer stream on ``device_id`` (created on first use)."""
    import cupy

    stream = _STREAMS.get(device_id)
    if stream is None:
        with cupy.cuda.Device(device_id):
            stream = _STREAMS[device_id] = cupy.cuda.Stream(non_blocking=True)
    return stream


_LAYER_STREAMS = threading.local()  # a thread's streams for received layers: (cupy, {device: stream})


def thread_streams(local: threading.local, cupy: Any) -> dict[int, Any]:
    """This thread's streams kept in ``local``, by device: those of ``cupy`` (a new CuPy
    module, as tests load, starts with none)."""
    held = getattr(local, "held", None)
    if held is None or held[0] is not cupy:
        held = local.held = (cupy, {})
    streams: dict[int, Any] = held[1]
    return streams


def allocate_layers_on(cupy: Any, device_id: int, stream: Any) -> None:
    """(in this thread) A GPU server's layers on ``device_id`` are allocated on ``stream``
    from now on, not on the thread's current stream there.  A kvwire.sync bridge's loop
    thread keeps them on the stream that was current before it made its own non-blocking
    stream current: a layer handed to the caller and dropped there goes back to CuPy's
    pool in that stream's order (normally the legacy null stream, which the caller's
    blocking streams are ordered with), not the loop's own, whose next allocation could
    reuse it before reads still queued on the caller's stream."""
    thread_streams(_LAYER_STREAMS, cupy)[device_id] = stream


def layer_stream(cupy: Any, device_id: int) -> Any:
    """(``device_id`` current) The stream this thread allocates received layers on there:
    the one given to :func:`allocate_layers_on`, else the current stream."""
    stream = thread_streams(_LAYER_STREAMS, cupy).get(device_id)
    return stream if stream is not None else cupy.cuda.get_current_stream()


async def _wait(event: Any, device_id: int) -> None:
    if event.done:
        return
    import cupy

    def block() -> None:
        with cupy.cuda.Device(device_id):
            event.synchronize()

    await in_worker(asyncio.get_running_loop(), block)


def _device_context(device_id: int) -> Callable[[], AbstractContextManager[Any]]:
    import cupy

    def enter() -> AbstractContextManager[Any]:
        ctx: AbstractContextManager[Any] = cupy.cuda.Device(device_id)
        return ctx

    return enter


def _settle(events: list[Any], enter: Callable[[], AbstractContextManager[Any]]) -> None:
    """Block until each of ``events`` has fired: the pinned buffers their copies write may
    go back to CuPy's pool (and the device buffers they read be freed) after this.

    Synchronous on purpose: it runs where a send was cancelled or failed, and an await
    there could be cancelled in turn and let the buffers go with the copies in flight.  An
    event that cannot be synchronized belongs to a device in a sticky error state, where
    no copy runs any more; the error is not raised here, so it does not replace the one
    that ended the send."""
    if not events:
        return
    with enter():
        for event in events:
            with contextlib.suppress(Exception):
                event.synchronize()


async def copy_ring(
    src: Any,
    spans: list[tuple[int, int]],
    stream: Any,
    device_id: int,
    *,
    depth: int | None = None,
    alloc: Callable[[int], np.ndarray[Any, Any]] | None = None,
    copy: Callable[[Any, int, np.ndarray[Any, Any], Any], None] | None = None,
    wait: Callable[[Any, int], Awaitable[None]] = _wait,
    on_device: Callable[[], AbstractContextManager[Any]] | None = None,
) -> AsyncGenerator[tuple[int, np.ndarray[Any, Any]], None]:
    """``(i, host)`` for each ``(offset, nbytes)`` span of device buffer ``src``, in order:
    ``host`` is a pinned copy of those bytes, ready to read.

    The copies are queued on ``stream`` up to ``depth`` (default :data:`PIPELINE_DEPTH`)
    spans ahead, each followed by an event; span i is yielded once its event has fired, and
    with a depth above 1 the next copies are queued before it is yielded, so they run while
    the caller sends it (depth 1: copy, yield, then the next copy).  ``alloc``, ``copy``,
    ``wait`` and ``on_device`` are CuPy's by default (pinned buffer
    (:func:`~kvwire.codec.gpu.pinned_empty`), async device-to-host copy
    (:func:`~kvwire.codec.gpu.copy_to_host_async`), event wait off the loop,
    ``with Device(device_id)``).

    Closed or failed early, it waits (blocking) for the copies still in flight before it
    lets their pinned buffers go: none returns to the pool with a copy writing into it.
    """
    depth = PIPELINE_DEPTH if depth is None else depth
    alloc = gpu.pinned_empty if alloc is None else alloc
    copy = gpu.copy_to_host_async if copy is None else copy
    enter = on_device if on_device is not None else _device_context(device_id)
    # (span, its pinned buffer, the event after its copy) of every copy not yet waited for
    pending: deque[tuple[int, np.ndarray[Any, Any], Any]] = deque()
    queued = 0

    def queue_more() -> None:
        nonlocal queued
        with enter():
            while queued < len(spans) and len(pending) < max(1, depth):
                offset, nbytes = spans[queued]
                host = alloc(nbytes)
                copy(src, offset, host, stream)
                pending.append((queued, host, stream.record()))
                queued += 1

    overlap = depth > 1
    try:
        queue_more()
        while pending:
            i, host, ready = pending[0]
            await wait(ready, device_id)
            pending.popleft()
            if overlap:
                queue_more()
            yield i, host
            if not overlap:
                queue_more()
    finally:
        _settle([ready for _i, _host, ready in pending], enter)
        pending.clear()


async def encode_chunks(
    codec: Codec, x: Any, kind: TensorKind, plan: list[tuple[int, int]], dtype: str
) -> AsyncGenerator[tuple[int, int, EncodedChunk], None]:
    """``(token_start, token_count, chunk)`` for each chunk of ``plan`` of CuPy tensor ``x``.

    ``plan`` is :func:`~kvwire.wire.transfer.plan_chunks`' (equal counts but the last).
    UsageError before the first chunk when the tensor holds NaN or infinity (or, for
    int4, a group range beyond float32).  Closing it closes its ring of copies at once.
    """
    import cupy

    loop = asyncio.get_running_loop()
    device_id = int(x.device.id)
    stream = stream_for(device_id)
    with x.device:
        # ordered after whatever produced x on the caller's stream (DLPack imports too)
        stream.wait_event(cupy.cuda.get_current_stream().record())
        with gpu.on_stream(stream):  # (not `with stream:`: CuPy 13 forgets a use()d stream after it)
            enc = gpu.encode_tensor(codec, x, kind, plan[0][1], dtype=dtype)
            flags = gpu.pinned_empty(4)
            gpu.copy_to_host_async(enc.flags, 0, flags, stream)
            flags_ready = stream.record()
    try:
        await _wait(flags_ready, device_id)
    except BaseException:
        _settle([flags_ready], _device_context(device_id))  # the flags' copy lands first
        raise
    enc.check(int(flags.view("<u4")[0]))
    if len(enc.sizes) != len(plan):
        raise AssertionError("chunk plan and device encoding disagree")
    _base, entropy = gpu.split_codec(codec)
    spans = list(zip(enc.offsets, enc.sizes, strict=True))
    async with contextlib.aclosing(copy_ring(enc.buffer, spans, stream, device_id)) as ring:
        async for i, host in ring:
            if entropy is None:
                chunk = gpu.finish_chunk(codec, enc, host.data)
            else:
                chunk = await in_worker(loop, functools.partial(gpu.finish_chunk, codec, enc, host.data))
            yield plan[i][0], plan[i][1], chunk


async def copy_raw_chunks(
    x: Any, plan: list[tuple[int, int]]
) -> AsyncGenerator[tuple[int, int, Any], None]:
    """``(token_start, token_count, host array)`` of each chunk of ``x``, for host codecs.

    The copies run on the transfer stream into pinned memory, overlapped like
    :func:`encode_chunks`; bfloat16 comes back as its uint16 bits.  Closing it closes its
    ring of copies at once.
    """
    import cupy

    device_id = int(x.device.id)
    stream = stream_for(device_id)
    with x.device:
        x = cupy.ascontiguousarray(x)
        stream.wait_event(cupy.cuda.get_current_stream().record())
    row = int(x.nbytes // x.shape[0])
    dt = {"float16": "<f2", "float32": "<f4"}.get(str(x.dtype), "<u2")
    spans = [(start * row, count * row) for start, count in plan]
    async with contextlib.aclosing(copy_ring(x, spans, stream, device_id)) as ring:
        async for i, host in ring:
            start, count = plan[i]
            yield start, count, host.view(dt).reshape((count, *x.shape[1:]))


class GpuReceiver:
    """Where a GPU server puts received layers, and how it decodes chunks into them."""

    def __init__(self, device: str) -> None:
        index = parse_device(device)
        if index is None:
            raise UsageError("GpuReceiver needs a GPU device")
        self.device_id = index

    def empty(self, shape: tuple[int, ...], dtype: str) -> Any:
        """An uninitialised layer tensor on the device (bfloat16 as uint16 bits).

        It comes from CuPy's pool in the order of this thread's layer stream
        (:func:`layer_stream`: the current stream, where the layer is then used, unless a
        kvwire.sync loop thread kept its previous one), and the transfer stream, which
        decodes into it, waits for what was queued there before it: the block may have
        been freed there with work on it still queued.  (The decode also waits for the
        current stream.)"""
        import cupy

        dt = {"float16": cupy.float16, "float32": cupy.float32, "bfloat16": cupy.uint16}[dtype]
        with cupy.cuda.Device(self.device_id):
            on = layer_stream(cupy, self.device_id)
            with gpu.on_stream(on):
                layer = cupy.empty(shape, dt)
            stream_for(self.device_id).wait_event(on.record())
            return layer

    def decode(self, codec: Codec, params: bytes, payload: Any, out: Any, dtype: str, kind: TensorKind) -> None:
        """Decode one chunk into ``out`` (a token range of a layer from :meth:`empty`) on
        the transfer stream (ordered after the current one, :func:`~kvwire.codec.gpu.decode_into`);
        ``out`` holds it when this returns."""
        gpu.decode_into(codec, params, payload, out, dtype=dtype, kind=TensorKind(kind),
                        stream=stream_for(self.device_id))

