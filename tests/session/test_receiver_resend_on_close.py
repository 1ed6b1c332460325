"""What the server sends once and the client waits for (a CREDIT, a RESET of its own, the
ACCEPT after a registry check) must not be lost for good with a broken stream while the
session goes on with its others (docs/protocol.md 6.3).  The stream that broke may never
come back: a client gives a slot up whose reconnects fail, and a sender whose chunks were
all acknowledged, waiting for a layer grant, sends nothing that would draw it out.  So
when a stream of a session closes and another is still open, the server says again on
the open one the current layer limit of each incomplete transfer and its kept RESETs, as
it does on a stream that joins; a client ignores a CREDIT at or below the limit it has."""

from __future__ import annotations

import random

import pytest

from kvwire.errors import ConnectionLostError, ErrorCode
from kvwire.session.receiver import LayerReady, ReceiverConfig, RegistryCheck
from kvwire.session.sender import SenderConfig, TransferDone
from kvwire.testing.session_pair import SessionPair
from kvwire.wire import (
    Chunk,
    Connection,
    CreditGranted,
    TransferAccepted,
    TransferReset,
    chunk_frame_size,
)
from kvwire.wire.frames import BlockVersion, FrameType
from tests.session.receiver_harness import SECRET, Harness, begin, chunk, join
from tests.session.stream_helpers import ONE_LAYER, break_stream, events_of

# A transfer buffer of one layer of the tests' chunks (8 tokens of K and V; the pair's, 64):
# the server grants one layer at a time, each time the application takes one.


def two_streams(**config: object) -> tuple[Harness, Connection]:
    """A session of two streams: the harness's client (stream 0, cid 1, joined first: the
    server's CREDITs and RESETs go on it) and a second client (stream 1, cid 2)."""
    h = Harness(ReceiverConfig(secret=SECRET, resume_timeout=10.0, **config))  # type: ignore[arg-type]
    second, _ = join(h.core, 2, h.now, session_id=h.client.session_id, stream_index=1)
    return h, second


def test_a_credit_lost_with_a_broken_stream_goes_again_on_a_stream_still_open() -> None:
    h, second = two_streams(transfer_buffer_bytes=ONE_LAYER)
    h.client.send_begin(begin(layers=3))
    h.pump()
    h.send(chunk(layer=0, kind=0))
    h.send(chunk(layer=0, kind=1))
    assert [e.layer for e in h.of(LayerReady)] == [0] and not h.client_of(CreditGranted)
    h.core.claim(h.key, h.now)
    h.core.take_layer(h.key, 0, h.now)  # grants layer 1: the CREDIT goes on stream 0 ...
    break_stream(h, 1)  # ... which breaks before the client read it
    credits = [e for e in events_of(h.core, 2, second, h.now) if isinstance(e, CreditGranted)]
    assert [(c.transfer_id, c.layer_limit) for c in credits] == [(1, 2)]
    # the transfer goes on on stream 1
    for kind in (0, 1):
        c = chunk(layer=1, kind=kind)
        second.send_chunk(c, chunk_frame_size(len(c.params), len(c.payload)))
    h.core.receive_data(2, b"".join(bytes(p) for p in second.data_to_send()), h.now)
    h.pump()
    assert [e.layer for e in h.of(LayerReady)] == [0, 1]


def test_a_reset_lost_with_a_broken_stream_goes_again_on_a_stream_still_open() -> None:
    h, second = two_streams()
    h.client.send_begin(begin(layers=2))
    h.pump()
    h.send(chunk(layer=0, kind=0))
    h.core.abort(h.key, "the application gave up", h.now)  # its RESET goes on stream 0 ...
    break_stream(h, 1)  # ... and is lost with it
    resets = [e for e in events_of(h.core, 2, second, h.now) if isinstance(e, TransferReset)]
    assert [(r.transfer_id, r.code) for r in resets] == [(1, ErrorCode.CANCELLED)]


def test_a_stream_closed_cleanly_leaves_its_resets_to_a_stream_still_open() -> None:
    h, second = two_streams()
    h.client.send_begin(begin(layers=2))
    h.pump()
    h.core.abort(h.key, "the application gave up", h.now)  # nothing incomplete is left
    h.client.close(ErrorCode.NO_ERROR, "done with this stream")  # before it read the RESET
    h.core.receive_data(1, b"".join(bytes(p) for p in h.client.data_to_send()), h.now)
    assert h.core.sessions == 1
    resets = [e for e in events_of(h.core, 2, second, h.now) if isinstance(e, TransferReset)]
    assert [r.transfer_id for r in resets] == [1]


def test_the_last_stream_breaking_sends_nothing_and_the_session_waits_for_a_reconnect() -> None:
    h = Harness(ReceiverConfig(secret=SECRET, resume_timeout=10.0, transfer_buffer_bytes=ONE_LAYER))
    h.client.send_begin(begin(layers=3))
    h.pump()
    h.send(chunk(layer=0, kind=0))
    h.send(chunk(layer=0, kind=1))
    h.core.claim(h.key, h.now)
    h.core.take_layer(h.key, 0, h.now)
    break_stream(h, 1)
    assert h.core.sessions == 1 and h.core.get_timer() == pytest.approx(10.0)
    # the stream that joins carries the CREDIT
    _client, events = join(h.core, 3, h.now, session_id=h.client.session_id)
    assert [(e.transfer_id, e.layer_limit) for e in events if isinstance(e, CreditGranted)] == [(1, 2)]


