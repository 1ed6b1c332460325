"""The receiving side of kvwire sessions, sans-IO: every connection, session and transfer.

:class:`ReceiverCore` owns the server's connections (each a :class:`~kvwire.wire.Connection`
keyed by an id the I/O layer chooses), groups them into sessions, and runs every transfer:
admission and BEGIN validation, layer credit, storage of verified chunks, acknowledgements,
tombstones and the memory of completed transfers, the registry gate, resume after a broken
stream, and every deadline (transfer, resume grace, claim).  It never does I/O and never
reads a clock: bytes and ``now`` go in, bytes, events and a timer come out.

The registry gate is an event: :class:`RegistryCheck` asks the I/O layer to run
``check_many`` and answer with :meth:`ReceiverCore.registry_checked`; :class:`RegistryPublish`
asks for ``publish`` before the last acknowledgement is released
(:meth:`ReceiverCore.registry_published`).  The core never waits.

Memory: layer buffers come from ``allocate`` (may raise MemoryError) and are counted
against ``max_buffer_bytes`` until the application takes the layer or the transfer ends.
A chunk counts as received only after ``decode`` has put its bytes in place.
"""

from __future__ import annotations

import json
import secrets
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvwire.consistency.blocks import block_from_key
from kvwire.errors import (
    ConnectionLostError,
    ErrorCode,
    KvwireError,
    LimitExceededError,
    ProtocolError,
    StaleVersionError,
    TransferAbortedError,
    TransferTimeoutError,
    UsageError,
    error_from_code,
)
from kvwire.spec import DTYPE_BY_ID, DTYPES, KVSpec
from kvwire.wire import (
    Begin,
    Chunk,
    ChunkAddress,
    ChunkReceived,
    ChunkVerdict,
    ClientAuthenticated,
    Connection,
    ConnectionClosed,
    ConnectionConfig,
    HandshakeComplete,
    IncomingTransfer,
    Role,
    TransferBegun,
    TransferReset,
)
from kvwire.wire.connection import NO_SESSION

Key = tuple[bytes, int]
"""A transfer's identity on a server: (session id, transfer id)."""

Allocate = Callable[[int], memoryview]
Decode = Callable[[Chunk, memoryview], None]

#: Versions registries issue are below this; anything above was never issued.
MAX_BLOCK_VERSION = 1 << 53
#: Longest text this side puts in a RESET (peer text is never echoed back in full).
WIRE_TEXT_LIMIT = 160


def wire_text(text: str) -> str:
    return text if len(text) <= WIRE_TEXT_LIMIT else text[: WIRE_TEXT_LIMIT - 3] + "..."


def admit_begin(
    begin: Begin, *, active: int, max_transfers: int, max_meta_bytes: int,
    fingerprints: frozenset[bytes] | set[bytes] = frozenset(),
) -> tuple[KVSpec, dict[str, object]]:
    """Validate a BEGIN for a session with ``active`` transfers in progress or unclaimed.

    Returns the transfer's layout and meta; raises the error its RESET carries (section
    7.1 of docs/protocol.md): LIMIT_EXCEEDED, INCOMPATIBLE_SPEC or PROTOCOL_ERROR.
    """
    if active >= max_transfers:
        raise LimitExceededError(f"more than {max_transfers} transfers in progress")
    dtype = DTYPE_BY_ID.get(begin.dtype_id)
    if dtype is None:
        raise error_from_code(ErrorCode.INCOMPATIBLE_SPEC, f"unknown dtype id {begin.dtype_id}")
    try:
        spec = KVSpec(
            num_layers=begin.num_layers, num_kv_heads=begin.num_kv_heads, head_dim=begin.head_dim,
            dtype=dtype, model=begin.model,
        )
    except UsageError as exc:
        raise error_from_code(ErrorCode.INCOMPATIBLE_SPEC, str(exc)) from None
    if fingerprints and spec.fingerprint not in fingerprints:
        raise error_from_code(ErrorCode.INCOMPATIBLE_SPEC, f"this server does not accept KV layout {spec}")
    if len(begin.meta) > max_meta_bytes:
        raise LimitExceededError(f"meta of {len(begin.meta)} bytes exceeds max_meta_bytes={max_meta_bytes}")
    try:
        meta = json.loads(begin.meta) if begin.meta else {}
    except (ValueError, RecursionError):
        raise ProtocolError("BEGIN meta is not JSON") from None
    if not isinstance(meta, dict):
        raise ProtocolError("BEGIN meta is not a JSON object")
    try:
        for bv in begin.blocks:
            block_from_key(bv.block.decode("utf-8"))
    except (UnicodeDecodeError, UsageError):
        raise ProtocolError("BEGIN carries a malformed block id") from None
    return spec, meta


