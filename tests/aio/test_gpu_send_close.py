"""Closing the GPU send path (``device_parts``, as the transport's send does with
``contextlib.aclosing``) closes every generator under it before ``aclose()`` returns:
the pinned host copies, the CUDA events, the device payload buffer and the caller's
tensor are let go at once, and no pinned buffer is let go with its copy still in flight.

Run without a GPU: the real ``device_parts`` / ``device_chunks`` / ``encode_chunks`` /
``copy_raw_chunks`` / ``copy_ring`` over a fake ``cupy`` module, a fake stream whose
copies land only when their event is waited for or synchronized, and fake pinned and
device buffers watched through weak references."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import sys
import types
import weakref
from collections.abc import Iterator
from typing import Any, cast

import numpy as np
import pytest

from kvwire.aio import _encode, _gpu
from kvwire.codec import TensorKind, get_codec, gpu

DEVICE = 0


class FakeDevice:
    id = DEVICE

    def __enter__(self) -> FakeDevice:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class DeviceArray(np.ndarray):
    """A numpy array standing for a CuPy one (``.device``)."""

    @property
    def device(self) -> FakeDevice:  # type: ignore[override]
        return FakeDevice()


class FakeEvent:
    def __init__(self, stream: FakeStream, index: int) -> None:
        self.stream, self.index, self.done = stream, index, False

    def synchronize(self) -> None:
        self.stream.land(self.index)


class PinnedArray(np.ndarray):
    """A fake pinned buffer, numbered in the order handed out."""

    serial: int


class FakeStream:
    """Copies are queued with weak references to their buffers (as a real stream holds
    none) and land, in order, when an event after them is waited for or synchronized."""

    def __init__(self) -> None:
        # (source bytes, weak reference to the pinned buffer, its serial) not yet landed
        self.queued: list[tuple[bytes, weakref.ref[PinnedArray], int]] = []
        self.events: list[FakeEvent] = []
        self.copied = 0
        self.landed: set[int] = set()
        self.problems: list[str] = []

    def copy(self, src: Any, offset: int, host: np.ndarray[Any, Any], stream: Any) -> None:
        assert stream is self
        pinned = cast(PinnedArray, host)
        data = np.asarray(src).reshape(-1).view(np.uint8)[offset : offset + host.nbytes].tobytes()
        self.queued.append((data, weakref.ref(pinned), pinned.serial))
        self.copied += 1

    def record(self) -> FakeEvent:
        ev = FakeEvent(self, self.copied)
        self.events.append(ev)
        return ev

    def land(self, upto: int) -> None:
        while self.queued and len(self.landed) < upto:
            data, ref, key = self.queued.pop(0)
            host = ref()
            if host is None:
                self.problems.append("a copy landed in a pinned buffer already let go")
            else:
                host[...] = np.frombuffer(data, np.uint8)
            self.landed.add(key)
        for ev in self.events:
            if ev.index <= upto:
                ev.done = True

    def wait_event(self, event: Any) -> None:
        pass

    def __enter__(self) -> FakeStream:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class Pinned:
    """The fake pinned pool: every buffer handed out, watched."""

    def __init__(self, stream: FakeStream) -> None:
        self.stream = stream
        self.refs: list[weakref.ref[PinnedArray]] = []

    def alloc(self, nbytes: int) -> PinnedArray:
        host = np.full(nbytes, 0xEE, np.uint8).view(PinnedArray)
        host.serial = len(self.refs)
        weakref.finalize(host, self.released, host.serial)
        self.refs.append(weakref.ref(host))
        return host

    def released(self, serial: int) -> None:
        if any(k == serial for _d, _r, k in self.stream.queued):
            self.stream.problems.append("a pinned buffer went back to the pool with its copy in flight")

    def alive(self) -> int:
        return sum(r() is not None for r in self.refs)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[FakeStream, Pinned]]:
    stream = FakeStream()
    pinned = Pinned(stream)
    cupy = types.ModuleType("cupy")
    caller_stream = types.SimpleNamespace(record=lambda: FakeEvent(stream, 0))
    cupy.cuda = types.SimpleNamespace(  # type: ignore[attr-defined]
        get_current_stream=lambda: caller_stream, Device=lambda _id: FakeDevice())
    cupy.ascontiguousarray = lambda a: a  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(_gpu, "stream_for", lambda device_id: stream)
    monkeypatch.setattr(gpu, "pinned_empty", pinned.alloc)
    monkeypatch.setattr(gpu, "copy_to_host_async", stream.copy)
    yield stream, pinned


def _tensor(tokens: int) -> DeviceArray:
    x = np.arange(tokens * 2 * 8, dtype=np.float16).reshape(tokens, 2, 8)
    return x.view(DeviceArray)


@pytest.mark.parametrize("codec_name", ["int8", "raw"])
async def test_closing_the_send_source_releases_everything_before_aclose_returns(
    fake_cuda: tuple[FakeStream, Pinned], monkeypatch: pytest.MonkeyPatch, codec_name: str,
) -> None:
    stream, pinned = fake_cuda
    device_buffers: list[weakref.ref[Any]] = []
    real_plan = [(i, 1) for i in range(10)]

    def encode_tensor(codec: Any, x: Any, kind: TensorKind, chunk_tokens: int, *, dtype: str | None = None) -> Any:
        sizes = [2 * 4 + 2 * 8] * x.shape[0]
        buffer = np.arange(sum(sizes), dtype=np.uint8) % 100  # stands for the device payloads
        device_buffers.append(weakref.ref(buffer))
        return gpu.DeviceChunks("int8", codec.codec_id, b"", buffer,
                                [i * sizes[0] for i in range(len(sizes))], sizes, np.zeros(1, np.uint32))

    monkeypatch.setattr(gpu, "encode_tensor", encode_tensor)
    x = _tensor(10)
    tensor = weakref.ref(x)
    src = _encode.device_parts([(TensorKind.K, x, real_plan)], lambda: get_codec(codec_name), "float16", None)
    del x
    was_enabled = gc.isenabled()
    gc.disable()  # what follows must not depend on the cycle collector
    try:
        async with contextlib.aclosing(src):
            async for _kind, start, count, _codec, enc in src:
                assert (start, count) == (0, 1)
                assert memoryview(enc.payload).nbytes > 0
                del enc
                break  # the send is cancelled or fails after its first chunk
        assert pinned.alive() == 0, "pinned host copies outlived the closed send"
        assert tensor() is None, "the caller's tensor outlived the closed send"
        assert all(ref() is None for ref in device_buffers), "the device payloads outlived the closed send"
        assert stream.queued == [], "copies still in flight after the send was closed"
        assert all(ev.done for ev in stream.events)
        assert stream.problems == []
    finally:
        if was_enabled:
            gc.enable()
    # more copies than the one taken were queued ahead: the close really had some to wait for
    assert stream.copied > 1


def _ring(stream: FakeStream, pinned: Pinned, src: np.ndarray[Any, Any], n: int, wait: Any) -> Any:
    return _gpu.copy_ring(src, [(10 * i, 10) for i in range(n)], stream, DEVICE, depth=3,
                          alloc=pinned.alloc, copy=stream.copy, wait=wait,
                          on_device=contextlib.nullcontext)


async def test_a_ring_closed_early_waits_for_its_copies_in_flight() -> None:
    stream = FakeStream()
    pinned = Pinned(stream)

    async def wait(ev: FakeEvent, device_id: int) -> None:
        stream.land(ev.index)

    src = np.arange(100, dtype=np.uint8)
    ring = _ring(stream, pinned, src, 10, wait)
    async for i, host in ring:
        assert i == 0 and host.tobytes() == src[:10].tobytes()
        del host
        break
    assert stream.queued  # the copies queued ahead are in flight
    await ring.aclose()
    assert stream.queued == [] and pinned.alive() == 0 and stream.problems == []


async def test_a_ring_whose_wait_is_cancelled_settles_that_copy_too() -> None:
    stream = FakeStream()
    pinned = Pinned(stream)

    async def wait(ev: FakeEvent, device_id: int) -> None:
        raise asyncio.CancelledError  # the send is cancelled while it waits for a copy

    src = np.arange(100, dtype=np.uint8)
    ring = _ring(stream, pinned, src, 10, wait)
    with pytest.raises(asyncio.CancelledError):
        async for _i, _host in ring:
            raise AssertionError("nothing is yielded before its copy landed")
    assert stream.queued == [] and pinned.alive() == 0 and stream.problems == []


@pytest.mark.parametrize("codec_name", ["int8+lz4", "raw"])
async def test_the_gpu_send_path_goes_on_when_the_worker_threads_refuse_work(
    fake_cuda: tuple[FakeStream, Pinned], monkeypatch: pytest.MonkeyPatch, codec_name: str,
) -> None:
    """At interpreter exit the loop's default thread pool refuses work (a send waited for
    by an atexit hook): the waits for the device's copies and an entropy stage's
    compression then run on the loop, and every chunk still comes out."""
    stream, _pinned = fake_cuda
    plan = [(i, 1) for i in range(6)]

    def encode_tensor(codec: Any, x: Any, kind: TensorKind, chunk_tokens: int, *, dtype: str | None = None) -> Any:
        sizes = [2 * 4 + 2 * 8] * x.shape[0]
        buffer = np.arange(sum(sizes), dtype=np.uint8) % 100
        return gpu.DeviceChunks("int8", codec.codec_id, b"", buffer,
                                [i * sizes[0] for i in range(len(sizes))], sizes, np.zeros(1, np.uint32))

    monkeypatch.setattr(gpu, "encode_tensor", encode_tensor)
    await asyncio.get_running_loop().shutdown_default_executor()
    src = _encode.device_parts([(TensorKind.K, _tensor(6), plan)], lambda: get_codec(codec_name), "float16", None)
    starts = []
    async with contextlib.aclosing(src):
        async for _kind, start, count, _codec, enc in src:
            assert count == 1 and memoryview(enc.payload).nbytes > 0
            starts.append(start)
    assert starts == list(range(6))
    assert stream.events and all(ev.done for ev in stream.events) and stream.problems == []
