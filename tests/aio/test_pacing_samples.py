"""What the sender's pump tells the delivery-rate estimator, and the encode time it feeds
``auto``: whether a chunk found the pipe running dry or its producer slow, and the codec's
own time without the wait for a worker."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import numpy as np
import pytest

import kvwire
from kvwire.aio import _encode
from kvwire.aio._send import SendState, until
from kvwire.aio.client import ClientOptions, Peer
from kvwire.codec import TensorKind, get_codec
from kvwire.codec.base import EncodedChunk
from kvwire.session.sender import ChunkSent
from kvwire.wire import ChunkAddress
from tests.conftest import SECRET, make_layers


def _peer() -> Peer:
    return Peer("127.0.0.1", 1, secret=SECRET, streams=1, codec="raw", ssl=None,
                options=ClientOptions())


def _sent(i: int, *, queued: bool, waited: bool = False, size: int = 1 << 20) -> ChunkSent:
    return ChunkSent(address=ChunkAddress(transfer_id=1, layer=0, kind=0, token_start=i), stream=0,
                     wire_size=size, kv_bytes=size, queued=queued, waited=waited)


def _measured(peer: Peer) -> float:
    """One link sample: 1 MiB acknowledged 1 ms after it was sent (about 8.4 Gbit/s, 1 ms
    RTT): a bandwidth-delay product of 1 MiB.  Returns it in bytes."""
    est = peer.estimator
    est.on_send("probe", 1 << 20, 10.0, app_limited=False)
    est.on_ack("probe", 10.001)
    assert est.max_filter_bps is not None and est.min_rtt is not None
    return est.max_filter_bps / 8 * est.min_rtt


async def test_a_chunk_sent_into_a_pipe_running_dry_is_an_app_limited_sample() -> None:
    peer = _peer()
    assert _measured(peer) == pytest.approx(1 << 20)
    peer._on_event(_sent(0, queued=False))  # nothing in flight, nothing behind it
    assert peer.estimator.app_limited  # the producer set the pace


def _full_pipe(monkeypatch: Any, at: list[float]) -> Peer:
    """A peer with two BDPs in flight and a clock the test moves."""
    from kvwire.aio import client as client_mod

    monkeypatch.setattr(client_mod, "clock", lambda: at[0])
    peer = _peer()
    _measured(peer)
    peer.estimator.on_send("before", 2 << 20, 10.002, app_limited=False)
    return peer


async def test_with_the_pipe_full_a_fast_producer_is_not_app_limited(monkeypatch: Any) -> None:
    """1 MiB takes about 1 ms on this path: a chunk made 50 us after the one before,
    going out as it was added (the in-flight limit had room), comes from a producer that
    keeps up; so does one that waited for room, and one with more queued behind it."""
    at = [20.0]
    peer = _full_pipe(monkeypatch, at)
    peer._on_event(_sent(0, queued=False, waited=True))
    at[0] += 0.00005
    peer._on_event(_sent(1, queued=False))
    at[0] += 0.005
    peer._on_event(_sent(2, queued=False, waited=True))  # held back 5 ms by the path
    at[0] += 0.005
    peer._on_event(_sent(3, queued=True))
    assert not peer.estimator.app_limited


async def test_with_the_pipe_full_a_slow_producer_is_app_limited(monkeypatch: Any) -> None:
    """A chunk larger than the BDP leaves the pipe "full" by bytes in flight even when an
    encoder slower than the path makes it: 1.5 ms to make a 2 MiB chunk the path carries
    in about 2 ms is the producer's pace."""
    at = [20.0]
    peer = _full_pipe(monkeypatch, at)
    peer._on_event(_sent(0, queued=False, waited=True, size=2 << 20))
    at[0] += 0.0015
    peer._on_event(_sent(1, queued=False, size=2 << 20))
    assert peer.estimator.app_limited


async def test_a_pause_with_chunks_queued_past_the_bdp_is_not_app_limited(monkeypatch: Any) -> None:
    """Chunks no larger than the BDP (a path with a long round trip): a producer's pause
    with more than two chunks in flight beyond a BDP is drained through by the path's
    queue, and the samples still measure the path; with the flight within two chunks of
    a BDP the same pause is the producer's pace."""
    at = [20.0]
    peer = _full_pipe(monkeypatch, at)  # one BDP (1 MiB) and 1 MiB more in flight
    peer._on_event(_sent(0, queued=False, waited=True))
    peer._on_event(_sent(1, queued=False, waited=True))  # 4 MiB in flight now
    at[0] += 0.005
    peer._on_event(_sent(2, queued=False))  # 5 ms to make: the path was never idle
    assert not peer.estimator.app_limited
    peer = _full_pipe(monkeypatch, at)
    peer._last_sent_at = at[0]  # the last send (of the 2 MiB in flight) was now
    at[0] += 0.0008
    peer._on_event(_sent(0, queued=False))  # 2 MiB in flight: within two chunks of the BDP
    assert peer.estimator.app_limited


