"""A RESET the client sent is said again when the stream it went on closes before the
receiver read it (docs/protocol.md 6.3): on another open stream at once, or on the next
to open; otherwise the receiver would hold the transfer until its transfer_timeout."""

from __future__ import annotations

from kvwire.errors import ErrorCode, TransferAbortedError, TransferTimeoutError
from kvwire.session.sender import RESETS_KEPT, StreamOpened, TransferFailed

from .test_sender_core import begin, chunk, harness


def _lose_stream(h, index: int) -> None:  # type: ignore[no-untyped-def]
    """Slot ``index``'s connection breaks before what the client handed it was written:
    the server never reads it."""
    h.core.receive_data(index, b"", h.now)  # EOF: what the core had queued on it is its tail
    h.core.data_to_send(index)  # (written to a dead socket)
    h.servers.pop(index).receive_data(b"")
    h.received = [r for r in h.received if r[0] != index]
    h.step()


def _reconnect(h) -> None:  # type: ignore[no-untyped-def]
    h.now = h.core.get_timer() or h.now  # the reconnect backoff
    h.core.handle_timer(h.now)
    h.step()


def test_a_reset_lost_with_its_stream_goes_again_on_the_reconnected_stream() -> None:
    h = harness(reconnect_backoff=0.1)
    tid = begin(h, layers=2)
    h.core.add_chunk(tid, chunk(tid, 0, 0, 0))
    h.step()
    h.core.abort(tid, TransferAbortedError("cancelled"))  # handed to stream 0, not yet written
    _lose_stream(h, 0)
    assert h.resets == [] and isinstance(h.of(TransferFailed)[0].error, TransferAbortedError)
    _reconnect(h)
    assert h.core.open_streams == [0] and h.of(StreamOpened)[-1].reconnect
    assert h.resets == [(0, tid)]


def test_a_reset_lost_with_its_stream_goes_again_on_another_open_stream_at_once() -> None:
    h = harness(streams=2, reconnect_backoff=60.0)
    tid = begin(h, layers=2)
    h.core.abort(tid, TransferTimeoutError("too slow"))  # on stream 0, the first open one
    _lose_stream(h, 0)
    assert h.core.open_streams == [1]
    assert h.resets == [(1, tid)]
    h.core.abort(tid, TransferAbortedError("again"))  # (nothing more for a failed transfer)
    h.step()
    assert h.resets == [(1, tid)]


def test_a_reset_goes_again_each_time_the_stream_carrying_it_breaks() -> None:
    h = harness(reconnect_backoff=0.1)
    tid = begin(h, layers=2)
    h.core.abort(tid, TransferAbortedError("cancelled"))
    for _ in range(2):
        _lose_stream(h, 0)
        _reconnect(h)
        assert h.resets[-1] == (0, tid)
        h.resets.clear()
        h.core.data_to_send(0)  # (nothing left over)
    h.kill(0)  # once more, its RESET read this time: sent again anyway (the server ignores it)
    _reconnect(h)
    assert h.resets == [(0, tid)]


def test_a_reset_the_server_answered_with_its_own_is_not_sent_again() -> None:
    h = harness(reconnect_backoff=0.1)
    tid = begin(h, layers=2)
    h.core.abort(tid, TransferAbortedError("cancelled"))
    h.step()
    assert h.resets == [(0, tid)]
    h.servers[0].send_reset(tid, ErrorCode.CANCELLED, "already failed")  # it has failed it
    h.step()
    h.kill(0)
    _reconnect(h)
    assert h.resets == [(0, tid)]


def test_only_the_latest_resets_are_kept() -> None:
    h = harness(reconnect_backoff=0.1)
    tids = [begin(h, layers=1) for _ in range(RESETS_KEPT + 3)]
    for tid in tids:
        h.core.abort(tid, TransferAbortedError("cancelled"))
    _lose_stream(h, 0)
    _reconnect(h)
    assert [tid for _, tid in h.resets] == tids[3:]


def test_an_accept_of_a_transfer_this_side_reset_is_answered_by_the_reset_again() -> None:
    """The transfer's BEGIN went again on another stream after a break and the receiver
    read it after the RESET (which found no such transfer then): its ACCEPT, or a CREDIT,
    is answered by the RESET again on that stream, so the receiver fails the transfer."""
    h = harness(streams=2)
    tid = begin(h, layers=2)
    h.core.abort(tid, TransferAbortedError("cancelled"))
    h.step()
    assert h.resets == [(0, tid), (1, tid)]  # on every open stream
    h.servers[1].send_accept(tid, 1)
    h.step()
    assert h.resets == [(0, tid), (1, tid), (1, tid)]
    h.servers[0].send_credit_frame(tid, 2)
    h.step()
    assert h.resets == [(0, tid), (1, tid), (1, tid), (0, tid)]
    h.servers[1].send_accept(tid + 1, 1)  # a transfer this side never had: nothing to say
    h.step()
    assert len(h.resets) == 4 and len(h.of(TransferFailed)) == 1
