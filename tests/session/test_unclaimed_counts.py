"""What ``transfers_unclaimed`` counts at ``claim_timeout``: transfers that had not failed
and nobody claimed, not the failed arrivals nobody claimed, which were counted when they
failed (``transfers_aborted_by_peer`` for a sender's RESET) and are counted as dropped in
``failed_arrivals_expired``."""

from __future__ import annotations

from kvwire.errors import ErrorCode
from kvwire.session.receiver import ReceiverConfig, TransferDropped
from tests.session.arrival_helpers import arrive
from tests.session.receiver_harness import SECRET, Harness


def test_failed_arrivals_that_expire_are_not_counted_as_unclaimed_transfers() -> None:
    h = Harness(ReceiverConfig(secret=SECRET, claim_timeout=5.0))
    for tid in (1, 2, 3):  # three sends that fail (their senders reset them)
        arrive(h, tid, f"bad{tid}")
        h.client.send_reset(tid, ErrorCode.CANCELLED, "sender aborted")
        h.pump()
    arrive(h, 4, "good")  # and one that arrived and nobody claims
    assert h.core.counters["transfers_aborted_by_peer"] == 3
    h.now = 5.0
    h.core.handle_timer(h.now)
    h.pump()
    assert len(h.of(TransferDropped)) == 3 and h.core.unclaimed() == []
    assert h.core.counters["transfers_unclaimed"] == 1  # was 4: each failure counted twice
    assert h.core.counters["failed_arrivals_expired"] == 3
    assert h.core.counters["transfers_aborted_by_peer"] == 3
    assert h.core.counters["transfers_aborted"] == 1  # the good one, aborted for want of a claim