async def test_a_chunk_made_at_once_after_waiting_on_the_path_is_not_app_limited(monkeypatch: Any) -> None:
    """A send task that waited 5 ms for its queue to go out (the path's pace) and made its
    next chunk 20 us after it came back keeps up: that chunk is no app-limited sample,
    though it went out as it was added 5 ms after the send before. Its transfer's send task
    that had not waited (resumed long before) is the slow producer of the test above."""
    at = [20.0]
    peer = _full_pipe(monkeypatch, at)
    st = SendState(changed=asyncio.Event())
    peer.sends[1] = st
    peer._on_event(_sent(0, queued=False, waited=True))
    at[0] += 0.005
    st.resumed_at = at[0] - 0.00002
    peer._on_event(_sent(1, queued=False, size=2 << 20))
    assert not peer.estimator.app_limited
    at[0] += 0.005
    peer._on_event(_sent(2, queued=False, size=2 << 20))  # 5 ms to make, no wait in between
    assert peer.estimator.app_limited


async def test_waiting_on_the_session_marks_when_the_send_task_resumed(monkeypatch: Any) -> None:
    from kvwire.aio import _send

    at = [5.0]
    monkeypatch.setattr(_send, "clock", lambda: at[0])
    st = SendState(changed=asyncio.Event())
    ready = [False]
    waiter = asyncio.ensure_future(until(st, lambda: ready[0]))
    await asyncio.sleep(0)
    assert st.resumed_at == -math.inf  # still waiting
    at[0] = 7.0
    ready[0] = True
    st.changed.set()
    await waiter
    assert st.resumed_at == 7.0
    at[0] = 9.0
    await until(st, lambda: True)  # ready at once: no wait, no resume
    assert st.resumed_at == 7.0


async def test_before_any_estimate_a_lone_chunk_is_app_limited() -> None:
    """The first chunk of a session (a transfer's small lead chunk) measures its round
    trip, not the link: it may raise the peak but must not set the goodput."""
    peer = _peer()
    peer._on_event(_sent(0, queued=False))
    assert peer.estimator.app_limited
    peer = _peer()
    peer._on_event(_sent(0, queued=True))
    assert not peer.estimator.app_limited


class _SlowCodec:
    """A quantizing codec whose encode takes 2 s of the (fake) clock."""

    name, lossless, codec_id = "fake", False, 0x7E

    def __init__(self, clock: list[float]) -> None:
        self.clock = clock

    def encode(self, x: Any, kind: TensorKind) -> EncodedChunk:
        self.clock[0] += 2.0
        return EncodedChunk(self.codec_id, b"", b"\0" * 8)


class _Chooser:
    def __init__(self) -> None:
        self.seen: list[tuple[str, int, float]] = []

    def observe_encode(self, codec: str, nbytes: int, seconds: float) -> None:
        self.seen.append((codec, nbytes, seconds))

    def observe_size(self, codec: str, fp16_bytes: int, wire_bytes: int) -> None:
        pass


async def test_encode_time_is_the_codecs_own_not_the_wait_for_a_worker(monkeypatch: Any) -> None:
    clock = [100.0]
    monkeypatch.setattr(_encode.time, "thread_time", lambda: clock[0])
    loop = asyncio.get_running_loop()
    real = loop.run_in_executor

    def queued(executor: Any, fn: Any, *args: Any) -> Any:
        clock[0] += 10.0  # the job waits 10 s for a free worker, the loop 10 s to pick it up
        fut = real(executor, fn, *args)
        fut.add_done_callback(lambda _: clock.__setitem__(0, clock[0] + 10.0))
        return fut

    monkeypatch.setattr(loop, "run_in_executor", queued)
    chooser = _Chooser()
    x = np.zeros((4, 2, 8), np.float16)
    await _encode.encode(_SlowCodec(clock), x, TensorKind.K, chooser)  # type: ignore[arg-type]
    assert chooser.seen == [("fake", x.nbytes, 2.0)]


class _SleepyCodec(_SlowCodec):
    """A codec whose worker is off its core for 0.3 s in every encode (as a thread is
    while other work holds the CPU)."""

    def encode(self, x: Any, kind: TensorKind) -> EncodedChunk:
        time.sleep(0.3)
        return EncodedChunk(self.codec_id, b"", b"\0" * 8)


async def test_encode_time_is_the_workers_cpu_time_not_the_clocks() -> None:
    chooser = _Chooser()
    x = np.zeros((4, 2, 8), np.float16)
    await _encode.encode(_SleepyCodec([0.0]), x, TensorKind.K, chooser)  # type: ignore[arg-type]
    [(name, nbytes, seconds)] = chooser.seen
    assert (name, nbytes) == ("fake", x.nbytes) and 0 <= seconds < 0.15


