"""Layer credit within the server's buffer budget (docs/protocol.md 8.2): the layers a
server grants past a transfer's first are reserved in ``max_buffer_bytes`` until they are
allocated, so transfers that together want more than the budget wait for credit (their
senders slow down) instead of failing with LIMIT_EXCEEDED.  Windows are granted into the
budget less an eighth, kept for first layers; a layer taken gives its room back to its
own transfer, and room that frees otherwise goes to the transfers waiting, the one waiting
longest first.  A transfer is accepted only once the room left holds its first layer at
an estimate (docs/protocol.md 8.2), reserved until that layer arrives; until then its
BEGIN waits to start, in the order of BEGINs.  In fake time,
through the receiver core alone (the client a wire connection that keeps to its credit)."""

from __future__ import annotations

from kvwire.errors import ErrorCode
from kvwire.session.receiver import (
    LayerReady,
    ReceiverConfig,
    TransferFailed,
    wire_text,
)
from kvwire.wire import CreditGranted, TransferAccepted
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
from tests.session.receiver_harness import SECRET, Harness, chunk, join


def credits(h: Harness, tid: int) -> list[int]:
    return [e.layer_limit for e in h.client_of(CreditGranted) if e.transfer_id == tid]


def test_two_transfers_over_the_budget_both_complete_as_the_application_takes_layers() -> None:
    """Each transfer's window (3 layers) fits the budget (4), both together do not: the
    second is granted what is left, and more as the application takes layers, and neither
    fails with LIMIT_EXCEEDED."""
    layers = 6
    h = harness(4, 3)
    begin_all(h, layers, 1, 2)
    h.send(chunk(tid=1, layer=0, kind=0))  # the first chunk of each: layer sizes known
    h.send(chunk(tid=2, layer=0, kind=0))
    within_budget(h)
    # 3 + 1 layers: both were accepted before any first layer was received whole (an
    # estimate of 0), so transfer 1's window takes the room less the eighth, and transfer
    # 2's first layer the room the eighth kept
    assert (limit(h, 1), limit(h, 2)) == (3, 1)
    assert h.core.waiting_for_room == 1 and h.core.counters["credit_waits"] == 1
    sent = {1: 0, 2: 0}
    taken = {1: 0, 2: 0}
    first_k_sent = {1: True, 2: True}
    for _ in range(100):
        # The client sends what it may (K and V of each layer below its limit) ...
        for tid in (1, 2):
            while sent[tid] < limit(h, tid):
                send_layer(h, tid, sent[tid], k=not first_k_sent[tid])
                first_k_sent[tid] = False
                sent[tid] += 1
        # ... and the application takes one layer of each that is ready, in turn.
        ready = {(e.key[1], e.layer) for e in h.of(LayerReady)}
        for tid in (1, 2):
            if (tid, taken[tid]) in ready and taken[tid] < layers:
                take(h, tid, taken[tid])
                taken[tid] += 1
        if taken == {1: layers, 2: layers}:
            break
    assert not h.of(TransferFailed)
    assert taken == {1: layers, 2: layers}
    assert h.core.buffered_bytes == 0 and h.core.reserved_bytes == 0 and h.core.waiting_for_room == 0
    assert h.core.counters["buffer_budget_refusals"] == 0


def test_a_layer_taken_gives_its_room_back_to_its_own_transfer_and_no_credit_goes_past_the_room() -> None:
    """A budget of 8 layers, an eighth of it (one layer) kept from windows for first layers:
    transfer 1 is granted its window of 5, transfer 2 what is left for windows (one layer
    past its first) and waits.  A layer transfer 1's application takes gives its room back
    to transfer 1 (it keeps its window; so the transfer an application reads always goes
    on), and no credit goes past the room."""
    h = harness(8, 5)
    begin_all(h, 8, 1, 2)
    send_layer(h, 1, 0)
    send_layer(h, 2, 0)
    assert (limit(h, 1), limit(h, 2)) == (5, 2) and credits(h, 2) == [2]
    assert h.core.waiting_for_room == 1 and h.core.counters["credit_waits"] == 1
    for layer in (1, 2, 3, 4):
        send_layer(h, 1, layer)
    take(h, 1, 0)
    assert credits(h, 1) == [5, 6] and credits(h, 2) == [2]  # its own room, not transfer 2's
    assert h.core.waiting_for_room == 1
    take(h, 2, 0)  # transfer 2's own layer: its room is its own too
    assert credits(h, 2) == [2, 3] and h.core.waiting_for_room == 1 and not h.of(TransferFailed)


