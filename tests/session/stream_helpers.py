"""Breaking one stream of a multi-stream session and reading what the client saw on it."""

from __future__ import annotations

from kvwire.session.receiver import ReceiverCore
from kvwire.wire import (
    Connection,
    Event,
)
from tests.session.receiver_harness import BPT, Harness

ONE_LAYER = 2 * 8 * BPT


def events_of(core: ReceiverCore, cid: int, client: Connection, now: float) -> list[Event]:
    """What connection ``cid``'s client reads of what the server has for it now."""
    out = core.data_to_send(cid)
    if out:
        client.receive_data(out, now)
    return list(iter(client.next_event, None))


def break_stream(h: Harness, cid: int) -> None:
    """The connection breaks (EOF, resumable) before its client read what the server sent."""
    h.core.receive_data(cid, b"", h.now)
    h.core.forget(cid)
