"""Admission by room (docs/protocol.md 7.1, 8.2): a BEGIN that passes every check is
admitted (it counts against max_transfers, its transfer deadline runs) but ACCEPTed only
once the room left in ``max_buffer_bytes`` holds its first layer at an estimate
(docs/protocol.md 8.2), reserved until that layer arrives; until then it waits to start,
in the order of BEGINs, and room that frees goes to the transfers waiting for credit
first, then to those waiting to start.  In fake time, through the receiver core alone."""

from __future__ import annotations

from typing import Any

from kvwire.errors import ErrorCode, TransferTimeoutError
from kvwire.session.receiver import (
    LayerReady,
    ReceiverConfig,
    ReceiverCore,
    TransferAborted,
    TransferArrived,
    TransferFailed,
)
from kvwire.wire import TransferAccepted, TransferReset
from tests.session.budget_helpers import (
    LAYER,
    begin_all,
    harness,
    key,
    limit,
    send_layer,
    take,
    within_budget,
)
from tests.session.receiver_harness import SECRET, Harness, begin, chunk, join


def accepted(h: Harness) -> list[int]:
    return [e.transfer_id for e in h.client_of(TransferAccepted)]


def at(h: Harness, now: float) -> None:
    """Fake time moves to ``now``: the core's timers run, what they said is delivered."""
    h.now = now
    h.core.handle_timer(now)
    h.pump()


def idle(h: Harness) -> None:
    """Nothing is left held, reserved or waiting."""
    core = h.core
    assert core.reserved_bytes == 0 and core.waiting_to_start == 0 and core.waiting_for_room == 0
    assert core.buffered_bytes - core.kept_bytes == 0
    assert not core._admitting and not core._waiting and not core._unestimated


def test_transfers_begun_together_all_complete_with_an_application_reading_every_layer_as_it_arrives() -> None:
    """The defaults' ratio (a budget of 4 GiB, windows of 256 MiB, layers of 32 MiB: 128,
    8 and 1 layer), 40 transfers begun at once, an application taking every layer as soon
    as it is ready: every transfer completes and none fails at its first layer, the room
    of every first layer being kept (at the size of the first one seen) before windows
    take it, a BEGIN past the room waiting to start."""
    n, layers = 40, 16
    h = Harness(ReceiverConfig(secret=SECRET, max_buffer_bytes=128 * LAYER, transfer_buffer_bytes=8 * LAYER,
                               claim_timeout=None))
    for tid in range(1, n + 1):
        h.client.send_begin(begin(tid=tid, layers=layers, request=f"r{tid}"))
    h.pump()
    sent = dict.fromkeys(range(1, n + 1), 0)
    taken = dict.fromkeys(range(1, n + 1), 0)
    seen = 0
    for _ in range(1000):
        for tid in sent:  # the client: one layer of each transfer it may send, in turn
            if tid in accepted(h) and sent[tid] < min(layers, limit(h, tid)):
                h.send(chunk(tid=tid, layer=sent[tid], kind=0))
                h.send(chunk(tid=tid, layer=sent[tid], kind=1))
                sent[tid] += 1
            for e in h.events[seen:]:  # the application: every layer ready, at once
                if isinstance(e, LayerReady):
                    h.core.pop_layer(e.key, e.layer, h.now)
                    taken[e.key[1]] += 1
            seen = len(h.events)
            h.pump()
            within_budget(h)
        if all(v == layers for v in taken.values()):
            break
    assert not h.of(TransferFailed), [(e.key[1], str(e.error)[:60]) for e in h.of(TransferFailed)]
    assert all(v == layers for v in taken.values())
    assert h.core.counters["buffer_budget_refusals"] == 0
    idle(h)


