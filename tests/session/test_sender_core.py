"""SenderCore's hooks for the I/O layer, with a fake clock and hand-driven receiver
connections: handshake results, the in-flight limit, the active-stream limit, writability,
delivery/loss events, credit queries, counters, RESET reasons and the session's end."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.errors import (
    AuthenticationError,
    ConnectionLostError,
    ErrorCode,
    LimitExceededError,
    TransferAbortedError,
    TransferTimeoutError,
    UsageError,
)
from kvwire.session.meta import parse_meta
from kvwire.session.sender import (
    ChunkDelivered,
    ChunkLost,
    ChunkSent,
    ReceiverCosts,
    SenderConfig,
    SenderCore,
    SessionFailed,
    StreamClosed,
    StreamGivenUp,
    StreamOpened,
    StreamWanted,
    TransferCredit,
    TransferDone,
    TransferFailed,
    begin_fields,
)
from kvwire.wire import (
    BlockVersion,
    Chunk,
    DecodeCost,
    Pong,
    Report,
    TransferReset,
    frame_bytes,
)
from kvwire.wire.frames import DEFAULT_CHUNK_BYTES, DEFAULT_MAX_FRAME_SIZE, DEFAULT_WINDOW, Reset
from tests.session.sender_harness import (
    FINGERPRINT,
    SECRET,
    SESSION,
    WINDOW,
    Harness,
    begin,
    harness,
)


def chunk(tid: int, layer: int, kind: int, start: int, size: int = 1000) -> Chunk:
    return Chunk(transfer_id=tid, layer=layer, kind=kind, codec_id=0, token_start=start, token_count=1,
                 layer_tokens=1 << 20, params=b"", payload=bytes(size))


def test_handshake_results_and_fingerprint_are_exposed() -> None:
    h = harness(streams=3)
    assert h.core.open_streams == [0, 1, 2]
    assert h.core.session_id == SESSION
    assert h.core.peer_codecs == ("raw", "fp8")
    assert h.core.max_transfers == 7
    assert h.core.peer_max_frame_size == 128 * 1024
    assert all(hello.fingerprint == FINGERPRINT for hello in h.hellos)
    opened = h.of(StreamOpened)
    assert sorted(e.index for e in opened) == [0, 1, 2]
    assert not any(e.reconnect for e in opened)


def test_credit_events_and_queries() -> None:
    h = harness()
    h.layer_limit = 2
    tid = begin(h)
    assert h.core.accepted(tid) and h.core.layer_limit(tid) == 2
    assert h.of(TransferCredit) == [TransferCredit(transfer_id=tid, layer_limit=2)]
    h.core.add_chunk(tid, chunk(tid, 2, 0, 0), kv_bytes=10)  # not granted yet: stays queued
    h.step()
    assert h.core.queued_bytes(tid) > 0 and not h.of(ChunkSent)
    h.servers[0].send_credit_frame(tid, 3)
    h.step()
    assert h.core.layer_limit(tid) == 3 and h.core.queued_bytes(tid) == 0
    [sent] = h.of(ChunkSent)
    assert sent.kv_bytes == 10 and sent.stream == 0 and not sent.queued
    assert h.core.accepted(999) is False and h.core.layer_limit(999) == 0


def test_delivery_events_carry_stream_sizes_and_kv_bytes_and_the_transfer_ends() -> None:
    h = harness(streams=2)
    tid = begin(h, layers=1)
    for i in range(4):
        h.core.add_chunk(tid, chunk(tid, 0, i % 2, i), kv_bytes=100 + i)
    h.core.producer_done(tid)
    h.step()
    sent = {e.address: e for e in h.of(ChunkSent)}
    h.ack()
    delivered = h.of(ChunkDelivered)
    assert len(delivered) == 4
    for d in delivered:
        assert (d.stream, d.wire_size, d.kv_bytes) == (sent[d.address].stream, sent[d.address].wire_size,
                                                        sent[d.address].kv_bytes)
    [done] = h.of(TransferDone)
    assert done.transfer_id == tid and done.chunks == 4
    assert h.core.bytes_in_flight == 0


def test_the_ack_that_completes_a_layer_says_so_and_each_slot_counts_its_acked_bytes() -> None:
    h = harness(streams=2)
    tid = begin(h, layers=2)
    for layer in range(2):
        for kind in range(2):
            for start in range(2):  # two one-token chunks of a two-token layer, K and V
                h.core.add_chunk(tid, Chunk(transfer_id=tid, layer=layer, kind=kind, codec_id=0,
                                            token_start=start, token_count=1, layer_tokens=2, params=b"",
                                            payload=bytes(100)))
    h.core.producer_done(tid)
    h.step()
    h.ack()
    delivered = h.of(ChunkDelivered)
    assert len(delivered) == 8
    for layer in range(2):
        of_layer = [d for d in delivered if d.address.layer == layer]
        assert [d.layer_done for d in of_layer] == [False, False, False, True]
    for i in range(2):
        assert h.core.acked_bytes(i) == sum(d.wire_size for d in delivered if d.stream == i)


@settings(max_examples=60, deadline=None)
@given(limit=st.integers(min_value=500, max_value=20_000), sizes=st.lists(
    st.integers(min_value=1, max_value=4000), min_size=1, max_size=30), seed=st.integers(0, 1000),
    streams=st.integers(1, 3))
def test_bytes_in_flight_stay_within_the_limit(limit: int, sizes: list[int], seed: int, streams: int) -> None:
    h = harness(streams=streams)
    h.core.inflight_limit = limit
    tid = begin(h, layers=1)
    for i, size in enumerate(sizes):
        h.core.add_chunk(tid, chunk(tid, 0, 0, i, size))
    h.core.producer_done(tid)
    h.step()
    rng = random.Random(seed)
    biggest = max(sizes) + 64
    for _ in range(len(sizes) + 1):
        flight = h.core.bytes_in_flight
        assert flight <= max(limit, biggest)  # an empty flight may always send one chunk
        sent = {e.address for e in h.of(ChunkSent)}
        assert sent, "a chunk always goes when nothing is in flight"
        h.ack(rng.randint(1, 3), order=rng)
    assert h.of(TransferDone)


def test_gate_holds_chunks_until_acks_make_room() -> None:
    h = harness()
    size = len(chunk(1, 0, 0, 0).payload)
    tid = begin(h, layers=1)
    h.core.inflight_limit = 2 * (size + 100)
    for i in range(5):
        h.core.add_chunk(tid, chunk(tid, 0, 0, i))
    h.step()
    assert len(h.of(ChunkSent)) == 2 and h.core.gate_blocked
    h.ack(1)
    assert len(h.of(ChunkSent)) == 3
    assert h.of(ChunkSent)[-1].queued  # more were waiting behind it
    h.core.inflight_limit = None  # the caller lifts the limit, then pumps
    h.core.pump()
    h.step()
    assert len(h.of(ChunkSent)) == 5


def test_chunks_go_only_on_the_active_streams() -> None:
    h = harness(streams=3)
    h.core.active_streams = 1
    tid = begin(h, layers=1)
    for i in range(6):
        h.core.add_chunk(tid, chunk(tid, 0, 0, i))
    h.step()
    assert {e.stream for e in h.of(ChunkSent)} == {0}
    h.core.active_streams = 3
    for i in range(6, 30):
        h.core.add_chunk(tid, chunk(tid, 0, 0, i))
    h.step()
    assert {e.stream for e in h.of(ChunkSent)} == {0, 1, 2}  # striped by most credit


def test_a_slot_in_use_that_is_down_hands_its_share_to_the_next_open_one() -> None:
    """One stream in use (as ``streams="auto"`` starts), and its slot breaks and stays
    down: the chunks go on the next open slot instead of waiting for it."""
    h = harness(streams=2, reconnect_backoff=60.0)
    h.core.active_streams = 1
    tid = begin(h, layers=1)
    h.kill(0)
    assert h.core.open_streams == [1]
    for i in range(4):
        h.core.add_chunk(tid, chunk(tid, 0, 0, i))
    h.core.producer_done(tid)
    h.step()
    assert {e.stream for e in h.of(ChunkSent)} == {1}
    h.ack()
    assert h.of(TransferDone)


def test_streams_in_use_counts_the_open_streams_of_those_in_use() -> None:
    """What ``Peer.active_streams`` reports: the streams chunks go on now, not the slots
    (a slot given up stayed counted).  A slot reconnecting is not counted until it is back."""
    h = harness(streams=3, reconnect_attempts=1, reconnect_backoff=0.1)
    assert h.core.streams_in_use == 3
    h.core.active_streams = 2
    assert h.core.streams_in_use == 2
    h.unreachable.add(2)
    h.kill(2)
    h.advance(10.0)
    assert h.core.is_given_up(2)
    h.core.active_streams = 3
    assert h.core.streams_in_use == 2
    h.core.active_streams = None
    assert h.core.streams_in_use == 2
    h.kill(1)  # reconnects after its backoff
    assert h.core.streams_in_use == 1
    h.advance(20.0)
    assert h.core.open_streams == [0, 1] and h.core.streams_in_use == 2
    tid = begin(h, layers=1)
    for i in range(12):
        h.core.add_chunk(tid, chunk(tid, 0, 0, i))
    h.step()
    assert len({e.stream for e in h.of(ChunkSent)}) == h.core.streams_in_use


def test_a_paused_transport_gets_no_chunks_until_it_resumes() -> None:
    h = harness(streams=2)
    h.core.set_writable(0, False)
    tid = begin(h, layers=1)
    for i in range(4):
        h.core.add_chunk(tid, chunk(tid, 0, 0, i))
    h.step()
    assert {e.stream for e in h.of(ChunkSent)} == {1}
    h.core.set_writable(1, False)
    h.core.add_chunk(tid, chunk(tid, 0, 0, 4))
    h.step()
    assert len(h.of(ChunkSent)) == 4 and h.core.queued_bytes(tid) > 0
    h.core.set_writable(0, True)  # resuming pumps at once
    h.step()
    assert h.of(ChunkSent)[-1].stream == 0 and h.core.queued_bytes(tid) == 0


def test_a_paused_transport_queues_no_pong_per_ping_and_answers_the_last_when_it_resumes() -> None:
    """A server flooding PINGs while it reads nothing: each PING answered at once grew the
    client's send queue without bound (the client goes on reading, for its acks)."""
    h = harness(streams=1)
    h.core.set_writable(0, False)
    srv = h.servers[0]
    for i in range(1, 1001):
        srv.send_ping(i)
    h.core.receive_data(0, b"".join(bytes(p) for p in srv.data_to_send()), h.now)
    assert h.core.data_to_send(0) == b""
    h.core.set_writable(0, True)
    assert h.core.data_to_send(0) == frame_bytes(Pong(opaque=1000))


