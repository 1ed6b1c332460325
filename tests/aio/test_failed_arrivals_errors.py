"""A transfer that failed after it arrived and before anyone claimed it is handed out
raising the error it failed with, as README says: not always TransferAbortedError."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import kvwire
from kvwire.errors import ErrorCode
from tests.aio.server_log_helpers import begin
from tests.conftest import SECRET
from tests.rawpeer import raw_client, wait_until

pytestmark = pytest.mark.timeout(60)


async def raised(server: Any) -> BaseException:
    assert await wait_until(lambda: server.statistics()["failed_arrivals"] == 1, 10)
    t = await server.expect("r", timeout=5)
    with pytest.raises(kvwire.KvwireError) as info:
        async with asyncio.timeout(5):
            await t.collect()
    return info.value


async def test_a_sender_reset_session_lost_and_transfer_timeout_each_raise_their_own_error() -> None:
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, resume_timeout=0) as server:
        conn, _reader, writer = await raw_client(server.port)
        conn.send_begin(begin(1, "r"))
        conn.send_reset(1, ErrorCode.CANCELLED, "bye")
        writer.writelines([bytes(p) for p in conn.data_to_send()])
        error = await raised(server)
        assert type(error) is kvwire.TransferAbortedError and str(error) == "bye"
        writer.close()
        conn, _reader, writer = await raw_client(server.port)
        conn.send_begin(begin(1, "r"))
        writer.writelines([bytes(p) for p in conn.data_to_send()])
        assert await wait_until(lambda: server.statistics()["pending_arrivals"] == 1, 10)
        writer.transport.abort()  # the connection breaks: its session is lost
        writer.close()
        assert isinstance(await raised(server), kvwire.ConnectionLostError)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, transfer_timeout=0.2) as server:
        conn, _reader, writer = await raw_client(server.port)
        try:
            conn.send_begin(begin(1, "r"))
            writer.writelines([bytes(p) for p in conn.data_to_send()])
            assert isinstance(await raised(server), kvwire.TransferTimeoutError)
        finally:
            writer.close()