def test_a_begin_that_finds_no_room_waits_to_start_and_is_accepted_as_room_frees_oldest_first() -> None:
    h = harness(4, 4)  # an eighth: half a layer
    begin_all(h, 4, 1)
    send_layer(h, 1, 0)
    assert limit(h, 1) == 3  # 1 + 2 layers: the room less the eighth
    begin_all(h, 4, 2)  # one layer of room left: its first layer's
    begin_all(h, 4, 3, 4, 5)
    assert accepted(h) == [1, 2] and not h.client_of(TransferReset)
    assert h.core.waiting_to_start == 3 and h.core.counters["admission_waits"] == 3
    assert [e.key[1] for e in h.of(TransferArrived)] == [1, 2]
    assert h.core.reserved_bytes == 3 * LAYER  # transfer 1's two layers, transfer 2's first
    # A BEGIN re-sent (after a break) is not answered while it waits.
    h.client.send_begin(begin(tid=3, layers=4, request="r3"))
    h.pump()
    assert accepted(h) == [1, 2] and not h.client_of(TransferReset)
    send_layer(h, 1, 1)
    send_layer(h, 1, 2)
    take(h, 1, 0)  # its room is transfer 1's own first: one more layer for it
    assert limit(h, 1) == 4 and accepted(h) == [1, 2]
    take(h, 1, 1)  # transfer 1 has its whole window: this room starts the oldest waiting
    assert accepted(h) == [1, 2, 3] and h.core.waiting_to_start == 2
    take(h, 1, 2)
    assert accepted(h) == [1, 2, 3, 4]
    h.core.abort(key(h, 2), "given up", h.now)  # the room its first layer's estimate kept
    h.pump()
    assert accepted(h) == [1, 2, 3, 4, 5] and h.core.waiting_to_start == 0
    assert [e.key[1] for e in h.of(TransferArrived)] == [1, 2, 3, 4, 5]
    within_budget(h)
    for tid in (3, 4, 5):
        send_layer(h, tid, 0)  # each first layer finds the room kept for it
    assert [e.key[1] for e in h.of(TransferFailed)] == [2]


def test_a_transfer_waiting_to_start_fails_at_transfer_timeout_saying_so() -> None:
    h = Harness(ReceiverConfig(secret=SECRET, max_buffer_bytes=LAYER, transfer_buffer_bytes=LAYER,
                               claim_timeout=None, transfer_timeout=30.0))
    begin_all(h, 1, 1)
    send_layer(h, 1, 0)  # complete, not taken: it holds the whole budget
    h.now = 10.0
    begin_all(h, 1, 2)
    assert accepted(h) == [1] and h.core.waiting_to_start == 1
    at(h, 39.0)
    assert not h.of(TransferFailed)
    at(h, 40.0)
    [failed] = h.of(TransferFailed)
    assert failed.key[1] == 2 and isinstance(failed.error, TransferTimeoutError)
    assert "not started after 30.0 s" in str(failed.error) and "max_buffer_bytes" in str(failed.error)
    [reset] = h.client_of(TransferReset)
    assert reset.transfer_id == 2 and reset.error().code == ErrorCode.TIMEOUT
    assert h.core.waiting_to_start == 0 and accepted(h) == [1]
    take(h, 1, 0)
    idle(h)


def test_the_claim_deadline_of_a_transfer_started_by_a_layer_taken_runs_from_its_accept() -> None:
    """A transfer that the room a layer taken frees starts has its claim deadline counted
    from its ACCEPT, at the time pop_layer gives, as for any transfer: not from the next
    call that gives the time."""
    h = Harness(ReceiverConfig(secret=SECRET, max_buffer_bytes=LAYER, transfer_buffer_bytes=LAYER,
                               claim_timeout=5.0, transfer_timeout=None))
    begin_all(h, 1, 1)
    h.core.claim(key(h, 1), h.now)
    send_layer(h, 1, 0)
    begin_all(h, 1, 2)
    assert accepted(h) == [1]
    h.now = 100.0
    take(h, 1, 0)  # ACCEPT at 100: the claim deadline is 105
    assert accepted(h) == [1, 2] and h.core.unclaimed() == [key(h, 2)]
    at(h, 104.0)  # the next call that gives the time
    assert not h.of(TransferAborted)
    at(h, 105.0)
    [aborted] = h.of(TransferAborted)
    assert aborted.key[1] == 2 and "not claimed" in aborted.reason


def test_a_transfer_waiting_to_start_is_accepted_on_the_stream_its_begin_was_re_sent_on() -> None:
    h = Harness(ReceiverConfig(secret=SECRET, max_buffer_bytes=LAYER, transfer_buffer_bytes=LAYER,
                               claim_timeout=None, resume_timeout=10.0))
    begin_all(h, 1, 1)
    send_layer(h, 1, 0)
    begin_all(h, 1, 2)
    sid = h.client.session_id
    a = key(h, 1)
    h.core.receive_data(1, b"", h.now)  # the stream broke
    h.core.forget(1)
    client, _ = join(h.core, 2, h.now, session_id=sid)
    client.send_begin(begin(tid=2, layers=1, request="r2"))  # re-sent: not answered yet
    h.core.receive_data(2, b"".join(bytes(p) for p in client.data_to_send()), h.now)
    assert not h.core.data_to_send(2)
    assert not [e for e in iter(client.next_event, None) if isinstance(e, TransferAccepted | TransferReset)]
    h.core.pop_layer(a, 0, h.now)  # room: transfer 2 starts, on the stream that re-sent its BEGIN
    client.receive_data(h.core.data_to_send(2), h.now)
    got = [e for e in iter(client.next_event, None) if isinstance(e, TransferAccepted)]
    assert [(e.transfer_id, e.layer_limit) for e in got] == [(2, 1)]


