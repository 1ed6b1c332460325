"""A server reads a HELLO's magic and version range before the rest of it (protocol 5.4):
a range it shares no version with is refused with UNSUPPORTED_VERSION whatever follows,
since a later version's HELLO may lay out its other fields otherwise."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.errors import ErrorCode
from kvwire.wire import (
    PROTOCOL_VERSION,
    Connection,
    ConnectionClosed,
    ConnectionConfig,
    FrameDecoder,
    FrameType,
    GoAway,
    Hello,
    Role,
    frame_bytes,
)
from kvwire.wire.crc import crc32c
from kvwire.wire.frames import HANDSHAKE_MAX_BODY, MAGIC, MIN_PROTOCOL_VERSION

SECRET = b"test-secret"
U16 = 0xFFFF


def raw_frame(ftype: int, body: bytes) -> bytes:
    head = struct.pack(">BBHI", ftype, 0, 0, len(body))
    return head + body + struct.pack(">I", crc32c(head + body))


def hello_body(vmin: int, vmax: int) -> bytes:
    hello = Hello(min_version=vmin, max_version=vmax, nonce=b"n" * 32, session_id=bytes(16), stream_index=0,
                  max_frame_size=1 << 20, codecs=("raw",), fingerprint=bytes(16))
    return frame_bytes(hello)[8:-4]


def answer(data: bytes, *, server_max: int = PROTOCOL_VERSION, split: int | None = None) -> tuple[GoAway, ConnectionClosed]:
    """What a server connection answers to ``data`` (fed at once, or in two reads)."""
    server = Connection(Role.SERVER, ConnectionConfig(secret=SECRET, max_version=server_max))
    if split is None:
        server.receive_data(data)
    else:
        server.receive_data(data[:split])
        server.receive_data(data[split:])
    out = b"".join(bytes(p) for p in server.data_to_send())
    [(goaway, _)] = FrameDecoder(1 << 16).feed(out)
    assert isinstance(goaway, GoAway)
    events = []
    while (ev := server.next_event()) is not None:
        events.append(ev)
    [closed] = events
    assert isinstance(closed, ConnectionClosed)
    return goaway, closed


@st.composite
def unshared_ranges(draw: st.DrawFn) -> tuple[int, int, int]:
    """(server max_version, min_version, max_version): a well-formed range that shares no
    version with [MIN_PROTOCOL_VERSION, server max_version]."""
    top = draw(st.integers(MIN_PROTOCOL_VERSION, PROTOCOL_VERSION))
    if draw(st.booleans()):
        vmin = draw(st.integers(top + 1, U16))
        vmax = draw(st.integers(vmin, U16))
    else:
        vmax = draw(st.integers(0, MIN_PROTOCOL_VERSION - 1))
        vmin = draw(st.integers(0, vmax))
    return top, vmin, vmax


@settings(max_examples=300, deadline=None)
@given(
    unshared_ranges(),
    st.one_of(st.binary(max_size=200), st.binary(max_size=HANDSHAKE_MAX_BODY - 12)),
    st.data(),
)
def test_a_hello_sharing_no_version_is_unsupported_version_whatever_follows_the_range(
    versions: tuple[int, int, int], rest: bytes, data: st.DataObject,
) -> None:
    top, vmin, vmax = versions
    frame = raw_frame(FrameType.HELLO, MAGIC + struct.pack(">HH", vmin, vmax) + rest)
    split = data.draw(st.none() | st.integers(1, len(frame) - 1))
    goaway, closed = answer(frame, server_max=top, split=split)
    assert goaway.code == ErrorCode.UNSUPPORTED_VERSION
    assert goaway.message == ""  # nothing told to an unauthenticated peer (5.8)
    assert closed.code == ErrorCode.UNSUPPORTED_VERSION and not closed.by_peer


@pytest.mark.parametrize("body", [
    hello_body(3, 3) + b"\x00" * 8,  # a later version's HELLO with one more field
    hello_body(3, 3)[:-16],  # ... or one field fewer
    hello_body(3, 5)[:12],  # the range alone
    hello_body(0, 0)[:20],
], ids=["one-more-field", "one-field-fewer", "range-alone", "version-0-cut"])
def test_a_later_versions_hello_laid_out_otherwise_is_unsupported_version(body: bytes) -> None:
    goaway, _ = answer(raw_frame(FrameType.HELLO, body))
    assert (goaway.code, goaway.message) == (ErrorCode.UNSUPPORTED_VERSION, "")


def test_the_server_checks_its_own_max_version() -> None:
    goaway, _ = answer(raw_frame(FrameType.HELLO, hello_body(2, 3) + b"\x00"), server_max=1)
    assert goaway.code == ErrorCode.UNSUPPORTED_VERSION


@pytest.mark.parametrize(("body", "reason"), [
    (hello_body(5, 3) + b"\x00" * 8, "trailing"),  # min > max: malformed, whatever follows
    (hello_body(5, 3)[:-16], "truncated"),
    (hello_body(3, 3)[:11], "truncated"),  # too short to hold the range
    (b"", "truncated"),
    (b"NOTKVWIR" + hello_body(3, 3)[8:] + b"\x00", "magic"),  # not a kvwire peer
    (hello_body(1, 2) + b"\x00" * 8, "trailing"),  # a range the server shares: parsed as its own
    (hello_body(2, 9)[:-1], "truncated"),
], ids=["min-above-max-longer", "min-above-max-shorter", "no-room-for-range", "empty", "bad-magic",
        "shared-range-longer", "shared-range-shorter"])
def test_malformed_hellos_stay_protocol_errors(body: bytes, reason: str) -> None:
    goaway, closed = answer(raw_frame(FrameType.HELLO, body))
    assert (goaway.code, goaway.message) == (ErrorCode.PROTOCOL_ERROR, "")
    assert reason in closed.message


def test_a_second_hello_laid_out_otherwise_is_a_protocol_error() -> None:
    server = Connection(Role.SERVER, ConnectionConfig(secret=SECRET))
    server.receive_data(raw_frame(FrameType.HELLO, hello_body(1, 2)))
    server.data_to_send()
    server.receive_data(raw_frame(FrameType.HELLO, hello_body(3, 3) + b"\x00" * 8))
    closed = [e for e in iter(server.next_event, None) if isinstance(e, ConnectionClosed)]
    assert [c.code for c in closed] == [ErrorCode.PROTOCOL_ERROR]