def check_chunk_size(chunk: Chunk, bytes_per_token: int, *, max_chunk_bytes: int, max_layer_bytes: int) -> None:
    """Refuse (LIMIT_EXCEEDED) a chunk that would decode beyond ``max_chunk_bytes`` or
    belongs to a layer beyond ``max_layer_bytes``, before anything is allocated or
    decompressed: the sizes come from the chunk's header, which the peer chose."""
    if chunk.token_count * bytes_per_token > max_chunk_bytes:
        raise LimitExceededError(
            f"a chunk of {chunk.token_count * bytes_per_token} bytes exceeds this server's max_chunk_bytes"
        )
    if 2 * chunk.layer_tokens * bytes_per_token > max_layer_bytes:
        raise LimitExceededError(
            f"a layer of {2 * chunk.layer_tokens * bytes_per_token} bytes exceeds this server's max_layer_bytes"
        )


def raw_decode(chunk: Chunk, dest: memoryview) -> None:
    """The ``raw`` codec: the payload is the data."""
    if chunk.codec_id != 0 or chunk.params:
        raise error_from_code(ErrorCode.UNSUPPORTED_CODEC, f"codec id {chunk.codec_id} is not accepted")
    if len(chunk.payload) != len(dest):
        raise ProtocolError(f"raw payload of {len(chunk.payload)} bytes, expected {len(dest)}")
    dest[:] = memoryview(chunk.payload).cast("B")


def byte_buffer(nbytes: int) -> memoryview:
    return memoryview(bytearray(nbytes))


@dataclass(frozen=True, slots=True, kw_only=True)
class ReceiverConfig:
    """Limits and deadlines of a receiving server (see ``kvwire.aio.ServerOptions``)."""

    secret: bytes
    codecs: tuple[str, ...] = ("raw",)
    max_frame_size: int = 4 * 1024 * 1024 + 64 * 1024
    window: int = 32 * 1024 * 1024
    max_transfers: int = 64
    max_sessions: int = 256
    max_streams: int = 64
    max_tokens: int = 256 * 1024
    transfer_buffer_bytes: int = 256 * 1024 * 1024
    max_layer_bytes: int = 1 << 30
    max_chunk_bytes: int = 64 << 20
    max_buffer_bytes: int = 4 << 30
    max_meta_bytes: int = 64 * 1024
    handshake_timeout: float = 10.0
    idle_timeout: float | None = 30.0
    transfer_timeout: float | None = 300.0
    resume_timeout: float = 10.0
    claim_timeout: float | None = 60.0
    registry: bool = False
    """Whether BEGINs with blocks go through the registry gate (RegistryCheck events)."""


# -- events for the I/O layer / application ------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferArrived:
    key: Key
    request_id: str
    meta: dict[str, object]
    num_layers: int
    layer_tokens_known: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerReady:
    key: Key
    layer: int


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferFailed:
    key: Key
    error: KvwireError


