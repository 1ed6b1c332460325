"""The estimate a transfer's first layer is admitted at (docs/protocol.md 8.2) comes from
its own session's history of first layers received whole: a chunk only declares a layer's
size, so a first layer is learned once every chunk of it is stored (never from a transfer
that failed before), and one session's first layers never set another session's estimate.
A session's history goes with the session.  In fake time, through the receiver core alone."""

from __future__ import annotations

import gc
import weakref
from typing import Any

from kvwire.errors import ErrorCode
from kvwire.session.receiver import RECENT_FIRST_LAYERS, ReceiverConfig
from kvwire.wire import Chunk, CreditGranted, TransferAccepted, TransferReset
from kvwire.wire.frames import chunk_frame_size
from tests.session.budget_helpers import LAYER, begin_all, key, take, within_budget
from tests.session.receiver_harness import BPT, SECRET, Harness, begin, chunk, join

#: A unit of the budget: a layer of 64 tokens (K and V).
UNIT = 2 * 64 * BPT


class Other:
    """Another client, on a session of its own, its connection ``cid`` to ``h``'s core."""

    def __init__(self, h: Harness, cid: int) -> None:
        self.h, self.cid = h, cid
        self.client, self.events = join(h.core, cid, h.now)
        assert self.client.state.name == "OPEN"

    def flow(self) -> None:
        core, now = self.h.core, self.h.now
        data = b"".join(bytes(p) for p in self.client.data_to_send())
        if data:
            core.receive_data(self.cid, data, now)
        down = core.data_to_send(self.cid)
        if down:  # (b"" would be the connection's end)
            self.client.receive_data(down, now)
        self.events.extend(iter(self.client.next_event, None))
        self.h.pump()  # (the core's events, and anything it said to the harness's client)

    def begin(self, tid: int, **kw: Any) -> None:
        self.client.send_begin(begin(tid=tid, request=f"other{tid}", **kw))
        self.flow()

    def send(self, c: Chunk) -> None:
        self.client.send_chunk(c, chunk_frame_size(len(c.params), len(c.payload)))
        self.flow()

    def accepted(self) -> list[int]:
        return [e.transfer_id for e in self.events if isinstance(e, TransferAccepted)]


def accepted(h: Harness) -> list[int]:
    return [e.transfer_id for e in h.client_of(TransferAccepted)]


def poison(h: Harness, tids: range, layer_tokens: int) -> None:
    """The harness's client begins each of ``tids``, sends one 1-token chunk declaring a
    layer of ``layer_tokens``, and resets it: a huge first layer announced, never sent."""
    for tid in tids:
        h.client.send_begin(begin(tid=tid, layers=1, request=f"p{tid}"))
        h.pump()
        assert tid in accepted(h)
        h.send(chunk(tid=tid, layer=0, kind=0, count=1, tokens=layer_tokens))
        h.client.send_reset(tid, ErrorCode.CANCELLED, "x")
        h.pump()


def test_a_session_announcing_huge_first_layers_does_not_hold_back_another_sessions_transfer() -> None:
    """A hostile client does 64 times BEGIN, one 1-token chunk declaring
    a first layer of 14 sixteenths of the budget, RESET; then one BEGIN that sends nothing.
    No first layer was received whole, so nothing is learned: that transfer reserves
    nothing, and another session's transfer (of another layout, and of the same one)
    starts at once and completes."""
    h = Harness(ReceiverConfig(secret=SECRET, max_buffer_bytes=16 * UNIT, transfer_buffer_bytes=16 * UNIT,
                               claim_timeout=None, transfer_timeout=300.0))
    poison(h, range(1, RECENT_FIRST_LAYERS + 1), layer_tokens=14 * 64)
    assert h.core.counters["transfers_aborted_by_peer"] == RECENT_FIRST_LAYERS
    h.client.send_begin(begin(tid=100, layers=1, request="idle"))
    h.pump()
    assert 100 in accepted(h)
    assert h.core.reserved_bytes == 0  # no estimate for it: none of its session was whole
    victim = Other(h, 2)
    victim.begin(1, layers=2, num_kv_heads=1)  # a layout the server has not seen
    victim.begin(2, layers=1)  # the hostile session's layout
    assert victim.accepted() == [1, 2] and h.core.waiting_to_start == 0
    for tid, heads in ((1, 1), (2, 2)):
        for layer in range(2 if tid == 1 else 1):
            for kind in (0, 1):
                victim.send(Chunk(transfer_id=tid, layer=layer, kind=kind, codec_id=0, token_start=0,
                                  token_count=64, layer_tokens=64, params=b"",
                                  payload=bytes(64 * heads * 4 * 2)))
            if tid == 1 and layer == 0:  # (its CREDIT: its window)
                assert any(isinstance(e, CreditGranted) and e.transfer_id == 1 for e in victim.events)
    assert not [e for e in victim.events if isinstance(e, TransferReset)]
    within_budget(h)


