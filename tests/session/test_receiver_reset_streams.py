"""A RESET the server sends on its own (the receiving application gave the transfer up, its
deadline passed, the server is closing) goes on every open stream of the session, not on
one: that one may be stalled (its client not reading it, its path stuck), and a RESET
queued behind its unread bytes reached the sender only once the stream broke, its idle
timeout later, while the sender went on sending a transfer nobody would take.  A RESET
that answers a BEGIN (the registry's verdict) still goes on the stream of that BEGIN.

The sender fails the transfer at the first copy it reads and ignores the others (a RESET
for a transfer it does not have, docs/protocol.md 10): shown here with the real sender
core, before and after the receiver's change."""

from __future__ import annotations

from typing import Any

from kvwire.errors import ErrorCode, TransferAbortedError, TransferTimeoutError
from kvwire.session.receiver import LayerReady, ReceiverConfig, ReceiverCore, TransferArrived
from kvwire.session.sender import (
    SenderConfig,
    SenderCore,
    SessionFailed,
    StreamClosed,
    StreamWanted,
    TransferDone,
    TransferFailed,
)
from kvwire.wire import Chunk, ConnectionClosed, TransferReset
from tests.session.receiver_harness import SECRET, Harness, begin, join
from tests.session.sender_harness import begin as sender_begin
from tests.session.sender_harness import harness as sender_harness
from tests.session.stream_helpers import break_stream, events_of

HEADS, HEAD_DIM, TOKENS = 2, 4, 8
BPT = HEADS * HEAD_DIM * 2


class Pair:
    """A sender core of ``streams`` streams wired by hand to a receiver core; the server's
    bytes on a stream in ``stalled`` are held back (its client reads nothing of it) until
    the test lets them through.  The receiving application claims what arrives and takes
    each layer."""

    def __init__(self, streams: int = 2, **receiver: Any) -> None:
        self.now = 0.0
        self.sender = SenderCore(SenderConfig(secret=SECRET, streams=streams, idle_timeout=None))
        self.receiver = ReceiverCore(ReceiverConfig(secret=SECRET, idle_timeout=None, **receiver))
        self.open: list[int] = []
        self.stalled: dict[int, bytearray] = {}
        self.events: list[Any] = []
        self.arrived: list[Any] = []
        self.step()

    def cid(self, index: int) -> int:
        return index + 1

    def stall(self, index: int) -> None:
        self.stalled[index] = bytearray()

    def unstall(self, index: int) -> None:
        held = self.stalled.pop(index)
        self.sender.receive_data(index, bytes(held), self.now)
        self.step()

    def step(self) -> None:
        busy = True
        while busy:
            busy = False
            while (ev := self.sender.next_event()) is not None:
                busy = True
                self.events.append(ev)
                if isinstance(ev, StreamWanted):
                    self.receiver.connection_made(self.cid(ev.index), self.now)
                    self.sender.stream_opened(ev.index, self.now)
                    self.open.append(ev.index)
            for index in self.open:
                up = self.sender.data_to_send(index)
                if up:
                    busy = True
                    self.receiver.receive_data(self.cid(index), up, self.now)
                down = self.receiver.data_to_send(self.cid(index))
                if down:
                    busy = True
                    if index in self.stalled:
                        self.stalled[index] += down
                    else:
                        self.sender.receive_data(index, down, self.now)
            while (rev := self.receiver.next_event()) is not None:
                busy = True
                if isinstance(rev, TransferArrived):
                    self.arrived.append(rev)
                    self.receiver.claim(rev.key, self.now)
                elif isinstance(rev, LayerReady):
                    self.receiver.take_layer(rev.key, rev.layer, self.now)

    def begin(self, request: str, layers: int = 2) -> int:
        tid = self.sender.begin(request, num_layers=layers, num_kv_heads=HEADS, head_dim=HEAD_DIM, now=self.now)
        self.step()
        return tid

    def send_layer(self, tid: int, layer: int) -> None:
        for kind in (0, 1):
            self.sender.add_chunk(tid, Chunk(transfer_id=tid, layer=layer, kind=kind, codec_id=0, token_start=0,
                                             token_count=TOKENS, layer_tokens=TOKENS, params=b"",
                                             payload=bytes(TOKENS * BPT)))
        self.step()

    def of(self, kind: type) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]

    def key(self, request: str) -> tuple[bytes, int]:
        return next(e.key for e in self.arrived if e.request_id == request)  # type: ignore[no-any-return]


def begin_stream(p: Pair, request: str) -> int:
    """The stream index whose connection carried ``request``'s BEGIN."""
    t = p.receiver._live[p.key(request)]
    assert t.begin_cid is not None
    return t.begin_cid - 1