def test_a_chunk_sent_as_it_was_added_did_not_wait_and_one_held_back_did() -> None:
    """``ChunkSent.waited`` tells the estimator who set the pace: a chunk that went out
    inside its own add_chunk() was paced by the producer; one the transport, credit or the
    in-flight limit held back, by the path."""
    h = harness()
    tid = begin(h, layers=1)
    h.core.add_chunk(tid, chunk(tid, 0, 0, 0))
    h.step()
    h.core.set_writable(0, False)
    h.core.add_chunk(tid, chunk(tid, 0, 0, 1))
    h.step()
    h.core.set_writable(0, True)
    h.step()
    h.core.inflight_limit = 1  # only an empty flight may send
    h.core.add_chunk(tid, chunk(tid, 0, 0, 2))
    h.step()
    h.ack()
    h.core.pump()
    h.step()
    assert [(e.address.token_start, e.waited) for e in h.of(ChunkSent)] == [(0, False), (1, True), (2, True)]


def test_a_broken_stream_reports_its_unacked_chunks_lost_and_they_go_again() -> None:
    h = harness(streams=2, reconnect_backoff=0.1)
    tid = begin(h, layers=1)
    for i in range(6):
        h.core.add_chunk(tid, chunk(tid, 0, 0, i))
    h.core.producer_done(tid)
    h.step()
    on_1 = {e.address for e in h.of(ChunkSent) if e.stream == 1}
    assert on_1
    h.kill(1)
    assert {e.address for e in h.of(ChunkLost)} == on_1
    [closed] = h.of(StreamClosed)
    assert closed.index == 1 and closed.resumed
    assert h.core.counters["resumes"] == 1 and h.core.counters["chunks_resent"] == len(on_1)
    resent = [e for e in h.of(ChunkSent) if e.address in on_1]
    assert len(resent) == 2 * len(on_1) and all(e.stream == 0 for e in resent[len(on_1):])
    h.now = h.core.get_timer() or 0.0  # the reconnect backoff
    h.core.handle_timer(h.now)
    h.step()
    assert h.core.open_streams == [0, 1] and h.core.counters["reconnects"] == 1
    assert h.of(StreamOpened)[-1].reconnect
    h.ack()
    assert h.of(TransferDone)


