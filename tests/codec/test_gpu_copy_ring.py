"""The transport's ring of pinned device-to-host copies (kvwire/aio/_gpu.py ``copy_ring``),
which both GPU send paths (device-encoded chunks and raw chunks for host codecs) use, run
without a GPU: a fake stream whose copies complete only when the test says so, so the
order of copies, waits and yields (the overlap) is observed, not timed."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.aio import _gpu


class FakeEvent:
    def __init__(self, stream: FakeStream, index: int) -> None:
        self.stream, self.index, self.done = stream, index, False

    def synchronize(self) -> None:
        """What the ring calls, blocking, for the copies in flight when it is closed early."""
        self.stream.land(self.index)
        self.stream.log.append(f"sync {self.index}")


class FakeStream:
    """Copies are queued; an event fires (and its copy lands) when the ring waits on it."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.queued: list[tuple[Any, int, np.ndarray[Any, Any]]] = []
        self.events: list[FakeEvent] = []
        self.devices_entered = 0

    def copy(self, src: Any, offset: int, host: np.ndarray[Any, Any], stream: Any) -> None:
        assert stream is self
        self.log.append(f"copy {len(self.queued)}")
        self.queued.append((src, offset, host))

    def record(self) -> FakeEvent:
        ev = FakeEvent(self, len(self.events))
        self.events.append(ev)
        return ev

    def land(self, index: int) -> None:
        """Everything queued up to event ``index`` lands, in stream order."""
        for src, offset, host in self.queued[: index + 1]:
            host[...] = src[offset : offset + host.nbytes]
        for ev in self.events[: index + 1]:
            ev.done = True

    async def wait(self, event: FakeEvent, device_id: int) -> None:
        assert device_id == 3
        self.land(event.index)
        self.log.append(f"wait {event.index}")

    @contextlib.contextmanager
    def device(self) -> Any:
        self.devices_entered += 1
        yield


async def _drain(ring: AsyncIterator[tuple[int, np.ndarray[Any, Any]]], log: list[str]) -> list[bytes]:
    out = []
    async for i, host in ring:
        log.append(f"yield {i}")
        out.append(host.tobytes())
    return out


def _ring(stream: FakeStream, src: np.ndarray[Any, Any], spans: list[tuple[int, int]], depth: int) -> Any:
    return _gpu.copy_ring(src, spans, stream, 3, depth=depth, alloc=lambda n: np.full(n, 0xEE, np.uint8),
                          copy=stream.copy, wait=stream.wait, on_device=stream.device)


@settings(max_examples=50, deadline=None)
@given(sizes=st.lists(st.integers(0, 40), min_size=1, max_size=12), depth=st.integers(1, 6))
def test_ring_yields_every_span_in_order_with_its_bytes(sizes: list[int], depth: int) -> None:
    src = np.random.default_rng(len(sizes)).integers(0, 256, sum(sizes) + 7, dtype=np.uint8)
    offsets = np.cumsum([3, *sizes[:-1]])
    spans = [(int(o), n) for o, n in zip(offsets, sizes, strict=True)]
    stream = FakeStream()
    got = asyncio.run(_drain(_ring(stream, src, spans, depth), stream.log))
    assert got == [src[o : o + n].tobytes() for o, n in spans]
    # at most `depth` copies ahead of the span being sent (depth 1: one at a time)
    outstanding = 0
    for entry in stream.log:
        outstanding += entry.startswith("copy") - entry.startswith("yield")
        assert 0 <= outstanding <= depth + (depth > 1)
    assert stream.devices_entered >= 1


async def test_ring_overlaps_the_next_copies_with_the_span_being_sent() -> None:
    src = np.arange(60, dtype=np.uint8)
    spans = [(10 * i, 10) for i in range(6)]
    stream = FakeStream()
    await _drain(_ring(stream, src, spans, 4), stream.log)
    log = stream.log
    # four copies are queued before the first wait; span i is handed out only after its
    # wait, and the copy of span i + 4 is queued before span i is handed out
    assert log[:5] == ["copy 0", "copy 1", "copy 2", "copy 3", "wait 0"]
    for i in range(6):
        assert log.index(f"wait {i}") < log.index(f"yield {i}")
        if i + 4 < 6:
            assert log.index(f"copy {i + 4}") < log.index(f"yield {i}")


async def test_ring_depth_one_copies_after_each_send() -> None:
    src = np.arange(30, dtype=np.uint8)
    stream = FakeStream()
    await _drain(_ring(stream, src, [(0, 10), (10, 10), (20, 10)], 1), stream.log)
    assert stream.log == ["copy 0", "wait 0", "yield 0", "copy 1", "wait 1", "yield 1",
                          "copy 2", "wait 2", "yield 2"]


async def test_ring_depth_defaults_to_the_module_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_gpu, "PIPELINE_DEPTH", 2)
    src = np.arange(40, dtype=np.uint8)
    stream = FakeStream()
    ring = _gpu.copy_ring(src, [(0, 10), (10, 10), (20, 10), (30, 10)], stream, 3,
                          alloc=lambda n: np.empty(n, np.uint8), copy=stream.copy, wait=stream.wait,
                          on_device=stream.device)
    await _drain(ring, stream.log)
    assert stream.log[:3] == ["copy 0", "copy 1", "wait 0"]


async def test_a_consumer_that_stops_early_leaves_no_copy_unqueued_beyond_the_ring() -> None:
    src = np.arange(100, dtype=np.uint8)
    stream = FakeStream()
    ring = _ring(stream, src, [(10 * i, 10) for i in range(10)], 3)
    async for i, host in ring:
        assert host.tobytes() == src[:10].tobytes() and i == 0
        break
    await ring.aclose()
    assert len(stream.queued) <= 4
    # the copies queued ahead were waited for (blocking) before their buffers were let go
    assert all(ev.done for ev in stream.events)
    assert [e for e in stream.log if e.startswith("sync")] == [f"sync {i}" for i in range(1, len(stream.queued))]
