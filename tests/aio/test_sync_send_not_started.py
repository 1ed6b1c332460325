"""kvwire.sync's SendHandle knows whether the server accepted its transfer: a server holds
ACCEPT while its buffer budget has no room for the transfer's first layer (docs/protocol.md
7.1), and a wait() that runs out meanwhile says that the send has not started, not only that
it is not done.  Real loopback sockets."""

from __future__ import annotations

import numpy as np
import pytest

import kvwire
from kvwire.errors import TransferTimeoutError
from kvwire.sync import SyncPeer, SyncServer
from tests.aio.sync_send_helpers import BUDGET, SPEC, until, waiting_for_credit
from tests.conftest import SECRET, make_layers

pytestmark = pytest.mark.timeout(60)

#: One layer of another layout, 192 KiB: sent whole and left unclaimed, it takes most of
#: the budget below, and the session that sent it has its next first layers admitted at its
#: size (the server's estimate of a first layer before it arrives is from those the session
#: sent): no room for one.
FILL_SPEC = kvwire.KVSpec(num_layers=1, num_kv_heads=8, head_dim=64, dtype="float32")


def test_a_wait_that_runs_out_before_the_accept_says_the_send_has_not_started() -> None:
    """The budget is full (a transfer the same session sent arrived whole, unclaimed):
    "b"'s BEGIN waits for its ACCEPT.  wait(0.3) says that it has not started, the server holding it; once the
    filler is claimed there is room, and the same handle's wait returns the receipt."""
    filler = np.ones((48, 8, 64), np.float32)
    layers = make_layers(4, 32, 1, 64, "float32")
    with SyncServer(secret=SECRET, max_buffer_bytes=BUDGET, claim_timeout=None) as server, \
            SyncPeer("127.0.0.1", server.port, secret=SECRET) as peer:
        peer.send("filler", FILL_SPEC, [(filler, filler)], timeout=30)
        s = peer.begin("b", SPEC, timeout=30)
        for k, v in layers:
            s.send_layer(k, v)
        until(lambda: server.statistics()["transfers_waiting_to_start"] == 1, "b waits on the server")
        assert peer.statistics()["transfers_waiting_to_start"] == 1
        with pytest.raises(TransferTimeoutError) as info:
            s.wait(0.3)
        text = str(info.value)
        assert text.startswith("send of 'b' not done after 0.3 s: it has not started, the server has not accepted"), text
        assert "buffer budget has no room" in text
        assert not s.accepted and not s.done
        server.expect("filler", timeout=30).wait(30)  # (claimed and read: room frees)
        h = server.expect("b", timeout=30)
        receipt = s.wait(30)
        assert receipt.request_id == "b" and s.accepted
        h.wait(30)


def test_a_wait_that_runs_out_after_the_accept_says_only_not_done() -> None:
    """A send the server accepted, its later layers not given yet: wait() running out says
    only that it is not done."""
    layers = make_layers(4, 32, 1, 64, "float32")
    with SyncServer(secret=SECRET) as server, SyncPeer("127.0.0.1", server.port, secret=SECRET) as peer:
        h = server.expect("c", timeout=30)
        s = peer.begin("c", SPEC, timeout=30)
        s.send_layer(*layers[0])
        until(lambda: s.accepted, "c accepted")
        with pytest.raises(TransferTimeoutError) as info:
            s.wait(0.05)
        assert str(info.value) == "send of 'c' not done after 0.05 s"
        for k, v in layers[1:]:
            s.send_layer(k, v)
        assert s.wait(30).request_id == "c" and s.accepted
        h.wait(30)


def test_a_wait_that_runs_out_while_the_send_waits_for_credit_says_what_was_granted() -> None:
    """Layers of 16 KiB take a 64 KiB slab each in the budget (256 KiB, an eighth kept for
    first layers): "d" is accepted and granted 3 of its 4 layers, which arrive and are held
    unread, so its last layer waits for credit.  The handle says so (waiting_for_credit,
    layers_granted), as does a wait() that runs out; once the application reads, it ends."""
    with SyncServer(secret=SECRET, max_buffer_bytes=BUDGET, claim_timeout=None) as server, \
            SyncPeer("127.0.0.1", server.port, secret=SECRET) as peer:
        s = waiting_for_credit(peer)
        assert s.accepted and s.layers_granted == 3 and server.statistics()["transfers_waiting_for_room"] == 1
        with pytest.raises(TransferTimeoutError) as info:
            s.wait(0.3)
        assert str(info.value) == (
            "send of 'd' not done after 0.3 s: the server has granted 3 of its 4 layers and holds the rest "
            "while its buffer budget has no room (until its application takes layers)")
        server.expect("d", timeout=30).wait(30)  # (claimed and read: room frees)
        assert s.wait(30).request_id == "d" and not s.waiting_for_credit and s.layers_granted == 4
