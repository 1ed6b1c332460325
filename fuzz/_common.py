"""Shared pieces of the fuzz harnesses: a server that a fixed handshake authenticates."""

from __future__ import annotations

from collections import deque
from enum import Enum

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


def _copy_state(obj: object) -> object:
    """A copy of ``obj`` that shares nothing mutable with it: containers are copied, plain
    objects (the decoder, a big frame in progress) copied attribute by attribute, frozen
    values (frames, config, enums, bytes) shared.  Used to clone an opened Connection."""
    if isinstance(obj, (bytearray, set, frozenset, bytes)):
        return obj.copy() if isinstance(obj, (bytearray, set)) else obj
    if isinstance(obj, (list, deque)):
        return type(obj)(_copy_state(x) for x in obj)
    if isinstance(obj, dict):
        return type(obj)((k, _copy_state(v)) for k, v in obj.items())
    if isinstance(obj, memoryview):
        return memoryview(bytearray(obj))
    if not _is_state(obj):
        return obj
    if hasattr(obj, "__dict__"):
        clone = object.__new__(type(obj))
        for name, value in vars(obj).items():
            setattr(clone, name, _copy_state(value))
        return clone
    if hasattr(type(obj), "__slots__"):
        clone = object.__new__(type(obj))
        slots: tuple[str, ...] = type(obj).__slots__  # type: ignore[attr-defined]
        for name in slots:
            if hasattr(obj, name):
                setattr(clone, name, _copy_state(getattr(obj, name)))
        return clone
    return obj


def _is_state(obj: object) -> bool:
    """A mutable kvwire object (not a frozen dataclass, an enum, a class or a function)."""
    cls = type(obj)
    if not cls.__module__.startswith("kvwire.") or isinstance(obj, Enum):
        return False
    params = getattr(cls, "__dataclass_params__", None)
    return params is None or not params.frozen


def clone_connection(conn: Connection) -> Connection:
    """A copy of ``conn`` that behaves exactly as ``conn`` would from here on (a fresh
    server through the recorded handshake costs about 15 times as much as a new one)."""
    return _copy_state(conn)  # type: ignore[return-value]


class Cloner:
    """:func:`clone_connection` of one prototype, many times: the attributes that hold
    something mutable are found once; each clone shares the rest with the prototype."""

    def __init__(self, proto: Connection) -> None:
        self.proto = proto
        self._shared = {k: v for k, v in vars(proto).items() if _copy_state(v) is v}
        self._copied = [k for k in vars(proto) if k not in self._shared]

    def __call__(self) -> Connection:
        proto = self.proto
        clone = object.__new__(type(proto))
        state = vars(clone)
        state.update(self._shared)
        for name in self._copied:
            state[name] = _copy_state(getattr(proto, name))
        return clone


def same_state(a: object, b: object) -> bool:
    """Whether two connections (or parts of them) hold equal state."""
    if type(a) is not type(b):
        return False
    if isinstance(a, memoryview):
        return True  # the decoder's scratch: contents are not state
    if _is_state(a) and hasattr(a, "__dict__"):
        da, db = vars(a), vars(b)
        return da.keys() == db.keys() and all(same_state(da[k], db[k]) for k in da)
    return bool(a == b)


def pump(conn: Connection) -> list[object]:
    """Handle events the way kvwire.aio's server does (welcome, accept, ack)."""
    events: list[object] = []
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


#: The id ReceiverCore gives the first session when its nonces are ``fixed_nonce``.
SESSION_ID = fixed_nonce(16)


def session_handshake_bytes() -> list[tuple[bytes, bytes]]:
    """HELLO and AUTH of three client streams against a ``ReceiverCore`` with fixed nonces:
    a new session (stream 0), a second stream of that session (stream 1), and stream 0
    again (a resume after it broke)."""
    from kvwire.session.receiver import ReceiverConfig, ReceiverCore

    out = []
    for session_id, index in ((bytes(16), 0), (SESSION_ID, 1), (SESSION_ID, 0)):
        client = Connection(
            Role.CLIENT, ConnectionConfig(secret=SECRET, session_id=session_id, stream_index=index),
            nonce_source=fixed_nonce,
        )
        client.initiate()
        hello = b"".join(bytes(p) for p in client.data_to_send())
        core = ReceiverCore(ReceiverConfig(secret=SECRET), nonce_source=fixed_nonce)
        core.connection_made(0, 0.0)
        core.receive_data(0, hello, 0.0)
        client.receive_data(core.data_to_send(0))
        out.append((hello, b"".join(bytes(p) for p in client.data_to_send())))
    return out
