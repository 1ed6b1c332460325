"""A failed transfer whose registry call still runs no longer takes a place in its
session's max_transfers (nor in the server's max_sessions x max_transfers): it counts
against an allowance of its own.  Before, it did, so a client that gave up a gated send
and began another at once was refused LIMIT_EXCEEDED ("1 failed awaiting the registry")
although nothing of it was in flight: the server cancels a check when its transfer fails
but the core hears of the end one loop turn later, and a publish (never cancelled) held
the place as long as the registry took.  Now a session's transfers in progress and its
failed ones awaiting the registry are together at most 2 x max_transfers (the server's
2 x max_sessions x max_transfers), so calls stay bounded, and a gated BEGIN past that is
refused saying so; the block list such a call holds stays counted in the budget."""

from __future__ import annotations

import random

from kvwire.errors import ErrorCode, RegistryUnavailableError
from kvwire.session.receiver import (
    RegistryCheck,
    RegistryPublish,
    TransferArrived,
    TransferFailed,
)
from kvwire.wire import TransferAccepted, chunk_frame_size
from tests.session.client_helpers import Client
from tests.session.receiver_harness import BPT, Harness, begin, chunk
from tests.session.registry_helpers import (
    BLOCKS,
    BLOCKS_BYTES,
    Key,
    checks,
    gated_harness,
    refusals,
)


def begin_gated(h: Harness, tid: int) -> None:
    h.client.send_begin(begin(tid=tid, layers=1, request=f"r{tid}", blocks=BLOCKS))
    h.pump()


def reset(h: Harness, tid: int) -> None:
    h.client.send_reset(tid, ErrorCode.CANCELLED, "the sender gave up")
    h.pump()


def test_a_send_given_up_while_its_check_runs_lets_the_next_one_in_at_once() -> None:
    """The reviewer's r2: max_transfers=1, the check of A still running (cancelled by the
    server, not yet answered) when B begins."""
    h = gated_harness(max_transfers=1)
    begin_gated(h, 1)
    reset(h, 1)
    assert len(h.of(TransferFailed)) == 1 and h.core.registry_calls == 1
    begin_gated(h, 2)
    assert not refusals(h) and len(checks(h)) == 2
    h.core.registry_checked(checks(h)[0], None, RegistryUnavailableError("registry check cancelled"), h.now)
    h.core.registry_checked(checks(h)[1], [], None, h.now)
    h.pump()
    assert [e.request_id for e in h.of(TransferArrived)] == ["r2"]
    assert [a.transfer_id for a in h.client_of(TransferAccepted)] == [2]
    assert h.core.registry_calls == 0


def test_a_send_given_up_while_its_publish_runs_lets_the_next_one_in_at_once() -> None:
    """The reviewer's r1: the publish of A (never cancelled) still running when B begins."""
    h = gated_harness(max_transfers=1, transfer_buffer_bytes=1 << 20)
    begin_gated(h, 1)
    h.core.registry_checked(checks(h)[0], [], None, h.now)
    h.pump()
    h.send(chunk(tid=1, layer=0, kind=0))
    h.send(chunk(tid=1, layer=0, kind=1))
    [publish] = h.of(RegistryPublish)
    reset(h, 1)
    assert [f.key for f in h.of(TransferFailed)] == [publish.key]
    begin_gated(h, 2)
    assert not refusals(h) and len(checks(h)) == 2
    assert h.core.registry_calls == 2
    h.core.registry_checked(checks(h)[1], [], None, h.now)
    h.pump()
    assert [a.transfer_id for a in h.client_of(TransferAccepted)] == [1, 2]
    h.core.registry_published(publish.key, None, h.now)  # (late: changes nothing but its place)
    assert h.core.registry_calls == 0


def test_past_the_allowance_a_gated_begin_is_refused_saying_so() -> None:
    h = gated_harness(max_transfers=1)
    begin_gated(h, 1)
    reset(h, 1)
    begin_gated(h, 2)  # in progress: the session's one transfer ...
    begin_gated(h, 3)
    [full] = refusals(h)  # ... so the next is refused by max_transfers, as ever
    assert full.transfer_id == 3 and "max_transfers=1" in full.message and "registry" not in full.message
    reset(h, 2)  # two failed awaiting the registry: 2 x max_transfers
    assert h.core.registry_calls == 2 and h.core.held_transfers == 0
    assert h.core.buffered_bytes == h.core.kept_bytes == 2 * BLOCKS_BYTES  # (their block lists)
    begin_gated(h, 4)
    refused = refusals(h)[-1]
    assert refused.transfer_id == 4
    assert refused.message == ("2 failed transfers of the session awaiting the registry, 0 held "
                               "(together at most 2 x max_transfers = 2): retry once the registry answers")
    assert len(checks(h)) == 2  # no call asked for
    h.client.send_begin(begin(tid=5, layers=1, request="r5"))  # one that calls no registry: let in
    h.pump()
    assert [e.request_id for e in h.of(TransferArrived)] == ["r5"]
    assert len(refusals(h)) == 2
    h.core.registry_checked(checks(h)[0], None, RegistryUnavailableError("cancelled"), h.now)
    assert h.core.buffered_bytes == h.core.kept_bytes == BLOCKS_BYTES
    reset(h, 5)
    begin_gated(h, 6)  # one answered: room again
    assert len(refusals(h)) == 2 and len(checks(h)) == 3


