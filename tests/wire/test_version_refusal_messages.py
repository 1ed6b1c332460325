"""When no protocol version is shared, each side's error names the versions: the client's
says what it offered, the server's (for its own log) what the client offered and what the
server speaks; the GOAWAY itself carries no message before AUTH (protocol 5.8)."""

from __future__ import annotations

import struct

import pytest

from kvwire.errors import ErrorCode, IncompatiblePeerError
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
    State,
    frame_bytes,
)
from kvwire.wire.crc import crc32c

SECRET = b"test-secret"


def closed_event(conn: Connection) -> ConnectionClosed:
    [closed] = [e for e in iter(conn.next_event, None) if isinstance(e, ConnectionClosed)]
    return closed


@pytest.mark.parametrize("client_max", range(1, PROTOCOL_VERSION + 1))
def test_the_client_says_which_versions_it_offered(client_max: int) -> None:
    client = Connection(Role.CLIENT, ConnectionConfig(secret=SECRET, max_version=client_max))
    client.initiate()
    client.data_to_send()
    client.receive_data(frame_bytes(GoAway(code=ErrorCode.UNSUPPORTED_VERSION, message="")))
    err = closed_event(client).error
    assert isinstance(err, IncompatiblePeerError) and err.code == ErrorCode.UNSUPPORTED_VERSION
    assert str(err) == f"the server speaks none of the protocol versions this client offered (1..{client_max})"


def test_a_message_the_server_gave_anyway_is_kept() -> None:
    client = Connection(Role.CLIENT, ConnectionConfig(secret=SECRET))
    client.initiate()
    client.receive_data(frame_bytes(GoAway(code=ErrorCode.UNSUPPORTED_VERSION, message="only version 7")))
    err = closed_event(client).error
    assert isinstance(err, IncompatiblePeerError)
    assert f"(1..{PROTOCOL_VERSION})" in str(err) and str(err).endswith("the server said: only version 7")


def server_refusal(body: bytes, server_max: int = PROTOCOL_VERSION) -> tuple[GoAway, ConnectionClosed]:
    server = Connection(Role.SERVER, ConnectionConfig(secret=SECRET, max_version=server_max))
    head = struct.pack(">BBHI", FrameType.HELLO, 0, 0, len(body))
    server.receive_data(head + body + struct.pack(">I", crc32c(head + body)))
    [(goaway, _)] = FrameDecoder(1 << 16).feed(b"".join(bytes(p) for p in server.data_to_send()))
    assert isinstance(goaway, GoAway)
    return goaway, closed_event(server)


def hello_body(vmin: int, vmax: int) -> bytes:
    return frame_bytes(Hello(min_version=vmin, max_version=vmax, nonce=b"n" * 32, session_id=bytes(16),
                             stream_index=0, max_frame_size=1 << 20, codecs=("raw",), fingerprint=bytes(16)))[8:-4]


@pytest.mark.parametrize(("vmin", "vmax", "server_max", "extra"), [
    (3, 5, PROTOCOL_VERSION, b""),
    (0, 0, PROTOCOL_VERSION, b""),
    (2, 4, 1, b""),
    (3, 3, PROTOCOL_VERSION, b"\x00" * 8),  # a later version's HELLO laid out otherwise
], ids=["later", "version-0", "server-speaks-1", "later-layout"])
def test_the_server_says_what_the_client_offered_and_what_it_speaks(
    vmin: int, vmax: int, server_max: int, extra: bytes,
) -> None:
    goaway, closed = server_refusal(hello_body(vmin, vmax) + extra, server_max)
    assert (goaway.code, goaway.message) == (ErrorCode.UNSUPPORTED_VERSION, "")
    assert closed.code == ErrorCode.UNSUPPORTED_VERSION
    expected = f"the client offered protocol versions {vmin}..{vmax}; this server speaks 1..{server_max}"
    assert closed.message == expected
    assert isinstance(closed.error, IncompatiblePeerError) and str(closed.error) == expected


def test_the_client_keeps_the_message_of_a_refusal_after_auth() -> None:
    # (a join refused for its version, 6.1: the client proved the secret, so the server says why)
    client = Connection(Role.CLIENT, ConnectionConfig(secret=SECRET))
    client.initiate()
    client.state = State.CLIENT_AUTH_SENT
    client.receive_data(frame_bytes(GoAway(code=ErrorCode.UNSUPPORTED_VERSION, message="session speaks 1")))
    err = closed_event(client).error
    assert isinstance(err, IncompatiblePeerError) and str(err) == "session speaks 1"
