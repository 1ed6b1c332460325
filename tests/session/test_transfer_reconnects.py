"""max_transfer_reconnects counts the breaks that hit a transfer: of a stream carrying its
unacknowledged chunks or its unanswered BEGIN.  Breaks of the session's other streams are
bounded by max_reconnects only (before, every break of any stream counted against every
transfer in flight, so a long transfer on N streams failed after max_transfer_reconnects
breaks spread over all of them while the session was healthy)."""

from __future__ import annotations

from kvwire.errors import ConnectionLostError
from kvwire.session.sender import ChunkSent, TransferDone, TransferFailed

from .test_sender_core import Harness, begin, chunk, harness


def reconnect(h: Harness, index: int) -> None:
    """Break stream ``index`` and let the core reconnect it (fake time)."""
    h.kill(index)
    assert h.core.broken is None and index not in h.core.open_streams
    h.advance(h.now + 1.0)
    assert index in h.core.open_streams


def carriers(h: Harness) -> set[int]:
    """The streams holding chunks the server received and did not acknowledge."""
    return {stream for stream, _ in h.received}


def test_breaks_of_a_stream_that_carried_nothing_of_a_transfer_do_not_count_against_it() -> None:
    h = harness(streams=2, reconnect_backoff=0.01, max_transfer_reconnects=2, max_reconnects=20)
    h.core.active_streams = 1  # chunks go on the first open stream only
    tid = begin(h, layers=1)
    for i in range(4):
        h.core.add_chunk(tid, chunk(tid, 0, 0, i))
    h.step()
    assert carriers(h) == {0}
    for _ in range(5):  # more than max_transfer_reconnects, fewer than max_reconnects
        reconnect(h, 1)
        assert carriers(h) == {0}
    assert h.core.resumes == 5
    assert not h.of(TransferFailed) and h.core.transfer(tid) is not None
    h.core.producer_done(tid)
    h.ack()
    [done] = h.of(TransferDone)
    assert done.transfer_id == tid


def test_breaks_of_the_stream_carrying_a_transfers_chunks_still_fail_it() -> None:
    h = harness(streams=2, reconnect_backoff=0.01, max_transfer_reconnects=2, max_reconnects=20)
    h.core.active_streams = 1
    tid = begin(h, layers=1)
    for i in range(4):
        h.core.add_chunk(tid, chunk(tid, 0, 0, i))
    h.step()
    for _ in range(3):  # a break of another stream in between changes nothing
        reconnect(h, 1)
    for n in range(1, 4):
        [carrier] = carriers(h)  # its chunks went again on the stream still open
        sent = len(h.of(ChunkSent))
        h.kill(carrier)
        if n <= 2:
            assert not h.of(TransferFailed) and len(h.of(ChunkSent)) > sent
            h.advance(h.now + 1.0)
    [failed] = h.of(TransferFailed)
    assert failed.transfer_id == tid and isinstance(failed.error, ConnectionLostError)
    assert "giving up after 3 broken streams (max_transfer_reconnects=2)" in str(failed.error)
    assert h.core.broken is None  # the session goes on: a new transfer completes
    other = begin(h, layers=1)
    h.core.add_chunk(other, chunk(other, 0, 0, 0))
    h.core.producer_done(other)
    h.step()
    h.ack()
    assert [d.transfer_id for d in h.of(TransferDone)] == [other]


def test_a_break_counts_against_a_transfer_whose_begin_it_carried_unanswered() -> None:
    h = harness(streams=2, reconnect_backoff=0.01, max_transfer_reconnects=0)
    other = h.core.begin("r", num_layers=1, num_kv_heads=1, head_dim=8, now=h.now)  # its BEGIN on stream 0
    h.kill(1)  # carried nothing of it
    assert not h.of(TransferFailed) and h.core.accepted(other)
    h.advance(h.now + 1.0)
    tid = h.core.begin("r", num_layers=1, num_kv_heads=1, head_dim=8, now=h.now)  # on stream 0, unanswered
    h.kill(0)
    [failed] = h.of(TransferFailed)
    assert failed.transfer_id == tid and "max_transfer_reconnects=0" in str(failed.error)
    assert h.core.broken is None and h.core.accepted(other)