def test_the_servers_allowance_counts_calls_of_sessions_that_ended() -> None:
    """max_sessions=1, max_transfers=1: a session leaves two failed transfers awaiting the
    registry and closes; the next session's gated BEGIN is refused (2 x max_sessions x
    max_transfers = 2), one that calls no registry is not."""
    h = gated_harness(max_sessions=1, max_transfers=1, resume_timeout=0.0)
    h.core.receive_data(1, b"", h.now)  # (the harness's own client is not used: its session goes)
    h.core.forget(1)
    a = Client(h, 2)
    for tid in (1, 2):
        a.conn.send_begin(begin(tid=tid, layers=1, request=f"a{tid}", blocks=BLOCKS))
        a.conn.send_reset(tid, ErrorCode.CANCELLED, "bye")
        a.flush()
    assert not a.resets and h.core.registry_calls == 2
    a.goodbye()
    assert h.core.sessions == 0 and h.core.held_transfers == 0
    b = Client(h, 3)
    b.conn.send_begin(begin(tid=1, layers=1, request="b1", blocks=BLOCKS))
    b.flush()
    [refused] = b.resets
    assert refused.code == ErrorCode.LIMIT_EXCEEDED
    assert refused.message == ("the server has 2 failed transfers awaiting the registry, 0 held "
                               "(together at most 2 x max_sessions x max_transfers = 2): retry later")
    b.conn.send_begin(begin(tid=2, layers=1, request="b2"))
    b.flush()
    assert len(b.resets) == 1 and h.of(TransferArrived)[-1].request_id == "b2"
    b.conn.send_reset(2, ErrorCode.CANCELLED, "bye")
    h.core.registry_checked(checks(h)[0], None, RegistryUnavailableError("cancelled"), h.now)
    b.conn.send_begin(begin(tid=3, layers=1, request="b3", blocks=BLOCKS))
    b.flush()
    assert len(b.resets) == 1 and len(checks(h)) == 3


def test_calls_stay_within_twice_the_transfers_whatever_the_clients_do() -> None:
    """Random gated and plain BEGINs, RESETs, registry answers, chunks and session ends:
    a session never has more than 2 x max_transfers calls running, the server never more
    than 2 x max_sessions x max_transfers, and once every call is answered nothing of the
    failed ones stays counted."""
    rng = random.Random(7)
    h = gated_harness(max_sessions=2, max_transfers=2, resume_timeout=0.0, transfer_buffer_bytes=1 << 20)
    h.core.receive_data(1, b"", h.now)
    h.core.forget(1)
    core = h.core
    answered: set[tuple[Key, bool]] = set()  # (key, a check's)

    def answer(e: RegistryCheck | RegistryPublish) -> None:
        answered.add((e.key, isinstance(e, RegistryCheck)))
        if isinstance(e, RegistryCheck):
            core.registry_checked(e.key, [], None, h.now)
        else:
            core.registry_published(e.key, None, h.now)
        h.pump()

    def unanswered() -> list[RegistryCheck | RegistryPublish]:
        return [e for e in h.events if isinstance(e, RegistryCheck | RegistryPublish)
                and (e.key, isinstance(e, RegistryCheck)) not in answered]

    clients: dict[int, Client] = {}
    cids = iter(range(2, 10**6))
    tids = iter(range(1, 10**6))
    most = 0
    for _ in range(3000):
        op = rng.choice(["gated", "gated", "gated", "plain", "reset", "reset", "answer", "chunks", "end"])
        if op == "answer":
            if waiting := unanswered():
                answer(rng.choice(waiting))
            continue
        slot = rng.randrange(2)
        if op == "end":
            if (gone := clients.pop(slot, None)) is not None:
                gone.goodbye()
            continue
        if slot not in clients:
            c = Client(h, next(cids))
            if not c.open:
                core.forget(c.cid)
                continue
            clients[slot] = c
        c = clients[slot]
        mine = [k[1] for k in core._live if k[0] == c.conn.session_id]
        if op in ("gated", "plain"):
            tid = next(tids)
            c.conn.send_begin(begin(tid=tid, layers=1, request=f"r{tid}", blocks=BLOCKS if op == "gated" else ()))
        elif op == "reset" and mine:
            c.conn.send_reset(rng.choice(mine), ErrorCode.CANCELLED, "bye")
        elif op == "chunks" and mine:
            tid = rng.choice(mine)
            for kind in (0, 1):
                part = chunk(tid=tid, layer=0, kind=kind)
                c.conn.send_chunk(part, chunk_frame_size(0, 8 * BPT))
        c.flush()
        waiting = unanswered()
        for sid in {e.key[0] for e in waiting}:
            assert sum(1 for e in waiting if e.key[0] == sid) <= 2 * 2
        assert len(waiting) == core.registry_calls <= 2 * core.held_limit
        most = max(most, len(waiting))
    assert most == 2 * core.held_limit  # (the bound was reached)
    while waiting := unanswered():
        for e in waiting:
            answer(e)
    assert core.registry_calls == 0 and not core._orphans and not core._orphans_open
