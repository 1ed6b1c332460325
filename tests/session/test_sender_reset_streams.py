"""A transfer the client fails is RESET on every open stream of its session, not only on
the first: a send times out most often because a stream is stuck, and a RESET queued on
that stream behind its unread bytes reached the receiver only once the stream broke (the
idle timeout, 30 s by default), or never if the client closed first (the receiver then
failed the transfer with ConnectionLostError, not TransferTimeoutError), while the
receiving application waited and the server held the transfer's buffer.

The receiver fails the transfer at the first copy it reads and ignores the others
(docs/protocol.md 10: a RESET for a transfer that failed already, or that it does not
have, is ignored): no second failure, no count, no answer, no GOAWAY."""

from __future__ import annotations

from kvwire.errors import ErrorCode, TransferAbortedError, TransferTimeoutError
from kvwire.session.receiver import ReceiverConfig, TransferAborted, TransferArrived
from kvwire.session.receiver import TransferFailed as IncomingFailed
from kvwire.session.sender import SenderConfig, SenderEvent, TransferDone, TransferFailed
from kvwire.testing.session_pair import SessionPair
from kvwire.wire import Chunk, ConnectionClosed, State, TransferAccepted, TransferReset
from kvwire.wire.frames import FrameType

from .test_receiver_core import Harness as ReceiverHarness
from .test_receiver_core import begin as begin_frame
from .test_receiver_core import chunk as receiver_chunk
from .test_receiver_resend_on_close import events_of, two_streams
from .test_sender_core import begin, chunk, harness
from .test_sender_resets import _lose_stream, _reconnect

# -- the sender core -------------------------------------------------------------------------


def test_a_transfer_timing_out_while_stream_0_is_stalled_is_reset_on_stream_1_too() -> None:
    h = harness(streams=2, idle_timeout=None)
    tid = begin(h, layers=2, timeout=5.0)
    for i in range(4):
        h.core.add_chunk(tid, chunk(tid, 0, 0, i))
    h.step()
    assert {e for e, _ in h.received} == {0, 1}  # both streams carry its chunks
    stalled = h.servers.pop(0)  # stream 0 is stuck: nothing written on it is read any more
    for i in range(4, 12):
        h.core.add_chunk(tid, chunk(tid, 0, 0, i))
    h.step()
    h.now = 5.0
    h.core.handle_timer(h.now)
    h.step()
    [failed] = h.of(TransferFailed)
    assert failed.transfer_id == tid and isinstance(failed.error, TransferTimeoutError)
    assert h.resets == [(1, tid)]  # the receiver reads it on the stream that moves
    # the stalled stream has it too, behind its unread chunks: read at last, it is ignored
    stalled.receive_data(h.core.data_to_send(0), h.now)
    late = [e for e in iter(stalled.next_event, None) if isinstance(e, TransferReset)]
    assert [(e.transfer_id, e.code) for e in late] == [(tid, ErrorCode.TIMEOUT)]


def test_a_reset_goes_on_every_open_stream_and_only_once_on_each() -> None:
    h = harness(streams=3, reconnect_backoff=60.0)
    tid = begin(h, layers=2)
    h.core.abort(tid, TransferAbortedError("cancelled"))
    h.step()
    assert sorted(h.resets) == [(0, tid), (1, tid), (2, tid)]
    h.core.abort(tid, TransferAbortedError("again"))  # a failed transfer: nothing more
    h.step()
    assert len(h.resets) == 3 and len(h.of(TransferFailed)) == 1


def test_a_break_of_one_stream_carrying_it_says_it_again_only_once_none_open_carries_it() -> None:
    """The re-send after a break stays as the fallback: a stream that breaks with the RESET
    unread loses nothing while another open stream carries it; once none does, it goes
    again (on every stream open then, or else on the next to open)."""
    h = harness(streams=2, reconnect_backoff=0.1)
    tid = begin(h, layers=2)
    h.core.abort(tid, TransferAbortedError("cancelled"))
    _lose_stream(h, 0)  # its copy is lost; stream 1 carries one
    assert h.resets == [(1, tid)]
    _reconnect(h)  # stream 0 is back: the RESET is not said again there
    assert h.core.open_streams == [0, 1] and h.resets == [(1, tid)]
    h.resets.clear()
    h.kill(1)  # the last stream carrying it breaks: said again on the one open (0)
    assert h.resets == [(0, tid)]
    h.resets.clear()
    _reconnect(h)  # stream 1 rejoins: stream 0 carries it, nothing more
    assert h.resets == []
    assert len(h.of(TransferFailed)) == 1