def test_reset_by_the_receiver_is_failed_with_its_reason_and_counted() -> None:
    h = harness()
    tid = begin(h)
    h.servers[0].send_reset(tid, ErrorCode.LIMIT_EXCEEDED, "no room for you")
    h.step()
    [failed] = h.of(TransferFailed)
    assert failed.by_peer and isinstance(failed.error, LimitExceededError)
    assert "no room for you" in str(failed.error)
    assert h.core.counters["transfers_reset_by_peer"] == 1
    assert h.core.accepted(tid) is False


def test_a_reset_with_no_error_fails_the_transfer_as_a_protocol_error() -> None:
    h = harness()
    tid = begin(h)
    # (as a server of its own would: a kvwire Connection never puts NO_ERROR in a RESET)
    h.servers[0]._queue(Reset(transfer_id=tid, code=ErrorCode.NO_ERROR, message="all good?"))
    h.step()
    [failed] = h.of(TransferFailed)
    assert failed.by_peer and type(failed.error).__name__ == "ProtocolError"
    assert failed.error.code == ErrorCode.PROTOCOL_ERROR and "NO_ERROR" in str(failed.error)


def test_abort_sends_a_reset_and_reports_unacked_chunks_lost() -> None:
    h = harness()
    tid = begin(h, layers=1)
    h.core.add_chunk(tid, chunk(tid, 0, 0, 0))
    h.step()
    h.core.abort(tid, TransferAbortedError("cancelled"))
    up = h.core.data_to_send(0)
    h.servers[0].receive_data(up, h.now)
    resets = [e for e in iter(h.servers[0].next_event, None) if isinstance(e, TransferReset)]
    assert resets and resets[0].code == ErrorCode.CANCELLED
    h.step()
    assert h.of(ChunkLost) and isinstance(h.of(TransferFailed)[0].error, TransferAbortedError)


