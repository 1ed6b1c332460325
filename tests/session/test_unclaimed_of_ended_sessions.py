"""Complete transfers nobody claimed stay held when their session ends (the application may
still claim them), and they count against a server-wide bound of max_sessions x
max_transfers: a client that sends max_transfers transfers, closes its session cleanly and
opens another, again and again, held 1600 of them on a server of max_sessions x
max_transfers = 16 (max_buffer_bytes and claim_timeout bounded them, nothing else).  At the
bound every BEGIN is refused with LIMIT_EXCEEDED, saying why; none of those transfers is
dropped to make room: they are freed only as before (claimed, or claim_timeout)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.errors import ErrorCode
from kvwire.session.receiver import ReceiverConfig, ReceiverCore, TransferArrived, TransferDropped
from tests.session.client_helpers import Client
from tests.session.receiver_harness import SECRET, Harness, begin


def ended_session_with_complete_transfers(h: Harness, cid: int, n: int, prefix: str) -> list[tuple[bytes, int]]:
    c = Client(h, cid)
    assert c.open
    for tid in range(1, n + 1):
        c.send_whole(tid, f"{prefix}{tid}")
    assert not c.resets
    keys = [e.key for e in h.of(TransferArrived) if e.key[0] == c.conn.session_id]
    c.goodbye()
    return keys


def harness(**config: object) -> Harness:
    config.setdefault("resume_timeout", 0.0)
    h = Harness(ReceiverConfig(secret=SECRET, **config))  # type: ignore[arg-type]
    h.core.receive_data(1, b"", h.now)  # (the harness's own client is not used: its session goes)
    h.core.forget(1)
    assert h.core.sessions == 0
    return h


def test_complete_transfers_of_ended_sessions_count_against_the_servers_bound_and_are_kept() -> None:
    h = harness(max_sessions=1, max_transfers=2, claim_timeout=None)
    assert h.core.held_limit == 2
    first = ended_session_with_complete_transfers(h, 2, 2, "a")
    assert h.core.sessions == 0 and h.core.unclaimed() == first and h.core.held_transfers == 2
    # A new session: its own count is 0, but the server holds its whole bound.
    c = Client(h, 3)
    c.send_whole(1, "b1")
    [refused] = c.resets
    assert refused.transfer_id == 1 and refused.code == ErrorCode.LIMIT_EXCEEDED
    assert "2 complete from ended sessions, not claimed" in refused.message
    assert "max_sessions x max_transfers = 2" in refused.message
    assert len(refused.message) <= 160
    # Nothing was dropped to make room: both are still there for the application.
    assert h.core.unclaimed() == first and not h.of(TransferDropped)
    assert h.core.counters["transfers_refused"] == 1
    # One claimed: room for one more, and only one, although this session holds one.
    h.core.claim(first[0], h.now)
    c.send_whole(2, "b2")
    c.send_whole(3, "b3")
    assert [r.transfer_id for r in c.resets] == [1, 3] and c.resets[1].code == ErrorCode.LIMIT_EXCEEDED
    h.core.claim(first[1], h.now)
    c.send_whole(4, "b4")
    assert [r.transfer_id for r in c.resets] == [1, 3]
    assert h.core.held_transfers == 2


def test_claim_timeout_frees_the_bound_as_before() -> None:
    h = harness(max_sessions=1, max_transfers=2, claim_timeout=5.0)
    ended_session_with_complete_transfers(h, 2, 2, "a")
    c = Client(h, 3)
    c.send_whole(1, "b1")
    assert [r.code for r in c.resets] == [ErrorCode.LIMIT_EXCEEDED]
    h.now = 5.0
    h.core.handle_timer(h.now)
    h.pump()
    assert h.core.counters["transfers_unclaimed"] == 2 and h.core.held_transfers == 0
    c.send_whole(2, "b2")
    assert len(c.resets) == 1  # accepted this time
    assert [e.request_id for e in h.of(TransferArrived)][-1] == "b2"


def test_closing_and_reopening_sessions_holds_no_more_than_the_bound() -> None:
    """The reviewer's reproducer in the core: sessions sending max_transfers each and
    closing, 200 times, on a server of max_sessions x max_transfers = 16."""
    h = harness(max_sessions=2, max_transfers=8, claim_timeout=None)
    refused = 0
    for n in range(200):
        c = Client(h, 10 + n)
        for tid in range(1, 9):
            c.send_whole(tid, f"s{n}-{tid}")
        refused += len(c.resets)
        c.goodbye()
        assert h.core.held_transfers <= h.core.held_limit == 16
    assert len(h.core.unclaimed()) == 16 and refused == 200 * 8 - 16
    assert not h.of(TransferDropped)


def brute_held(core: ReceiverCore) -> int:
    return sum(1 for t in core._live.values() if not (t.complete and t.claimed))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["send", "send", "half", "close", "break", "claim", "take"]),
                          st.integers(0, 2)), max_size=40))
def test_the_count_of_transfers_held_is_exact_and_within_its_bound(ops: list[tuple[str, int]]) -> None:
    h = harness(max_sessions=2, max_transfers=2, claim_timeout=None)
    clients: dict[int, Client] = {}
    cids = iter(range(2, 1000))
    tids = iter(range(1, 1000))
    for op, slot in ops:
        if op in ("claim", "take"):
            if (keys := h.core.unclaimed()):
                h.core.claim(keys[0], h.now)
                if op == "take" and (t := h.core._live.get(keys[0])) is not None and t.complete:
                    h.core.take_layer(keys[0], 0, h.now)
        elif op in ("close", "break"):
            if (c := clients.pop(slot, None)) is not None:
                if op == "close":
                    c.goodbye()
                else:
                    h.core.receive_data(c.cid, b"", h.now)
                    h.core.forget(c.cid)
                    h.pump()
        else:
            if slot not in clients:
                c = Client(h, next(cids))
                if not c.open:  # max_sessions reached
                    h.core.forget(c.cid)
                    continue
                clients[slot] = c
            c = clients[slot]
            tid = next(tids)
            if op == "send":
                c.send_whole(tid, f"r{tid}")
            else:  # BEGIN only: in progress
                c.conn.send_begin(begin(tid=tid, layers=1, request=f"r{tid}"))
                c.flush()
        core = h.core
        assert core.held_transfers == brute_held(core) <= core.held_limit
        assert set(core._held_gone) <= {k for k in core._live if k[0] not in core._sessions}