def test_a_first_layer_is_learned_only_once_it_is_received_whole() -> None:
    """K of transfer 1's layer 0 stored: its size is declared, not learned, so transfer 2
    is accepted at an estimate of 0.  Once V makes layer 0 whole, the size is learned:
    transfer 2 (given room at 0, its first chunk not arrived) has it reserved, and
    transfer 3 is accepted at it."""
    h = Harness(ReceiverConfig(secret=SECRET, max_buffer_bytes=4 * LAYER, transfer_buffer_bytes=LAYER,
                               claim_timeout=None))
    begin_all(h, 2, 1)
    h.send(chunk(tid=1, layer=0, kind=0))
    assert h.core.buffered_bytes - h.core.kept_bytes == LAYER
    begin_all(h, 2, 2)
    assert accepted(h) == [1, 2]
    assert h.core.reserved_bytes == 0 and h.core._live[key(h, 2)].estimate == 0
    h.send(chunk(tid=1, layer=0, kind=1))  # layer 0 whole
    assert h.core.reserved_bytes == LAYER and h.core._live[key(h, 2)].estimate == LAYER
    begin_all(h, 2, 3)
    assert accepted(h) == [1, 2, 3] and h.core.reserved_bytes == 2 * LAYER
    within_budget(h)


def test_a_transfer_that_fails_before_its_layer_0_is_whole_teaches_nothing() -> None:
    """Most of a huge layer 0 (all of K, half of V), then RESET: nothing learned; the
    session's next transfer is accepted at an estimate of 0."""
    h = Harness(ReceiverConfig(secret=SECRET, max_buffer_bytes=16 * UNIT, transfer_buffer_bytes=16 * UNIT,
                               claim_timeout=None))
    begin_all(h, 1, 1)
    h.send(chunk(tid=1, layer=0, kind=0, count=14 * 64, tokens=14 * 64))
    h.send(chunk(tid=1, layer=0, kind=1, count=7 * 64, tokens=14 * 64))
    h.client.send_reset(1, ErrorCode.CANCELLED, "x")
    h.pump()
    begin_all(h, 1, 2)
    assert accepted(h) == [1, 2] and h.core.reserved_bytes == 0


def test_a_sessions_own_first_layers_set_its_estimate_and_its_history_goes_with_it() -> None:
    """Session A's first layers (14 units, received whole and taken) set A's estimate:
    capped at the smallest of them where that is larger than the eighth, its next BEGIN
    reserves 14 units.  Session B, with no history of its own, is estimated from every
    session's first layers but never past the eighth (2 units): its BEGIN is accepted at
    once, in the 2 units left, and A's next waits to start.  Once A is gone (its stream
    closed, every transfer of it done), its history is gone with it: nothing of the core
    still refers to A's session, and a new session's transfer is accepted at the eighth
    again, not at A's 14 units."""
    h = Harness(ReceiverConfig(secret=SECRET, max_buffer_bytes=16 * UNIT, transfer_buffer_bytes=16 * UNIT,
                               claim_timeout=None, resume_timeout=0.0))
    big = 14 * 64
    for tid in (1, 2):
        begin_all(h, 1, tid)
        h.send(chunk(tid=tid, layer=0, kind=0, count=big, tokens=big))
        h.send(chunk(tid=tid, layer=0, kind=1, count=big, tokens=big))
        h.core.claim(key(h, tid), h.now)
        take(h, tid, 0)
    begin_all(h, 1, 3)
    assert accepted(h) == [1, 2, 3] and h.core.reserved_bytes == 14 * UNIT
    b = Other(h, 2)
    b.begin(1, layers=1)
    assert b.accepted() == [1] and h.core.reserved_bytes == 14 * UNIT + 2 * UNIT
    begin_all(h, 1, 4)
    assert accepted(h) == [1, 2, 3] and h.core.waiting_to_start == 1
    a_id = key(h, 1)[0]
    a_session = weakref.ref(h.core._sessions[a_id])
    for tid in (3, 4):  # A's last transfers end, then its stream closes cleanly
        h.core.abort((a_id, tid), "done", h.now)
    h.pump()
    h.client.close(ErrorCode.NO_ERROR, "bye")
    h.pump()
    assert a_id not in h.core._sessions and h.core.sessions == 1
    gc.collect()
    assert a_session() is None  # (its history with it: nothing holds it)
    c = Other(h, 3)
    c.begin(1, layers=1)
    assert c.accepted() == [1] and h.core.reserved_bytes == 2 * UNIT + 2 * UNIT  # (B's and C's)


