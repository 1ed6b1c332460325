"""Shared pieces of the fuzz harnesses: a server that a fixed handshake authenticates."""

from __future__ import annotations

from kvwire.wire import (
    ChunkReceived,
    ClientAuthenticated,
    Connection,
    ConnectionConfig,
    Role,
    State,
    TransferBegun,
)

SECRET = b"fuzz-secret-0123"
MAX_FRAME = 64 * 1024


def fixed_nonce(n: int) -> bytes:
    """Fixed nonces make the recorded HELLO/AUTH valid for every fresh server."""
    return b"\x5a" * n


def new_server() -> Connection:
    cfg = ConnectionConfig(
        secret=SECRET, max_frame_size=MAX_FRAME, window=2 * MAX_FRAME, max_transfers=4,
    )
    return Connection(Role.SERVER, cfg, now=0.0, nonce_source=fixed_nonce)


def handshake_bytes() -> tuple[bytes, bytes]:
    """HELLO and AUTH of a real client against ``new_server()``."""
    client = Connection(Role.CLIENT, ConnectionConfig(secret=SECRET), nonce_source=fixed_nonce)
    client.initiate()
    hello = b"".join(bytes(p) for p in client.data_to_send())
    server = new_server()
    server.receive_data(hello)
    client.receive_data(b"".join(bytes(p) for p in server.data_to_send()))
    auth = b"".join(bytes(p) for p in client.data_to_send())
    return hello, auth


def pump(conn: Connection) -> list[object]:
    """Handle events the way kvwire.aio's server does (welcome, accept, ack)."""
    events = []
    while (ev := conn.next_event()) is not None:
        events.append(ev)
        if isinstance(ev, ClientAuthenticated):
            # A frame pipelined behind AUTH may already have closed the connection;
            # welcome() would then be a UsageError, which the asyncio shell turns into a close.
            if conn.state is State.SERVER_AUTHENTICATED:
                conn.welcome(b"S" * 16, ("raw",))
        elif isinstance(ev, TransferBegun):
            conn.send_accept(ev.frame.transfer_id, 1)
        elif isinstance(ev, ChunkReceived):
            conn.send_ack(ev.chunk.address)
    conn.data_to_send()
    return events


def fix_crcs(data: bytes) -> bytes:
    """Rewrite the CRC32C of every frame in ``data`` (as framed by its own headers), so
    mutated bodies get past the integrity check and reach the frame parsers and the
    state machine.  A trailing partial frame is left as it is."""
    from crc32c import crc32c

    out = bytearray(data)
    pos = 0
    while pos + 8 <= len(out):
        length = int.from_bytes(out[pos + 4 : pos + 8], "big")
        end = pos + 8 + length
        if end + 4 > len(out):
            break
        out[end : end + 4] = crc32c(bytes(out[end - length : end]), crc32c(bytes(out[pos : pos + 8]))).to_bytes(4, "big")
        pos = end + 4
    return bytes(out)
