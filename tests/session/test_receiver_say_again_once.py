"""The server keeps the RESETs of a session's recently failed transfers to say them again
when a stream that carried them closes (docs/protocol.md 6.3), and only then: each on one
stream still open, or, with none open, on the stream that joins.  A break of a stream that
carried none of them, or a stream joining while the one that carried them is open, sends
none of them again (before, every join and every break sent all of them, up to 256, and a
session of a few streams paid about 94 KB per dropped stream)."""

from __future__ import annotations

from kvwire.errors import ErrorCode
from kvwire.session.receiver import LayerReady, ReceiverConfig, ReceiverCore
from kvwire.wire import Connection, CreditGranted, Event, TransferReset
from tests.session.receiver_harness import SECRET, Harness, begin, chunk, join
from tests.session.stream_helpers import ONE_LAYER, break_stream, events_of

FAILED = 5  # transfers the application aborts, tids 1..5


def resets(core: ReceiverCore, cid: int, client: Connection, now: float) -> list[int]:
    """The transfer ids of the RESETs connection ``cid``'s client reads now."""
    return [e.transfer_id for e in events_of(core, cid, client, now) if isinstance(e, TransferReset)]


def aborted(h: Harness, n: int = FAILED) -> list[int]:
    """``n`` transfers begun on stream 0 (cid 1) and aborted by the application: their
    RESETs go on cid 1, whose client reads them.  Their ids."""
    for tid in range(1, n + 1):
        h.client.send_begin(begin(tid=tid, request=f"r{tid}"))
    h.pump()
    for tid in range(1, n + 1):
        h.core.abort((h.key[0], tid), "the application gave up", h.now)
    h.pump()
    got = [e.transfer_id for e in h.client_of(TransferReset)]
    assert got == list(range(1, n + 1))
    return got


def three_streams(*, failed_first: bool = False) -> tuple[Harness, Connection, Connection]:
    """A session of three streams: cid 1 (the harness's client, stream 0), cid 2 and cid 3.
    ``failed_first``: the application aborts FAILED transfers while cid 1 is the only
    stream (a RESET the server sends on its own goes on every open stream: then on cid 1
    alone); cid 2 and cid 3 join after."""
    h = Harness(ReceiverConfig(secret=SECRET, resume_timeout=10.0))
    if failed_first:
        aborted(h)
    second, _ = join(h.core, 2, h.now, session_id=h.client.session_id, stream_index=1)
    third, _ = join(h.core, 3, h.now, session_id=h.client.session_id, stream_index=2)
    return h, second, third


def test_a_break_of_a_stream_that_carried_none_of_the_resets_says_none_again() -> None:
    h, second, _third = three_streams(failed_first=True)
    break_stream(h, 3)
    assert resets(h.core, 1, h.client, h.now) == []
    assert resets(h.core, 2, second, h.now) == []
    # the slot rejoins: the stream that carried them is open, nothing is said again
    _again, events = join(h.core, 4, h.now, session_id=h.client.session_id, stream_index=2)
    assert [e for e in events if isinstance(e, TransferReset)] == []
    assert resets(h.core, 1, h.client, h.now) == [] and resets(h.core, 2, second, h.now) == []


def test_a_stream_joining_says_none_of_the_resets_an_open_stream_carries() -> None:
    h, _second, _third = three_streams()
    aborted(h)
    for cid, index in ((4, 3), (5, 4)):
        _client, events = join(h.core, cid, h.now, session_id=h.client.session_id, stream_index=index)
        assert [e for e in events if isinstance(e, TransferReset)] == []