class _TransportChooser:
    measures_goodput = False

    def __init__(self) -> None:
        self.seen: list[tuple[int, float]] = []
        self.codecs: list[str | None] = []

        self.runnable: list[float | None] = []

    def observe_transport(self, wire_bytes: int, cpu_seconds: float, codec: str | None = None, *,
                          runnable: float | None = None) -> None:
        self.seen.append((wire_bytes, cpu_seconds))
        self.codecs.append(codec)
        self.runnable.append(runnable)


async def test_the_loop_threads_cpu_per_wire_byte_feeds_auto(monkeypatch: Any) -> None:
    """Every 32 MiB acknowledged, the event loop thread's CPU time since the last
    measurement (framing, checksums, the kernel's copy) per wire byte, the peer's first
    measurement left out (warm-up); the count pauses while the peer is idle, so the
    application's own time between transfers on the loop is not the transport's."""
    from kvwire.aio import client as client_mod
    from kvwire.session.sender import ChunkDelivered

    cpu, wall, runnable = [50.0], [1000.0], [7 * 10**9]
    monkeypatch.setattr(client_mod.time, "thread_time", lambda: cpu[0])
    monkeypatch.setattr(client_mod, "clock", lambda: wall[0])
    monkeypatch.setattr(client_mod, "runnable_ns", lambda: runnable[0])
    peer = _peer()
    chooser = _TransportChooser()
    peer.chooser = chooser  # type: ignore[assignment]
    peer.transport_meter.resume()  # what send() does on an idle peer

    def delivered(i: int, size: int) -> None:
        peer._on_event(ChunkDelivered(address=ChunkAddress(transfer_id=1, layer=0, kind=0, token_start=i),
                                      stream=0, wire_size=size, kv_bytes=size, codec_id=0))

    for i in range(8):
        cpu[0] += 0.003
        delivered(100 + i, 4 << 20)  # the peer's first 32 MiB: its code paths' first use
    assert chooser.seen == []
    for i in range(7):
        cpu[0] += 0.001
        wall[0] += 0.002
        runnable[0] += 1_900_000  # running or waiting for a CPU 95% of the time
        delivered(i, 4 << 20)  # 28 MiB: not yet
    assert chooser.seen == []
    cpu[0] += 0.001
    wall[0] += 0.002
    runnable[0] += 1_900_000
    delivered(7, 4 << 20)
    assert chooser.seen == [(32 << 20, pytest.approx(0.008))]
    assert chooser.runnable == [pytest.approx(0.95)]
    peer.transport_meter.pause()  # the last send ended
    cpu[0] += 5.0  # the application's work between transfers
    wall[0] += 10.0
    runnable[0] += 5 * 10**9
    peer.transport_meter.resume()  # a send begins on the idle peer
    for i in range(8):
        cpu[0] += 0.002
        delivered(8 + i, 4 << 20)
    assert chooser.seen[1] == (32 << 20, pytest.approx(0.016))
    assert chooser.runnable[1] is None  # the clock did not move while busy: no share to tell
    assert chooser.codecs == ["raw", "raw"]  # every byte raw's: raw's own measurement too
    # a measurement is a codec's only if nearly all its bytes were (75%)
    for i, codec_id in enumerate([0] * 6 + [get_codec("int8").codec_id] * 2):
        peer._on_event(ChunkDelivered(address=ChunkAddress(transfer_id=1, layer=1, kind=0, token_start=i),
                                      stream=0, wire_size=4 << 20, kv_bytes=4 << 20, codec_id=codec_id))
    for i, codec_id in enumerate([0] * 5 + [get_codec("int8").codec_id] * 3):
        peer._on_event(ChunkDelivered(address=ChunkAddress(transfer_id=1, layer=2, kind=0, token_start=i),
                                      stream=0, wire_size=4 << 20, kv_bytes=4 << 20, codec_id=codec_id))
    assert chooser.codecs[2:] == ["raw", None]


