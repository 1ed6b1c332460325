"""The sender core takes a transfer's first RESET from the server and ignores any further
copy of it (docs/protocol.md 10: a RESET for a transfer it does not have is ignored):
no second failure, no count, nothing said back, no stream or session closed.  What lets
the server send a RESET of its own on more than one stream of a session (a stalled
stream would otherwise hold it until its idle timeout)."""

from __future__ import annotations

from kvwire.errors import ErrorCode, TransferAbortedError
from kvwire.session.sender import SessionFailed, StreamClosed, TransferFailed
from tests.session.sender_harness import begin, harness

TEXT = "receiver aborted transfer 'r'"


def test_the_first_copy_fails_the_transfer_and_the_others_are_ignored() -> None:
    h = harness(streams=2)
    tid = begin(h, layers=2)
    h.servers[0].send_reset(tid, ErrorCode.CANCELLED, TEXT)
    h.step()
    [failed] = h.of(TransferFailed)
    assert failed.transfer_id == tid and isinstance(failed.error, TransferAbortedError) and failed.by_peer
    h.servers[1].send_reset(tid, ErrorCode.CANCELLED, TEXT)  # read later, on the other stream
    h.servers[0].send_reset(tid, ErrorCode.CANCELLED, TEXT)  # (and again on the first)
    h.step()
    assert len(h.of(TransferFailed)) == 1 and h.core.counters["transfers_reset_by_peer"] == 1
    assert h.resets == []  # nothing said back
    assert not h.of(StreamClosed) and not h.of(SessionFailed) and h.core.open_streams == [0, 1]
    assert all(srv.closed_event is None for srv in h.servers.values())
    # the session goes on
    tid2 = begin(h, layers=1)
    assert tid2 != tid and h.core.accepted(tid2)


def test_copies_of_a_transfer_the_sender_failed_itself_are_ignored() -> None:
    h = harness(streams=2)
    tid = begin(h, layers=2)
    h.core.abort(tid, TransferAbortedError("the sender gave up"))
    h.step()
    [failed] = h.of(TransferFailed)
    assert not failed.by_peer
    for index in (0, 1):
        h.servers[index].send_reset(tid, ErrorCode.CANCELLED, TEXT)
    h.step()
    assert len(h.of(TransferFailed)) == 1 and h.core.counters["transfers_reset_by_peer"] == 0
    assert not h.of(StreamClosed) and not h.of(SessionFailed) and h.core.open_streams == [0, 1]
