"""A server closing (docs/protocol.md 10; ``ReceiverCore.close``) accepts nothing more: the
room each failing transfer frees never starts a transfer waiting to start, and every
transfer admitted, those still waiting to start or for the registry's verdict included,
is failed with its sender told by a ``RESET(SESSION_LOST)`` before the GOAWAY.  In fake
time, through the receiver core alone."""

from __future__ import annotations

from kvwire.errors import ErrorCode
from kvwire.session.receiver import ReceiverConfig, RegistryCheck, TransferFailed
from kvwire.wire import (
    BlockVersion,
    ConnectionClosed,
    HandshakeComplete,
    TransferAccepted,
    TransferReset,
)
from tests.session.budget_helpers import LAYER, begin_all, limit, send_layer
from tests.session.receiver_harness import SECRET, Harness, begin, join


def test_a_closing_server_accepts_none_of_those_waiting_and_resets_every_admitted_transfer_before_its_goaway() -> None:
    h = Harness(ReceiverConfig(secret=SECRET, max_buffer_bytes=8 * LAYER, transfer_buffer_bytes=8 * LAYER,
                               claim_timeout=None, registry=True, max_transfers=32))
    begin_all(h, 16, 1)
    send_layer(h, 1, 0)  # its window: the budget less the eighth
    begin_all(h, 16, 2)  # its first layer in the eighth
    begin_all(h, 16, *range(3, 13))  # no room: waiting to start
    h.client.send_begin(begin(tid=13, layers=1, request="gated", blocks=(BlockVersion(block=b"i:1", version=0),)))
    h.pump()
    assert [e.key[1] for e in h.of(RegistryCheck)] == [13]  # never answered
    accepted = [e.transfer_id for e in h.client_of(TransferAccepted)]
    assert accepted == [1, 2] and limit(h, 1) == 7 and h.core.waiting_to_start == 11
    seen = len(h.client_events)
    h.core.close(h.now)
    h.pump()
    after = h.client_events[seen:]
    assert not [e for e in after if isinstance(e, TransferAccepted)]  # nothing starts
    resets = [e for e in after if isinstance(e, TransferReset)]
    assert sorted(r.transfer_id for r in resets) == list(range(1, 14))
    assert all(r.code == ErrorCode.SESSION_LOST and "the server is shutting down" in r.message for r in resets)
    [closed] = [i for i, e in enumerate(after) if isinstance(e, ConnectionClosed)]
    assert closed > max(i for i, e in enumerate(after) if isinstance(e, TransferReset))  # RESETs first
    assert after[closed].goaway and after[closed].code == ErrorCode.NO_ERROR
    assert sorted(e.key[1] for e in h.of(TransferFailed)) == list(range(1, 14))
    assert h.core.counters["transfers_accepted"] == 2
    assert h.core.reserved_bytes == 0 and h.core.waiting_to_start == 0 and h.core.waiting_for_room == 0


def test_a_connection_made_after_close_gets_a_goaway_and_no_session() -> None:
    """The core's close() holds for connections made after it too (an I/O layer that
    still hands one over): its handshake ends in GOAWAY saying the server is shutting
    down, no session is opened, and nothing is accepted."""
    h = Harness(ReceiverConfig(secret=SECRET))
    h.core.close(h.now)
    h.pump()
    _client, events = join(h.core, 2, h.now)
    [closed] = [e for e in events if isinstance(e, ConnectionClosed)]
    assert closed.goaway and closed.code == ErrorCode.NO_ERROR and closed.message == "the server is shutting down"
    assert h.core.sessions == 0 and not [e for e in events if isinstance(e, HandshakeComplete)]