def test_accept_goes_on_the_stream_that_carried_the_begin_sent_again() -> None:
    """The client re-sent BEGIN on stream 1 because stream 0, which carried it, broke (the
    server does not know yet) while the registry check ran: the check's ACCEPT must go on
    stream 1, not on stream 0, where it was lost and the client waited for it."""
    h, second = two_streams(registry=True)
    b = begin(layers=2, blocks=(BlockVersion(block=b"i:1", version=3),))
    h.client.send_begin(b)
    h.pump()
    [check] = h.of(RegistryCheck)
    second.send_begin(b)
    h.core.receive_data(2, b"".join(bytes(p) for p in second.data_to_send()), h.now)
    assert not [e for e in events_of(h.core, 2, second, h.now) if isinstance(e, TransferAccepted)]
    h.core.registry_checked(check.key, [], None, h.now)
    accepts = [e for e in events_of(h.core, 2, second, h.now) if isinstance(e, TransferAccepted)]
    assert [a.transfer_id for a in accepts] == [1]


def test_a_stale_verdict_goes_on_the_stream_that_carried_the_begin_sent_again() -> None:
    """As the ACCEPT above, the RESET of a BEGIN the registry found stale goes on stream 1,
    which carried the BEGIN sent again, not on stream 0, which broke."""
    h, second = two_streams(registry=True)
    b = begin(layers=2, blocks=(BlockVersion(block=b"i:1", version=3),))
    h.client.send_begin(b)
    h.pump()
    [check] = h.of(RegistryCheck)
    second.send_begin(b)
    h.core.receive_data(2, b"".join(bytes(p) for p in second.data_to_send()), h.now)
    events_of(h.core, 2, second, h.now)
    h.core.registry_checked(check.key, ["i:1"], None, h.now)
    resets = [e for e in events_of(h.core, 2, second, h.now) if isinstance(e, TransferReset)]
    assert [r.transfer_id for r in resets] == [1]
    assert not [e for e in events_of(h.core, 1, h.client, h.now) if isinstance(e, TransferReset)]


# -- both cores, in fake time ----------------------------------------------------------------

HEADS, HEAD_DIM, ITEM = 2, 8, 2
BPT = HEADS * HEAD_DIM * ITEM
TOKENS, LAYERS = 64, 6


class SlotDown(SessionPair):
    """A pair whose slot 0 never reconnects: every connect after its first is refused."""

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.connects: dict[int, int] = {}
        self.down: list[tuple[int, int, bytes]] = []
        """(frame number, slot, frame) of every frame the sender read."""
        self.up: list[tuple[int, int]] = []
        """(frame number, connection id) of every frame the receiver read."""
        read, take = self.sender.receive_data, self.receiver.receive_data

        def reading(index: int, data: bytes, now: float) -> None:
            if data:
                self.down.append((self.frames - 1, index, data))
            read(index, data, now)

        def taking(cid: int, data: bytes, now: float) -> None:
            if data:
                self.up.append((self.frames - 1, cid))
            take(cid, data, now)

        self.sender.receive_data = reading  # type: ignore[method-assign]
        self.receiver.receive_data = taking  # type: ignore[method-assign]

    def _open(self, index: int) -> None:
        self.connects[index] = self.connects.get(index, 0) + 1
        if index == 0 and self.connects[index] > 1:
            self.sender.stream_failed(index, self.clock.now, ConnectionLostError("refused"))
            return
        super()._open(index)


def pair(faults: dict[int, tuple[str, int]] | None = None) -> tuple[SlotDown, int, list[tuple[bytes, bytes]]]:
    p = SlotDown(SenderConfig(secret=SECRET, streams=2, codecs=("raw",), reconnect_attempts=2),
                 ReceiverConfig(secret=SECRET, codecs=("raw",), transfer_buffer_bytes=2 * TOKENS * BPT),
                 faults=faults)
    p.run(until=1.0)  # both streams open
    rng = random.Random(7)
    data = [(rng.randbytes(TOKENS * BPT), rng.randbytes(TOKENS * BPT)) for _ in range(LAYERS)]
    tid = p.sender.begin("r", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM, now=p.clock.now)
    for layer, (k, v) in enumerate(data):
        for kind, blob in ((0, k), (1, v)):
            p.sender.add_chunk(tid, Chunk(transfer_id=tid, layer=layer, kind=kind, codec_id=0, token_start=0,
                                          token_count=TOKENS, layer_tokens=TOKENS, params=b"", payload=blob))
    p.sender.producer_done(tid)
    return p, tid, data


@pytest.mark.parametrize("cut", ["the-credit", "after-the-credit"])
def test_a_transfer_goes_on_when_a_slot_breaks_with_a_credit_and_is_given_up(cut: str) -> None:
    """Stream 0 breaks losing the CREDIT it carried (or after the client read it: the
    CREDIT said again is a duplicate, which it ignores), and its reconnects are refused
    until the client gives the slot up: the transfer completes on stream 1, bit for bit."""
    clean, _, _ = pair()
    clean.run(until=60.0)
    credits = [n for n, index, frame in clean.down if index == 0 and frame[0] == FrameType.CREDIT]
    assert len(credits) >= 2, clean.down  # one layer at a time: the CREDITs go on stream 0
    # the frame stream 0 breaks at: that CREDIT, or the next its client sends
    at = credits[1] if cut == "the-credit" else min(n for n, cid in clean.up if cid == 1 and n > credits[1])
    p, tid, data = pair({at: ("drop", 0)})
    p.run(until=60.0)
    assert p.connects[0] == 3  # the first connection and its 2 reconnects, refused
    assert p.sender.is_given_up(0) and p.sender.open_streams == [1]
    said_again = next(frame for n, index, frame in p.down if n > at and index == 1 and frame[0] == FrameType.CREDIT)
    assert said_again == clean.down[[n for n, _, _ in clean.down].index(credits[1])][2]
    assert isinstance(p.outcomes.get(tid), TransferDone), (p.outcomes, p.failed_incoming)
    assert p.delivered["r"] == dict(enumerate(data))
