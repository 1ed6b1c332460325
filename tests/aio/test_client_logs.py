"""What a client logs of its server: each line names the server as host:port, none repeats
the logger's name ('kvwire: kvwire:' under ``kvwire serve``'s format), and text the server
chose (RESET and GOAWAY messages, a refusal's) has its unprintable characters and the
backslash escaped, so a server cannot forge a line of the client's log."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import kvwire
from kvwire.aio._logtext import printable
from kvwire.errors import ErrorCode
from kvwire.testing.fault_proxy import FaultPlan, FaultProxy, Faults
from kvwire.wire import (
    ClientAuthenticated,
    Connection,
    ConnectionConfig,
    Role,
    State,
    TransferBegun,
)
from tests.aio.conftest import Records
from tests.aio.server_log_helpers import FORGERS
from tests.conftest import SECRET, make_layers

pytestmark = pytest.mark.timeout(60)

SPEC = kvwire.KVSpec(num_layers=2, num_kv_heads=1, head_dim=8)
#: A line break and a forged line after it, an escape sequence, a bidirectional override.
FORGED = "bye\n2026-01-01 00:00:00 ERROR kvwire: forged \x1b[31m\u202e\\x41"


def client_lines(records: Records) -> list[str]:
    return [r.getMessage() for r in records.records if r.name == "kvwire" and r.module == "client"]


def check_lines(lines: list[str], where: str) -> None:
    for line in lines:
        assert not line.startswith("kvwire:"), line
        assert where in line, line
        assert not any(c in line for c in FORGERS), line


async def fake_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Stream 0: welcomed; its first transfer reset, then the stream closed, each with
    FORGED.  A stream joining the session: refused (LIMIT_EXCEEDED) with FORGED."""
    conn = Connection(Role.SERVER, ConnectionConfig(secret=SECRET))
    try:
        while True:
            data = await reader.read(65536)
            if not data:
                return
            conn.receive_data(data)
            while (ev := conn.next_event()) is not None:
                if isinstance(ev, ClientAuthenticated):
                    if any(ev.session_id):
                        conn.refuse(ErrorCode.LIMIT_EXCEEDED, FORGED)
                    else:
                        conn.welcome(b"F" * 16, ("raw",))
                elif isinstance(ev, TransferBegun):
                    conn.send_reset(ev.frame.transfer_id, ErrorCode.INTERNAL_ERROR, FORGED)
                    writer.write(b"".join(bytes(p) for p in conn.data_to_send()))
                    await writer.drain()
                    conn.close(ErrorCode.NO_ERROR, FORGED)
            writer.write(b"".join(bytes(p) for p in conn.data_to_send()))
            await writer.drain()
            if conn.state is State.CLOSED:
                return
    finally:
        writer.transport.abort()


async def test_a_servers_text_is_escaped_in_the_clients_lines(records: Records) -> None:
    srv = await asyncio.start_server(fake_server, "127.0.0.1", 0)
    try:
        port = srv.sockets[0].getsockname()[1]
        async with kvwire.connect("127.0.0.1", port, secret=SECRET, streams="auto", max_streams=2,
                                  codec="raw") as peer:
            with pytest.raises(kvwire.KvwireError):
                await peer.send("x", SPEC, make_layers(2, 64, 1, 8), timeout=10)
            loop = asyncio.get_running_loop()
            end = loop.time() + 10
            while not any("on stream 0" in line for line in client_lines(records)) and loop.time() < end:
                await asyncio.sleep(0.02)
    finally:
        srv.close()
    lines = client_lines(records)
    where = f"127.0.0.1:{port}"
    for what in ("given up", "reset by the server", "GOAWAY from 127.0.0.1:{port} on stream 0",
                 "GOAWAY from 127.0.0.1:{port} on stream 1"):
        [line] = [line for line in lines if what.format(port=port) in line]
        # Escaped, not dropped; the backslash too (it cannot pass for an escape).
        assert "bye\\n2026-01-01" in line and "\\x1b[31m\\u202e\\\\x41" in line, line
    check_lines(lines, where)


async def test_failed_authentication_and_resumes_name_the_server(records: Records) -> None:
    def first_breaks(index: int) -> FaultPlan:
        return FaultPlan(forward=Faults(drop_at=3000)) if index == 0 else FaultPlan()

    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        with pytest.raises(kvwire.AuthenticationError):
            async with kvwire.connect("127.0.0.1", server.port, secret=b"wrong-secret-123"):
                pass
        check_lines(client_lines(records), f"127.0.0.1:{server.port}")
        assert any("authentication with" in line for line in client_lines(records))
        records.records.clear()
        async with FaultProxy("127.0.0.1", server.port, plan=first_breaks) as proxy:
            async with kvwire.connect("127.0.0.1", proxy.port, secret=SECRET, reconnect_backoff=0.01,
                                      chunk_bytes=4096) as peer:
                recv: Any = asyncio.create_task(server.expect("resumed", timeout=10))
                await peer.send("resumed", SPEC, make_layers(2, 512, 1, 8), timeout=20)
                await (await recv).collect(timeout=10)
            assert peer.statistics()["resumes"] == 1
            lines = client_lines(records)
            assert any("resuming" in line for line in lines)
            check_lines(lines, f"127.0.0.1:{proxy.port}")


def resetting_server(message: str) -> Any:
    """A server that welcomes a client and resets its first transfer with ``message``."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = Connection(Role.SERVER, ConnectionConfig(secret=SECRET))
        try:
            while data := await reader.read(65536):
                conn.receive_data(data)
                while (ev := conn.next_event()) is not None:
                    if isinstance(ev, ClientAuthenticated):
                        conn.welcome(b"F" * 16, ("raw",))
                    elif isinstance(ev, TransferBegun):
                        conn.send_reset(ev.frame.transfer_id, ErrorCode.INTERNAL_ERROR, message)
                writer.write(b"".join(bytes(p) for p in conn.data_to_send()))
                await writer.drain()
        finally:
            writer.transport.abort()
    return serve


async def test_a_servers_long_reset_text_is_cut_as_the_server_cuts_a_clients(records: Records) -> None:
    """The one rule for a peer's text in a log line (printable): escaped, cut after 500
    characters with '...' saying so, not silently after 200."""
    message = "\\" + "".join(f"{i:04d}," for i in range(180))  # 901 characters, under RESET's 1024 bytes
    srv = await asyncio.start_server(resetting_server(message), "127.0.0.1", 0)
    try:
        port = srv.sockets[0].getsockname()[1]
        async with kvwire.connect("127.0.0.1", port, secret=SECRET, codec="raw") as peer:
            with pytest.raises(kvwire.KvwireError):
                await peer.send("x", SPEC, make_layers(2, 64, 1, 8), timeout=10)
    finally:
        srv.close()
    [line] = [line for line in client_lines(records) if "reset by the server" in line]
    assert line.endswith(": " + printable(message)) and line.endswith("...")
    assert printable(message).startswith("\\\\0000,") and len(printable(message)) == 1 + 500 + 3
