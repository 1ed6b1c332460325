"""How far the send task runs ahead of the streams: raw chunks of host arrays (views of the
caller's memory) are queued up to ``AHEAD_CHUNKS`` chunk targets ahead; an encoded chunk
is made only once the one before left the queue; past ``YIELD_AFTER`` the task lets the
event loop run between chunks.  Driven against a stand-in core whose queue the test
empties by hand, so each wake-up of the task is seen."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import kvwire
from kvwire.aio._send import AHEAD_CHUNKS, SendState, _send_layer, clock
from kvwire.wire import Chunk
from kvwire.wire.frames import chunk_frame_size
from tests.conftest import make_layers

pytestmark = pytest.mark.timeout(60)

SPEC = kvwire.KVSpec(num_layers=4, num_kv_heads=2, head_dim=16)
TARGET = 4096  # bytes per chunk: 64 tokens of 64 bytes, 4 chunks of K and 4 of V per layer


class WaitSeen(asyncio.Event):
    """The transfer's change event, telling the test when the send task waits on it."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = asyncio.Event()

    async def wait(self) -> Any:
        self.waiting.set()
        try:
            return await super().wait()
        finally:
            self.waiting.clear()


class QueueCore:
    """What ``_send_layer`` asks of the session core, with a queue nothing drains."""

    def __init__(self, kv_chunks: bool = False) -> None:
        self.queue: list[Chunk] = []
        self.added: list[Chunk] = []
        self.kv_chunks = kv_chunks  # the session's protocol version carries KV chunks

    def chunk_target(self, requested: int) -> int:
        return requested

    def add_chunk(self, transfer_id: int, chunk: Chunk, *, kv_bytes: int = 0) -> None:
        self.queue.append(chunk)
        self.added.append(chunk)

    def queued_bytes(self, transfer_id: int | None = None) -> int:
        return sum(chunk_frame_size(len(c.params), sum(memoryview(p).nbytes for p in _parts(c))) for c in self.queue)


def _parts(c: Chunk) -> tuple[Any, ...]:
    return c.payload if isinstance(c.payload, tuple) else (c.payload,)