def test_abort_of_a_transfer_completed_but_not_yet_taken_still_sends_a_reset() -> None:
    """Every chunk acknowledged (TransferDone queued), then the send() is cancelled before
    it took its receipt: it did not succeed, so the receiver is told (it delivered such a
    transfer, 6 of 92 cancelled sends); only once per transfer, and only for one the
    session ran."""
    h = harness()
    tid = begin(h, layers=1)
    h.core.add_chunk(tid, chunk(tid, 0, 0, 0))
    h.core.producer_done(tid)
    h.step()
    h.ack()
    assert h.of(TransferDone) and h.core.transfer(tid) is None and h.resets == []
    h.core.abort(tid, TransferAbortedError("cancelled"))
    h.step()
    assert h.resets == [(0, tid)] and not h.of(TransferFailed)
    h.core.abort(tid, TransferAbortedError("cancelled"))
    h.core.abort(tid + 1, TransferAbortedError("cancelled"))  # never begun
    h.step()
    assert h.resets == [(0, tid)]


def test_a_transfer_that_fails_while_no_stream_is_open_is_reset_on_the_next_that_opens() -> None:
    """Aborted while its only stream is down (a reconnect backing off): the RESET cannot
    go now, so it goes on the stream that opens next, and the receiver lets go of the
    transfer then instead of at its own timeout."""
    h = harness(reconnect_backoff=0.1)
    tid = begin(h, layers=1)
    h.core.add_chunk(tid, chunk(tid, 0, 0, 0))
    h.step()
    h.kill(0)
    assert h.core.open_streams == []
    h.core.abort(tid, TransferAbortedError("cancelled"))
    h.step()
    assert isinstance(h.of(TransferFailed)[0].error, TransferAbortedError) and h.resets == []
    h.now = h.core.get_timer() or 0.0  # the reconnect backoff
    h.core.handle_timer(h.now)
    h.step()
    assert h.core.open_streams == [0] and h.resets == [(0, tid)]


def test_a_begin_lost_with_its_stream_goes_again_on_another() -> None:
    """The stream that carried a BEGIN breaks before the server saw it and does not come
    back (yet): the BEGIN goes again on the stream still open, and the transfer is
    accepted there, without waiting for the broken one to reconnect."""
    h = harness(streams=2, reconnect_backoff=60.0)
    tid = h.core.begin("r", num_layers=1, num_kv_heads=1, head_dim=8, now=h.now)
    h.kill(0)  # the BEGIN queued on stream 0 never reached the server
    assert h.core.open_streams == [1]
    h.step()
    assert h.core.accepted(tid)


