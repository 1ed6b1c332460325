"""A TLS client that reaches a kvwire server without TLS sends a ClientHello first: its
record header reads as a frame header of type 0x16 announcing more than the handshake's
16 KiB, so the server refuses it with FRAME_TOO_LARGE.  The error it closes with (and logs)
says what the bytes were, a TLS ClientHello, where they are the first of the connection;
the code on the wire stays FRAME_TOO_LARGE."""

from __future__ import annotations

import ssl

import pytest

from kvwire.errors import ErrorCode, FrameTooLargeError
from kvwire.testing.memory import MemoryPair
from kvwire.wire import ConnectionClosed
from kvwire.wire.frames import HANDSHAKE_MAX_BODY, FrameDecoder, GoAway, Ping, encode_frame

TLS_HINT = "a TLS ClientHello"


def client_hello() -> bytes:
    """The first bytes a TLS client sends: its ClientHello record, as Python's ssl makes it."""
    ctx = ssl.create_default_context()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing, server_hostname="localhost")
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    data = outgoing.read()
    assert data[:2] == b"\x16\x03" and data[5] == 0x01  # a handshake record: ClientHello
    return data


@pytest.mark.parametrize("split", [None, 1, 3, 8])
def test_a_client_hello_first_is_named(split: int | None) -> None:
    hello = client_hello()
    dec = FrameDecoder(HANDSHAKE_MAX_BODY)
    pieces = [hello] if split is None else [hello[i:i + split] for i in range(0, len(hello), split)]
    with pytest.raises(FrameTooLargeError) as info:
        for piece in pieces:
            dec.feed(piece)
    assert TLS_HINT in str(info.value)
    assert "this server does not use TLS (or the client expects TLS)" in str(info.value)


def test_the_same_bytes_after_a_frame_are_a_frame_too_large() -> None:
    """Only the first bytes of a connection are taken for a ClientHello: later, the same
    header is a frame announcing too much, as any other."""
    ping = b"".join(bytes(p) for p in encode_frame(Ping(opaque=1)))
    for data in ([ping + client_hello()], [ping, client_hello()]):
        dec = FrameDecoder(HANDSHAKE_MAX_BODY)
        with pytest.raises(FrameTooLargeError) as info:
            for piece in data:
                dec.feed(piece)
                dec.raise_pending()
        assert TLS_HINT not in str(info.value)
        assert "frame type 0x16 announces" in str(info.value)


def test_another_oversized_first_header_is_not_called_tls() -> None:
    dec = FrameDecoder(HANDSHAKE_MAX_BODY)
    with pytest.raises(FrameTooLargeError) as info:
        dec.feed(b"\x16\x00\x00\x00\x00\x01\x00\x01")  # type 0x16, no TLS version
    assert TLS_HINT not in str(info.value)


def test_the_server_closes_with_frame_too_large_naming_the_client_hello() -> None:
    pair = MemoryPair.create()
    pair.server.receive_data(client_hello())
    events = []
    while (ev := pair.server.next_event()) is not None:
        events.append(ev)
    [closed] = [e for e in events if isinstance(e, ConnectionClosed)]
    assert closed.code == ErrorCode.FRAME_TOO_LARGE
    assert isinstance(closed.error, FrameTooLargeError)
    assert TLS_HINT in closed.message
    sent = b"".join(bytes(b) for b in pair.server.data_to_send())
    [(goaway, _)] = FrameDecoder(HANDSHAKE_MAX_BODY).feed(sent)
    assert isinstance(goaway, GoAway) and goaway.code == ErrorCode.FRAME_TOO_LARGE