def test_a_reset_the_server_answered_is_not_said_again_on_any_stream() -> None:
    h = harness(streams=2, reconnect_backoff=0.1)
    tid = begin(h, layers=2)
    h.core.abort(tid, TransferAbortedError("cancelled"))
    h.step()
    h.servers[1].send_reset(tid, ErrorCode.CANCELLED, "already failed")  # it has failed it
    h.step()
    h.resets.clear()
    h.kill(0)
    h.kill(1)
    _reconnect(h)
    _reconnect(h)
    assert h.resets == [] and len(h.of(TransferFailed)) == 1
    assert h.core.counters["transfers_reset_by_peer"] == 0


def test_a_break_of_the_stream_that_carried_its_unanswered_begin_says_it_again_on_every_open_one() -> None:
    """The receiver may have read the copy on another stream before that BEGIN (ignored
    then) and answered the BEGIN with an ACCEPT lost with the stream: the RESET goes again
    on every open stream although one still carries it.  Only the first break of that
    stream does so; the rule for the others stays (said again once none carries it)."""
    h = harness(streams=3, reconnect_backoff=0.1)
    h.hold_accept = True  # the BEGIN stays unanswered
    tid = begin(h, layers=2)
    h.core.abort(tid, TransferAbortedError("cancelled"))
    h.step()
    assert sorted(h.resets) == [(0, tid), (1, tid), (2, tid)]
    h.resets.clear()
    h.kill(0)  # it carried the BEGIN: said again on 1 and 2, which carry copies already
    assert sorted(h.resets) == [(1, tid), (2, tid)]
    h.resets.clear()
    _reconnect(h)  # stream 0 rejoins: others carry it, nothing goes there
    assert h.core.open_streams == [0, 1, 2] and h.resets == []
    h.kill(1)  # it never carried the BEGIN, and stream 2 carries the RESET: nothing
    assert h.resets == []
    h.kill(2)  # none carries it now: said again on the one open (0)
    assert h.resets == [(0, tid)]
    assert len(h.of(TransferFailed)) == 1


def test_an_accepted_transfer_s_reset_goes_again_only_once_none_open_carries_it() -> None:
    """With the BEGIN answered the receiver has the transfer: any copy it reads fails it,
    so a break of the stream the BEGIN went on loses nothing while another carries one."""
    h = harness(streams=2, reconnect_backoff=0.1)
    tid = begin(h, layers=2)
    assert h.core.accepted(tid)
    h.core.abort(tid, TransferAbortedError("cancelled"))
    h.step()
    h.resets.clear()
    h.kill(0)
    assert h.resets == []


# -- the receiver core: a duplicate is ignored -----------------------------------------------


def test_the_receiver_fails_a_transfer_once_for_copies_of_its_reset_on_two_streams() -> None:
    h, second = two_streams()
    h.client.send_begin(begin_frame(layers=2))
    h.pump()
    h.send(receiver_chunk(layer=0, kind=0))
    key = h.key
    h.core.claim(key, h.now)
    h.events.clear()
    # the copy on stream 1 is read first; stream 0's, behind a chunk, later
    second.send_reset(1, ErrorCode.TIMEOUT, "transfer 'r' did not complete in 2 s")
    h.core.receive_data(2, b"".join(bytes(p) for p in second.data_to_send()), h.now)
    h.pump()
    [failed] = h.of(IncomingFailed)
    assert isinstance(failed.error, TransferTimeoutError) and failed.error.code == ErrorCode.TIMEOUT
    h.send(receiver_chunk(layer=0, kind=1))  # stream 0's bytes, read now: a chunk in flight ...
    h.client.send_reset(1, ErrorCode.TIMEOUT, "transfer 'r' did not complete in 2 s")  # ... its copy
    h.pump()
    h.client.send_reset(1, ErrorCode.TIMEOUT, "once more")
    h.pump()
    assert len(h.of(IncomingFailed)) == 1 and len(h.of(TransferAborted)) == 1
    assert h.core.counters["transfers_aborted_by_peer"] == 1
    # neither stream is closed, no GOAWAY; the chunk read after the failure gets the
    # RESET of a failed transfer and its ACK, as any chunk of it does (9.1)
    assert h.client.state is State.OPEN and second.state is State.OPEN and h.core.sessions == 1
    assert not h.client_of(ConnectionClosed) and not [
        e for e in events_of(h.core, 2, second, h.now) if isinstance(e, ConnectionClosed | TransferReset)]
    assert [e.transfer_id for e in h.client_of(TransferReset)] == [1]
    assert h.core.buffered_bytes == 0
    # the session goes on
    h.client.send_begin(begin_frame(tid=2, request="next"))
    h.pump()
    assert [e.request_id for e in h.of(TransferArrived)] == ["next"]