def test_a_begin_larger_than_the_peer_frame_limit_is_a_usage_error() -> None:
    h = harness()
    with pytest.raises(UsageError, match="meta and blocks"):
        h.core.begin("big", num_layers=1, num_kv_heads=1, head_dim=8, meta=b"x" * (200 * 1024), now=0.0)
    assert h.core.transfers == 0


def test_chunks_are_planned_to_fit_the_server_frame_limit() -> None:
    """The server here accepts frames of 128 KiB: a larger chunk target shrinks to fit it
    (with room for header, params and an entropy stage), a smaller one is kept."""
    h = harness()
    limit = h.core.peer_max_frame_size
    assert limit == 128 * 1024
    target = h.core.chunk_target(4 << 20)
    assert target < limit and target * 256 // 255 + 4096 <= limit
    assert h.core.chunk_target(8192) == 8192
    assert SenderCore(SenderConfig(secret=SECRET)).chunk_target(4 << 20) == 4 << 20  # no server yet


def test_the_default_chunk_fits_the_default_frame_limit() -> None:
    """A default server's frame limit holds a default chunk whole (with the room
    ``chunk_target`` keeps for the header and an entropy stage's growth), and its window
    two such frames: a chunk split in two by the limit doubles the per-chunk work."""
    core = SenderCore(SenderConfig(secret=SECRET))
    core.peer_max_frame_size = DEFAULT_MAX_FRAME_SIZE  # as a default server's WELCOME sets it
    assert core.chunk_target(DEFAULT_CHUNK_BYTES) == DEFAULT_CHUNK_BYTES
    assert DEFAULT_WINDOW >= 2 * DEFAULT_MAX_FRAME_SIZE


def test_begin_timeout_overrides_the_configured_deadline() -> None:
    h = harness(transfer_timeout=100.0)
    tid = begin(h, timeout=2.0)
    assert h.core.get_timer() is not None and h.core.get_timer() <= 2.0  # type: ignore[operator]
    h.now = 2.0
    h.core.handle_timer(h.now)
    h.step()
    [failed] = h.of(TransferFailed)
    assert failed.transfer_id == tid and isinstance(failed.error, TransferTimeoutError)


def test_a_failed_first_connect_ends_the_session_with_the_given_error() -> None:
    core = SenderCore(SenderConfig(secret=SECRET))
    assert isinstance(core.next_event(), StreamWanted)
    core.stream_failed(0, 0.0, AuthenticationError("certificate"))
    [ev] = list(iter(core.next_event, None))
    assert isinstance(ev, SessionFailed) and isinstance(ev.error, AuthenticationError)
    with pytest.raises(AuthenticationError):
        core.begin("x", num_layers=1, num_kv_heads=1, head_dim=8, now=0.0)


def test_a_wrong_secret_is_counted_and_ends_the_session() -> None:
    core = SenderCore(SenderConfig(secret=b"another-secret!!"))
    h = Harness(core)
    h.step()
    assert isinstance(core.broken, AuthenticationError)
    assert core.counters["authentication_failures"] == 1
    assert h.of(SessionFailed)


def test_a_stream_that_joins_another_session_is_closed() -> None:
    h = harness(streams=1, reconnect_backoff=0.1)
    h.session_id = bytes(16)[:-1] + b"\x01"  # the receiver now answers with another session
    h.kill(0)
    h.now = h.core.get_timer() or 0.0
    h.core.handle_timer(h.now)
    h.step()
    assert h.core.open_streams == []
    assert any(isinstance(e, StreamClosed) and e.closed.code == ErrorCode.PROTOCOL_ERROR for e in h.events)