def test_an_abort_reaches_the_sender_while_the_stream_of_its_begin_is_stalled() -> None:
    p = Pair(streams=2)
    assert sorted(p.open) == [0, 1] and p.sender.open_streams == [0, 1]
    tid = p.begin("r")
    p.send_layer(tid, 0)
    stalled = begin_stream(p, "r")  # where ACCEPT went, and where the RESET went before
    p.stall(stalled)
    p.receiver.abort(p.key("r"), "the application gave up", p.now)
    p.step()
    [failed] = p.of(TransferFailed)
    assert failed.transfer_id == tid and isinstance(failed.error, TransferAbortedError) and failed.by_peer
    # The stalled stream's copy is read at last: ignored (no second failure, nothing closed).
    assert p.stalled[stalled]
    p.unstall(stalled)
    assert len(p.of(TransferFailed)) == 1 and p.sender.counters["transfers_reset_by_peer"] == 1
    assert not p.of(StreamClosed) and not p.of(SessionFailed) and p.sender.open_streams == [0, 1]
    # The session goes on: a transfer after it completes.
    tid2 = p.begin("after", layers=1)
    p.send_layer(tid2, 0)
    p.sender.producer_done(tid2)
    p.step()
    assert [e.transfer_id for e in p.of(TransferDone)] == [tid2]


def test_a_deadline_reset_goes_on_every_open_stream() -> None:
    p = Pair(streams=3, transfer_timeout=5.0)
    tid = p.begin("r")
    for index in (0, 1):  # two of the three streams are stalled
        p.stall(index)
    p.now = 5.0
    p.receiver.handle_timer(p.now)
    p.step()
    [failed] = p.of(TransferFailed)
    assert failed.transfer_id == tid and isinstance(failed.error, TransferTimeoutError)
    for index in (0, 1):
        p.unstall(index)
    assert len(p.of(TransferFailed)) == 1 and not p.of(StreamClosed)


def test_the_sender_ignores_the_servers_copies_of_a_transfer_it_failed_itself() -> None:
    """The sender gave the transfer up (and RESET it on every stream) as the receiving
    application did: every copy of the server's RESET is one for a transfer it no longer
    has."""
    p = Pair(streams=2)
    tid = p.begin("r")
    p.sender.abort(tid, TransferAbortedError("the sender gave up"))
    p.receiver.abort(p.key("r"), "the application gave up", p.now)
    p.step()
    [failed] = p.of(TransferFailed)
    assert failed.transfer_id == tid and not failed.by_peer
    assert p.sender.counters["transfers_reset_by_peer"] == 0
    assert not p.of(StreamClosed) and not p.of(SessionFailed) and p.sender.open_streams == [0, 1]


def test_the_sender_core_takes_the_first_copy_and_ignores_the_others() -> None:
    """The sender core alone, its servers hand-driven: RESETs of one transfer on both
    streams, the second read after the first failed it."""
    h = sender_harness(streams=2)
    tid = sender_begin(h, layers=2)
    h.servers[0].send_reset(tid, ErrorCode.CANCELLED, "receiver aborted transfer 'r'")
    h.step()
    [failed] = h.of(TransferFailed)
    assert failed.transfer_id == tid and isinstance(failed.error, TransferAbortedError) and failed.by_peer
    h.servers[1].send_reset(tid, ErrorCode.CANCELLED, "receiver aborted transfer 'r'")
    h.servers[0].send_reset(tid, ErrorCode.CANCELLED, "receiver aborted transfer 'r'")  # (and again)
    h.step()
    assert len(h.of(TransferFailed)) == 1 and h.core.counters["transfers_reset_by_peer"] == 1
    assert h.resets == []  # nothing said back
    assert not h.of(StreamClosed) and not h.of(SessionFailed) and h.core.open_streams == [0, 1]
    assert all(srv.closed_event is None for srv in h.servers.values())


def reset_ids(events: list[Any]) -> list[int]:
    return [e.transfer_id for e in events if isinstance(e, TransferReset)]


def test_an_application_abort_is_reset_once_on_each_open_stream() -> None:
    h = Harness(ReceiverConfig(secret=SECRET, resume_timeout=10.0))
    second, _ = join(h.core, 2, h.now, session_id=h.client.session_id, stream_index=1)
    h.client.send_begin(begin())
    h.pump()
    h.core.abort(h.key, "the application gave up", h.now)
    h.pump()
    assert reset_ids(h.client_events) == [1]
    assert reset_ids(events_of(h.core, 2, second, h.now)) == [1]
    # Carried by two streams: a break of one says nothing again on the other ...
    break_stream(h, 1)
    assert reset_ids(events_of(h.core, 2, second, h.now)) == []
    # ... a break of the last says it on the stream that joins.
    break_stream(h, 2)
    _client, events = join(h.core, 3, h.now, session_id=h.client.session_id)
    assert reset_ids(events) == [1]


def test_a_server_closing_resets_on_every_stream_before_its_goaways() -> None:
    h = Harness(ReceiverConfig(secret=SECRET))
    second, _ = join(h.core, 2, h.now, session_id=h.client.session_id, stream_index=1)
    h.client.send_begin(begin())
    h.pump()
    h.core.close(h.now)
    for events in (events_of(h.core, 1, h.client, h.now), events_of(h.core, 2, second, h.now)):
        kinds = [type(e) for e in events if isinstance(e, TransferReset | ConnectionClosed)]
        assert kinds == [TransferReset, ConnectionClosed]
        assert [e.code for e in events if isinstance(e, TransferReset)] == [ErrorCode.SESSION_LOST]
