"""Encoding ahead of the consumer (``kvwire.aio._encode.host_chunks``): the chunks come out
in plan order with the codec's own payloads, the next encode is submitted before a chunk
is handed on and starts on a worker once the one before ended (never two at once), an
encode's error reaches the consumer at its chunk, and closing the iterator leaves nothing
running or unretrieved."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
import time
from typing import Any

import numpy as np
import pytest

from kvwire.aio._encode import ENCODE_AHEAD, host_chunks, start_encode
from kvwire.codec import TensorKind, get_codec

pytestmark = pytest.mark.timeout(60)

TOKENS, HEADS, DIM = 256, 2, 16


def arrays() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    k = rng.standard_normal((TOKENS, HEADS, DIM)).astype(np.float16)
    v = rng.standard_normal((TOKENS, HEADS, DIM)).astype(np.float16)
    return k, v


def parts(k: np.ndarray, v: np.ndarray, step: int = 64) -> list[Any]:
    plan = [(s, min(step, TOKENS - s)) for s in range(0, TOKENS, step)]
    return [(TensorKind.K, k, plan), (TensorKind.V, v, list(plan))]


class Watched:
    """A codec whose encodes are recorded: how many run at once, which ended, and an
    optional failure on one chunk (by token start and kind)."""

    def __init__(self, name: str, *, hold: float = 0.0, fail_at: tuple[int, int] | None = None) -> None:
        self._codec = get_codec(name)
        self.name = self._codec.name
        self.lossless = self._codec.lossless
        self.hold = hold
        self.fail_at = fail_at
        self.lock = threading.Lock()
        self.running = 0
        self.most = 0
        self.ended: list[tuple[int, int]] = []
        self.ended_event = threading.Event()

    def encode(self, x: np.ndarray, kind: TensorKind) -> Any:
        key = (int(kind), int(x.ctypes.data))
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            if self.hold:
                time.sleep(self.hold)  # long enough for a second worker to overlap, were it let
            if self.fail_at is not None and key == self.fail_at:
                raise ValueError("refused by the test")
            return self._codec.encode(x, kind)
        finally:
            with self.lock:
                self.running -= 1
                self.ended.append(key)
            self.ended_event.set()


def key_of(arr: np.ndarray, kind: TensorKind, start: int) -> tuple[int, int]:
    return int(kind), int(arr[start:].ctypes.data)


@pytest.mark.parametrize("name", ["raw", "int8", "fp8", "raw+lz4"])
async def test_chunks_in_plan_order_with_the_codecs_payloads(name: str) -> None:
    k, v = arrays()
    codec = get_codec(name)
    got = [item async for item in host_chunks(parts(k, v), lambda: codec, None)]
    want = [(kind, s, c) for kind, arr, plan in parts(k, v) for s, c in plan]
    assert [(kind, s, c) for kind, s, c, _codec, _enc in got] == want
    for kind, s, c, _codec, enc in got:
        ref = codec.encode((k if kind is TensorKind.K else v)[s : s + c], kind)
        assert bytes(memoryview(enc.payload).cast("B")) == bytes(memoryview(ref.payload).cast("B"))
        assert bytes(enc.params) == bytes(ref.params)


async def test_pick_is_asked_once_per_chunk_in_order() -> None:
    k, v = arrays()
    names = iter(["int8", "raw", "fp8", "int4", "raw", "int8", "fp8", "raw"])
    picked: list[str] = []

    def pick() -> Any:
        picked.append(next(names))
        return get_codec(picked[-1])

    got = [item async for item in host_chunks(parts(k, v), pick, None)]
    assert [codec.name for _k, _s, _c, codec, _e in got] == picked
    assert len(picked) == 8


async def test_the_next_encode_ends_while_the_consumer_holds_a_chunk() -> None:
    k, v = arrays()
    codec = Watched("int8")
    source = host_chunks(parts(k, v), lambda: codec, None)
    async with contextlib.aclosing(source):
        first = await anext(source)
        assert first[:3] == (TensorKind.K, 0, 64)
        # The consumer holds chunk 0 (as while it is sent); chunks 1 .. ENCODE_AHEAD were
        # submitted before it was handed on and are encoded meanwhile.
        wanted = {key_of(k, TensorKind.K, 64 * i) for i in range(1, ENCODE_AHEAD + 1)}
        deadline = time.monotonic() + 30
        while not wanted <= set(codec.ended) and time.monotonic() < deadline:
            await asyncio.to_thread(codec.ended_event.wait, 0.05)
            codec.ended_event.clear()
        assert wanted <= set(codec.ended)
        assert len(codec.ended) == 1 + ENCODE_AHEAD  # and no further than that


async def test_encodes_follow_each_other_never_two_at_once() -> None:
    k, v = arrays()
    codec = Watched("fp8", hold=0.02)
    got = [item async for item in host_chunks(parts(k, v), lambda: codec, None)]
    assert len(got) == 8
    assert codec.most == 1


async def test_an_encode_error_reaches_the_consumer_at_its_chunk() -> None:
    k, v = arrays()
    codec = Watched("int8", fail_at=key_of(v, TensorKind.V, 64))
    seen = []
    with pytest.raises(ValueError, match="refused by the test"):
        async with contextlib.aclosing(host_chunks(parts(k, v), lambda: codec, None)) as source:
            async for kind, s, _c, _codec, _enc in source:
                seen.append((kind, s))
    assert seen == [(TensorKind.K, 0), (TensorKind.K, 64), (TensorKind.K, 128), (TensorKind.K, 192),
                    (TensorKind.V, 0)]


async def test_closing_early_leaves_no_encode_unretrieved() -> None:
    k, v = arrays()
    # Chunk 1 fails on its worker while the consumer, holding chunk 0, gives up.
    codec = Watched("int8", fail_at=key_of(k, TensorKind.K, 64))
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, ctx: reported.append(ctx))
    try:
        async with contextlib.aclosing(host_chunks(parts(k, v), lambda: codec, None)) as source:
            await anext(source)
            deadline = time.monotonic() + 30
            while len(codec.ended) < 1 + ENCODE_AHEAD and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert len(codec.ended) == 1 + ENCODE_AHEAD
            await asyncio.sleep(0)  # the failed future's result reaches the loop
        for _ in range(3):
            await asyncio.sleep(0)
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(None)
    assert reported == []
    # Nothing was submitted past what was ahead when the consumer stopped.
    assert len(codec.ended) == 1 + ENCODE_AHEAD


async def test_ahead_zero_encodes_a_chunk_only_when_asked_for() -> None:
    k, v = arrays()
    codec = Watched("int8")
    source = host_chunks(parts(k, v), lambda: codec, None, ahead=0)
    async with contextlib.aclosing(source):
        await anext(source)
        for _ in range(20):
            await asyncio.to_thread(codec.ended_event.wait, 0.01)
        assert codec.ended == [key_of(k, TensorKind.K, 0)]
        rest = [item async for item in source]
    assert len(rest) == 7 and len(codec.ended) == 8


async def test_an_encode_stopped_before_its_turn_never_runs() -> None:
    """A chained encode whose consumer gave up (``stop`` set, as host_chunks does when it
    is closed or cancelled) does not run when its turn comes, once the encode before it
    has ended: nobody would take what it encodes from the caller's array."""
    k, _ = arrays()
    codec = Watched("int8", hold=0.3)
    stop = threading.Event()
    first, first_ended = start_encode(codec, k[:64], TensorKind.K)
    second, second_ended = start_encode(codec, k[64:128], TensorKind.K, after=first_ended, stop=stop)
    stop.set()
    second.cancel()
    await first
    assert await asyncio.get_running_loop().run_in_executor(None, second_ended.wait, 30)
    assert codec.ended == [key_of(k, TensorKind.K, 0)]
