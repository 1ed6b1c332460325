"""FaultProxy against real loopback sockets."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from kvwire.testing.fault_proxy import CLEAN, FaultPlan, FaultProxy, Faults
from tests.servers import target


@dataclass
class Sink:
    """A target that records what each connection sent and can reply."""

    port: int = 0
    received: list[bytearray] = field(default_factory=list)
    done: list[asyncio.Event] = field(default_factory=list)
    reply: bytes = b""
    read: bool = True


@pytest.fixture
async def sink() -> AsyncIterator[Sink]:
    state = Sink()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        buf = bytearray()
        ev = asyncio.Event()
        state.received.append(buf)
        state.done.append(ev)
        try:
            if state.reply:
                writer.write(state.reply)
                await writer.drain()
            while state.read:
                data = await reader.read(65536)
                if not data:
                    break
                buf += data
            if not state.read:
                await asyncio.sleep(30)
        finally:
            ev.set()

    async with target(handle) as port:
        state.port = port
        yield state


async def send_and_close(port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    try:
        await writer.drain()
        writer.write_eof()
    except (ConnectionError, OSError):
        pass
    got = bytearray()
    try:
        while chunk := await reader.read(65536):
            got += chunk
    except ConnectionError:
        pass
    writer.close()
    return bytes(got)


async def wait_received(sink: Sink, index: int = 0) -> bytes:
    while len(sink.done) <= index:
        await asyncio.sleep(0.005)
    await asyncio.wait_for(sink.done[index].wait(), 5)
    return bytes(sink.received[index])


async def wait_len(sink: Sink, n: int, index: int = 0) -> None:
    async def poll() -> None:
        while len(sink.received) <= index or len(sink.received[index]) < n:
            await asyncio.sleep(0.005)

    await asyncio.wait_for(poll(), 5)


async def test_clean_plan_forwards_both_ways(sink: Sink) -> None:
    sink.reply = b"hello back" * 1000
    payload = os.urandom(1 << 20)
    async with FaultProxy("127.0.0.1", sink.port) as proxy:
        got = await asyncio.wait_for(send_and_close(proxy.port, payload), 5)
        assert await wait_received(sink) == payload
        assert got == sink.reply
        stats = proxy.statistics()
    assert stats.connections == 1
    assert stats.bytes_forward == len(payload)
    assert stats.bytes_backward == len(sink.reply)
    assert stats.drops == stats.bit_flips == stats.stalls == 0


async def test_drop_at_offset_delivers_exactly_that_many_bytes(sink: Sink) -> None:
    payload = os.urandom(300_000)
    plan = FaultPlan(forward=Faults(drop_at=123_457))
    async with FaultProxy("127.0.0.1", sink.port, plan=plan) as proxy:
        await asyncio.wait_for(send_and_close(proxy.port, payload), 5)
        assert await wait_received(sink) == payload[:123_457]
        assert proxy.statistics().drops == 1


async def test_drop_at_zero_closes_before_any_byte(sink: Sink) -> None:
    plan = FaultPlan(forward=Faults(drop_at=0))
    async with FaultProxy("127.0.0.1", sink.port, plan=plan) as proxy:
        await asyncio.wait_for(send_and_close(proxy.port, b"x" * 1000), 5)
        assert await wait_received(sink) == b""


async def test_backward_drop_cuts_the_reply(sink: Sink) -> None:
    sink.reply = os.urandom(200_000)
    plan = FaultPlan(backward=Faults(drop_at=5000))
    async with FaultProxy("127.0.0.1", sink.port, plan=plan) as proxy:
        got = await asyncio.wait_for(send_and_close(proxy.port, b"hi"), 5)
    assert got == sink.reply[:5000]


async def test_bit_flips_change_exactly_those_bits(sink: Sink) -> None:
    payload = bytes(200_000)
    bits = (0, 8 * 1000 + 3, 8 * 150_000 + 7)
    plan = FaultPlan(forward=Faults(flip_bits=bits))
    async with FaultProxy("127.0.0.1", sink.port, plan=plan) as proxy:
        await asyncio.wait_for(send_and_close(proxy.port, payload), 5)
        got = await wait_received(sink)
        assert proxy.statistics().bit_flips == 3
    expected = bytearray(payload)
    for b in bits:
        expected[b // 8] ^= 1 << (b % 8)
    assert got == bytes(expected)


async def test_plan_per_connection_index(sink: Sink) -> None:
    def plan(index: int) -> FaultPlan:
        return FaultPlan(forward=Faults(drop_at=10)) if index == 0 else CLEAN

    async with FaultProxy("127.0.0.1", sink.port, plan=plan) as proxy:
        await asyncio.wait_for(send_and_close(proxy.port, b"a" * 100), 5)
        assert await wait_received(sink, 0) == b"a" * 10
        await asyncio.wait_for(send_and_close(proxy.port, b"b" * 100), 5)
        assert await wait_received(sink, 1) == b"b" * 100
        # Plans can be swapped at runtime for new connections.
        proxy.plan = FaultPlan(forward=Faults(drop_at=3))
        await asyncio.wait_for(send_and_close(proxy.port, b"c" * 100), 5)
        assert await wait_received(sink, 2) == b"ccc"
        assert [c.index for c in proxy.connections] == [0, 1, 2]


async def test_timed_stall_holds_bytes_after_offset(sink: Sink) -> None:
    plan = FaultPlan(forward=Faults(stall_at=5, stall_for=0.3))
    async with FaultProxy("127.0.0.1", sink.port, plan=plan) as proxy:
        _, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(b"0123456789")
        await writer.drain()
        await wait_len(sink, 5)
        start = time.monotonic()
        assert bytes(sink.received[0]) == b"01234"
        await wait_len(sink, 10)
        assert time.monotonic() - start >= 0.2
        assert bytes(sink.received[0]) == b"0123456789"
        assert proxy.statistics().stalls == 1
        writer.close()


async def test_stall_forever_until_resume(sink: Sink) -> None:
    plan = FaultPlan(forward=Faults(stall_at=3))
    async with FaultProxy("127.0.0.1", sink.port, plan=plan) as proxy:
        _, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(b"abcdef")
        await writer.drain()
        await wait_len(sink, 3)
        await asyncio.sleep(0.2)
        assert bytes(sink.received[0]) == b"abc"
        proxy.resume(0)
        await wait_len(sink, 6)
        assert bytes(sink.received[0]) == b"abcdef"
        writer.close()


async def test_runtime_stall_resume_and_drop(sink: Sink) -> None:
    async with FaultProxy("127.0.0.1", sink.port) as proxy:
        _, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(b"one")
        await wait_len(sink, 3)
        proxy.stall(0)
        writer.write(b"two")
        await asyncio.sleep(0.15)
        assert bytes(sink.received[0]) == b"one"
        proxy.resume()
        await wait_len(sink, 6)
        proxy.drop(0)
        assert await wait_received(sink) == b"onetwo"
        assert proxy.statistics().drops == 1
        writer.close()


async def test_trickle_forwards_small_pieces_slowly(sink: Sink) -> None:
    plan = FaultPlan(forward=Faults(trickle_from=4, trickle_bytes=2, trickle_interval=0.02))
    async with FaultProxy("127.0.0.1", sink.port, plan=plan) as proxy:
        start = time.monotonic()
        await asyncio.wait_for(send_and_close(proxy.port, b"HEAD" + b"t" * 20), 5)
        got = await wait_received(sink)
        elapsed = time.monotonic() - start
        assert got == b"HEAD" + b"t" * 20
        # Ten 2-byte pieces, 20 ms apart.
        assert elapsed >= 0.18
        assert proxy.statistics().trickled_bytes == 20


async def test_rate_cap_slows_the_direction(sink: Sink) -> None:
    payload = os.urandom(500_000)
    plan = FaultPlan(forward=Faults(rate_bps=20e6))  # 2.5 MB/s -> 0.2 s
    async with FaultProxy("127.0.0.1", sink.port, plan=plan) as proxy:
        start = time.monotonic()
        await asyncio.wait_for(send_and_close(proxy.port, payload), 5)
        assert await wait_received(sink) == payload
        assert time.monotonic() - start >= 0.18


async def test_slow_target_bounds_proxy_memory(sink: Sink) -> None:
    sink.read = False
    async with FaultProxy("127.0.0.1", sink.port, buffer_bytes=256 * 1024) as proxy:
        _, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        chunk = bytes(1 << 20)
        # The client gets ahead only by socket buffers plus the proxy's bound.
        for _ in range(64):
            writer.write(chunk)
            try:
                await asyncio.wait_for(writer.drain(), 0.2)
            except TimeoutError:
                break
        conn = proxy.connections[0]
        assert conn.forward is not None
        stats = conn.forward.statistics()
        assert stats.bytes_in < 64 << 20
        # One read (up to 1 MiB) may land on top of the bound before reading pauses.
        assert stats.queued_bytes <= 256 * 1024 + (1 << 20)
        assert stats.reading_paused or stats.writing_paused
        writer.transport.abort()


async def test_unreachable_target_closes_client() -> None:
    srv = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    srv.close()
    await srv.wait_closed()
    async with FaultProxy("127.0.0.1", port) as proxy:
        got = await asyncio.wait_for(send_and_close(proxy.port, b"x"), 5)
    assert got == b""
