"""A server that closes the session with a clean GOAWAY on its streams (kvwire's does as it
shuts down): the sender's transfers fail with the GOAWAY's reason, whatever the timing:
the server's RESET for a transfer it held says the same, but a transfer whose BEGIN had
not reached it (nothing there to reset) failed with "stream N closed"."""

from __future__ import annotations

import pytest

from kvwire.errors import ConnectionLostError, ErrorCode
from kvwire.session.sender import SessionFailed, TransferFailed
from tests.session.sender_harness import Harness, harness

REASON = "the server is shutting down"


def _begun_not_accepted(h: Harness, request_id: str = "r") -> int:
    """A transfer whose BEGIN is queued on the streams but has not reached the server."""
    tid = h.core.begin(request_id, num_layers=2, num_kv_heads=1, head_dim=8, now=h.now)
    assert not h.core.accepted(tid)
    return tid


def _goodbye(h: Harness, *indices: int) -> None:
    """The server closes streams ``indices`` at once with its clean GOAWAY; what the
    client had written to them and the server had not read is lost with them."""
    for i in indices:
        h.servers[i].close(ErrorCode.NO_ERROR, REASON)
    h.step()


@pytest.mark.parametrize("streams", [1, 2, 4])
def test_a_transfer_not_yet_accepted_fails_with_the_servers_goaway_reason(streams: int) -> None:
    h = harness(streams=streams)
    tid = _begun_not_accepted(h)
    _goodbye(h, *range(streams))  # as kvwire's server does as it shuts down
    assert not h.core.accepted(tid)
    [failed] = h.of(TransferFailed)
    assert failed.transfer_id == tid and not failed.by_peer
    assert isinstance(failed.error, ConnectionLostError)
    assert str(failed.error) == f"transfer 'r': {REASON}"
    assert failed.error.code == ErrorCode.SESSION_LOST
    assert isinstance(h.core.broken, ConnectionLostError) and str(h.core.broken) == REASON
    assert [str(e.error) for e in h.of(SessionFailed)] == [REASON]
    assert h.core.open_streams == []


def test_each_transfer_is_named_and_one_the_server_held_keeps_its_reset() -> None:
    """A transfer the server reset first keeps the RESET's error; the others fail with
    the GOAWAY's reason under their own request id."""
    h = harness(streams=2)
    held = h.core.begin("held", num_layers=2, num_kv_heads=1, head_dim=8, now=h.now)
    h.step()
    assert h.core.accepted(held)
    h.servers[0].send_reset(held, ErrorCode.SESSION_LOST, f"transfer 'held': {REASON}")
    h.step()
    waiting = _begun_not_accepted(h, "waiting")
    _goodbye(h, 0, 1)
    errors = {e.transfer_id: e.error for e in h.of(TransferFailed)}
    assert set(errors) == {held, waiting}
    assert all(isinstance(e, ConnectionLostError) for e in errors.values())
    assert str(errors[held]) == f"transfer 'held': {REASON}"
    assert str(errors[waiting]) == f"transfer 'waiting': {REASON}"


def test_a_stream_that_breaks_after_the_goodbye_and_cannot_resume_still_says_why() -> None:
    """The GOAWAY on one stream is read, the other stream's lost (an EOF: its GOAWAY
    dropped with a TCP reset); that stream cannot reconnect (the server stopped
    listening): the session is lost for the reason the server gave."""
    h = harness(streams=2, reconnect_attempts=2, reconnect_backoff=0.1)
    tid = _begun_not_accepted(h)
    _goodbye(h, 0)
    assert h.core.broken is None
    h.unreachable.update({0, 1})
    h.kill(1)
    h.advance(60.0)
    [failed] = h.of(TransferFailed)
    assert failed.transfer_id == tid and isinstance(failed.error, ConnectionLostError)
    assert str(failed.error) == f"transfer 'r': {REASON}"


def test_a_stream_opened_after_a_goodbye_forgets_it() -> None:
    """A server that took a stream after its clean GOAWAY on another was not closing:
    a session lost later is lost for its own reason."""
    h = harness(streams=2, reconnect_attempts=1, reconnect_backoff=0.1)
    _goodbye(h, 1)
    h.kill(0)  # a break: stream 0 reconnects
    h.advance(1.0)
    assert h.core.open_streams == [0] and h.core.broken is None
    _begun_not_accepted(h)
    h.unreachable.add(0)
    h.kill(0)
    h.advance(60.0)
    [failed] = h.of(TransferFailed)
    assert REASON not in str(failed.error) and "could not resume the session" in str(failed.error)


def test_a_goodbye_without_a_message_still_says_the_server_closed_the_session() -> None:
    h = harness(streams=1)
    _begun_not_accepted(h)
    h.servers[0].close(ErrorCode.NO_ERROR, "")
    h.step()
    [failed] = h.of(TransferFailed)
    assert str(failed.error) == "transfer 'r': the server closed the session"