def test_begins_count_against_max_transfers_while_they_wait_to_start() -> None:
    h = Harness(ReceiverConfig(secret=SECRET, max_buffer_bytes=LAYER, transfer_buffer_bytes=LAYER,
                               claim_timeout=None, max_transfers=3))
    begin_all(h, 1, 1)
    send_layer(h, 1, 0)
    begin_all(h, 1, 2, 3, 4)
    assert accepted(h) == [1] and h.core.waiting_to_start == 2
    [reset] = h.client_of(TransferReset)
    assert reset.transfer_id == 4 and reset.error().code == ErrorCode.LIMIT_EXCEEDED


def setup_queues(**kw: Any) -> Harness:
    """Transfers holding layers, one waiting for credit, and two waiting to start."""
    h = Harness(ReceiverConfig(secret=SECRET, max_buffer_bytes=8 * LAYER, transfer_buffer_bytes=5 * LAYER,
                               claim_timeout=None, **kw))
    begin_all(h, 8, 1)
    send_layer(h, 1, 0)
    begin_all(h, 8, 2)
    send_layer(h, 2, 0)
    begin_all(h, 8, 3, 4, 5)
    assert accepted(h) == [1, 2, 3]
    assert h.core.waiting_for_room == 1 and h.core.waiting_to_start == 2 and h.core.reserved_bytes > 0
    return h


def test_a_lost_session_or_a_server_closing_leaves_nothing_reserved_or_waiting() -> None:
    for how in ("lost", "close"):
        h = setup_queues(resume_timeout=1.0)
        if how == "lost":
            h.core.receive_data(1, b"", h.now)
            h.core.forget(1)
            h.now += 2.0
            h.core.handle_timer(h.now)
        else:
            h.core.close(h.now)
        h.pump()
        assert sorted(e.key[1] for e in h.of(TransferFailed)) == [1, 2, 3, 4, 5]
        idle(h)
        assert h.core.buffered_bytes == 0 and not h.core._live


def test_a_server_closing_with_many_transfers_waiting_offers_the_room_once() -> None:
    """A server closing with 200 transfers waiting for credit fails them without giving
    the room away as each fails (which would walk every transfer waiting: quadratic in
    them): the room for windows is looked at a bounded number of times."""
    n = 200
    unit = LAYER
    budget = 8 * (2 * n + 1) * unit
    h = Harness(ReceiverConfig(secret=SECRET, max_buffer_bytes=budget, transfer_buffer_bytes=budget * 7 // 8,
                               claim_timeout=None, max_transfers=n + 5, transfer_timeout=None))
    h.client.send_begin(begin(tid=1, layers=7 * (2 * n + 1) + 1, request="big"))
    h.pump()
    h.send(chunk(tid=1, layer=0, kind=0))  # its window: the budget less the eighth
    for tid in range(2, n + 2):
        h.client.send_begin(begin(tid=tid, layers=8, request=f"w{tid}"))
    h.pump()
    for tid in range(2, n + 2):
        h.send(chunk(tid=tid, layer=0, kind=0, count=16, tokens=16))
    assert h.core.waiting_for_room == n
    calls = 0
    room = ReceiverCore._window_room

    def counted(self: ReceiverCore) -> int:
        nonlocal calls
        calls += 1
        return room(self)

    ReceiverCore._window_room = counted  # type: ignore[method-assign]
    try:
        h.core.close(h.now)
    finally:
        ReceiverCore._window_room = room  # type: ignore[method-assign]
    assert calls <= 10
    idle(h)