def test_room_a_transfer_that_ends_leaves_goes_to_the_transfers_waiting_the_longest_first() -> None:
    h = harness(8, 4)
    begin_all(h, 8, 1, 2, 3)
    send_layer(h, 1, 0)  # (the first layers of 2 and 3 reserved from here: 1 + 2 + 1 kept)
    send_layer(h, 2, 0)
    send_layer(h, 3, 0)
    assert (limit(h, 1), limit(h, 2), limit(h, 3)) == (4, 2, 1)
    assert h.core.waiting_for_room == 2
    h.core.abort(key(h, 1), "given up", h.now)  # its four layers' room: 2 first, then 3
    h.pump()
    within_budget(h)
    assert (limit(h, 2), limit(h, 3)) == (4, 3) and h.core.waiting_for_room == 1


def test_a_transfer_that_fails_or_is_received_into_a_destination_gives_its_granted_room_to_those_waiting() -> None:
    for end in ("attach", "abort"):
        h = harness(8, 5)
        begin_all(h, 8, 1, 2)
        send_layer(h, 1, 0)
        send_layer(h, 2, 0)
        assert (limit(h, 1), limit(h, 2)) == (5, 2)
        if end == "attach":
            # Received into the application's memory from now on: its layers granted and
            # not begun no longer count, and transfer 2 gets them.
            h.core.attach(key(h, 1), h.now)
        else:
            h.core.abort(key(h, 1), "given up", h.now)
        h.pump()
        within_budget(h)
        assert limit(h, 2) == 5 and h.core.waiting_for_room == 0
        if end == "attach":
            assert limit(h, 1) == 8


def test_a_first_layer_larger_than_its_estimate_that_finds_the_budget_granted_away_fails_saying_what_to_do() -> None:
    """ACCEPT grants layer 0 before its size is known: its room is kept at an estimate
    (docs/protocol.md 8.2).  A first layer larger than that (here: twice as many tokens)
    that does not fit in the room left fails with LIMIT_EXCEEDED, whose text says why and what the receiving side can do about it."""
    h = harness(8, 8)
    begin_all(h, 8, 1)
    send_layer(h, 1, 0)
    assert limit(h, 1) == 7  # its window, as far as the budget less the eighth goes
    begin_all(h, 8, 2, 3)  # room for one first layer of one layer's footprint: 3 waits
    assert h.core.waiting_to_start == 1 and h.core.counters["admission_waits"] == 1
    assert {e.transfer_id for e in h.client_of(TransferAccepted)} == {1, 2}
    h.send(chunk(tid=2, layer=0, kind=0, count=16, tokens=16))  # two layers' footprint
    [failed] = h.of(TransferFailed)
    assert failed.key[1] == 2 and failed.error.code == ErrorCode.LIMIT_EXCEEDED
    text = str(failed.error)
    assert "taken by other transfers" in text and f"max_buffer_bytes={8 * LAYER}" in text
    for remedy in ("consume layers", "raise max_buffer_bytes", "lower transfer_buffer_bytes", "destination"):
        assert remedy in wire_text(text)  # (what the sender is told: the start of it)
    assert f"a first layer of {2 * LAYER} bytes" in text
    assert h.core.counters["buffer_budget_refusals"] == 1
    within_budget(h)
    # The room transfer 2's estimate kept starts transfer 3; transfer 1 goes on: every
    # layer it was granted finds its room.
    assert {e.transfer_id for e in h.client_of(TransferAccepted)} == {1, 2, 3}
    assert h.core.waiting_to_start == 0
    send_layer(h, 3, 0)
    for layer in range(1, 7):
        send_layer(h, 1, layer)
    assert len(h.of(TransferFailed)) == 1


def test_credit_given_while_no_stream_is_open_is_said_on_the_stream_that_rejoins() -> None:
    """Room that frees while the session's only stream is broken raises a waiting
    transfer's limit with no stream to carry the CREDIT: the stream that resumes the
    session carries it (6.3), or its sender would wait for credit for ever."""
    h = Harness(ReceiverConfig(secret=SECRET, max_buffer_bytes=8 * LAYER, transfer_buffer_bytes=5 * LAYER,
                               claim_timeout=None, resume_timeout=10.0))
    begin_all(h, 8, 1, 2)
    send_layer(h, 1, 0)
    send_layer(h, 2, 0)
    for layer in (1, 2, 3, 4):
        send_layer(h, 1, layer)
    assert (limit(h, 1), limit(h, 2)) == (5, 2)
    sid = h.client.session_id
    a = key(h, 1)
    h.core.receive_data(1, b"", h.now)  # the connection broke
    h.core.forget(1)
    h.core.pop_layer(a, 0, h.now)  # room for one layer: transfer 1's own, no stream to say it on
    within_budget(h)
    assert h.core._live[a].state.layer_limit == 6
    _, events = join(h.core, 2, h.now, session_id=sid)
    said = {(e.transfer_id, e.layer_limit) for e in events if isinstance(e, CreditGranted)}
    assert (1, 6) in said and (2, 2) in said
