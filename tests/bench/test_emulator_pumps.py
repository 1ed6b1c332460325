"""Both link-emulator pumps on real loopback sockets: bytes intact and in order, EOF and
resets passed on, a bounded queue against a receiver that stops reading, and nothing
left open afterwards. The splice pump's delay line spans many kernel pipes here."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import hashlib
import os
import socket
import struct

import pytest

from kvwire.bench import _splice as splice_module
from kvwire.bench._splice import PIPE_BYTES, READ_BUDGET, SpliceProxy
from kvwire.bench.emulator import LinkEmulator
from tests.environment import needs_splice
from tests.servers import target

MB = 1 << 20


async def digest_then_reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Reads to EOF, answers with the SHA-256 of what it read, then closes."""
    h = hashlib.sha256()
    while data := await reader.read(MB):
        h.update(data)
    writer.write(h.digest())
    await writer.drain()


async def through(port: int, data: bytes, timeout: float = 10) -> bytes:
    """Sends ``data`` to ``port``, half-closes, and returns what comes back until EOF."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await asyncio.wait_for(writer.drain(), timeout)
    writer.write_eof()  # the target sees EOF only after every byte
    reply = await asyncio.wait_for(reader.read(), timeout)  # to the target's FIN
    writer.close()
    return reply


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_bytes_arrive_intact_and_eof_passes_both_ways(splice: bool) -> None:
    data = os.urandom(24 * MB)
    # 2 Gbit/s x 40 ms one way: about 10 MB wait in the delay line at once.
    async with target(digest_then_reply) as port, LinkEmulator(
        "127.0.0.1", port, rate_bps=2e9, delay=0.04, jitter=0.005, seed=3, splice=splice
    ) as link:
        reply = await through(link.port, data)
        stats = link.statistics()
        if splice:
            assert isinstance(link._proxy, SpliceProxy)
            assert link._proxy.pipes_created > 1  # the delay line spanned pipes
    assert reply == hashlib.sha256(data).digest()
    assert stats.bytes_forward == len(data) and stats.bytes_backward == 32


async def test_connections_stay_separate(splice: bool) -> None:
    blocks = [os.urandom(3 * MB + i) for i in range(4)]
    async with target(digest_then_reply) as port, LinkEmulator(
        "127.0.0.1", port, rate_bps=4e9, delay=0.005, splice=splice
    ) as link:
        replies = await asyncio.gather(*(through(link.port, b) for b in blocks))
        assert link.statistics().connections == 4
    assert replies == [hashlib.sha256(b).digest() for b in blocks]


async def test_a_receiver_that_stops_reading_bounds_the_queue(splice: bool) -> None:
    release = asyncio.Event()
    received = [0]

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await release.wait()
        while data := await reader.read(MB):
            received[0] += len(data)

    queue = 2 * MB
    total = 64 * MB
    async with target(slow) as port, LinkEmulator("127.0.0.1", port, queue_bytes=queue, splice=splice) as link:
        _, writer = await asyncio.open_connection("127.0.0.1", link.port)
        writer.write(os.urandom(total))
        with pytest.raises(asyncio.TimeoutError):  # the target reads nothing: no way through
            await asyncio.wait_for(writer.drain(), 1.0)
        conn = link._proxy.connections[0]
        assert conn.forward is not None
        stats = conn.forward.statistics()
        # Past the high-water mark reading stops; one read may overshoot it.
        assert 0 < stats.queued_bytes <= queue + max(READ_BUDGET, MB)
        assert stats.reading_paused
        release.set()
        await asyncio.wait_for(writer.drain(), 10)
        writer.write_eof()
        for _ in range(1000):
            if received[0] == total:
                break
            await asyncio.sleep(0.01)
        writer.close()
    assert received[0] == total


async def test_a_reset_is_passed_on(splice: bool) -> None:
    async def reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(4)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()

    async with target(reset) as port, LinkEmulator("127.0.0.1", port, splice=splice) as link:
        reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
        writer.write(b"ping")
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(reader.read(), 5)
        writer.close()
        for _ in range(500):
            if not link.statistics().active:
                break
            await asyncio.sleep(0.01)
        assert link.statistics().active == 0


async def test_an_unreachable_target_resets_the_client(splice: bool) -> None:
    with socket.socket() as probe:  # a port with nothing listening
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    async with LinkEmulator("127.0.0.1", port, splice=splice) as link:
        reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(reader.read(), 5)
        writer.close()


async def test_closing_with_bytes_in_flight_leaves_nothing_open(splice: bool) -> None:
    async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.read(MB):
            pass

    async with target(sink) as port:
        before = open_fds()
        link = LinkEmulator("127.0.0.1", port, rate_bps=1e9, delay=0.2, splice=splice)
        await link.start()
        _, writer = await asyncio.open_connection("127.0.0.1", link.port)
        writer.write(os.urandom(8 * MB + PIPE_BYTES // 3))
        await asyncio.sleep(0.1)  # bytes are waiting out the delay now
        assert link.statistics().bytes_forward == 0
        await link.close()
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
        for _ in range(500):
            if open_fds() <= before:
                break
            await asyncio.sleep(0.01)
        assert open_fds() <= before


@needs_splice
async def test_pipes_full_before_their_byte_budget_are_rotated(monkeypatch: pytest.MonkeyPatch) -> None:
    # Pipes left at the kernel's default 16 slots (as over a user's pipe quota) fill up long
    # before PIPE_BYTES: each refused splice moves on to a new pipe, and nothing is lost.
    monkeypatch.setattr(splice_module, "_F_SETPIPE_SZ", fcntl.F_GETPIPE_SZ)
    data = os.urandom(12 * MB)
    async with target(digest_then_reply) as port, LinkEmulator(
        "127.0.0.1", port, rate_bps=2e9, delay=0.03, splice=True
    ) as link:
        reply = await through(link.port, data)
        assert isinstance(link._proxy, SpliceProxy)
        created = link._proxy.pipes_created
    assert reply == hashlib.sha256(data).digest()
    # 7.5 MB wait in the delay line: 8-13 pipes of PIPE_BYTES; these took about 50
    assert created > 3 * 7.5e6 / PIPE_BYTES


def _pipe_limit(monkeypatch: pytest.MonkeyPatch, most: int) -> None:
    """Every pipe past the first ``most`` fails as it would out of descriptors."""
    real = splice_module._PipePool.get

    def get(self: splice_module._PipePool) -> splice_module._KernelPipe:
        if not self._free and self.created >= most:
            raise OSError(errno.EMFILE, "Too many open files")
        return real(self)

    monkeypatch.setattr(splice_module._PipePool, "get", get)


@needs_splice
async def test_out_of_pipes_waits_for_its_own_to_drain(monkeypatch: pytest.MonkeyPatch) -> None:
    _pipe_limit(monkeypatch, 3)  # far fewer than the delay line wants
    data = os.urandom(16 * MB)
    async with target(digest_then_reply) as port, LinkEmulator(
        "127.0.0.1", port, rate_bps=2e9, delay=0.03, splice=True
    ) as link:
        reply = await through(link.port, data, timeout=20)
        assert isinstance(link._proxy, SpliceProxy) and link._proxy.pipes_created == 3
    assert reply == hashlib.sha256(data).digest()


@needs_splice
async def test_no_pipe_at_all_resets_the_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    _pipe_limit(monkeypatch, 0)
    async with target(digest_then_reply) as port, LinkEmulator("127.0.0.1", port, splice=True) as link:
        reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
        writer.write(b"x" * 1000)
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(reader.read(), 5)
        writer.close()


async def test_a_delayed_eof_to_a_side_that_reset_raises_nothing_into_the_loop() -> None:
    """The target reset the connection while the client's EOF waited behind delayed bytes:
    writing that EOF fails, and the proxy must not hand the OSError to the event loop's
    exception handler (tests that check the handler saw nothing would fail at random)."""
    from kvwire.testing.fault_proxy import FaultPlan, FaultProxy, Faults

    errors: list[dict[str, object]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: errors.append(ctx))

    async def reset_early(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(0.05)
        writer.close()  # client data unread: the close is a reset

    server = await asyncio.start_server(reset_early, "127.0.0.1", 0)
    try:
        port = server.sockets[0].getsockname()[1]
        async with FaultProxy("127.0.0.1", port, plan=FaultPlan(forward=Faults(delay=0.3))) as proxy:
            _, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            writer.write(b"x" * 1000)
            await writer.drain()
            await asyncio.sleep(0.1)
            writer.write_eof()  # queued behind the delayed bytes
            await asyncio.sleep(1.0)
            writer.close()
    finally:
        server.close()
        await server.wait_closed()
    assert not errors
