"""A registry call (a RegistryCheck at BEGIN, a RegistryPublish after the last chunk) is
counted until it is answered, also once its transfer failed: before, a transfer reset
while its check ran was forgotten at once, and a client beginning and resetting gated
transfers in a loop against a slow registry had calls running (each holding its BEGIN's
block list) without any bound (95 after 1500 BEGIN+RESET with max_transfers=4; heap +66
MiB).  Such failed transfers awaiting the registry have an allowance of their own beside
max_transfers (see test_registry_calls_allowance.py): a session has at most 2 x
max_transfers calls running (gated BEGINs past that are refused with LIMIT_EXCEEDED), the
server at most 2 x max_sessions x max_transfers (those of sessions that ended included),
their block lists stay counted in the budget, and each answer, whatever it says, frees
its place and nothing else."""

from __future__ import annotations

import pytest

import kvwire.session.receiver as receiver_module
from kvwire.errors import ErrorCode, RegistryUnavailableError, StaleVersionError
from kvwire.session.receiver import (
    BLOCK_ENTRY_BYTES,
    LayerReady,
    RegistryCheck,
    RegistryPublish,
    TransferArrived,
    TransferFailed,
)
from kvwire.wire import ChunkAcked, TransferAccepted, TransferReset, chunk_frame_size
from kvwire.wire.frames import BlockVersion
from tests.session.client_helpers import Client
from tests.session.receiver_harness import BPT, Harness, begin, chunk
from tests.session.registry_helpers import (
    BLOCKS,
    BLOCKS_BYTES,
    checks,
    gated_harness,
    refusals,
)


def begin_and_reset(h: Harness, tid: int) -> None:
    """The client begins a gated transfer and resets it before the registry answered."""
    h.client.send_begin(begin(tid=tid, layers=1, request=f"r{tid}", blocks=BLOCKS))
    h.client.send_reset(tid, ErrorCode.CANCELLED, "the sender gave up")
    h.pump()


def test_a_check_whose_transfer_was_reset_keeps_its_place_until_answered() -> None:
    h = gated_harness(max_transfers=2)
    for tid in range(1, 5):
        begin_and_reset(h, tid)
    assert len(checks(h)) == 4 and len(h.of(TransferFailed)) == 4 and not refusals(h)
    assert h.core.held_transfers == 0  # their memory was given back at once, but their
    assert h.core.buffered_bytes == h.core.kept_bytes == 4 * BLOCKS_BYTES  # calls' block lists
    begin_and_reset(h, 5)  # ... and their calls still run, and keep their places
    [refused] = refusals(h)
    assert refused.transfer_id == 5 and "4 failed transfers of the session awaiting the registry" in refused.message
    assert len(checks(h)) == 4  # no fifth call was asked for
    assert h.core.registry_calls == 4
    # An answer (any: the registry's error, or a cancelled call's) frees its place only.
    h.core.registry_checked(checks(h)[0], None, RegistryUnavailableError("cancelled"), h.now)
    h.pump()
    assert h.core.registry_calls == 3 and len(h.of(TransferFailed)) == 4
    assert h.core.buffered_bytes == 3 * BLOCKS_BYTES
    h.client.send_begin(begin(tid=6, layers=1, request="r6", blocks=BLOCKS))
    h.pump()
    assert len(checks(h)) == 5 and len(refusals(h)) == 1
    for key in checks(h)[1:4]:  # "fresh", for transfers gone: nothing
        h.core.registry_checked(key, [], None, h.now)
    h.core.registry_checked(checks(h)[4], [], None, h.now)  # the live one's: accepted
    h.pump()
    assert [e.request_id for e in h.of(TransferArrived)] == ["r6"]
    assert [a.transfer_id for a in h.client_of(TransferAccepted)] == [6]
    assert h.core.registry_calls == 0


def test_a_loop_of_begin_and_reset_never_has_more_calls_running_than_twice_max_transfers() -> None:
    h = gated_harness(max_transfers=4)
    for tid in range(1, 1501):
        begin_and_reset(h, tid)
        assert len(checks(h)) <= 8  # (none answered: every call asked for still runs)
    assert len(checks(h)) == 8 and len(refusals(h)) == 1492 and h.core.registry_calls == 8
    assert h.core.buffered_bytes == 8 * BLOCKS_BYTES and h.core.held_transfers == 0
    for key in checks(h):  # the registry answers at last: everything drains
        h.core.registry_checked(key, None, RegistryUnavailableError("timed out"), h.now)
    assert h.core.registry_calls == 0 and h.core.buffered_bytes == 0
    h.client.send_begin(begin(tid=2000, layers=1, request="after", blocks=BLOCKS))
    h.pump()
    assert len(checks(h)) == 9