@pytest.mark.parametrize("welcome, what", [
    (dict(max_frame_size=64 * 1024), "max_frame_size 65536"),
    (dict(max_transfers=3), "max_transfers 3"),
    (dict(codecs=("raw",)), "codecs raw"),
    (dict(codecs=("fp8", "raw")), None),  # the same codecs in another order
    (dict(window=2 * WINDOW), None),  # connection credit is the stream's own
])
def test_a_stream_welcomed_with_other_session_wide_values_loses_the_session(
    welcome: dict[str, object], what: str | None,
) -> None:
    """Chunks are sized and coded by the session's WELCOME values and may go on any
    stream: a join announcing others (here a smaller frame limit, which made send_chunk()
    raise UsageError) is a protocol error, as a version mismatch is."""
    h = Harness(SenderCore(SenderConfig(secret=SECRET, streams=2, codecs=("raw",))))
    h.welcomes[1] = welcome
    h.step()
    if what is None:
        assert h.core.open_streams == [0, 1] and h.core.broken is None
        return
    assert h.core.open_streams == []
    err = h.core.broken
    assert err is not None and err.code == ErrorCode.PROTOCOL_ERROR and what in str(err), err
    [failed] = h.of(SessionFailed)
    assert failed.error is err
    with pytest.raises(type(err)):
        h.core.begin("r", num_layers=1, num_kv_heads=1, head_dim=8, now=h.now)


@pytest.mark.parametrize("how", ["connect-refused", "goaway-timeout-in-handshake"])
def test_a_join_that_never_succeeds_is_given_up_once_its_attempts_are_used_up(how: str) -> None:
    """The slot was retried until its reconnect_attempts were used, then silently left
    down while stream 0 was open, and open() waited for it for ever: now the core says it
    gave the slot up (StreamGivenUp), and the session goes on with the others."""
    h = Harness(SenderCore(SenderConfig(secret=SECRET, streams=2, codecs=("raw",), reconnect_attempts=3,
                                        reconnect_backoff=0.1)))
    if how == "connect-refused":
        h.unreachable.add(1)
    else:
        h.refuse[1] = ErrorCode.TIMEOUT  # a break, resumable: retried
    h.advance(60.0)
    assert h.connects == {0: 1, 1: 4}  # the join and its 3 reconnects; nothing after
    [given_up] = h.of(StreamGivenUp)
    assert given_up.index == 1 and isinstance(given_up.error, ConnectionLostError)
    assert "stream 1 could not join the session in 4 attempts" in str(given_up.error)
    assert h.core.is_given_up(1) and not h.core.is_given_up(0)
    assert h.core.broken is None and h.core.open_streams == [0] and not h.of(SessionFailed)
    tid = begin(h, layers=1)
    for i in range(3):
        h.core.add_chunk(tid, chunk(tid, 0, 0, i))
    h.step()
    assert [i for i, _ in h.received] == [0, 0, 0]


def test_a_join_refused_with_limit_exceeded_is_given_up_at_once_and_the_session_goes_on() -> None:
    """A server with max_streams below the client's stream count refuses the extra joins
    with LIMIT_EXCEEDED: that was fatal to the whole session; now those slots are given up
    (not retried: the server said no) and the session goes on with the streams it has."""
    h = Harness(SenderCore(SenderConfig(secret=SECRET, streams=4, codecs=("raw",))))
    h.refuse[2] = h.refuse[3] = ErrorCode.LIMIT_EXCEEDED
    h.advance(60.0)
    assert h.connects == {0: 1, 1: 1, 2: 1, 3: 1}
    assert sorted(g.index for g in h.of(StreamGivenUp)) == [2, 3]
    assert all(isinstance(g.error, LimitExceededError) for g in h.of(StreamGivenUp))
    assert h.core.broken is None and h.core.open_streams == [0, 1]
    # the first stream refused (max_sessions) is still the end of it: there is no session
    first = Harness(SenderCore(SenderConfig(secret=SECRET, streams=2, codecs=("raw",))))
    first.refuse[0] = ErrorCode.LIMIT_EXCEEDED
    first.advance(60.0)
    assert isinstance(first.core.broken, LimitExceededError) and not first.of(StreamGivenUp)


def test_a_slot_given_up_with_no_stream_open_loses_the_session() -> None:
    h = Harness(SenderCore(SenderConfig(secret=SECRET, streams=1, codecs=("raw",), reconnect_attempts=2,
                                        reconnect_backoff=0.1)))
    h.step()
    h.unreachable.add(0)
    h.kill(0)
    h.advance(60.0)
    assert isinstance(h.core.broken, ConnectionLostError) and "could not resume the session" in str(h.core.broken)
    assert not h.of(StreamGivenUp) and h.of(SessionFailed)


