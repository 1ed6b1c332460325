"""A reconnect the server refuses with GOAWAY(UNKNOWN_SESSION) (it restarted, or the
session's resume_timeout passed) fails every transfer saying so: ``transfer '<request
id>': the server no longer has this session (restarted, or resume_timeout passed): <the
server's message>``, as a clean GOAWAY's loss names each transfer, instead of the server's
bare "no such session".  The error's type and code are the server's (ConnectionLostError,
UNKNOWN_SESSION); the session's own error is its message as before."""

from __future__ import annotations

from kvwire.errors import ConnectionLostError, ErrorCode
from kvwire.session.receiver import ReceiverConfig
from kvwire.session.sender import SenderConfig, SessionFailed, TransferFailed
from kvwire.testing.session_pair import SessionPair
from kvwire.wire import Chunk

from .test_sender_core import chunk, harness

WHY = "the server no longer has this session (restarted, or resume_timeout passed)"


def test_a_reconnect_refused_with_unknown_session_fails_each_transfer_naming_it() -> None:
    h = harness(reconnect_backoff=0.1)
    first = h.core.begin("prefill-1", num_layers=1, num_kv_heads=1, head_dim=8, now=h.now)
    second = h.core.begin("prefill-2", num_layers=1, num_kv_heads=1, head_dim=8, now=h.now)
    h.step()
    h.core.add_chunk(first, chunk(first, 0, 0, 0))
    h.step()
    h.refuse[0] = ErrorCode.UNKNOWN_SESSION  # the server restarted: its reconnect is refused
    h.kill(0)
    h.advance(h.now + 1.0)
    failed = {e.transfer_id: e.error for e in h.of(TransferFailed)}
    assert set(failed) == {first, second}
    for tid, rid in ((first, "prefill-1"), (second, "prefill-2")):
        err = failed[tid]
        assert type(err) is ConnectionLostError and err.code == ErrorCode.UNKNOWN_SESSION
        assert str(err) == f"transfer '{rid}': {WHY}: refused"
    [lost] = h.of(SessionFailed)
    assert str(lost.error) == "refused" and lost.error.code == ErrorCode.UNKNOWN_SESSION


def test_a_receiver_restart_mid_transfer_says_the_server_no_longer_has_the_session() -> None:
    secret = b"session-secret-01"
    pair = SessionPair(SenderConfig(secret=secret, streams=1, reconnect_backoff=0.1, idle_timeout=4.0),
                       ReceiverConfig(secret=secret, idle_timeout=4.0), restart_at=frozenset({8}))
    pair.run(until=0.5)
    tid = pair.sender.begin("rs", num_layers=2, num_kv_heads=2, head_dim=8, now=pair.clock.now)
    for layer in range(2):
        for kind in (0, 1):
            for start in range(0, 40, 8):
                pair.sender.add_chunk(tid, Chunk(transfer_id=tid, layer=layer, kind=kind, codec_id=0,
                                                 token_start=start, token_count=8, layer_tokens=40,
                                                 params=b"", payload=bytes(8 * 32)))
    pair.sender.producer_done(tid)
    pair.run(until=60.0)
    outcome = pair.outcomes[tid]
    assert isinstance(outcome, TransferFailed)
    assert type(outcome.error) is ConnectionLostError and outcome.error.code == ErrorCode.UNKNOWN_SESSION
    assert str(outcome.error) == f"transfer 'rs': {WHY}: no such session"
