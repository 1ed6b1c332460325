"""One client beginning and resetting transfers without end cannot make the server forget
another client's failed arrival before its ``claim_timeout``: each session keeps its own
(at most ``max_transfers``), the oldest of its own forgotten first."""

from __future__ import annotations

import asyncio

import pytest

import kvwire
from kvwire.errors import ErrorCode, TransferAbortedError
from tests.aio.server_log_helpers import begin
from tests.conftest import SECRET
from tests.rawpeer import raw_client, wait_until

pytestmark = pytest.mark.timeout(60)


async def test_another_clients_resets_do_not_evict_a_failed_arrival() -> None:
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, claim_timeout=60,
                            max_sessions=4, max_transfers=4) as server:
        a, _ra, wa = await raw_client(server.port)
        b, _rb, wb = await raw_client(server.port)
        try:
            a.send_begin(begin(1, "victim"))
            a.send_reset(1, ErrorCode.CANCELLED, "the victim's failure")
            wa.writelines([bytes(p) for p in a.data_to_send()])
            assert await wait_until(lambda: server.statistics()["failed_arrivals"] == 1, 10)
            many = 4 * server.core.failed_kept_limit  # past the whole server's bound, too
            for tid in range(1, many + 1):
                b.send_begin(begin(tid, f"junk{tid}"))
                b.send_reset(tid, ErrorCode.CANCELLED, "bye")
            wb.writelines([bytes(p) for p in b.data_to_send()])
            assert await wait_until(lambda: server.statistics()["transfers_aborted_by_peer"] == many + 1, 10)
            stats = server.statistics()
            assert stats["failed_arrivals"] == stats["pending_arrivals"] == 1 + 4  # b keeps its last 4
            t = await server.expect("victim", timeout=5)
            with pytest.raises(TransferAbortedError, match="the victim's failure"):
                async with asyncio.timeout(5):
                    await t.collect()
            assert [(await server.accept(timeout=5)).request_id for _ in range(4)] == [
                f"junk{tid}" for tid in range(many - 3, many + 1)]
        finally:
            wa.close()
            wb.close()
