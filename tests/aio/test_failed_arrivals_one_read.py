"""A transfer whose BEGIN and what fails it (its sender's RESET, a chunk that breaks the
rules) come in one read: the server handles its arrival and its failure in one pump.
Whoever claims it, an ``accept()`` / ``expect()`` already waiting or one made later, is
handed it once, failed: iterating it raises the error it failed with (it never hangs),
and nothing of it is left to hand out again.  The same whatever the order of the events
and of the calls."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import kvwire
from kvwire.errors import ErrorCode, KvwireError, TransferAbortedError
from kvwire.wire import Chunk
from kvwire.wire.frames import chunk_frame_size
from tests.aio.arrival_helpers import Destination
from tests.aio.server_log_helpers import begin
from tests.conftest import SECRET
from tests.rawpeer import raw_client, wait_until

pytestmark = pytest.mark.timeout(60)

WAITERS = ["accept", "expect", "expect-into"]


def claim(server: Any, how: str, dest: Destination) -> Any:
    if how == "accept":
        return server.accept(timeout=10)
    return server.expect("r", timeout=10, into=dest if how == "expect-into" else None)


async def outcome(t: kvwire.Transfer) -> KvwireError:
    """What iterating ``t`` raises (bounded: a transfer that never learns it failed hangs)."""
    with pytest.raises(KvwireError) as info:
        async with asyncio.timeout(5):
            async for _ in t:
                pass
    return info.value


async def nothing_left(server: Any) -> None:
    stats = server.statistics()
    assert stats["pending_arrivals"] == 0 and stats["failed_arrivals"] == 0
    assert server.core.unclaimed() == [] and not server._transfers
    with pytest.raises(kvwire.TransferTimeoutError):  # not handed out a second time
        await server.expect("r", timeout=0.2)


@pytest.mark.parametrize("how", WAITERS)
@pytest.mark.parametrize("when", ["waiting", "after"])
@pytest.mark.parametrize("writes", ["one", "two"])
async def test_begin_and_reset_are_handed_out_failed_once(how: str, when: str, writes: str) -> None:
    """BEGIN and RESET in one write (one read, one pump) or two, the claim made before
    they arrive or after: each way the claim gets the transfer failed with the sender's
    reset, its destination never called once it failed."""
    dest = Destination()
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        waiter = asyncio.create_task(claim(server, how, dest)) if when == "waiting" else None
        conn, _reader, writer = await raw_client(server.port)
        try:
            await begin_and_reset(server, how, when, writes, dest, waiter, conn, writer)
        finally:
            writer.close()


async def begin_and_reset(server: Any, how: str, when: str, writes: str, dest: Destination,
                          waiter: Any, conn: Any, writer: Any) -> None:
    conn.send_begin(begin(1, "r"))
    if writes == "two":
        writer.writelines([bytes(p) for p in conn.data_to_send()])
        assert await wait_until(lambda: server.statistics()["transfers_accepted"] == 1, 10)
    conn.send_reset(1, ErrorCode.CANCELLED, "bye")
    writer.writelines([bytes(p) for p in conn.data_to_send()])
    assert await wait_until(lambda: server.statistics()["transfers_aborted_by_peer"] == 1, 10)
    t = await asyncio.wait_for(waiter if waiter is not None else claim(server, how, dest), 10)
    error = await outcome(t)
    assert isinstance(error, TransferAbortedError) and str(error) == "bye"
    # (Claimed before it failed: its destination was checked then, and nothing more.)
    assert dest.calls == (["check"] if how == "expect-into" and (when, writes) == ("waiting", "two") else [])
    await nothing_left(server)


@pytest.mark.parametrize("how", WAITERS)
async def test_begin_and_a_chunk_breaking_the_rules_are_handed_out_failed_once(how: str) -> None:
    """The server fails the transfer itself (a codec it does not take), in the pump its
    arrival is handled in."""
    dest = Destination()
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, codecs=("raw",)) as server:
        waiter = asyncio.create_task(claim(server, how, dest))
        conn, _reader, writer = await raw_client(server.port)
        try:
            conn.send_begin(begin(1, "r"))
            bad = Chunk(transfer_id=1, layer=0, kind=0, codec_id=2, token_start=0, token_count=4,
                        layer_tokens=4, params=b"", payload=bytes(4 * 2 * 16 * 2))
            conn.send_chunk(bad, chunk_frame_size(0, len(bad.payload)))
            writer.writelines([bytes(p) for p in conn.data_to_send()])
            t = await asyncio.wait_for(waiter, 10)
            error = await outcome(t)
            assert error.code == ErrorCode.UNSUPPORTED_CODEC
            assert dest.calls == []
            await nothing_left(server)
        finally:
            writer.close()