def test_the_receiver_ignores_a_copy_that_arrives_before_the_transfers_begin() -> None:
    """Stream 0 carries the BEGIN and is stalled; the copy on stream 1 names a transfer the
    server does not have yet: ignored (the BEGIN, read later, is answered by ACCEPT, which
    the client answers with the RESET again on that stream)."""
    h, second = two_streams()
    second.send_reset(1, ErrorCode.TIMEOUT, "transfer 'r' did not complete in 2 s")
    h.core.receive_data(2, b"".join(bytes(p) for p in second.data_to_send()), h.now)
    h.pump()
    assert not h.of(IncomingFailed) and h.core.counters["transfers_aborted_by_peer"] == 0
    h.client.send_begin(begin_frame(layers=2))
    h.pump()
    assert h.client_of(TransferAccepted) and h.of(TransferArrived)
    assert second.state is State.OPEN and h.client.state is State.OPEN
    h.client.send_reset(1, ErrorCode.TIMEOUT, "again")
    h.pump()
    assert [type(e.error) for e in h.of(IncomingFailed)] == [TransferTimeoutError]


def test_a_single_stream_harness_still_ignores_a_reset_for_no_transfer() -> None:
    h = ReceiverHarness()
    h.client.send_reset(9, ErrorCode.TIMEOUT, "nothing of that id")
    h.pump()
    assert h.client.state is State.OPEN and not h.client_of(ConnectionClosed) and not h.of(IncomingFailed)


# -- both cores ------------------------------------------------------------------------------

SECRET = b"session-secret-01"
HEADS, HEAD_DIM = 2, 8
BPT = HEADS * HEAD_DIM * 2


def _pair(**sender: object) -> SessionPair:
    """Two streams that never time out when idle (a stalled stream stays open); the
    server's transfer_timeout far off, so only the client's RESET can fail a transfer."""
    scfg = SenderConfig(secret=SECRET, streams=2, max_frame_size=64 * 1024, idle_timeout=None,
                        **sender)  # type: ignore[arg-type]
    rcfg = ReceiverConfig(secret=SECRET, max_frame_size=64 * 1024, window=128 * 1024, idle_timeout=None,
                          resume_timeout=5.0, transfer_timeout=1000.0)
    pair = SessionPair(scfg, rcfg)
    pair.run(until=0.5)
    assert pair.sender.open_streams == [0, 1]
    return pair


def _chunks(pair: SessionPair, tid: int, layer: int, tokens: int = 64, per: int = 8) -> None:
    for kind in (0, 1):
        for start in range(0, tokens, per):
            pair.sender.add_chunk(tid, Chunk(
                transfer_id=tid, layer=layer, kind=kind, codec_id=0, token_start=start, token_count=per,
                layer_tokens=tokens, params=b"", payload=bytes(per * BPT)))


def _resets_read(pair: SessionPair) -> dict[int, int]:
    """RESET frames the receiver reads, by connection id (counted as they are read)."""
    counts: dict[int, int] = {}
    receive = pair.receiver.receive_data

    def spy(cid: int, data: bytes, now: float) -> None:
        if data[:1] == bytes([FrameType.RESET]):
            counts[cid] = counts.get(cid, 0) + 1
        receive(cid, data, now)

    pair.receiver.receive_data = spy  # type: ignore[method-assign]
    return counts


def _sender_events(pair: SessionPair) -> list[SenderEvent]:
    seen: list[SenderEvent] = []
    next_event = pair.sender.next_event

    def spy() -> SenderEvent | None:
        ev = next_event()
        if ev is not None:
            seen.append(ev)
        return ev

    pair.sender.next_event = spy  # type: ignore[method-assign]
    return seen


def test_the_receiver_learns_of_a_timeout_at_once_while_stream_0_is_stalled() -> None:
    pair = _pair()
    tid = pair.sender.begin("x", num_layers=4, num_kv_heads=HEADS, head_dim=HEAD_DIM, now=pair.clock.now,
                            timeout=2.0)
    _chunks(pair, tid, 0)
    pair.run(until=0.6)
    assert "x" in pair.keys  # the server has it
    pair.links[0].blackholed = True  # stream 0 is stuck both ways from now on, and stays open
    _chunks(pair, tid, 1)
    pair.run(until=10.0)
    outcome = pair.outcomes[tid]
    assert isinstance(outcome, TransferFailed) and isinstance(outcome.error, TransferTimeoutError)
    # the receiver read it on stream 1 (idle timeouts are off and the server's own deadline
    # is far off: nothing else could fail it)
    assert isinstance(pair.failed_incoming.get("x"), TransferTimeoutError)
    # nothing broke: the peer stays open on both streams
    assert pair.sender.broken is None and pair.sender.open_streams == [0, 1]
    assert pair.receiver.sessions == 1 and pair.receiver.buffered_bytes == 0