def test_a_publish_whose_transfer_failed_keeps_its_place_until_answered() -> None:
    """The publish path: a gated transfer sent whole, then reset while its publish runs."""
    h = gated_harness(max_transfers=1, transfer_buffer_bytes=1 << 20)
    h.client.send_begin(begin(tid=1, layers=1, request="r1", blocks=BLOCKS))
    h.pump()
    h.core.registry_checked(checks(h)[0], [], None, h.now)
    h.pump()
    h.send(chunk(tid=1, layer=0, kind=0))
    h.send(chunk(tid=1, layer=0, kind=1))
    [publish] = h.of(RegistryPublish)
    h.client.send_reset(1, ErrorCode.CANCELLED, "the sender gave up")
    h.pump()
    [failed] = h.of(TransferFailed)
    assert failed.key == publish.key
    acks = len(h.client_of(ChunkAcked))
    assert acks == 2  # the held ack went out when it failed
    h.client.send_begin(begin(tid=2, layers=1, request="r2"))  # (not refused: its own allowance)
    h.pump()
    assert not refusals(h) and h.core.registry_calls == 1
    assert [e.request_id for e in h.of(TransferArrived)] == ["r1", "r2"]
    # The registry's late answer, even a success, changes nothing but that place.
    h.core.registry_published(publish.key, None, h.now)
    h.pump()
    assert not h.of(LayerReady) and len(h.client_of(ChunkAcked)) == acks
    assert h.core.registry_calls == 0


def test_calls_of_sessions_that_ended_count_against_the_servers_bound() -> None:
    """A client that resets its gated transfers, closes its session and opens another,
    again and again, cannot have more calls running than 2 x max_sessions x max_transfers."""
    h = gated_harness(max_sessions=1, max_transfers=2, resume_timeout=0.0)
    h.core.receive_data(1, b"", h.now)  # (the harness's own client is not used: its session goes)
    h.core.forget(1)
    a = Client(h, 2)
    for tid in (1, 2, 3, 4):
        a.conn.send_begin(begin(tid=tid, layers=1, request=f"a{tid}", blocks=BLOCKS))
        a.conn.send_reset(tid, ErrorCode.CANCELLED, "bye")
        a.flush()
    a.goodbye()
    assert h.core.sessions == 0
    b = Client(h, 3)
    b.conn.send_begin(begin(tid=1, layers=1, request="b1", blocks=BLOCKS))
    b.flush()
    [refused] = b.resets
    assert refused.code == ErrorCode.LIMIT_EXCEEDED and "4 failed transfers awaiting the registry" in refused.message
    assert "2 x max_sessions x max_transfers = 4" in refused.message
    assert h.core.registry_calls == 4
    h.core.registry_checked(checks(h)[0], None, RegistryUnavailableError("cancelled"), h.now)
    b.conn.send_begin(begin(tid=2, layers=1, request="b2", blocks=BLOCKS))
    b.flush()
    assert len(b.resets) == 1 and len(checks(h)) == 5


def test_an_id_whose_call_still_runs_is_not_taken_by_a_new_transfer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The failed transfer's tombstone was forgotten (a session keeps the last 4096; here
    1) while its check still ran: a BEGIN re-using its id is refused, so the late answer
    can never be taken for the new transfer's."""
    monkeypatch.setattr(receiver_module, "TOMBSTONES_KEPT", 1)
    h = gated_harness(max_transfers=4)
    begin_and_reset(h, 1)
    h.client.send_begin(begin(tid=2, layers=1, request="r2"))
    h.client.send_reset(2, ErrorCode.CANCELLED, "bye")  # its tombstone pushes 1's out
    h.pump()
    stale = [BlockVersion(block=b"i:1", version=2)]
    h.client.send_begin(begin(tid=1, layers=1, request="another", blocks=tuple(stale)))
    h.pump()
    [dup] = [e for e in h.client_of(TransferReset) if e.code == ErrorCode.DUPLICATE_TRANSFER]
    assert dup.transfer_id == 1 and "registry call" in dup.message
    h.core.registry_checked(checks(h)[0], [], None, h.now)  # the old call: "fresh"
    h.pump()
    assert [e.request_id for e in h.of(TransferArrived)] == ["r2"]
    h.client.send_begin(begin(tid=1, layers=1, request="another", blocks=tuple(stale)))
    h.pump()
    [check] = [e for e in h.of(RegistryCheck) if e.blocks == ((b"i:1", 2),)]
    h.core.registry_checked(check.key, ["i:1"], StaleVersionError("i:1 is stale"), h.now)
    h.pump()
    assert [e.request_id for e in h.of(TransferArrived)] == ["r2"]
    assert [e.code for e in h.client_of(TransferReset)][-1] == ErrorCode.STALE_VERSION