def test_a_break_of_the_stream_that_carried_them_says_each_again_once_on_one_other() -> None:
    h, second, third = three_streams(failed_first=True)
    failed = list(range(1, FAILED + 1))
    break_stream(h, 1)
    said = {2: resets(h.core, 2, second, h.now), 3: resets(h.core, 3, third, h.now)}
    assert sorted([said[2], said[3]]) == [[], failed]  # all of them, on one stream
    carrier, other = (2, 3) if said[2] else (3, 2)
    # a break of the stream left over says nothing again; one of the new carrier, all
    clients = {2: second, 3: third}
    break_stream(h, other)
    assert resets(h.core, carrier, clients[carrier], h.now) == []
    rejoined, _ = join(h.core, 6, h.now, session_id=h.client.session_id, stream_index=0)
    assert resets(h.core, 6, rejoined, h.now) == []
    break_stream(h, carrier)
    assert resets(h.core, 6, rejoined, h.now) == failed


def test_a_lone_stream_that_breaks_and_rejoins_gets_each_lost_reset_once() -> None:
    h = Harness(ReceiverConfig(secret=SECRET, resume_timeout=10.0))
    failed = aborted(h)
    break_stream(h, 1)
    rejoined, events = join(h.core, 2, h.now, session_id=h.client.session_id)
    assert [e.transfer_id for e in events if isinstance(e, TransferReset)] == failed
    # a second stream joining the session, and the rejoined one, get none of them again
    _second, events = join(h.core, 3, h.now, session_id=h.client.session_id, stream_index=1)
    assert [e for e in events if isinstance(e, TransferReset)] == []
    assert resets(h.core, 2, rejoined, h.now) == []
    # a break of the second says nothing again; one of the rejoined stream, all of them
    break_stream(h, 3)
    assert resets(h.core, 2, rejoined, h.now) == []
    third, _ = join(h.core, 4, h.now, session_id=h.client.session_id, stream_index=1)
    break_stream(h, 2)
    assert resets(h.core, 4, third, h.now) == failed


def test_a_reset_that_found_no_open_stream_goes_on_the_stream_that_joins() -> None:
    h = Harness(ReceiverConfig(secret=SECRET, resume_timeout=10.0))
    h.client.send_begin(begin())
    h.pump()
    key = h.key
    break_stream(h, 1)
    h.core.abort(key, "the application gave up", h.now)  # no stream is open
    _client, events = join(h.core, 2, h.now, session_id=h.client.session_id)
    assert [(e.transfer_id, e.code) for e in events if isinstance(e, TransferReset)] == [(1, ErrorCode.CANCELLED)]
    _other, events = join(h.core, 3, h.now, session_id=h.client.session_id, stream_index=1)
    assert [e for e in events if isinstance(e, TransferReset)] == []


def credits(core: ReceiverCore, cid: int, client: Connection, now: float) -> list[tuple[int, int]]:
    evs: list[Event] = events_of(core, cid, client, now)
    return [(e.transfer_id, e.layer_limit) for e in evs if isinstance(e, CreditGranted)]


def test_a_credit_is_said_again_only_when_the_stream_that_carried_it_closes() -> None:
    h = Harness(ReceiverConfig(secret=SECRET, resume_timeout=10.0, transfer_buffer_bytes=ONE_LAYER))
    second, _ = join(h.core, 2, h.now, session_id=h.client.session_id, stream_index=1)
    join(h.core, 3, h.now, session_id=h.client.session_id, stream_index=2)
    h.client.send_begin(begin(layers=3))
    h.pump()
    h.send(chunk(layer=0, kind=0))
    h.send(chunk(layer=0, kind=1))
    assert [e.layer for e in h.of(LayerReady)] == [0]
    h.core.claim(h.key, h.now)
    h.core.take_layer(h.key, 0, h.now)  # the CREDIT for layer 1 goes on cid 1
    h.pump()
    assert [(e.transfer_id, e.layer_limit) for e in h.client_of(CreditGranted)] == [(1, 2)]
    break_stream(h, 3)  # carried nothing
    assert credits(h.core, 2, second, h.now) == []
    joined, events = join(h.core, 4, h.now, session_id=h.client.session_id, stream_index=2)
    assert [e for e in events if isinstance(e, CreditGranted)] == []
    break_stream(h, 1)  # carried the CREDIT: said again on one stream still open
    said = credits(h.core, 2, second, h.now) + credits(h.core, 4, joined, h.now)
    assert said == [(1, 2)]
