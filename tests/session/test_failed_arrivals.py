"""A transfer that fails after it arrived and before the application claimed it stays
claimable, in its place among the arrivals, until its claim deadline: the application is
handed the failure whenever it asks, as one that claimed it before it failed is (what it
sees does not depend on timing).  Such a transfer holds no layer, only the budget of what
its BEGIN made the server keep, and the server keeps a bounded number of them."""

from __future__ import annotations

import json

import pytest

from kvwire.errors import ErrorCode, TransferAbortedError
from kvwire.session.meta import parse_meta
from kvwire.session.receiver import (
    ReceiverConfig,
    TransferAborted,
    TransferArrived,
    TransferDropped,
    TransferFailed,
    begin_footprint,
)
from tests.session.test_receiver_core import SECRET, Harness, begin, chunk


def arrive(h: Harness, tid: int, request: str, **kw: object) -> tuple[bytes, int]:
    h.client.send_begin(begin(tid=tid, layers=1, request=request, **kw))
    h.pump()
    return next(e.key for e in h.of(TransferArrived) if e.key[1] == tid)  # type: ignore[no-any-return]


def failed_of(h: Harness, key: tuple[bytes, int]) -> TransferFailed:
    [ev] = [e for e in h.of(TransferFailed) if e.key == key]
    return ev  # type: ignore[no-any-return]


def test_a_transfer_the_sender_resets_before_it_is_claimed_stays_claimable_in_its_place() -> None:
    h = Harness(ReceiverConfig(secret=SECRET, claim_timeout=5.0))
    a1 = arrive(h, 1, "a")
    b = arrive(h, 2, "b")
    a3 = arrive(h, 3, "a")
    h.send(chunk(tid=1, layer=0, kind=0))
    h.client.send_reset(1, ErrorCode.CANCELLED, "sender aborted: RuntimeError('producer failed')")
    h.pump()
    ev = failed_of(h, a1)
    assert ev.claimable and isinstance(ev.error, TransferAbortedError)
    # In arrival order, among that id's arrivals and all of them, until claimed.
    assert h.core.unclaimed("a") == [a1, a3] and h.core.unclaimed() == [a1, b, a3]
    assert h.core.failed_unclaimed == 1 and h.core.buffered_bytes == 0  # no layer held
    h.core.claim(a1)
    assert h.core.unclaimed("a") == [a3] and h.core.failed_unclaimed == 0
    assert not h.of(TransferDropped)


def test_a_transfer_the_core_fails_before_it_is_claimed_stays_claimable_too() -> None:
    """A chunk that breaks the rules, the transfer's deadline, its session lost: failures
    of the core's own, the same rule as a RESET from the sender."""
    h = Harness(ReceiverConfig(secret=SECRET, codecs=("raw",), transfer_timeout=3.0, claim_timeout=10.0))
    bad = arrive(h, 1, "bad-chunk")
    late = arrive(h, 2, "deadline")
    h.send(chunk(tid=1, layer=0, kind=0, codec_id=2))  # a codec this server does not take
    assert failed_of(h, bad).claimable and failed_of(h, bad).error.code == ErrorCode.UNSUPPORTED_CODEC
    h.now = 3.0
    h.core.handle_timer(h.now)
    h.pump()
    assert failed_of(h, late).claimable and failed_of(h, late).error.code == ErrorCode.TIMEOUT
    assert h.core.unclaimed() == [bad, late]


def test_a_failed_arrival_nobody_claims_is_dropped_at_its_claim_deadline() -> None:
    h = Harness(ReceiverConfig(secret=SECRET, claim_timeout=5.0))
    key = arrive(h, 1, "r")
    h.now = 2.0
    h.client.send_reset(1, ErrorCode.CANCELLED, "bye")
    h.pump()
    assert h.core.get_timer() == pytest.approx(5.0)  # counted from its arrival, as if it had not failed
    h.now = 5.0
    h.core.handle_timer(h.now)
    h.pump()
    [dropped] = h.of(TransferDropped)
    assert dropped.key == key and dropped.request_id == "r"
    assert h.core.unclaimed() == [] and h.core.failed_unclaimed == 0
    assert h.core.counters["transfers_unclaimed"] == 1
    assert h.core.counters["transfers_aborted"] == 0  # nothing to abort: it had failed
    assert [e.by_peer for e in h.of(TransferAborted)] == [True]


@pytest.mark.parametrize("how", ["abort", "fail"])
def test_a_transfer_the_receiver_gives_up_on_is_not_kept(how: str) -> None:
    h = Harness(ReceiverConfig(secret=SECRET, claim_timeout=5.0))
    key = arrive(h, 1, "r")
    if how == "abort":
        h.core.abort(key, "not wanted", h.now)
    else:
        h.core.fail(key, TransferAbortedError("the destination refused it"), h.now)
    h.pump()
    assert not failed_of(h, key).claimable
    assert h.core.unclaimed() == [] and h.core.failed_unclaimed == 0


def test_a_failed_arrival_keeps_its_begin_charged_until_claimed() -> None:
    """Its meta and prefix blocks are still held (by the I/O layer's view of it, which the
    application will be handed): charged as they were, never a layer."""
    meta = json.dumps({f"k{i}": list(range(8)) for i in range(20)}).encode()
    h = Harness(ReceiverConfig(secret=SECRET, claim_timeout=5.0))
    key = arrive(h, 1, "r", meta=meta)
    cost = begin_footprint(begin(tid=1, layers=1, request="r", meta=meta), parse_meta(meta))
    assert cost > 0 and h.core.buffered_bytes == cost
    h.send(chunk(tid=1, layer=0, kind=0))
    assert h.core.buffered_bytes > cost  # a layer
    h.client.send_reset(1, ErrorCode.CANCELLED, "bye")
    h.pump()
    assert h.core.buffered_bytes == cost == h.core.kept_bytes
    h.core.claim(key)
    assert h.core.buffered_bytes == 0 == h.core.kept_bytes


def test_failed_arrivals_nobody_claims_are_bounded_oldest_dropped_first() -> None:
    """A client beginning and resetting transfers without end keeps at most
    max_sessions * max_transfers of them on the server."""
    h = Harness(ReceiverConfig(secret=SECRET, max_sessions=1, max_transfers=2, claim_timeout=60.0))
    assert h.core.failed_kept_limit == 2
    keys = []
    for tid in range(1, 6):
        keys.append(arrive(h, tid, f"r{tid}"))
        h.client.send_reset(tid, ErrorCode.CANCELLED, "bye")
        h.pump()
    assert h.core.unclaimed() == keys[-2:] and h.core.failed_unclaimed == 2
    assert [e.key for e in h.of(TransferDropped)] == keys[:3]
    assert h.client.state.name == "OPEN"  # nothing refused the sender
    # Deadlines alive: its connection's, and the claim deadlines of the two kept.
    assert sum(h.core._timer_value(name) is not None for name in h.core._timer_at) == 1 + 2


def test_closing_drops_the_failed_arrivals() -> None:
    h = Harness(ReceiverConfig(secret=SECRET, claim_timeout=5.0))
    key = arrive(h, 1, "r")
    h.client.send_reset(1, ErrorCode.CANCELLED, "bye")
    h.pump()
    h.core.close(h.now)
    h.pump()
    assert [e.key for e in h.of(TransferDropped)] == [key]
    assert h.core.unclaimed() == [] and h.core.failed_unclaimed == 0 and h.core.get_timer() is None
