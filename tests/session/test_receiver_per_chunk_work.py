"""What the receiver works out once instead of per chunk still answers as it did: the
codecs accepted (their ids worked out once, when the core is made), a chunk classified
once before it is recorded, the deadline heap's top refreshed in place, copies of one
chunk acknowledged one by one."""

from __future__ import annotations

from kvwire.errors import ErrorCode
from kvwire.session.receiver import LayerReady, ReceiverConfig, TransferFailed
from kvwire.wire import ChunkAcked, ChunkVerdict, IncomingTransfer
from tests.session.receiver_harness import SECRET, Harness, begin, chunk


def test_a_codec_not_accepted_is_refused_after_chunks_of_one_that_is() -> None:
    h = Harness(ReceiverConfig(secret=SECRET, codecs=("raw",)))
    h.client.send_begin(begin(tid=1))
    h.pump()
    h.send(chunk(tid=1, layer=0, kind=0))
    h.send(chunk(tid=1, layer=0, kind=1))
    assert [e.layer for e in h.of(LayerReady)] == [0]
    h.client.send_begin(begin(tid=2, request="s"))
    h.pump()
    h.send(chunk(tid=2, codec_id=1))
    [failed] = h.of(TransferFailed)
    assert failed.error.code == ErrorCode.UNSUPPORTED_CODEC
    h.send(chunk(tid=1, layer=1, kind=0, codec_id=1))  # still refused, on the transfer that had raw ones
    assert [f.error.code for f in h.of(TransferFailed)] == [ErrorCode.UNSUPPORTED_CODEC] * 2


def test_add_with_the_verdict_classify_gave_records_as_add_does() -> None:
    chunks = [chunk(layer=0, kind=0, start=0, count=4), chunk(layer=0, kind=0, start=4, count=4),
              chunk(layer=0, kind=0, start=0, count=4), chunk(layer=0, kind=1, start=0, count=8)]
    plain = IncomingTransfer(1, 2, layer_limit=2, max_tokens=8)
    given = IncomingTransfer(1, 2, layer_limit=2, max_tokens=8)
    for c in chunks:
        plain.check(c)
        given.check(c)
        assert given.add(c, given.classify(c)) == plain.add(c)
        assert (given.ranges, given.chunks_received, given.duplicates) == (
            plain.ranges, plain.chunks_received, plain.duplicates)
        assert given.layer_complete(0) == plain.layer_complete(0)
    assert given.classify(chunks[0]) is ChunkVerdict.DUPLICATE


def test_the_timer_is_the_connections_current_deadline_as_frames_move_it_later() -> None:
    h = Harness()
    conn = h.core.connection(1)
    assert conn is not None
    for when in (1.0, 2.5, 7.0, 7.25):
        h.now = when
        h.client.send_ping(int(when * 4))
        h.pump()
        assert h.core.get_timer() == conn.get_timer()
        h.core.handle_timer(when)  # nothing due: nothing happens
        assert h.core.get_timer() == conn.get_timer()


def test_copies_of_one_chunk_on_one_connection_are_each_acknowledged() -> None:
    h = Harness()
    h.client.send_begin(begin())
    h.pump()
    c = chunk(layer=0, kind=0)
    h.send(c)
    h.send(c)
    h.send(c)
    assert len(h.client_of(ChunkAcked)) == 3
    conn = h.core.connection(1)
    assert conn is not None and conn.recv_unacked == 0