async def batches(codec: str, k: Any, v: Any) -> tuple[list[int], QueueCore]:
    """Run one layer's send; each time the task waits, count what it queued, then empty
    the queue (the chunks went on a stream) and wake it."""
    core = QueueCore()
    peer = SimpleNamespace(core=core, options=SimpleNamespace(chunk_bytes=TARGET), chooser=None,
                           pump=lambda: None, estimator=None)
    changed = WaitSeen()
    st = SendState(changed)
    task = asyncio.create_task(_send_layer(peer, st, 1, SPEC, 1, k, v, codec, {}, clock(), None))  # type: ignore[arg-type]
    seen: list[int] = []
    while not task.done():
        waiting = asyncio.create_task(changed.waiting.wait())
        await asyncio.wait({task, waiting}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        if task.done():
            break
        assert changed.waiting.is_set(), "the send task neither waited nor finished"
        seen.append(len(core.queue))
        core.queue.clear()
        changed.set()
        await asyncio.sleep(0)  # let it run past the wait before looking again
    await task
    if core.queue:
        seen.append(len(core.queue))
    return seen, core


async def test_raw_chunks_of_host_arrays_are_queued_ahead_in_batches() -> None:
    k, v = make_layers(1, 256, SPEC.num_kv_heads, SPEC.head_dim, seed=3)[0]
    seen, core = await batches("raw", k, v)
    # Each frame is a little over TARGET, so the task stops after AHEAD_CHUNKS of them.
    assert seen == [AHEAD_CHUNKS] * (8 // AHEAD_CHUNKS)
    got = np.concatenate([np.frombuffer(c.payload, np.float16) for c in core.added if c.kind == 0])
    assert np.array_equal(got, k.reshape(-1))  # K in token order, every byte, once


@pytest.mark.parametrize("codec", ["int8", "raw+lz4"])
async def test_an_encoded_chunk_waits_until_the_one_before_left_the_queue(codec: str) -> None:
    k, v = make_layers(1, 256, SPEC.num_kv_heads, SPEC.head_dim, seed=3)[0]
    seen, core = await batches(codec, k, v)
    assert seen == [1] * 8
    assert [(c.kind, c.token_start) for c in core.added] == [(kind, t) for kind in (0, 1) for t in (0, 64, 128, 192)]


class CountingCore(QueueCore):
    """A core whose queue is always empty (every chunk went on a stream at once); it
    notes how often the event loop ran other work between two chunks."""

    def __init__(self) -> None:
        super().__init__()
        self.ticks = 0
        self.ticks_at_add: list[int] = []

    def add_chunk(self, transfer_id: int, chunk: Chunk, *, kv_bytes: int = 0) -> None:
        self.added.append(chunk)
        self.ticks_at_add.append(self.ticks)


async def ticks_between_chunks(monkeypatch: pytest.MonkeyPatch, yield_after: float) -> list[int]:
    from kvwire.aio import _send

    monkeypatch.setattr(_send, "YIELD_AFTER", yield_after)
    core = CountingCore()
    peer = SimpleNamespace(core=core, options=SimpleNamespace(chunk_bytes=TARGET), chooser=None,
                           pump=lambda: None, estimator=None)
    st = SendState(asyncio.Event())
    st.ran_since = clock()
    task = asyncio.create_task(_send_layer(peer, st, 1, SPEC, 1, *make_layers(1, 256, 2, 16, seed=4)[0],  # type: ignore[arg-type]
                                           "raw", {}, clock(), None))
    while not task.done():  # another task on the same loop
        core.ticks += 1
        await asyncio.sleep(0)
    await task
    assert len(core.added) == 8
    return [b - a for a, b in zip(core.ticks_at_add, core.ticks_at_add[1:], strict=False)]


async def test_the_send_task_lets_the_loop_run_between_chunks_once_it_ran_long_enough(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert all(n > 0 for n in await ticks_between_chunks(monkeypatch, 0.0))
    # Within the bound nothing else runs: the chunks of a layer go out in one stretch.
    assert all(n == 0 for n in await ticks_between_chunks(monkeypatch, 3600.0))


@pytest.mark.parametrize(("codec", "layer", "tokens", "kv_chunks", "paired"), [
    ("raw", 1, 32, True, True),  # K and V of the layer fit one chunk target: one KV chunk
    ("raw", 0, 32, True, False),  # the first layer keeps its small first chunk
    ("raw", 1, 64, True, False),  # K and V together exceed the target
    ("raw", 1, 32, False, False),  # a version-1 server
    ("int8", 1, 32, True, False),  # KV chunks are raw only
])
async def test_a_small_raw_layer_goes_as_one_kv_chunk_of_views(
    codec: str, layer: int, tokens: int, kv_chunks: bool, paired: bool,
) -> None:
    core = QueueCore(kv_chunks)
    core.queued_bytes = lambda transfer_id=None: 0  # type: ignore[method-assign]  # every chunk leaves at once
    peer = SimpleNamespace(core=core, options=SimpleNamespace(chunk_bytes=TARGET), chooser=None,
                           pump=lambda: None, estimator=None)
    k, v = make_layers(1, tokens, SPEC.num_kv_heads, SPEC.head_dim, seed=5)[0]
    used: dict[str, int] = {}
    await _send_layer(peer, SendState(asyncio.Event()), 1, SPEC, layer, k, v, codec, used, clock(), None)  # type: ignore[arg-type]
    if not paired:
        assert all(c.kind in (0, 1) for c in core.added) and len(core.added) >= 2
        return
    [c] = core.added
    assert (c.kind, c.token_start, c.token_count, c.layer_tokens, c.codec_id) == (2, 0, tokens, tokens, 0)
    pk, pv = _parts(c)
    assert np.shares_memory(np.frombuffer(pk, np.uint8), k) and np.shares_memory(np.frombuffer(pv, np.uint8), v)
    assert bytes(pk) + bytes(pv) == k.tobytes() + v.tobytes()
    assert used == {"raw": 1}


class ScriptedChooser:
    """``auto``'s chooser, answering each ``choose`` with the next codec of a script."""

    measures_goodput = False

    def __init__(self, *script: str) -> None:
        self.script = list(script)
        self.calls = 0
        self.rtts: list[float] = []

    def choose(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return SimpleNamespace(codec=self.script.pop(0) if len(self.script) > 1 else self.script[0])

    def observe_encode(self, *args: Any) -> None:
        pass

    observe_size = observe_encode

    def observe_path_rtt(self, seconds: float) -> None:
        self.rtts.append(seconds)


@pytest.mark.parametrize(("script", "kinds"), [
    (("raw",), [2]),  # auto chose raw for the layer: one KV chunk
    (("int8",), [0, 1]),  # a compact codec: K and V chunks, each its own choice
    (("int8", "raw"), [0, 1]),  # the first choice is not asked again: it is the first chunk's
])
async def test_auto_sends_a_small_layer_it_chose_raw_for_as_one_kv_chunk(script: tuple[str, ...], kinds: list[int]) -> None:
    core = QueueCore(kv_chunks=True)
    core.queued_bytes = lambda transfer_id=None: 0  # type: ignore[method-assign]
    chooser = ScriptedChooser(*script)
    peer = SimpleNamespace(core=core, options=SimpleNamespace(chunk_bytes=TARGET), chooser=chooser,
                           pump=lambda: None, estimator=SimpleNamespace(bandwidth_bps=1e9, app_limited=False,
                                                                         max_filter_bps=1e9, min_rtt=0.0004))
    k, v = make_layers(1, 32, SPEC.num_kv_heads, SPEC.head_dim, seed=6)[0]
    used: dict[str, int] = {}
    await _send_layer(peer, SendState(asyncio.Event()), 1, SPEC, 1, k, v, "auto", used, clock(), None)  # type: ignore[arg-type]
    assert [c.kind for c in core.added] == kinds
    assert chooser.calls == len(core.added)  # one choice per chunk sent, none thrown away
    assert chooser.rtts == [0.0004] * chooser.calls  # each told the data's round trip first
    if script[0] != "raw":
        assert core.added[0].codec_id == 2  # int8: the choice made for the layer
