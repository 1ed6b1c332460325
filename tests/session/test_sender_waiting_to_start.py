"""A send whose BEGIN the server does not answer (it holds ACCEPT while its buffer budget
has no room, docs/protocol.md 7.1): the client core counts it as waiting to start, and
its timeout says that it never started rather than only that it did not complete."""

from __future__ import annotations

from kvwire.errors import TransferTimeoutError
from kvwire.session.sender import TransferFailed
from tests.session.sender_harness import begin, harness


def test_a_send_not_accepted_is_counted_and_its_timeout_says_it_never_started() -> None:
    h = harness()
    h.hold_accept = True
    tid = begin(h, timeout=2.0)
    assert h.core.transfers == 1 and h.core.waiting_to_start == 1
    h.advance(2.0)
    [failed] = h.of(TransferFailed)
    assert failed.transfer_id == tid and isinstance(failed.error, TransferTimeoutError)
    assert "did not complete in 2.0 s: the server never answered its BEGIN" in str(failed.error)
    assert h.core.transfers == 0 and h.core.waiting_to_start == 0


def test_an_accepted_send_is_not_waiting_and_its_timeout_says_only_not_complete() -> None:
    h = harness()
    tid = begin(h, timeout=2.0)
    assert h.core.transfers == 1 and h.core.waiting_to_start == 0
    h.advance(2.0)
    [failed] = h.of(TransferFailed)
    assert failed.transfer_id == tid
    assert str(failed.error) == "transfer 'r' did not complete in 2.0 s"


def test_a_timeout_names_a_long_request_id_shortened() -> None:
    """An id may be 65535 bytes; the message quotes at most QUOTED_ID_LIMIT characters of it."""
    from kvwire.session.quoting import QUOTED_ID_LIMIT

    h = harness()
    tid = h.core.begin("x" * 60000, num_layers=2, num_kv_heads=1, head_dim=8, now=h.now, timeout=2.0)
    h.step()
    h.advance(2.0)
    [failed] = h.of(TransferFailed)
    assert failed.transfer_id == tid and isinstance(failed.error, TransferTimeoutError)
    assert "did not complete in 2.0 s" in str(failed.error)
    assert len(str(failed.error)) < QUOTED_ID_LIMIT + 200