def test_a_new_session_waits_to_start_at_every_sessions_estimate_instead_of_failing() -> None:
    """Session A's eight one-layer transfers (2 units each, received whole, held unread)
    fill the budget of 16 units.  A new session B (no history of its own: a client that
    connects per transfer) is estimated from every session's first layers (2 units,
    within the eighth): its BEGIN waits to start, where an estimate of 0 would accept it
    and fail its first layer for want of room.  Once one of A's layers is taken, B starts
    and its first layer is stored; nothing fails."""
    h = Harness(ReceiverConfig(secret=SECRET, max_buffer_bytes=16 * UNIT, transfer_buffer_bytes=16 * UNIT,
                               claim_timeout=None))
    tokens = 2 * 64
    for tid in range(1, 9):
        begin_all(h, 1, tid)
        h.send(chunk(tid=tid, layer=0, kind=0, count=tokens, tokens=tokens))
        h.send(chunk(tid=tid, layer=0, kind=1, count=tokens, tokens=tokens))
    assert accepted(h) == list(range(1, 9)) and h.core.buffered_bytes - h.core.kept_bytes == 16 * UNIT
    b = Other(h, 2)
    b.begin(1, layers=1)
    assert b.accepted() == [] and h.core.waiting_to_start == 1
    h.core.claim(key(h, 1), h.now)
    take(h, 1, 0)
    b.flow()
    assert b.accepted() == [1] and h.core.waiting_to_start == 0
    b.send(chunk(tid=1, layer=0, kind=0, count=tokens, tokens=tokens))
    b.send(chunk(tid=1, layer=0, kind=1, count=tokens, tokens=tokens))
    assert not [e for e in b.events if isinstance(e, TransferReset)]
    assert h.core.counters["buffer_budget_refusals"] == 0 and h.core.buffered_bytes - h.core.kept_bytes == 16 * UNIT


def test_one_session_cannot_bring_a_new_sessions_estimate_down() -> None:
    """Session A holds 15 of 16 units in layers received whole (2 units each, one of 1).
    Session P then sends many one-token first layers whole (each reset: it holds nothing):
    the server keeps one first layer per session, so P moves only its own entry, and a new
    session B (no history of its own) is still estimated at A's 2 units: its BEGIN waits to
    start instead of being accepted at about 0 and failing its first layer for want of room."""
    h = Harness(ReceiverConfig(secret=SECRET, max_buffer_bytes=16 * UNIT, transfer_buffer_bytes=16 * UNIT,
                               claim_timeout=None))
    p = Other(h, 3)

    def tiny(tid: int) -> None:
        p.begin(tid, layers=1)
        assert tid in p.accepted()
        p.send(chunk(tid=tid, layer=0, kind=0, count=1, tokens=1))
        p.send(chunk(tid=tid, layer=0, kind=1, count=1, tokens=1))  # layer 0 whole: learned
        p.client.send_reset(tid, ErrorCode.CANCELLED, "x")
        p.flow()

    tiny(1)
    for tid in range(1, 9):
        tokens = 2 * 64 if tid < 8 else 64
        begin_all(h, 1, tid)
        h.send(chunk(tid=tid, layer=0, kind=0, count=tokens, tokens=tokens))
        h.send(chunk(tid=tid, layer=0, kind=1, count=tokens, tokens=tokens))
    for tid in range(2, RECENT_FIRST_LAYERS + 2):
        tiny(tid)
    assert h.core.buffered_bytes - h.core.kept_bytes == 15 * UNIT
    b = Other(h, 2)
    b.begin(1, layers=1)
    assert b.accepted() == [] and h.core.waiting_to_start == 1
