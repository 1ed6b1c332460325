"""A transfer given up after max_transfer_reconnects broken streams is named by its
request id, quoted as every other per-transfer error of the session names it
(``transfer '<request id>': ...``), not by the session's internal transfer number (and one
broken stream is a stream, not "1 broken streams")."""

from __future__ import annotations

from kvwire.errors import ConnectionLostError
from kvwire.session.quoting import quoted_id
from kvwire.session.sender import TransferFailed

from .test_sender_core import harness


def test_a_transfer_given_up_after_its_broken_streams_is_named_by_its_request_id() -> None:
    h = harness(streams=2, reconnect_backoff=0.01, max_transfer_reconnects=0)
    h.hold_accept = True
    tid = h.core.begin("prefill-42", num_layers=1, num_kv_heads=1, head_dim=8, now=h.now)  # on stream 0
    h.step()
    h.kill(0)  # its BEGIN was unanswered on it
    [failed] = h.of(TransferFailed)
    assert failed.transfer_id == tid and isinstance(failed.error, ConnectionLostError)
    assert str(failed.error) == ("transfer 'prefill-42': giving up after 1 broken stream "
                                 "(max_transfer_reconnects=0)")


def test_a_long_request_id_is_quoted_shortened() -> None:
    rid = "x" * 5000 + "\n"
    h = harness(streams=2, reconnect_backoff=0.01, max_transfer_reconnects=0)
    h.hold_accept = True
    h.core.begin(rid, num_layers=1, num_kv_heads=1, head_dim=8, now=h.now)
    h.step()
    h.kill(0)
    [failed] = h.of(TransferFailed)
    assert str(failed.error) == (f"transfer {quoted_id(rid)}: giving up after 1 broken stream "
                                 "(max_transfer_reconnects=0)")
    assert len(str(failed.error)) < 200
