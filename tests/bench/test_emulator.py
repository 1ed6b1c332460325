"""LinkEmulator: rate schedule arithmetic, and shaping real loopback transfers (with each
pump: splice(2) through kernel pipes, and reading into Python).

The transfers assert only what a shaper guarantees whatever else the host runs: bytes never
leave faster than the rate, nor a round trip sooner than the delay.  A loaded host can only
make them later, so how close they come on a quiet one is measured by the benchmarks
(docs/benchmarks.md, "Link emulator accuracy"), not asserted here."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from kvwire.bench import emulator
from kvwire.bench.emulator import SPLICE_AVAILABLE, LinkEmulator, RateSchedule
from tests.servers import target

MB = 1_000_000


def test_splice_is_the_default_where_available(monkeypatch: pytest.MonkeyPatch) -> None:
    assert LinkEmulator("127.0.0.1", 9).splice is SPLICE_AVAILABLE
    monkeypatch.setattr(emulator, "SPLICE_AVAILABLE", False)
    assert LinkEmulator("127.0.0.1", 9).splice is False
    with pytest.raises(ValueError, match="splice"):
        LinkEmulator("127.0.0.1", 9, splice=True)


def test_schedule_rate_at_and_finish_time() -> None:
    s = RateSchedule([(0.0, 8e6), (2.0, 4e6)])  # 1 MB/s, then 0.5 MB/s
    assert s.rate_at(0.0) == 8e6
    assert s.rate_at(1.999) == 8e6
    assert s.rate_at(2.0) == 4e6
    assert s.peak_bps == 8e6
    assert s.finish_time(0.0, MB) == pytest.approx(1.0)
    # 1 MB before the step, the other 0.5 MB after it at half the rate.
    assert s.finish_time(1.0, MB + MB // 2) == pytest.approx(3.0)
    assert s.finish_time(5.0, MB) == pytest.approx(7.0)


def test_schedule_unlimited_and_steps() -> None:
    s = RateSchedule.constant(None)
    assert s.finish_time(3.0, 10**12) == 3.0
    assert s.peak_bps is None
    s = RateSchedule([(1.0, 8e6)])
    assert s.steps == [(0.0, 8e6), (1.0, 8e6)]
    s.add_step(0.5, 16e6)
    assert s.steps == [(0.0, 8e6), (0.5, 16e6)]
    with pytest.raises(ValueError):
        RateSchedule([(0.0, 0.0)])


@dataclass
class Counter:
    port: int = 0
    total: int = 0
    last_byte_at: float = 0.0
    per_conn: list[int] = field(default_factory=list)
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    expected: int = 0


@pytest.fixture
async def counter() -> AsyncIterator[Counter]:
    state = Counter()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        index = len(state.per_conn)
        state.per_conn.append(0)
        while data := await reader.read(1 << 20):
            if data.startswith(b"PING"):
                writer.write(b"PONG")
                continue
            state.per_conn[index] += len(data)
            state.total += len(data)
            state.last_byte_at = time.monotonic()
            if state.expected and state.total >= state.expected:
                state.finished.set()

    async with target(handle) as port:
        state.port = port
        yield state


async def blast(port: int, nbytes: int) -> None:
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    block = bytes(1 << 20)
    sent = 0
    while sent < nbytes:
        n = min(len(block), nbytes - sent)
        writer.write(block[:n])
        await writer.drain()
        sent += n
    writer.write_eof()
    await writer.drain()
    writer.close()


async def test_shapes_a_transfer_to_its_rate(counter: Counter, splice: bool) -> None:
    rate = 200e6
    nbytes = 15 * MB  # 0.6 s at 200 Mbit/s
    counter.expected = nbytes
    async with LinkEmulator("127.0.0.1", counter.port, rate_bps=rate, splice=splice) as link:
        start = time.monotonic()
        await asyncio.wait_for(blast(link.port, nbytes), 5)
        await asyncio.wait_for(counter.finished.wait(), 5)
        elapsed = counter.last_byte_at - start
        stats = link.statistics()
    assert counter.total == nbytes
    assert 8 * nbytes / elapsed <= rate * 1.05  # never faster than the link
    assert stats.bytes_forward == nbytes
    assert stats.rate_bps == rate
    assert stats.connections == 1


async def test_connections_share_the_rate(counter: Counter, splice: bool) -> None:
    rate = 200e6
    each = 5 * MB
    counter.expected = 2 * each
    async with LinkEmulator("127.0.0.1", counter.port, rate_bps=rate, splice=splice) as link:
        start = time.monotonic()
        await asyncio.wait_for(asyncio.gather(blast(link.port, each), blast(link.port, each)), 5)
        await asyncio.wait_for(counter.finished.wait(), 5)
        elapsed = counter.last_byte_at - start
    assert counter.per_conn == [each, each]
    assert 8 * 2 * each / elapsed <= rate * 1.05  # the two share the rate: neither gets it all


async def test_schedule_change_takes_effect(counter: Counter, splice: bool) -> None:
    # 50 MB/s for 0.2 s (10 MB), then 12.5 MB/s: 15 MB take 0.2 + 0.4 = 0.6 s.
    nbytes = 15 * MB
    counter.expected = nbytes
    schedule = [(0.0, 400e6), (0.2, 100e6)]
    async with LinkEmulator("127.0.0.1", counter.port, schedule=schedule, splice=splice) as link:
        assert link.rate_at(0.1) == 400e6 and link.rate_at(0.3) == 100e6
        start = time.monotonic()
        await asyncio.wait_for(blast(link.port, nbytes), 5)
        await asyncio.wait_for(counter.finished.wait(), 5)
        elapsed = counter.last_byte_at - start
        assert link.statistics().rate_bps == 100e6
    assert elapsed >= 0.6 * 0.95  # at 50 MB/s throughout it would take 0.3 s


async def test_set_rate_at_runtime(counter: Counter, splice: bool) -> None:
    async with LinkEmulator("127.0.0.1", counter.port, rate_bps=100e6, splice=splice) as link:
        link.set_rate(300e6)
        assert link.statistics().rate_bps == 300e6
        assert link.rate_at(0.0) == 100e6


async def test_delay_adds_round_trip_latency(counter: Counter, splice: bool) -> None:
    delay = 0.05
    async with LinkEmulator("127.0.0.1", counter.port, delay=delay, splice=splice) as link:
        reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
        rtts = []
        for _ in range(3):
            start = time.monotonic()
            writer.write(b"PING")
            assert await asyncio.wait_for(reader.readexactly(4), 5) == b"PONG"
            rtts.append(time.monotonic() - start)
        writer.close()
    assert min(rtts) >= 2 * delay


async def test_jitter_keeps_delay_within_bounds(counter: Counter, splice: bool) -> None:
    async with LinkEmulator("127.0.0.1", counter.port, delay=0.03, jitter=0.01, seed=1, splice=splice) as link:
        reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
        for _ in range(3):
            start = time.monotonic()
            writer.write(b"PING")
            await asyncio.wait_for(reader.readexactly(4), 5)
            rtt = time.monotonic() - start
            assert rtt >= 2 * 0.02
        writer.close()


def test_the_default_queue_lasts_the_same_time_at_every_rate() -> None:
    assert emulator.default_queue_bytes(None) == emulator.MAX_QUEUE
    assert emulator.default_queue_bytes(10e9) == emulator.MAX_QUEUE
    assert emulator.default_queue_bytes(100e6) == int(100e6 / 8 * emulator.QUEUE_TIME)
    assert emulator.default_queue_bytes(1e6) == emulator.MIN_QUEUE
    assert LinkEmulator("127.0.0.1", 9, rate_bps=100e6).queue_bytes == int(100e6 / 8 * emulator.QUEUE_TIME)
    assert LinkEmulator("127.0.0.1", 9, rate_bps=100e6, queue_bytes=12345).queue_bytes == 12345


async def test_a_slow_link_queues_a_fraction_of_a_second_not_megabytes(counter: Counter, splice: bool) -> None:
    """A sender writing as fast as it can into an 8 Mbit/s link: what it got rid of and the
    link has not carried yet is the bottleneck's queue (50 ms, its 64 KiB floor here) and
    small socket buffers, not the 4 MiB of a fast link plus the kernel's autotuned
    megabytes (which made the bench's last message wait a minute behind them)."""
    import socket

    async with LinkEmulator("127.0.0.1", counter.port, rate_bps=8e6, splice=splice) as link:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(sock, ("127.0.0.1", link.port))
        block, written = bytes(64 * 1024), 0
        until = time.monotonic() + 1.5  # long enough to fill every buffer on the way
        try:
            while time.monotonic() < until:
                try:
                    written += sock.send(block)
                except BlockingIOError:
                    await asyncio.sleep(0.01)
            ahead = written - link.statistics().bytes_forward
        finally:
            sock.close()
    assert ahead < 1 << 20, f"{ahead} bytes queued ahead of an 8 Mbit/s link"


async def test_connections_share_one_bottleneck_queue(counter: Counter, splice: bool) -> None:
    """Eight senders writing as fast as they can into one 8 Mbit/s link: what the emulator
    holds for the link is one queue of ``queue_bytes`` for all of them (a router port's),
    not one per connection (eight times as long a wait for every byte). A reader that
    finds the queue full reads no more; the copying pump may overshoot by one small read
    per connection."""
    import socket

    senders, queue = 8, 64 * 1024
    async with LinkEmulator("127.0.0.1", counter.port, rate_bps=8e6, queue_bytes=queue, splice=splice) as link:
        loop = asyncio.get_running_loop()
        socks = []
        for _ in range(senders):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
            sock.setblocking(False)
            await loop.sock_connect(sock, ("127.0.0.1", link.port))
            socks.append(sock)
        block, written = bytes(64 * 1024), 0
        held, reported = [], []
        until = time.monotonic() + 1.5
        try:
            while time.monotonic() < until:
                for sock in socks:
                    with contextlib.suppress(BlockingIOError):
                        written += sock.send(block)
                stats = link.statistics()
                reported.append(stats.queued_bytes)
                held.append(sum(c.forward.statistics().queued_bytes for c in link._proxy.connections if c.forward))
                await asyncio.sleep(0.002)
            carried = link.statistics().bytes_forward
        finally:
            for sock in socks:
                sock.close()
    assert carried > 0 and written > carried + senders * queue  # every sender was held back
    # No delay line here: what the pumps hold is what the bottleneck has not passed yet.
    bound = queue + senders * 16 * 1024
    assert max(held) <= bound, f"{max(held)} bytes held for the link by {senders} connections"
    assert 0 < max(reported) <= bound


async def test_the_shared_queue_wakes_its_readers_once_drained_to_half() -> None:
    loop = asyncio.get_running_loop()
    queue = emulator._SharedQueue(1000)
    now = loop.time()
    for i in range(10):  # 100 bytes leaving every 10 ms
        queue.add(now + 0.01 * (i + 1), 100)
    assert queue.room(now) == 0 and not queue.drained(now)
    woken: list[int] = []
    done = asyncio.Event()

    def wake(tag: int) -> None:
        woken.append(queue.backlog(loop.time()))
        if len(woken) == 2:
            done.set()

    queue.wait(now, lambda: wake(1))
    queue.wait(now, lambda: wake(2))
    await asyncio.wait_for(done.wait(), 5)
    assert all(left <= 500 for left in woken)  # each woken once, at or below the low mark
    await asyncio.sleep(0.02)
    assert len(woken) == 2
    assert queue.backlog(loop.time() + 1) == 0
    queue.close()


def test_a_read_leaves_the_link_in_pieces_each_when_it_is_through() -> None:
    """600 KB read at once from a 100 Mbit/s link: its first bytes may leave after 1 ms
    (as on a wire), not when the read's last byte is through 48 ms later."""
    link = LinkEmulator("127.0.0.1", 9, rate_bps=100e6, burst=0.0)
    forward, _ = link._policies(None)  # type: ignore[arg-type]
    pieces = forward.pieces(0.0, 600_000)
    assert sum(n for n, _ in pieces) == 600_000
    assert {n for n, _ in pieces[:-1]} == {12_500}  # 1 ms of the rate each
    assert pieces[0][1] == pytest.approx(0.001)
    assert pieces[-1][1] == pytest.approx(0.048)
    assert [due for _, due in pieces] == sorted(due for _, due in pieces)
    unlimited, _ = LinkEmulator("127.0.0.1", 9)._policies(None)  # type: ignore[arg-type]
    assert unlimited.pieces(0.0, 600_000) == [(600_000, 0.0)]
    # The reverse direction by its own rate: one piece when it is unlimited (not 4 KiB
    # slices of the forward rate's), 1 ms of its rate when it has one.
    _, back = link._policies(None)  # type: ignore[arg-type]
    assert back.pieces(0.0, 600_000) == [(600_000, 0.0)]
    slow_back = LinkEmulator("127.0.0.1", 9, rate_bps=10e9, reverse_rate_bps=10e6, burst=0.0)
    _, back = slow_back._policies(None)  # type: ignore[arg-type]
    first, *_ = back.pieces(0.0, 100_000)
    assert first == (4096, pytest.approx(4096 * 8 / 10e6))  # 1 ms is under MIN_PIECE here
    assert slow_back._backward_queue.limit == emulator.default_queue_bytes(10e6)


async def test_connections_take_turns_at_a_full_queue(counter: Counter, splice: bool) -> None:
    """Four senders always ahead of a 100 Mbit/s link: each gets a turn when the shared
    queue has room (one read each per readiness), so none is starved by the one whose
    socket the event loop happens to report first (it had taken all the room: 95 of 100
    Mbit/s)."""
    import socket
    import threading

    stop = threading.Event()

    def blast(port: int) -> None:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.settimeout(5)
            block = bytes(16 * 1024)
            with contextlib.suppress(OSError):
                while not stop.is_set():
                    sock.sendall(block)

    async with LinkEmulator("127.0.0.1", counter.port, rate_bps=100e6, splice=splice) as link:
        threads = [threading.Thread(target=blast, args=(link.port,), daemon=True) for _ in range(4)]
        for thread in threads:
            thread.start()
        try:
            await asyncio.sleep(2.0)
            carried = [c.forward.statistics().bytes_out for c in link._proxy.connections if c.forward]
        finally:
            stop.set()
            await asyncio.gather(*(asyncio.to_thread(thread.join, 10) for thread in threads))
    assert len(carried) == 4 and sum(carried) > 0
    assert min(carried) >= sum(carried) / 10, carried