def test_a_clean_goaway_requeues_on_the_other_streams_without_reconnecting() -> None:
    h = harness(streams=2)
    tid = begin(h, layers=1)
    for i in range(4):
        h.core.add_chunk(tid, chunk(tid, 0, 0, i))
    h.core.producer_done(tid)
    h.step()
    h.servers[1].close(ErrorCode.NO_ERROR, "bye")
    h.received = [r for r in h.received if r[0] != 1]
    h.step()
    assert h.core.counters["goaways_received"] == 1 and h.core.counters["resumes"] == 0
    assert h.core.open_streams == [0] and h.core.get_timer() is not None
    h.ack()
    assert h.of(TransferDone)


def test_our_goaway_is_written_before_the_transport_closes() -> None:
    h = harness(idle_timeout=2.0, reconnect_attempts=0)
    h.now = 10.0
    h.core.handle_timer(h.now)  # silence: the idle timer closes the stream with GOAWAY TIMEOUT
    assert h.core.is_closed(0)
    tail = h.core.data_to_send(0)
    assert tail  # the GOAWAY
    h.servers[0].receive_data(tail, h.now)
    assert h.servers[0].closed_event is not None and h.servers[0].closed_event.goaway
    assert isinstance(h.core.broken, TransferTimeoutError | ConnectionLostError)


def test_close_fails_every_transfer_and_says_goaway_on_every_stream() -> None:
    h = harness(streams=2)
    tid = begin(h)
    h.core.close(h.now)
    assert all(h.core.is_closed(i) for i in range(2))
    for i in range(2):
        h.servers[i].receive_data(h.core.data_to_send(i), h.now)
        closed = h.servers[i].closed_event
        assert closed is not None and closed.code == ErrorCode.NO_ERROR
    h.step()
    assert [e.transfer_id for e in h.of(TransferFailed)] == [tid]
    assert isinstance(h.core.broken, ConnectionLostError)


@pytest.mark.parametrize("request_id, blocks", [
    ("", ()),
    ("x" * 70_000, ()),
    ("\ud800", ()),  # no UTF-8 for a lone surrogate (was a UnicodeEncodeError)
    ("r", (BlockVersion(block=b"k" * 256, version=1),)),
    ("r", (BlockVersion(block=b"k", version=-1),)),
    ("r", (BlockVersion(block=b"k", version=1 << 64),)),
    ("r", (BlockVersion(block=b"k", version=True),)),
    ("r", tuple(BlockVersion(block=b"k", version=i) for i in range(0x10000))),
])
def test_begin_refuses_what_the_wire_cannot_carry(request_id: str, blocks: tuple[BlockVersion, ...]) -> None:
    h = harness()
    with pytest.raises(UsageError):
        h.core.begin(request_id, num_layers=1, num_kv_heads=1, head_dim=8, blocks=blocks, now=0.0)
    assert h.core.transfers == 0 and not h.core.data_to_send(0)


@pytest.mark.parametrize("meta", [{"x": float("nan")}, {"x": float("inf")}, {"x": "\ud800"}, {"\udc00": 1},
                                  {"x": 10**400}],
                         ids=["nan", "inf", "lone-surrogate", "lone-surrogate-key", "int-beyond-a-double"])
def test_meta_a_receiver_would_refuse_is_a_usage_error_before_anything_is_sent(meta: dict[str, object]) -> None:
    with pytest.raises(UsageError, match="JSON"):
        begin_fields(meta, None)


