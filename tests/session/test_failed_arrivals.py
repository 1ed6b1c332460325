"""A transfer that fails after it arrived and before the application claimed it stays
claimable, in its place among the arrivals, until its claim deadline: the application is
handed the failure whenever it asks, as one that claimed it before it failed is (what it
sees does not depend on timing).  Such a transfer holds no layer, only the budget of what
its BEGIN made the server keep, and the server keeps a bounded number of them."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.errors import ErrorCode, TransferAbortedError
from kvwire.session.meta import parse_meta
from kvwire.session.receiver import (
    ReceiverConfig,
    TransferAborted,
    TransferDropped,
    TransferFailed,
    begin_footprint,
)
from kvwire.wire import Connection
from tests.session.arrival_helpers import arrive
from tests.session.receiver_harness import SECRET, Harness, begin, chunk, join


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
    h.core.claim(a1, h.now)
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
    # Counted as a failed arrival that expired, not as a transfer nobody claimed: it was
    # counted when it failed (transfers_aborted_by_peer), and never arrived whole.
    assert h.core.counters["failed_arrivals_expired"] == 1
    assert h.core.counters["transfers_unclaimed"] == 0
    assert h.core.counters["transfers_aborted_by_peer"] == 1
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
    h.core.claim(key, h.now)
    assert h.core.buffered_bytes == 0 == h.core.kept_bytes


def test_failed_arrivals_nobody_claims_are_bounded_oldest_dropped_first() -> None:
    """A client beginning and resetting transfers without end keeps at most
    max_transfers of them on the server (max_sessions * max_transfers in all)."""
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


def other_client(h: Harness, cid: int) -> Connection:
    """Another client, on a session of its own, its connection ``cid``."""
    client, _ = join(h.core, cid, h.now)
    assert client.state.name == "OPEN"
    return client


def begin_and_reset(h: Harness, cid: int, client: Connection, tids: range, request: str = "junk") -> None:
    """``client`` begins and resets each of ``tids``, each arriving and failing."""
    for tid in tids:
        client.send_begin(begin(tid=tid, layers=1, request=f"{request}{tid}"))
        client.send_reset(tid, ErrorCode.CANCELLED, "bye")
        h.core.receive_data(cid, b"".join(bytes(p) for p in client.data_to_send()), h.now)
        client.receive_data(h.core.data_to_send(cid), h.now)
        h.pump()


def test_a_client_resetting_transfers_without_end_forgets_only_its_own_failures() -> None:
    """The bound is each session's (max_transfers): another client's failed arrivals stay
    claimable until their claim deadline, however many transfers one client begins and
    resets (the whole server's bound forgot the oldest failure first: anyone's)."""
    h = Harness(ReceiverConfig(secret=SECRET, max_sessions=3, max_transfers=2, claim_timeout=60.0))
    assert h.core.failed_kept_limit == 6
    victim = arrive(h, 1, "victim")
    h.client.send_reset(1, ErrorCode.CANCELLED, "the victim's failure")
    h.pump()
    b = other_client(h, 2)
    begin_and_reset(h, 2, b, range(1, 41))
    c = other_client(h, 3)
    begin_and_reset(h, 3, c, range(1, 41), "more")
    assert victim in h.core.unclaimed("victim") and failed_of(h, victim).claimable
    assert victim not in [e.key for e in h.of(TransferDropped)]
    # Each of the others keeps its last two; 38 of each forgotten, oldest first.
    assert [h.core._request_id(k) for k in h.core.unclaimed()] == ["victim", "junk39", "junk40", "more39", "more40"]
    assert len(h.of(TransferDropped)) == 2 * 38 and h.core.failed_unclaimed == 5
    h.core.claim(victim, h.now)
    assert h.core.failed_unclaimed == 4


def test_failures_of_sessions_that_are_gone_are_forgotten_first_past_the_servers_bound() -> None:
    """A session lost leaves its failed arrivals claimable; sessions coming and going could
    keep more of them than max_sessions * max_transfers: past that, those of sessions gone
    are forgotten (whose session went first), never those of a session still open."""
    h = Harness(ReceiverConfig(secret=SECRET, max_sessions=2, max_transfers=2, claim_timeout=60.0,
                               resume_timeout=0.0))
    for tid in (1, 2):
        arrive(h, tid, f"open{tid}")
        h.client.send_reset(tid, ErrorCode.CANCELLED, "bye")
        h.pump()
    kept = h.core.unclaimed()
    for n, cid in enumerate(range(2, 6)):  # four clients in turn, each gone before the next
        client = other_client(h, cid)
        begin_and_reset(h, cid, client, range(1, 3), f"gone{n}-")
        h.core.receive_data(cid, b"", h.now)  # its connection broke: the session is lost
        h.core.forget(cid)
        h.pump()
        assert h.core.sessions == 1 and h.core.failed_unclaimed <= h.core.failed_kept_limit
    gone = [h.core._request_id(k) for k in h.core.unclaimed()]
    assert h.core.unclaimed()[:2] == kept and gone[2:] == ["gone3-1", "gone3-2"]
    assert h.core.failed_unclaimed == 4


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["fail", "fail", "fail", "drop", "claim"]), st.integers(0, 2)),
                max_size=40))
def test_failed_arrivals_stay_within_their_bounds_and_only_their_own_session_evicts_them(
        ops: list[tuple[str, int]]) -> None:
    """Clients on sessions of their own begin and reset transfers, break their connections
    and come back as new sessions, and the application claims: a session open keeps at
    most max_transfers failures, the server at most max_sessions * max_transfers, and a
    failure of a session still open is forgotten only for a newer one of its own."""
    h = Harness(ReceiverConfig(secret=SECRET, max_sessions=2, max_transfers=2, claim_timeout=60.0,
                               resume_timeout=0.0))
    h.core.receive_data(1, b"", h.now)  # (the harness's own client is not used: its session goes)
    h.core.forget(1)
    assert h.core.sessions == 0
    clients: dict[int, tuple[int, Connection]] = {}
    cids = iter(range(2, 1000))
    tids = iter(range(1, 1000))
    for op, slot in ops:
        if op == "claim":
            if h.core.unclaimed():
                h.core.claim(h.core.unclaimed()[0], h.now)
            continue
        if op == "drop":
            if slot in clients:
                cid, _ = clients.pop(slot)
                h.core.receive_data(cid, b"", h.now)
                h.core.forget(cid)
                h.pump()
            continue
        if slot not in clients:
            cid = next(cids)
            client, _ = join(h.core, cid, h.now)
            h.pump()
            if client.state.name != "OPEN":  # max_sessions reached
                h.core.forget(cid)
                continue
            clients[slot] = (cid, client)
        cid, client = clients[slot]
        before = len(h.events)
        begin_and_reset(h, cid, client, range(tid := next(tids), tid + 1))
        failing = client.session_id
        open_ids = {c.session_id for _, c in clients.values()}
        for ev in h.events[before:]:
            if isinstance(ev, TransferDropped):
                assert ev.key[0] == failing or ev.key[0] not in open_ids
        core = h.core
        assert core.failed_unclaimed <= core.failed_kept_limit
        per: dict[bytes, int] = {}
        for key in core._failed:
            per[key[0]] = per.get(key[0], 0) + 1
        assert all(per.get(sid, 0) <= 2 for sid in open_ids)
        assert set(core._failed) == set(core._failed_gone).union(*core._failed_open.values())
        assert set(core._failed_open) <= open_ids and not set(core._failed_gone) & set().union(
            *core._failed_open.values())