@dataclass(frozen=True, slots=True, kw_only=True)
class RegistryCheck:
    key: Key
    blocks: tuple[tuple[bytes, int], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class RegistryPublish:
    key: Key
    blocks: tuple[tuple[bytes, int], ...]


ReceiverEvent = TransferArrived | LayerReady | TransferFailed | RegistryCheck | RegistryPublish


# -- state ---------------------------------------------------------------------------------


@dataclass(eq=False)
class _Incoming:
    key: Key
    begin: Begin
    itemsize: int
    state: IncomingTransfer
    deadline: float | None
    accepted: bool = False
    claimed: bool = False
    claim_deadline: float | None = None
    error: KvwireError | None = None
    buffers: dict[int, memoryview] = field(default_factory=dict)
    held: int = 0
    taken: int = 0
    window: int = 1
    publish_pending: list[tuple[int, ChunkAddress]] = field(default_factory=list)
    published: bool = False
    gated: bool = False  # goes through the registry gate

    @property
    def bpt(self) -> int:
        return self.begin.num_kv_heads * self.begin.head_dim * self.itemsize

    @property
    def complete(self) -> bool:
        return self.state.complete and (self.published or not self.gated)


@dataclass(eq=False)
class _Session:
    session_id: bytes
    streams: dict[int, int] = field(default_factory=dict)  # stream index -> connection id
    transfers: dict[int, _Incoming] = field(default_factory=dict)
    tombstones: OrderedDict[int, KvwireError] = field(default_factory=OrderedDict)
    completed: OrderedDict[int, None] = field(default_factory=OrderedDict)
    lose_at: float | None = None
    closed: bool = False


class ReceiverCore:
    """Every connection, session and transfer of one receiving server (sans-IO)."""

    def __init__(
        self, config: ReceiverConfig, *, allocate: Allocate = byte_buffer, decode: Decode = raw_decode,
        nonce_source: Callable[[int], bytes] = secrets.token_bytes,
    ) -> None:
        self.config = config
        self._allocate = allocate
        self._decode = decode
        self._nonce = nonce_source
        self._conns: dict[int, Connection] = {}
        self._conn_session: dict[int, _Session] = {}
        self._sessions: dict[bytes, _Session] = {}
        self._events: deque[ReceiverEvent] = deque()
        self.buffered_bytes = 0
        self.counters: dict[str, int] = {}

    # -- connections ---------------------------------------------------------------------

    def connection_made(self, cid: int, now: float) -> None:
        cfg = self.config
        ccfg = ConnectionConfig(
            secret=cfg.secret, codecs=cfg.codecs, max_frame_size=cfg.max_frame_size,
            window=cfg.window, max_transfers=cfg.max_transfers,
            handshake_timeout=cfg.handshake_timeout, idle_timeout=cfg.idle_timeout,
        )
        self._conns[cid] = Connection(Role.SERVER, ccfg, now=now, nonce_source=self._nonce)

    def receive_data(self, cid: int, data: bytes, now: float) -> None:
        """Bytes from connection ``cid`` (``b""``: the peer closed or the connection broke)."""
        conn = self._conns.get(cid)
        if conn is None:
            return
        conn.receive_data(data, now)
        self._process(cid, now)

    def data_to_send(self, cid: int) -> bytes:
        conn = self._conns.get(cid)
        if conn is None:
            return b""
        return b"".join(bytes(p) for p in conn.data_to_send())

    def is_closed(self, cid: int) -> bool:
        """Whether the I/O layer should close ``cid`` once its last bytes are written."""
        conn = self._conns.get(cid)
        return conn is None or conn.closed_event is not None

    def forget(self, cid: int) -> None:
        """The I/O layer closed ``cid``; nothing more will come from it."""
        self._conns.pop(cid, None)
        self._conn_session.pop(cid, None)

    @property
    def connections(self) -> list[int]:
        return list(self._conns)

    # -- application ---------------------------------------------------------------------

    def next_event(self) -> ReceiverEvent | None:
        return self._events.popleft() if self._events else None

    def claim(self, key: Key) -> None:
        t = self._transfer(key)
        if t is not None:
            t.claimed = True
            t.claim_deadline = None

    def take_layer(self, key: Key, layer: int) -> tuple[bytes, bytes]:
        """The K and V bytes of a complete layer; its memory leaves the budget and the
        sender gets credit for one more layer."""
        t = self._transfer(key)
        if t is None or t.error is not None:
            raise ConnectionLostError("no such transfer")
        buf = t.buffers.pop(layer)
        half = len(buf) // 2
        out = (bytes(buf[:half]), bytes(buf[half:]))
        self._release(t, len(buf))
        t.taken += 1
        self._grant(t, t.taken + t.window)
        return out

    def abort(self, key: Key, reason: str, now: float) -> None:
        t = self._transfer(key)
        if t is None or t.error is not None:
            return
        self._count("transfers_aborted")
        self._fail(t, TransferAbortedError(f"receiver aborted: {reason}" if reason else "receiver aborted"),
                   reset=True, even_if_complete=True)

    def registry_checked(self, key: Key, stale: list[bytes] | None, error: KvwireError | None, now: float) -> None:
        """The answer to a :class:`RegistryCheck` (stale blocks, or the registry's error)."""
        t = self._transfer(key)
        if t is None or t.error is not None:
            return
        if error is not None or stale:
            self._count("transfers_refused")
            self._fail(t, error or StaleVersionError(f"stale prefix blocks: {stale!r}"[:200]), reset=True)
            return
        self._accept(t)

    def registry_published(self, key: Key, error: KvwireError | None, now: float) -> None:
        """The answer to a :class:`RegistryPublish`: the held acknowledgements go out."""
        t = self._transfer(key)
        if t is None:
            return
        pending, t.publish_pending = t.publish_pending, []
        if error is not None:
            self._fail(t, error, reset=True, even_if_complete=True)
        else:
            t.published = True
            self._finish_if_complete(t)
        for cid, address in pending:
            conn = self._conns.get(cid)
            if conn is not None:
                conn.send_ack(address)

    # -- time ----------------------------------------------------------------------------

    def get_timer(self) -> float | None:
        times = [c.get_timer() for c in self._conns.values()]
        for sess in self._sessions.values():
            times.append(sess.lose_at)
            for t in sess.transfers.values():
                times += [t.deadline, t.claim_deadline]
        real = [x for x in times if x is not None]
        return min(real) if real else None

    def handle_timer(self, now: float) -> None:
        for cid, conn in list(self._conns.items()):
            when = conn.get_timer()
            if when is not None and now >= when:
                conn.handle_timer(now)
                self._process(cid, now)
        for sess in list(self._sessions.values()):
            if sess.lose_at is not None and now >= sess.lose_at:
                self._lose(sess, ConnectionLostError("the client did not reconnect in time"))
                continue
            for t in list(sess.transfers.values()):
                if t.deadline is not None and now >= t.deadline and t.error is None:
                    self._fail(t, TransferTimeoutError(
                        f"transfer {t.begin.request_id!r} not complete after {self.config.transfer_timeout} s"
                    ), reset=True)
                elif t.claim_deadline is not None and now >= t.claim_deadline and not t.claimed:
                    self._count("transfers_unclaimed")
                    self.abort(t.key, "not claimed in time", now)

    # -- internals -----------------------------------------------------------------------

    def _count(self, what: str) -> None:
        self.counters[what] = self.counters.get(what, 0) + 1

    def _transfer(self, key: Key) -> _Incoming | None:
        sess = self._sessions.get(key[0])
        return sess.transfers.get(key[1]) if sess is not None else None

    def _any_conn(self, sess: _Session) -> Connection | None:
        for cid in sess.streams.values():
            conn = self._conns.get(cid)
            if conn is not None and conn.closed_event is None:
                return conn
        return None

    def _process(self, cid: int, now: float) -> None:
        conn = self._conns.get(cid)
        while conn is not None and (ev := conn.next_event()) is not None:
            try:
                if isinstance(ev, ChunkReceived):
                    self._on_chunk(cid, conn, ev)
                elif isinstance(ev, TransferBegun):
                    self._on_begin(cid, conn, ev.frame, now)
                elif isinstance(ev, ClientAuthenticated):
                    self._on_authenticated(conn, ev)
                elif isinstance(ev, HandshakeComplete):
                    self._on_open(cid, conn, ev)
                elif isinstance(ev, TransferReset):
                    sess = self._conn_session.get(cid)
                    t = sess.transfers.get(ev.transfer_id) if sess is not None else None
                    if t is not None:
                        self._fail(t, ev.error(), reset=False, tombstone=error_from_code(ev.code, "reset by the client"))
                elif isinstance(ev, ConnectionClosed):
                    self._on_closed(cid, ev, now)
            except KvwireError as exc:
                conn.close(exc.code, wire_text(str(exc)))

    def _on_authenticated(self, conn: Connection, ev: ClientAuthenticated) -> None:
        if ev.session_id == NO_SESSION:
            if len(self._sessions) >= self.config.max_sessions:
                conn.refuse(ErrorCode.LIMIT_EXCEEDED, "server has reached max_sessions")
                return
            sid = self._nonce(16)
            self._sessions[sid] = _Session(sid)
        else:
            sid = ev.session_id
            sess = self._sessions.get(sid)
            if sess is None or sess.closed:
                conn.refuse(ErrorCode.UNKNOWN_SESSION, "no such session")
                return
            old = sess.streams.pop(ev.stream_index, None)
            if old is not None and old in self._conns:
                self._conns[old].close(ErrorCode.SESSION_LOST, "replaced by a reconnected stream")
                self._conn_session.pop(old, None)
            if len(sess.streams) >= self.config.max_streams:
                conn.refuse(ErrorCode.LIMIT_EXCEEDED, "stream limit reached")
                return
        conn.welcome(sid, self.config.codecs)

    def _on_open(self, cid: int, conn: Connection, ev: HandshakeComplete) -> None:
        sess = self._sessions.get(ev.session_id)
        if sess is None:
            return
        sess.streams[ev.stream_index] = cid
        self._conn_session[cid] = sess
        if sess.lose_at is not None:
            sess.lose_at = None
            self._count("resumes")
        for t in sess.transfers.values():  # CREDIT frames may have been lost with a stream
            if t.error is None and t.accepted and t.state.layer_limit > 1:
                conn.send_credit_frame(t.key[1], t.state.layer_limit)

    def _on_closed(self, cid: int, ev: ConnectionClosed, now: float) -> None:
        sess = self._conn_session.pop(cid, None)
        if sess is None or sess.closed:
            return
        for index, c in list(sess.streams.items()):
            if c == cid:
                del sess.streams[index]
        if ev.resumable and self.config.resume_timeout > 0:
            if not any(self._conns.get(c) is not None and self._conns[c].closed_event is None
                       for c in sess.streams.values()) and sess.lose_at is None:
                sess.lose_at = now + self.config.resume_timeout
        elif ev.error is not None or any(not t.complete for t in sess.transfers.values()):
            self._lose(sess, ev.error or ConnectionLostError("client connection closed mid-transfer"))
        elif not sess.streams:
            self._sessions.pop(sess.session_id, None)

    def _lose(self, sess: _Session, error: KvwireError) -> None:
        sess.closed = True
        sess.lose_at = None
        for t in list(sess.transfers.values()):
            self._fail(t, error, reset=False)
        for c in sess.streams.values():
            conn = self._conns.get(c)
            if conn is not None:
                conn.close(ErrorCode.SESSION_LOST, "another stream of this session was lost")
        self._sessions.pop(sess.session_id, None)

    def _on_begin(self, cid: int, conn: Connection, begin: Begin, now: float) -> None:
        sess = self._conn_session.get(cid)
        if sess is None:
            raise ProtocolError("BEGIN before the session was set up")
        tid = begin.transfer_id
        existing = sess.transfers.get(tid)
        if existing is not None and existing.begin.request_id == begin.request_id:
            if existing.accepted:  # re-sent after a broken stream
                conn.send_accept(tid, existing.state.layer_limit)
            return
        if self._repeat_reset(sess, conn, tid):
            return
        cfg = self.config
        try:
            if tid in sess.transfers or tid in sess.completed:
                raise error_from_code(ErrorCode.DUPLICATE_TRANSFER, f"transfer id {tid} is already in use")
            active = sum(1 for t in sess.transfers.values() if not t.complete or not t.claimed)
            spec, meta = admit_begin(begin, active=active, max_transfers=cfg.max_transfers,
                                     max_meta_bytes=cfg.max_meta_bytes)
        except KvwireError as exc:
            self._count("transfers_refused")
            conn.send_reset(tid, exc.code, wire_text(str(exc)))
            return
        t = _Incoming(
            key=(sess.session_id, tid), begin=begin, itemsize=DTYPES[spec.dtype][1],
            state=IncomingTransfer(tid, begin.num_layers, layer_limit=1, max_tokens=cfg.max_tokens),
            deadline=None if cfg.transfer_timeout is None else now + cfg.transfer_timeout,
        )
        for old in [i for i, x in sess.transfers.items() if x.claimed and x.complete and not x.buffers]:
            del sess.transfers[old]
            sess.completed[old] = None
            while len(sess.completed) > 4096:
                sess.completed.popitem(last=False)
        sess.transfers[tid] = t
        self._events.append(TransferArrived(key=t.key, request_id=begin.request_id, meta=meta,
                                            num_layers=begin.num_layers))
        if cfg.claim_timeout is not None:
            t.claim_deadline = now + cfg.claim_timeout
        if cfg.registry and begin.blocks:
            t.gated = True
            blocks = tuple((bv.block, bv.version) for bv in begin.blocks)
            if any(not 0 <= v < MAX_BLOCK_VERSION for _, v in blocks):
                self._count("transfers_refused")
                self._fail(t, StaleVersionError("a block version was never issued"), reset=True)
                return
            self._events.append(RegistryCheck(key=t.key, blocks=blocks))
            return
        self._accept(t)

    def _accept(self, t: _Incoming) -> None:
        t.accepted = True
        sess = self._sessions.get(t.key[0])
        conn = self._any_conn(sess) if sess is not None else None
        if conn is not None:
            conn.send_accept(t.key[1], t.state.layer_limit)

    def _repeat_reset(self, sess: _Session, conn: Connection, tid: int) -> bool:
        error = sess.tombstones.get(tid)
        if error is None:
            return False
        conn.send_reset(tid, error.code, wire_text(str(error)))
        return True

    def _grant(self, t: _Incoming, limit: int) -> None:
        limit = min(limit, t.begin.num_layers)
        if limit <= t.state.layer_limit or t.error is not None:
            return
        t.state.layer_limit = limit
        sess = self._sessions.get(t.key[0])
        conn = self._any_conn(sess) if sess is not None else None
        if conn is not None and t.accepted:
            conn.send_credit_frame(t.key[1], limit)

    def _release(self, t: _Incoming, nbytes: int) -> None:
        nbytes = min(nbytes, t.held)
        t.held -= nbytes
        self.buffered_bytes -= nbytes

    def _fail(
        self, t: _Incoming, error: KvwireError, *, reset: bool, even_if_complete: bool = False,
        tombstone: KvwireError | None = None,
    ) -> None:
        if t.error is not None or (t.complete and not even_if_complete):
            return
        t.error = error
        t.buffers.clear()
        self._release(t, t.held)
        t.deadline = t.claim_deadline = None
        sess = self._sessions.get(t.key[0])
        if sess is not None:
            sess.transfers.pop(t.key[1], None)
            sess.tombstones[t.key[1]] = tombstone or error
            while len(sess.tombstones) > 4096:
                sess.tombstones.popitem(last=False)
            conn = self._any_conn(sess)
            if reset and conn is not None:
                conn.send_reset(t.key[1], error.code, wire_text(str(error)))
        self._events.append(TransferFailed(key=t.key, error=error))

    def _finish_if_complete(self, t: _Incoming) -> None:
        if t.complete:
            t.deadline = None

    def _on_chunk(self, cid: int, conn: Connection, ev: ChunkReceived) -> None:
        chunk = ev.chunk
        addr = chunk.address
        sess = self._conn_session.get(cid)
        if sess is None:
            conn.send_ack(addr)
            return
        t = sess.transfers.get(addr.transfer_id)
        if t is not None and t.error is None:
            try:
                new = self._store(t, chunk)
            except KvwireError as exc:
                self._fail(t, exc, reset=False)
            else:
                if t.gated and t.state.complete and not t.published:
                    t.publish_pending.append((cid, addr))
                    if new and len(t.publish_pending) == 1:
                        self._events.append(RegistryPublish(
                            key=t.key, blocks=tuple((bv.block, bv.version) for bv in t.begin.blocks),
                        ))
                    return
        if self._repeat_reset(sess, conn, addr.transfer_id):
            pass
        elif t is None and addr.transfer_id not in sess.completed:
            conn.send_reset(addr.transfer_id, ErrorCode.PROTOCOL_ERROR, "no such transfer")
        conn.send_ack(addr)

    def _store(self, t: _Incoming, chunk: Chunk) -> bool:
        """Verify and store a chunk; True when it was new.  Raises KvwireError to reset."""
        if not t.accepted:
            raise ProtocolError("CHUNK before the transfer was accepted")
        first = t.state.layer_tokens is None
        t.state.check(chunk)
        bpt = t.bpt
        check_chunk_size(chunk, bpt, max_chunk_bytes=self.config.max_chunk_bytes,
                         max_layer_bytes=self.config.max_layer_bytes)
        layer_bytes = 2 * chunk.layer_tokens * bpt
        if first:
            t.window = max(1, self.config.transfer_buffer_bytes // max(1, layer_bytes))
            self._grant(t, t.taken + t.window)
        if t.state.classify(chunk) is ChunkVerdict.DUPLICATE:
            t.state.add(chunk)
            return False
        try:
            buf = t.buffers.get(chunk.layer)
            if buf is None:
                if self.buffered_bytes + layer_bytes > self.config.max_buffer_bytes:
                    raise LimitExceededError("the server's max_buffer_bytes is reached")
                buf = self._allocate(layer_bytes)
                self.buffered_bytes += layer_bytes
                t.held += layer_bytes
                t.buffers[chunk.layer] = buf
            half = layer_bytes // 2
            start = chunk.kind * half + chunk.token_start * bpt
            self._decode(chunk, buf[start : start + chunk.token_count * bpt])
        except KvwireError:
            raise
        except MemoryError:
            raise LimitExceededError("out of memory storing a chunk") from None
        except Exception as exc:
            raise ProtocolError(f"chunk could not be decoded ({type(exc).__name__})") from exc
        t.state.add(chunk)
        if t.state.layer_complete(chunk.layer):
            self._events.append(LayerReady(key=t.key, layer=chunk.layer))
            if t.state.complete and not t.gated:
                t.deadline = None
        return True


__all__ = [
    "Key",
    "LayerReady",
    "ReceiverConfig",
    "ReceiverCore",
    "ReceiverEvent",
    "RegistryCheck",
    "RegistryPublish",
    "TransferArrived",
    "TransferFailed",
    "admit_begin",
    "check_chunk_size",
    "raw_decode",
    "wire_text",
]