def test_copies_read_on_both_streams_fail_the_transfer_once_on_each_side() -> None:
    pair = _pair()
    resets = _resets_read(pair)
    events = _sender_events(pair)
    tid = pair.sender.begin("y", num_layers=4, num_kv_heads=HEADS, head_dim=HEAD_DIM, now=pair.clock.now,
                            timeout=2.0)
    _chunks(pair, tid, 0)  # the producer never finishes: the deadline passes
    pair.run(until=10.0)
    assert sorted(resets.values()) == [1, 1]  # one copy read on each stream
    assert isinstance(pair.failed_incoming.get("y"), TransferTimeoutError)
    assert pair.receiver.counters["transfers_aborted_by_peer"] == 1
    assert [e.transfer_id for e in events if isinstance(e, TransferFailed)] == [tid]
    assert pair.sender.counters["transfers_reset_by_peer"] == 0
    assert pair.sender.counters["goaways_received"] == 0 and pair.sender.counters["resumes"] == 0
    # the session goes on
    nxt = pair.sender.begin("z", num_layers=1, num_kv_heads=HEADS, head_dim=HEAD_DIM, now=pair.clock.now)
    _chunks(pair, nxt, 0)
    pair.sender.producer_done(nxt)
    pair.run(until=20.0)
    assert isinstance(pair.outcomes[nxt], TransferDone)
    assert sorted(resets.values()) == [1, 1] and pair.sender.open_streams == [0, 1]


def test_a_reset_read_before_the_begin_goes_again_when_the_begins_stream_breaks() -> None:
    """Stream 0 carries the BEGIN and is slow; the client gives the transfer up, and the
    receiver reads the RESET's copy on stream 1 first (a transfer it does not have yet:
    ignored), then the BEGIN on stream 0 (it answers ACCEPT there), and stream 0 breaks
    before its own copy is read, the ACCEPT lost with it.  Stream 1 still carried a copy,
    so the RESET was not said again, nothing told the client the receiver had the
    transfer, and the receiver held it until its transfer_timeout.  A stream that carried
    the BEGIN unanswered breaking now sends the RESET again on every open stream."""
    pair = _pair(reconnect_backoff=0.05)
    resets = _resets_read(pair)
    now = pair.clock.now
    link0, link1 = pair.links[0], pair.links[1]
    tid = pair.sender.begin("race", num_layers=2, num_kv_heads=HEADS, head_dim=HEAD_DIM, now=now)
    begin0 = pair.sender.data_to_send(0)  # the BEGIN, on stream 0 (slow: held here)
    assert begin0[:1] == bytes([FrameType.BEGIN]) and pair.sender.data_to_send(1) == b""
    pair.sender.abort(tid, TransferAbortedError("cancelled by the app"))
    assert pair.sender.data_to_send(0)[:1] == bytes([FrameType.RESET])  # behind the BEGIN: lost below
    reset1 = pair.sender.data_to_send(1)
    assert reset1[:1] == bytes([FrameType.RESET])
    pair.receiver.receive_data(link1.cid, reset1, now)  # read first: no such transfer, ignored
    assert pair.receiver.next_event() is None and pair.receiver.counters["transfers_aborted_by_peer"] == 0
    pair.receiver.receive_data(link0.cid, begin0, now)  # then the BEGIN: the receiver has it
    assert pair.receiver.data_to_send(link0.cid)  # its ACCEPT, on stream 0: lost with it
    assert pair.receiver.data_to_send(link1.cid) == b""
    pair._close(link0)  # stream 0 breaks both ways before its RESET copy is read
    pair.run(until=5.0)  # the server's transfer_timeout (1000 s) is far off
    assert isinstance(pair.failed_incoming.get("race"), TransferAbortedError)
    assert pair.receiver.counters["transfers_aborted_by_peer"] == 1
    assert pair.receiver.buffered_bytes == 0
    assert resets[link1.cid] == 2  # the first copy on stream 1, ignored; the one sent after the break
    assert isinstance(pair.outcomes[tid], TransferFailed)
    assert pair.sender.broken is None and pair.sender.open_streams == [0, 1]
