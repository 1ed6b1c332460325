"""Shared pieces of the fuzz harnesses: a server that a fixed handshake authenticates."""

from __future__ import annotations

import types
from collections import deque
from collections.abc import Callable
from enum import Enum
from typing import Any, Generic, TypeVar

from kvwire.wire import (
    ChunkReceived,
    ClientAuthenticated,
    Connection,
    ConnectionConfig,
    Role,
    State,
    TransferBegun,
)

T = TypeVar("T")

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


def _copy_state(obj: object, memo: dict[int, object]) -> object:
    """A copy of ``obj`` that shares nothing mutable with it: containers are copied, kvwire
    objects (a connection, its decoder, a session) attribute by attribute, kvwire closures
    and bound methods rebound to the copies of what they hold; immutable values (frozen
    frames and configs, enums, bytes, plain functions) shared.  ``memo`` keeps objects
    reachable twice (a session from two tables, a core from a closure) one object."""
    if not isinstance(obj, (bytearray, set, list, deque, dict, memoryview)) and not _is_state(obj):
        return obj
    done = memo.get(id(obj))
    if done is not None:
        return done
    clone: Any
    if isinstance(obj, (bytearray, set)):
        clone = memo[id(obj)] = obj.copy()
    elif isinstance(obj, memoryview):
        clone = memo[id(obj)] = memoryview(bytearray(obj))
    elif isinstance(obj, (list, deque)):
        clone = memo[id(obj)] = type(obj)()
        clone.extend(_copy_state(x, memo) for x in obj)
    elif isinstance(obj, dict):
        clone = memo[id(obj)] = type(obj)()
        for k, v in obj.items():
            clone[k] = _copy_state(v, memo)
    elif isinstance(obj, types.MethodType):
        clone = memo[id(obj)] = types.MethodType(obj.__func__, _copy_state(obj.__self__, memo))
    elif isinstance(obj, types.FunctionType):
        cells = tuple(
            types.CellType(_copy_state(c.cell_contents, memo)) if _cell_full(c) else types.CellType()
            for c in obj.__closure__ or ()
        )
        clone = memo[id(obj)] = types.FunctionType(
            obj.__code__, obj.__globals__, obj.__name__, obj.__defaults__, cells
        )
        clone.__kwdefaults__ = obj.__kwdefaults__
    else:
        clone = memo[id(obj)] = object.__new__(type(obj))
        if hasattr(obj, "__dict__"):
            for name, value in vars(obj).items():
                setattr(clone, name, _copy_state(value, memo))
        for name in getattr(type(obj), "__slots__", ()):
            if hasattr(obj, name):
                setattr(clone, name, _copy_state(getattr(obj, name), memo))
    return clone


def _cell_full(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


def _is_state(obj: object) -> bool:
    """A mutable kvwire object (not a frozen dataclass, an enum or a class), or a kvwire
    closure or method bound to one."""
    if isinstance(obj, types.MethodType):
        return _is_state(obj.__self__)
    if isinstance(obj, types.FunctionType):
        return bool(obj.__closure__) and obj.__module__.startswith("kvwire.")
    cls = type(obj)
    if not cls.__module__.startswith("kvwire.") or isinstance(obj, Enum):
        return False
    params = getattr(cls, "__dataclass_params__", None)
    return params is None or not params.frozen


class Cloner(Generic[T]):
    """Copies of one prototype (an opened ``Connection``, a ``ReceiverCore`` with an open
    session) that behave exactly as it would from here on, and share nothing mutable with
    it: opening a fresh one through the recorded handshake costs several times as much.
    The attributes that hold something mutable are found once."""

    def __init__(self, proto: T) -> None:
        self.proto = proto
        self._shared = {k: v for k, v in vars(proto).items() if _copy_state(v, {}) is v}
        self._copied = [k for k in vars(proto) if k not in self._shared]

    def __call__(self) -> T:
        proto = self.proto
        clone = object.__new__(type(proto))
        state = vars(clone)
        state.update(self._shared)
        memo: dict[int, object] = {id(proto): clone}
        for name in self._copied:
            state[name] = _copy_state(getattr(proto, name), memo)
        return clone


def same_state(a: object, b: object, _seen: set[tuple[int, int]] | None = None) -> bool:
    """Whether two connections or cores (or parts of them) hold equal state: the check
    that a clone is what replaying the handshake gives."""
    seen = set() if _seen is None else _seen
    if type(a) is not type(b):
        return False
    if (id(a), id(b)) in seen:
        return True
    seen.add((id(a), id(b)))
    if isinstance(a, memoryview):
        return True  # the decoder's scratch: contents are not state
    if isinstance(a, dict):
        assert isinstance(b, dict)
        return a.keys() == b.keys() and all(same_state(a[k], b[k], seen) for k in a)
    if isinstance(a, (list, deque)):
        assert isinstance(b, (list, deque))
        return len(a) == len(b) and all(same_state(x, y, seen) for x, y in zip(a, b, strict=True))
    if isinstance(a, types.MethodType):
        assert isinstance(b, types.MethodType)
        return a.__func__ is b.__func__ and same_state(a.__self__, b.__self__, seen)
    if isinstance(a, types.FunctionType) and _is_state(a):
        assert isinstance(b, types.FunctionType)
        ca, cb = a.__closure__ or (), b.__closure__ or ()
        return a.__code__ is b.__code__ and len(ca) == len(cb) and all(
            same_state(x.cell_contents, y.cell_contents, seen) for x, y in zip(ca, cb, strict=True)
        )
    if _is_state(a) and hasattr(a, "__dict__"):
        da, db = vars(a), vars(b)
        return da.keys() == db.keys() and all(same_state(da[k], db[k], seen) for k in da)
    return bool(a == b)


def mutable_parts(obj: object) -> dict[int, object]:
    """Every mutable object reachable from ``obj`` the way :class:`Cloner` copies it, by id:
    a clone and its prototype must have none in common."""
    found: dict[int, object] = {}
    todo = [obj]
    while todo:
        x = todo.pop()
        if id(x) in found:
            continue
        if isinstance(x, (bytearray, set, memoryview)):
            found[id(x)] = x
        elif isinstance(x, (list, deque)):
            found[id(x)] = x
            todo.extend(x)
        elif isinstance(x, dict):
            found[id(x)] = x
            todo.extend(x.values())
        elif _is_state(x):
            found[id(x)] = x
            if isinstance(x, types.MethodType):
                todo.append(x.__self__)
            elif isinstance(x, types.FunctionType):
                todo.extend(c.cell_contents for c in x.__closure__ or () if _cell_full(c))
            else:
                todo.extend(vars(x).values() if hasattr(x, "__dict__") else ())
                todo.extend(getattr(x, n) for n in getattr(type(x), "__slots__", ()) if hasattr(x, n))
    return found


def check_cloner(cloner: Cloner[T], fresh: Callable[[], T], use: Callable[[T], object]) -> None:
    """A clone holds what a fresh replay holds, shares nothing mutable with its prototype,
    and ``use`` on a clone leaves the prototype as it was."""
    clone = cloner()
    assert same_state(clone, fresh()), "a clone differs from a replayed handshake"
    shared = mutable_parts(clone).keys() & mutable_parts(cloner.proto).keys()
    assert not shared, f"a clone shares {len(shared)} mutable objects with its prototype"
    use(clone)
    assert not same_state(clone, cloner.proto), "using a clone changed nothing"
    assert same_state(cloner.proto, fresh()), "using a clone changed its prototype"


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
