"""What the server logs and counts of its peers: every counter from 0, one line (at most a
few) per connection whatever a peer repeats on it, a line for each connection dropped for
an error, the peer's address in each, and no line a peer's text can forge."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

import kvwire
from kvwire.aio._logtext import code_name, printable
from kvwire.errors import ErrorCode
from kvwire.wire.frames import frame_bytes
from tests.aio.conftest import Records
from tests.aio.server_log_helpers import FORGERS, begin
from tests.conftest import SECRET
from tests.rawpeer import raw_client, wait_until

pytestmark = pytest.mark.timeout(60)

COUNTERS = (
    "transfers_accepted", "transfers_refused", "transfers_aborted", "transfers_aborted_by_peer",
    "transfers_unclaimed", "buffer_budget_refusals", "authentication_failures", "tls_handshake_failures",
    "resumes", "goaways_received", "connections_dropped", "pending_arrivals",
)


async def until_closed(reader: asyncio.StreamReader) -> None:
    async def go() -> None:
        try:
            while await reader.read(65536):
                pass
        except ConnectionError:
            pass
    await asyncio.wait_for(go(), 10)


def local(writer: Any) -> str:
    host, port = writer.get_extra_info("sockname")[:2]
    return f"{host}:{port}"


async def test_every_counter_is_there_from_the_start() -> None:
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        stats = server.statistics()
        assert {name: stats[name] for name in COUNTERS} == dict.fromkeys(COUNTERS, 0)


async def test_a_peer_beginning_and_resetting_transfers_without_end_gets_a_line_or_two(records: Records) -> None:
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        conn, reader, writer = await raw_client(server.port)
        for tid in range(1, 301):
            conn.send_begin(begin(tid, f"r{tid}"))
            conn.send_reset(tid, ErrorCode.CANCELLED, "bye")
        writer.writelines([bytes(p) for p in conn.data_to_send()])
        assert await wait_until(lambda: server.statistics()["transfers_aborted_by_peer"] == 300, 10)
        conn.close()
        writer.writelines([bytes(p) for p in conn.data_to_send()])
        await until_closed(reader)
        writer.close()
        assert await wait_until(lambda: server.statistics()["goaways_received"] == 1, 5)
    # Each transfer at DEBUG (counted in statistics()); the connection's end at INFO, once.
    assert len([r for r in records.records if r.levelno == logging.DEBUG and "reset by the client" in r.getMessage()]) == 300
    [line] = [r.getMessage() for r in records.at_least(logging.INFO)]
    assert line.startswith(f"GOAWAY from {local(writer)}: NO_ERROR")


async def test_a_peers_text_cannot_forge_or_hide_a_line(records: Records) -> None:
    text = "bye" + "".join(FORGERS) + "2099-01-01 ERROR kvwire: forged line"
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        conn, reader, writer = await raw_client(server.port)
        conn.send_begin(begin(1, "r\n" + "".join(FORGERS) + "2099-01-01 ERROR kvwire: forged id"))
        conn.send_reset(1, ErrorCode.CANCELLED, text)
        conn.close(ErrorCode.NO_ERROR, text)
        writer.writelines([bytes(p) for p in conn.data_to_send()])
        await until_closed(reader)
        writer.close()
        assert await wait_until(lambda: server.statistics()["goaways_received"] == 1, 5)
    said = [r.getMessage() for r in records.records]
    assert any("reset by the client" in m for m in said) and any("GOAWAY" in m for m in said)
    for message in said:
        assert not any(c in message for c in FORGERS), message
        assert message.count("forged line") <= 1
    assert any("bye\\n\\r\\x1b" in m for m in said)  # escaped, not dropped


async def drop_with_garbage(port: int) -> str:
    _conn, reader, writer = await raw_client(port)
    writer.write(b"\xff" * 64)  # no frame
    await until_closed(reader)
    writer.close()
    return local(writer)


async def drop_with_a_bad_crc(port: int) -> str:
    _conn, reader, writer = await raw_client(port)
    frame = bytearray(frame_bytes(begin(1, "x")))
    frame[-1] ^= 0xFF
    writer.write(bytes(frame))
    await until_closed(reader)
    writer.close()
    return local(writer)


async def drop_when_silent(port: int) -> str:
    _conn, reader, writer = await raw_client(port)
    await until_closed(reader)  # the server's idle_timeout (its PING unanswered)
    writer.close()
    return local(writer)


@pytest.mark.parametrize(("how", "level", "said"), [
    (drop_with_garbage, logging.WARNING, "FRAME_TOO_LARGE"),
    (drop_with_a_bad_crc, logging.WARNING, "INTEGRITY_ERROR"),
    (drop_when_silent, logging.INFO, "TIMEOUT"),
], ids=["garbage", "bad-crc", "idle-timeout"])
async def test_a_connection_dropped_for_an_error_is_logged_once_with_the_peers_address(
    records: Records, how: Any, level: int, said: str,
) -> None:
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, idle_timeout=0.5) as server:
        peer = await how(server.port)
        assert await wait_until(lambda: server.statistics()["connections_dropped"] == 1, 5)
    [record] = [r for r in records.at_least(logging.INFO) if peer in r.getMessage()]
    assert record.levelno == level and said in record.getMessage()
    assert record.getMessage().startswith(f"connection from {peer} closed")


async def test_a_resume_is_logged_with_the_address_and_no_message_repeats_the_loggers_name(
    records: Records,
) -> None:
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, resume_timeout=10) as server:
        conn, _reader, writer = await raw_client(server.port)
        conn.send_begin(begin(1, "r"))
        writer.writelines([bytes(p) for p in conn.data_to_send()])
        assert await wait_until(lambda: server.statistics()["transfers_accepted"] == 1, 5)
        writer.transport.abort()  # the stream breaks
        assert await wait_until(lambda: server.statistics()["connections"] == 0, 5)
        _conn2, _reader2, writer2 = await raw_client(server.port, session_id=conn.session_id)
        assert await wait_until(lambda: server.statistics()["resumes"] == 1, 5)
        writer2.close()
    [resumed] = [r for r in records.records if "resumed" in r.getMessage()]
    assert resumed.getMessage().startswith(f"{local(writer2)} resumed stream 0 of session ")
    assert records.records and not [r for r in records.records if r.getMessage().startswith("kvwire")]


async def test_goaway_text_and_request_ids_follow_the_one_rule_for_a_peers_text(records: Records) -> None:
    """A GOAWAY's message and a request id are logged as every other text a peer chose
    (printable: escaped, cut after 500 characters with '...'), as the client logs a
    GOAWAY: not as a repr (quoted, cut at 48 characters for a request id)."""
    request_id = "it's " + "x" * 600
    message = "it's time\n"
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        conn, reader, writer = await raw_client(server.port)
        conn.send_begin(begin(1, request_id))
        conn.send_reset(1, ErrorCode.CANCELLED, "bye")
        conn.close(ErrorCode.NO_ERROR, message)
        writer.writelines([bytes(p) for p in conn.data_to_send()])
        await until_closed(reader)
        writer.close()
        assert await wait_until(lambda: server.statistics()["goaways_received"] == 1, 5)
    said = [r.getMessage() for r in records.records]
    [goaway] = [m for m in said if m.startswith("GOAWAY")]
    assert goaway == f"GOAWAY from {local(writer)}: {code_name(ErrorCode.NO_ERROR)} {printable(message)}"
    [reset] = [m for m in said if "reset by the client" in m]
    assert reset.startswith(f"transfer '{printable(request_id)}' from {local(writer)} reset by the client")
    assert printable(request_id).endswith("x" * 495 + "...")