def test_a_session_lost_with_checks_running_leaves_them_counted_until_answered() -> None:
    h = gated_harness(max_sessions=1, max_transfers=1, resume_timeout=0.0)
    h.client.send_begin(begin(tid=1, layers=1, request="r1", blocks=BLOCKS))
    h.pump()
    h.core.receive_data(1, b"", h.now)  # the connection breaks: the session is lost
    h.core.forget(1)
    h.pump()
    assert h.core.sessions == 0 and len(h.of(TransferFailed)) == 1
    assert h.core.registry_calls == 1 and h.core.held_transfers == 0
    other = Client(h, 2)
    other.conn.send_begin(begin(tid=1, layers=1, request="o1", blocks=BLOCKS))
    other.conn.send_reset(1, ErrorCode.CANCELLED, "bye")
    other.flush()  # (within 2 x max_sessions x max_transfers = 2 calls)
    assert not other.resets and len(checks(h)) == 2 and h.core.registry_calls == 2
    other.conn.send_begin(begin(tid=2, layers=1, request="o2", blocks=BLOCKS))
    other.flush()  # the lost session's call still counts: past the server's allowance
    assert [r.code for r in other.resets] == [ErrorCode.LIMIT_EXCEEDED] and len(checks(h)) == 2
    h.core.registry_checked(checks(h)[0], [], None, h.now)
    assert h.core.registry_calls == 1
    other.conn.send_begin(begin(tid=3, layers=1, request="o3", blocks=BLOCKS))
    other.flush()
    assert len(other.resets) == 1 and len(checks(h)) == 3


@pytest.mark.parametrize("order", ["answers first", "claims first", "server closes first"])
def test_a_failed_arrival_whose_publish_runs_counts_its_block_list_once(order: str) -> None:
    """Gated transfers sent whole, not claimed, reset while their publish runs: each is
    kept failed to claim (its BEGIN's footprint, block list included) and its call counts
    until answered.  Before, the call counted the block list a second time: with four
    block lists of a fifth of the bound each, buffered_bytes went to 8386304 past a bound
    of 5242880.  Now it never passes the bound, and every path brings it back to 0 (a
    record claimed or dropped before the call's answer hands the block list to the call)."""
    mt, maxbuf = 4, 4 << 20
    h = gated_harness(max_transfers=mt, max_buffer_bytes=maxbuf, max_frame_size=16 << 20)
    bound = maxbuf + max(maxbuf // 8, receiver_module.KEPT_ROOM_MIN)
    n = (bound // (mt + 1)) // (2 * 200 + BLOCK_ENTRY_BYTES)
    peak = 0

    def step() -> None:
        nonlocal peak
        h.pump()
        peak = max(peak, h.core.buffered_bytes)

    def blocks(tid: int) -> tuple[BlockVersion, ...]:
        return tuple(BlockVersion(block=(f"s:t{tid}" + "k" * 190 + f"{i:06d}").encode(), version=1) for i in range(n))

    for tid in range(1, mt + 1):
        h.client.send_begin(begin(tid=tid, layers=1, request=f"r{tid}", blocks=blocks(tid)))
    step()
    for key in checks(h):
        h.core.registry_checked(key, None, None, h.now)
    step()
    for tid in range(1, mt + 1):
        h.client.send_chunk(chunk(tid=tid, layer=0, kind=0), chunk_frame_size(0, 8 * BPT))
        h.client.send_chunk(chunk(tid=tid, layer=0, kind=1), chunk_frame_size(0, 8 * BPT))
        step()
    publishes = [e.key for e in h.of(RegistryPublish)]
    assert len(publishes) == mt and len(h.core.unclaimed()) == mt
    for tid in range(1, mt + 1):
        h.client.send_reset(tid, ErrorCode.CANCELLED, "the sender gave up")
        step()
    assert len(h.of(TransferFailed)) == mt and h.core.registry_calls == mt
    assert h.core.failed_unclaimed == mt and peak <= bound
    if order == "answers first":
        for key in publishes:
            h.core.registry_published(key, None, h.now)
            step()
        assert h.core.registry_calls == 0 and h.core.buffered_bytes > 0  # (the failed records)
        for key in h.core.unclaimed():
            h.core.claim(key, h.now)
            step()
    else:
        if order == "claims first":
            for key in h.core.unclaimed():
                h.core.claim(key, h.now)
                step()
        else:
            h.core.close(h.now)
            step()
        assert h.core.failed_unclaimed == 0 and h.core.registry_calls == mt
        assert h.core.buffered_bytes == h.core.kept_bytes > 0  # (the calls' block lists)
        for key in publishes:
            h.core.registry_published(key, None, h.now)
            step()
    assert h.core.registry_calls == 0 and h.core.failed_unclaimed == 0
    assert h.core.buffered_bytes == h.core.kept_bytes == 0
    assert peak <= bound
