"""A connection replaced by one that re-joins its stream slot (the client reconnects while
the server still sees the old one) leaves nothing of itself in its session.  Before, the
session's kept RESETs (each with the set of open connections that carried it) kept the
old connection's id for good: the replacement took the connection out of its session
first, so its close, later, returned early and cleaned nothing, and each re-join said the
RESETs again on the new stream, adding its id too (2000 re-joins of a session keeping 256
RESETs: 512256 ids kept, heap +33 MB).  Now the replacement lets go of the old
connection's id at once (as a close does), and a RESET said again keeps only connections
still open among its carriers."""

from __future__ import annotations

from kvwire.session.receiver import ReceiverConfig, ReceiverCore, TransferArrived
from kvwire.wire import Connection, TransferReset
from tests.session.receiver_harness import SECRET, begin, join

RESETS = 16


def flush(core: ReceiverCore, client: Connection, cid: int) -> list[object]:
    data = b"".join(bytes(p) for p in client.data_to_send())
    if data:
        core.receive_data(cid, data, 0.0)
    out = core.data_to_send(cid)
    if out:
        client.receive_data(out, 0.0)
    return list(iter(client.next_event, None))


def session_with_kept_resets(core: ReceiverCore, streams: int) -> tuple[bytes, dict[int, Connection]]:
    """A session of ``streams`` streams (cids 1, 2, ...) whose RESETS transfers the
    application gave up on: the server keeps each RESET, with the streams that carried it."""
    first, _ = join(core, 1, 0.0)
    sid = first.session_id
    clients = {1: first}
    for index in range(1, streams):
        clients[index + 1], _ = join(core, index + 1, 0.0, session_id=sid, stream_index=index)
    for tid in range(1, RESETS + 1):
        first.send_begin(begin(tid=tid, layers=1, request=f"r{tid}"))
    flush(core, first, 1)
    for ev in list(iter(core.next_event, None)):
        if isinstance(ev, TransferArrived):
            core.abort(ev.key, "the application gave up", 0.0)
    for cid, client in clients.items():
        flush(core, client, cid)
    assert len(core._sessions[sid].resets) == RESETS
    return sid, clients


def carriers_are_open_streams(core: ReceiverCore, sid: bytes) -> set[int]:
    """Every connection id the session's kept RESETs name is one of its open streams
    (and so is every transfer's limit_cid): the ids named."""
    sess = core._sessions[sid]
    open_streams = {c for c in sess.streams.values() if core._conns[c].closed_event is None}
    named = set().union(*sess.resets.values())
    assert named <= open_streams, (named, open_streams)
    assert {t.limit_cid for t in sess.transfers.values()} <= open_streams | {None}
    return named


def test_re_joining_a_slot_again_and_again_keeps_no_id_of_the_replaced_connections() -> None:
    """The reviewer's r5 (40 cycles): each re-join of slot 0 replaces the connection the
    server still sees, whose close comes after."""
    core = ReceiverCore(ReceiverConfig(secret=SECRET, resume_timeout=10.0, idle_timeout=None))
    sid, _ = session_with_kept_resets(core, 1)
    old = 1
    for cid in range(2, 42):
        _, events = join(core, cid, 0.0, session_id=sid, stream_index=0)  # replaces ``old``
        # it says again every kept RESET: its old carrier was let go of
        assert len([e for e in events if isinstance(e, TransferReset)]) == RESETS
        core.data_to_send(old)
        core.receive_data(old, b"", 0.0)  # the replaced connection's close reaches the server
        core.forget(old)
        assert carriers_are_open_streams(core, sid) == {cid}
        assert sum(len(on) for on in core._sessions[sid].resets.values()) == RESETS
        old = cid


def test_a_replaced_connection_whose_close_never_comes_is_let_go_of_too() -> None:
    """The old connection stays (its close not seen yet) while its slot is re-joined
    again and again, the session's other stream open throughout: what that one carries
    is not said again, and no replaced id stays."""
    core = ReceiverCore(ReceiverConfig(secret=SECRET, resume_timeout=10.0, idle_timeout=None))
    sid, _ = session_with_kept_resets(core, 2)  # carried by cids 1 and 2
    assert carriers_are_open_streams(core, sid) == {1, 2}
    for cid in range(3, 43):
        _, events = join(core, cid, 0.0, session_id=sid, stream_index=0)
        assert not [e for e in events if isinstance(e, TransferReset)]  # stream 1 carries them
        assert carriers_are_open_streams(core, sid) == {2}
    core.receive_data(2, b"", 0.0)  # the other stream breaks: the last joined says them again
    core.forget(2)
    assert carriers_are_open_streams(core, sid) == {42}


def test_a_reset_said_again_keeps_only_open_carriers() -> None:
    """Whatever else left an id behind (here planted: a connection the server never had,
    and one that closed), a RESET said again keeps only the connections still open."""
    core = ReceiverCore(ReceiverConfig(secret=SECRET, resume_timeout=10.0, idle_timeout=None))
    sid, _ = session_with_kept_resets(core, 1)
    for on in core._sessions[sid].resets.values():
        on.update({999, 1})
    core.receive_data(1, b"", 0.0)  # its one stream breaks ...
    core.forget(1)
    for on in core._sessions[sid].resets.values():
        on.add(1)
    _, events = join(core, 2, 0.0, session_id=sid, stream_index=0)  # ... and comes back
    assert len([e for e in events if isinstance(e, TransferReset)]) == RESETS
    assert carriers_are_open_streams(core, sid) == {2}