@pytest.mark.parametrize("blocks, message", [
    ([("a", 1, 2)], r"blocks\[0\] is not a \(block id, version\) pair"),
    ([("a", 1), ("b",)], r"blocks\[1\] is not a \(block id, version\) pair"),
    (["ab"], r"blocks\[0\] is not a \(block id, version\) pair: 'ab'"),
    ([5], r"blocks\[0\] is not a \(block id, version\) pair: 5"),
    ("ab", "not a single str"),
    (5, "not int"),
])
def test_blocks_that_are_not_pairs_are_a_usage_error(blocks: object, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        begin_fields(None, blocks)  # type: ignore[arg-type]


def test_blocks_go_as_canonical_keys() -> None:
    pairs: list[Any] = [(1, 2), ["s", 3], (b"\x01", 4)]  # a list entry (JSON's pairs) is a pair too
    _, versions = begin_fields(None, pairs)
    assert versions == (BlockVersion(block=b"i:1", version=2), BlockVersion(block=b"s:s", version=3),
                        BlockVersion(block=b"b:01", version=4))


def test_meta_goes_as_json_in_utf8() -> None:
    meta, _ = begin_fields({"é": "\U0001f600", "n": 1.5}, None)
    assert meta.decode("utf-8") == '{"é":"\U0001f600","n":1.5}'
    assert parse_meta(meta) == {"é": "\U0001f600", "n": 1.5}


def test_a_connection_made_after_the_session_broke_is_closed_at_once() -> None:
    core = SenderCore(SenderConfig(secret=SECRET, streams=2))
    assert isinstance(core.next_event(), StreamWanted)
    core.close(0.0)
    core.stream_opened(0, 0.0)  # a connect that was already under way completes
    assert core.is_closed(0) and core.connection(0) is None and not core.data_to_send(0)


def test_the_close_reason_names_the_stream_the_side_and_the_code() -> None:
    h = harness(streams=2)
    h.servers[1].close(ErrorCode.NO_ERROR, "maintenance")
    h.step()
    [closed] = h.of(StreamClosed)
    assert closed.reason == "stream 1 closed by server (GOAWAY NO_ERROR: maintenance)"


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["pause", "resume", "active", "ack", "add"]),
                              st.integers(0, 2)), max_size=40))
def test_chunks_never_go_on_a_paused_or_unused_stream(ops: list[tuple[str, int]]) -> None:
    h = harness(streams=3)
    tid = begin(h, layers=1)
    paused: set[int] = set()
    n = 0
    for op, arg in ops:
        before = len(h.of(ChunkSent))
        if op == "pause":
            paused.add(arg)
            h.core.set_writable(arg, False)
        elif op == "resume":
            paused.discard(arg)
            h.core.set_writable(arg, True)
        elif op == "active":
            h.core.active_streams = arg + 1
            h.core.pump()
        elif op == "ack":
            h.ack(arg + 1)
        else:
            h.core.add_chunk(tid, chunk(tid, 0, 0, n))
            n += 1
        h.step()
        active = h.core.active_streams or 3
        for ev in h.of(ChunkSent)[before:]:
            assert ev.stream not in paused and ev.stream < active
    h.core.producer_done(tid)
    for i in range(3):
        h.core.set_writable(i, True)
    h.core.active_streams = None
    h.core.pump()
    h.step()
    h.ack()
    assert len({e.address for e in h.of(ChunkSent)}) == n
    assert h.of(TransferDone) and h.core.bytes_in_flight == 0


def test_a_report_becomes_receiver_costs_in_seconds() -> None:
    h = harness(streams=2)
    h.servers[1].send_report(Report(transport_ns_per_mib=1 << 20, decode=(
        DecodeCost(codec_id=1, ns_per_melem=3 << 20), DecodeCost(codec_id=2, ns_per_melem=0))))
    h.servers[0].send_report(Report(transport_ns_per_mib=0, decode=()))
    h.step()
    costs = h.of(ReceiverCosts)
    assert len(costs) == 2
    assert ReceiverCosts(transport_s_per_byte=1e-9, decode_s_per_element={1: 3e-9}) in costs  # 0: not measured
    assert ReceiverCosts(transport_s_per_byte=None, decode_s_per_element={}) in costs


def _slow_first_challenge(streams: int) -> SenderCore:
    """A session whose first stream's CHALLENGE comes 40 ms after its HELLO; the rest of
    its handshakes (and every other stream's) are answered at once."""
    h = Harness(SenderCore(SenderConfig(secret=SECRET, streams=streams, codecs=("raw",), fingerprint=FINGERPRINT)))
    h.now = 5.0
    [wanted] = [e for e in iter(h.core.next_event, None) if isinstance(e, StreamWanted)]
    h.open(wanted.index)
    srv = h.servers[0]
    srv.receive_data(h.core.data_to_send(0), 5.0)
    h._serve(0, srv)
    h.now = 5.04
    h.core.receive_data(0, b"".join(bytes(p) for p in srv.data_to_send()), h.now)
    h.step()
    assert len(h.core.open_streams) == streams
    return h.core


def test_the_session_keeps_the_shortest_handshake_round_trip() -> None:
    assert _slow_first_challenge(1).path_rtt == pytest.approx(0.04)
    assert _slow_first_challenge(2).path_rtt == 0.0  # the second stream's, answered at once