def test_a_transfer_granted_its_whole_window_no_longer_waits() -> None:
    """Granted its whole window by the room its own layers leave, a transfer waits no
    more (it stayed counted among those waiting, and was offered room it did not want)."""
    h = harness(8, 7)
    begin_all(h, 8, 1)
    begin_all(h, 3, 2)
    send_layer(h, 1, 0)
    send_layer(h, 2, 0)
    assert limit(h, 2) == 1 and key(h, 2) in h.core._waiting
    waiting = h.core.waiting_for_room
    take(h, 2, 0)
    send_layer(h, 2, 1)
    take(h, 2, 1)
    assert limit(h, 2) == 3
    assert key(h, 2) not in h.core._waiting and h.core.waiting_for_room == waiting - 1


def test_a_first_layer_received_into_a_destination_sets_no_estimate_an_idle_server_cannot_hold() -> None:
    """A transfer received into the application's memory may have layers larger than
    the whole budget (it does not count them).  Its first layer sets no estimate: later
    transfers of its layout, and of a layout not seen yet, start at once on an idle
    server."""
    h = Harness(ReceiverConfig(secret=SECRET, max_buffer_bytes=4 * LAYER, transfer_buffer_bytes=4 * LAYER,
                               claim_timeout=None, transfer_timeout=300.0))
    h.client.send_begin(begin(tid=1, layers=1, request="big"))
    h.pump()
    big = key(h, 1)
    h.core.attach(big, h.now)
    h.send(chunk(tid=1, layer=0, kind=0, count=64, tokens=64))  # a layer of 8 budgets
    h.send(chunk(tid=1, layer=0, kind=1, count=64, tokens=64))
    h.core.pop_layer(big, 0, h.now)
    h.pump()
    h.client.send_begin(begin(tid=2, layers=2, request="small"))
    h.client.send_begin(begin(tid=3, layers=2, request="other layout", num_kv_heads=1))
    h.pump()
    assert accepted(h) == [1, 2, 3] and h.core.waiting_to_start == 0


def test_one_large_first_layer_makes_later_transfers_wait_for_no_more_than_the_kept_share() -> None:
    """With one long prompt's first layer (received whole: only then is it learned)
    holding 12 of the budget's 16 layers, 4 left, later transfers of the layout still
    start: past ordinary first layers of the layout, the estimate is at most the eighth of
    the budget kept for first layers (2 here), so two start and the next waits."""
    h = Harness(ReceiverConfig(secret=SECRET, max_buffer_bytes=16 * LAYER, transfer_buffer_bytes=4 * LAYER,
                               claim_timeout=None))
    begin_all(h, 2, 1)  # an ordinary transfer of the layout: layers of one LAYER
    for layer in (0, 1):
        send_layer(h, 1, layer)
        take(h, 1, layer)
    h.client.send_begin(begin(tid=2, layers=2, request="long"))
    h.pump()
    h.send(chunk(tid=2, layer=0, kind=0, count=96, tokens=96))  # its first layer: 12 LAYERs held
    h.send(chunk(tid=2, layer=0, kind=1, count=96, tokens=96))  # (whole: its size learned)
    begin_all(h, 2, 3, 4, 5)
    assert accepted(h) == [1, 2, 3, 4] and h.core.waiting_to_start == 1  # 2 LAYERs each: 4 left
    for tid in (3, 4):
        send_layer(h, tid, 0)
    assert not h.of(TransferFailed)


def test_a_transfer_accepted_before_any_estimate_gets_its_room_before_those_waiting_to_start() -> None:
    """Transfers accepted at a cold start (no first layer seen: an estimate of 0) have
    their estimate reserved once the first layer is stored, as far as room holds; one
    it did not hold has its estimate reserved when room frees, before a later BEGIN
    waiting to start, and its first layer then finds room."""
    h = Harness(ReceiverConfig(secret=SECRET, max_buffer_bytes=8 * LAYER, transfer_buffer_bytes=LAYER,
                               claim_timeout=None))
    begin_all(h, 1, *range(1, 10))  # all accepted at once: no estimate yet
    assert accepted(h) == list(range(1, 10))
    send_layer(h, 1, 0)  # the estimate, one LAYER: 2..8 reserved, 9 not (no room)
    assert list(h.core._unestimated) == [key(h, 9)]
    begin_all(h, 1, 10)
    assert h.core.waiting_to_start == 1  # no room for 10
    take(h, 1, 0)  # transfer 1 done: its room goes to 9, accepted before 10 began
    assert not h.core._unestimated and h.core.waiting_to_start == 1
    send_layer(h, 9, 0)
    assert not h.of(TransferFailed)
    within_budget(h)