async def test_a_measurement_runs_on_across_small_sends(monkeypatch: Any) -> None:
    """Sends smaller than a measurement, one after another: their bytes add up to one,
    the idle time between them left out.  (A restart at every send never completed a
    measurement of 32 MiB with sends of 16 MiB, and ``auto`` kept raw, never measured,
    on a link where int4 delivered twice raw's goodput.)"""
    from kvwire.aio import client as client_mod
    from kvwire.session.sender import ChunkDelivered

    cpu, wall = [50.0], [1000.0]
    monkeypatch.setattr(client_mod.time, "thread_time", lambda: cpu[0])
    monkeypatch.setattr(client_mod, "clock", lambda: wall[0])
    monkeypatch.setattr(client_mod, "runnable_ns", lambda: None)
    peer = _peer()
    chooser = _TransportChooser()
    peer.chooser = chooser  # type: ignore[assignment]
    meter = peer.transport_meter
    token = iter(range(10**6))
    for send in range(4):  # four sends of 16 MiB: the first 32 MiB warm up, the next are measured
        meter.resume()
        for _ in range(4):
            cpu[0] += 0.002
            wall[0] += 0.004
            peer._on_event(ChunkDelivered(address=ChunkAddress(transfer_id=send + 1, layer=0, kind=0,
                                                               token_start=next(token)),
                                          stream=0, wire_size=4 << 20, kv_bytes=4 << 20, codec_id=0))
        meter.pause()
        cpu[0] += 3.0  # the application's work between sends
        wall[0] += 7.0
    assert chooser.seen == [(32 << 20, pytest.approx(0.016))]
    assert chooser.codecs == ["raw"]


def test_an_acknowledgement_after_the_last_send_is_measured_without_the_idle_time(monkeypatch: Any) -> None:
    """A measurement completed while the peer is idle (an acknowledgement after its last
    send ended) is measured up to the pause: the idle time is in neither it nor the next
    (which came out short, even negative, when it was taken off both)."""
    from kvwire.aio import client as client_mod

    cpu, wall = [10.0], [100.0]
    monkeypatch.setattr(client_mod.time, "thread_time", lambda: cpu[0])
    monkeypatch.setattr(client_mod, "clock", lambda: wall[0])
    monkeypatch.setattr(client_mod, "runnable_ns", lambda: None)
    meter = client_mod._TransportMeter()
    meter._warm = True
    chooser = _TransportChooser()
    meter.resume()
    cpu[0] += 0.2
    meter.delivered(24 << 20, chooser, "raw")
    meter.pause()  # the last send ended
    cpu[0] += 1.0  # idle: the application's time
    meter.delivered(8 << 20, chooser, "raw")  # 32 MiB: a measurement while idle
    cpu[0] += 1.0
    meter.resume()
    cpu[0] += 0.05
    meter.delivered(32 << 20, chooser, "raw")
    assert [c for _, c in chooser.seen] == [pytest.approx(0.2), pytest.approx(0.05)]


async def test_a_send_refused_at_begin_leaves_the_idle_peers_meter_paused() -> None:
    """A send refused by BEGIN (here its meta larger than a frame) on an idle peer leaves
    it idle: its meter stays paused, and the application's time until the next send is
    not the transport's."""
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, codec="auto") as peer:
            spec = kvwire.KVSpec(num_layers=1, num_kv_heads=1, head_dim=8)
            with pytest.raises(kvwire.UsageError):
                await peer.send("big", spec, make_layers(1, 4, 1, 8), meta={"x": "y" * (8 << 20)})
            assert not peer.sends
            assert peer.transport_meter._paused is not None


async def test_auto_measures_raw_over_sends_of_a_few_mib() -> None:
    """Over a real connection: sequential sends of 8 MiB each with ``codec="auto"`` get
    raw's transport cost measured (before, each send restarted the count and no
    measurement of 32 MiB ever completed, so ``auto`` held raw as unmeasured for good)."""
    spec = kvwire.KVSpec(num_layers=4, num_kv_heads=8, head_dim=128)
    layers = make_layers(4, 1024, 8, 128)  # 4 layers x K, V x 1024 x 8 x 128 x 2 B = 8 MiB
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async def take() -> None:
            while True:
                async for _ in await server.accept():
                    pass

        taker = asyncio.create_task(take())
        try:
            async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, codec="auto") as peer:
                assert peer.chooser is not None
                for i in range(12):  # 96 MiB of raw: the first 32 MiB warm up, then two measurements
                    await peer.send(f"r{i}", spec, layers, timeout=60)
                assert peer.chooser.transport_cost_of("raw") is not None
                assert peer.chooser._free_measured()
        finally:
            taker.cancel()
            await asyncio.gather(taker, return_exceptions=True)


def test_runnable_ns_counts_the_threads_time_on_a_cpu() -> None:
    """Linux's schedstat of the calling thread: its time on a CPU (what thread_time
    counts) plus its time waiting for one; it never counts less than the former."""
    import sys

    from kvwire.aio.client import runnable_ns

    before, cpu0 = runnable_ns(), time.thread_time_ns()
    if sys.platform != "linux":
        assert before is None
        return
    assert isinstance(before, int)
    x = 0
    for i in range(3_000_000):
        x += i
    after, cpu1 = runnable_ns(), time.thread_time_ns()
    # the scheduler's count may lag the thread's clock by a tick (10 ms at HZ=100)
    assert after is not None and after - before >= (cpu1 - cpu0) - 20_000_000 > 0
