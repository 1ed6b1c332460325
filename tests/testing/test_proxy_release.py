"""A connection through the proxy (kvwire.bench._proxy.TcpProxy, behind
kvwire.testing.FaultProxy) that has ended lets go of its sides' read buffers (1 MiB each),
its pipes and its fault policies; it keeps only its byte counts, which
FaultProxy.statistics() still adds up. (Every ended connection held its two 1 MiB buffers
and both policies for the proxy's lifetime: about 2 MiB a connection.)"""

from __future__ import annotations

import asyncio

from kvwire.bench._proxy import ProxyConnection
from kvwire.testing import CLEAN, FaultPlan, FaultProxy, Faults
from kvwire.testing.fault_proxy import _FaultPolicy
from tests.servers import target


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()


async def _round_trip(port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        writer.write_eof()
        got = bytearray()
        try:
            while chunk := await reader.read(65536):
                got += chunk
        except ConnectionError:
            pass
        return bytes(got)
    finally:
        writer.close()


def _assert_holds_nothing(conn: ProxyConnection) -> None:
    assert conn.closed.done()
    for side in (conn.client, conn.upstream):
        assert len(side._buffer) == 0 and len(side._view) == 0
        assert side.outgoing is None and side.incoming is None
        assert side.transport is None
        assert side._early == []
    for pipe in (conn.forward, conn.backward):
        if pipe is not None:
            assert not isinstance(pipe.policy, _FaultPolicy)
            assert pipe.gate is None
            assert pipe.statistics().queued_bytes == 0


async def test_ended_connections_keep_their_counts_not_their_buffers_or_policies() -> None:
    # Connection 1 is dropped by its plan after 3 bytes; the others echo everything.
    plans = {1: FaultPlan(forward=Faults(drop_at=3))}

    def plan(index: int) -> FaultPlan:
        return plans.get(index, CLEAN)

    async with target(_echo) as port, FaultProxy("127.0.0.1", port, plan=plan) as proxy:
        # While a connection is open it has its buffers and its policies.
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(b"open")
        await writer.drain()
        assert await reader.readexactly(4) == b"open"
        conn = proxy.connections[0]
        assert conn.forward is not None and conn.backward is not None
        assert isinstance(conn.forward.policy, _FaultPolicy)
        assert isinstance(conn.backward.policy, _FaultPolicy)
        assert len(conn.client._buffer) > 0 and len(conn.upstream._buffer) > 0
        writer.write_eof()
        assert await reader.read() == b""
        writer.close()

        assert await _round_trip(proxy.port, b"dropped") == b""
        for _ in range(5):
            assert await _round_trip(proxy.port, b"hello") == b"hello"
        for conn in proxy.connections:
            await asyncio.wait_for(conn.closed, 5)

        assert len(proxy.connections) == 7
        for conn in proxy.connections:
            _assert_holds_nothing(conn)
        # Counts survive the release.
        stats = proxy.statistics()
        assert stats.connections == 7 and stats.active == 0
        assert stats.bytes_forward == 4 + 3 + 5 * 5
        assert stats.bytes_backward == 4 + 5 * 5
        assert stats.drops == 1
        # Faults aimed at an ended connection do nothing.
        proxy.resume(0)
        proxy.stall(1)
        proxy.drop(2)
        assert proxy.statistics().drops == 1


async def test_a_connection_stalled_for_good_and_dropped_lets_go_too() -> None:
    plan = FaultPlan(forward=Faults(stall_at=2), backward=Faults(stall_at=0))
    async with target(_echo) as port, FaultProxy("127.0.0.1", port, plan=plan) as proxy:
        _, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(b"queued behind the stall")
        await writer.drain()
        conn = proxy.connections[0]

        async def read_by_proxy() -> None:
            while conn.forward is None or conn.forward.bytes_in < 23:
                await asyncio.sleep(0.005)

        await asyncio.wait_for(read_by_proxy(), 5)
        assert conn.forward is not None
        assert conn.forward.statistics().queued_bytes == 21
        proxy.drop(0, reset=True)
        await asyncio.wait_for(conn.closed, 5)
        _assert_holds_nothing(conn)
        assert conn.forward.bytes_out == 2
        writer.close()


async def test_a_connection_whose_target_refuses_lets_go() -> None:
    srv = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    srv.close()
    await srv.wait_closed()
    async with FaultProxy("127.0.0.1", port) as proxy:
        assert await asyncio.wait_for(_round_trip(proxy.port, b"x" * 1000), 5) == b""
        conn = proxy.connections[0]
        await asyncio.wait_for(conn.closed, 5)
        _assert_holds_nothing(conn)
        assert conn.forward is None and conn.backward is None
        assert proxy.statistics().active == 0
