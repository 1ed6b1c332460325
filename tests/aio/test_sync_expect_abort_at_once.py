"""A SyncServer.expect() aborted at once, before its receive began on the loop, gives up
the transfer it would have taken when that one has arrived already: it is aborted (its
sender told, its budget freed), not left for nobody to claim (for ever without a
claim_timeout).  Real loopback sockets."""

from __future__ import annotations

import threading

import pytest

from kvwire.errors import TransferAbortedError
from kvwire.sync import SyncPeer, SyncServer
from tests.aio.sync_send_helpers import BUDGET, until, waiting_for_credit
from tests.conftest import SECRET

pytestmark = pytest.mark.timeout(60)


def test_an_expect_aborted_before_it_began_aborts_the_transfer_already_there() -> None:
    """"d" waits for credit (its layers held unread at the server, nobody has claimed it):
    expect("d") then abort() at once.  The server aborts "d" and its sender learns of it;
    nothing is held."""
    with SyncServer(secret=SECRET, max_buffer_bytes=BUDGET, claim_timeout=None) as server, \
            SyncPeer("127.0.0.1", server.port, secret=SECRET) as peer:
        s = waiting_for_credit(peer)
        gate = threading.Event()
        server.bridge.call_soon(gate.wait, 10)  # the loop waits: the receive and the abort queue behind
        t = server.expect("d", timeout=30)
        t.abort("given up", timeout=0)  # (before the receive began: the loop is held)
        gate.set()
        with pytest.raises(TransferAbortedError):
            s.wait(30)
        until(lambda: server.statistics()["transfers_aborted"] == 1, "d aborted on the server")
        stats = server.statistics()
        assert stats["transfers_waiting_for_room"] == 0 and stats["buffered_bytes"] == 0
        assert stats["reserved_bytes"] == 0 and stats["pending_arrivals"] == 0
