"""The sending side of a kvwire session, sans-IO: N connections, transfers, credit, resume.

:class:`SenderCore` owns one client session: its stream slots (each a
:class:`~kvwire.wire.Connection` while connected), the transfers in flight, which chunk goes
on which stream (the one with the most connection credit, only for layers the receiver
granted), acknowledgements, RESETs, and resume: when a stream breaks, what it carried
unacknowledged goes back into the re-send set, and a reconnect of its slot is due after a
doubling backoff (:class:`StreamWanted` tells the I/O layer to open one).  Reconnects are
bounded per session and per transfer.  Every deadline goes through
:meth:`SenderCore.get_timer` / :meth:`SenderCore.handle_timer`; ``now`` is always passed in.
"""

from __future__ import annotations

import secrets
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvwire.errors import (
    ConnectionLostError,
    ErrorCode,
    KvwireError,
    TransferTimeoutError,
    UsageError,
)
from kvwire.wire import (
    Begin,
    BlockVersion,
    Chunk,
    ChunkAcked,
    Connection,
    ConnectionClosed,
    ConnectionConfig,
    CreditGranted,
    HandshakeComplete,
    OutgoingTransfer,
    Role,
    SentChunk,
    State,
    TransferAccepted,
    TransferReset,
    chunk_frame_size,
)
from kvwire.wire.connection import NO_SESSION


@dataclass(frozen=True, slots=True, kw_only=True)
class SenderConfig:
    """Settings of a client session (see ``kvwire.aio.ClientOptions``)."""

    secret: bytes
    streams: int = 1
    codecs: tuple[str, ...] = ("raw",)
    max_frame_size: int = 4 * 1024 * 1024 + 64 * 1024
    connect_timeout: float = 10.0
    idle_timeout: float | None = 30.0
    reconnect_attempts: int = 5
    reconnect_backoff: float = 0.05
    max_reconnects: int = 32
    max_transfer_reconnects: int = 8
    transfer_timeout: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamWanted:
    """Open a TCP connection for stream slot ``index`` and call ``stream_opened``."""

    index: int


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferDone:
    transfer_id: int
    chunks: int
    wire_bytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferFailed:
    transfer_id: int
    error: KvwireError


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionFailed:
    error: KvwireError


SenderEvent = StreamWanted | TransferDone | TransferFailed | SessionFailed


@dataclass(eq=False)
class _Transfer:
    state: OutgoingTransfer
    begin: Begin
    deadline: float | None
    queue: deque[tuple[Chunk, int]] = field(default_factory=deque)  # not yet on a stream
    error: KvwireError | None = None
    reconnects: int = 0
    done: bool = False


@dataclass(eq=False)
class _Slot:
    conn: Connection | None = None
    open: bool = False
    attempts: int = 0
    reconnect_at: float | None = None
    wanted: bool = False


class SenderCore:
    """One client session (sans-IO)."""

    def __init__(self, config: SenderConfig, *, nonce_source: Callable[[int], bytes] = secrets.token_bytes) -> None:
        if config.streams < 1:
            raise UsageError("streams must be >= 1")
        self.config = config
        self._nonce = nonce_source
        self.session_id = NO_SESSION
        self._slots = [_Slot() for _ in range(config.streams)]
        self._transfers: dict[int, _Transfer] = {}
        self._next_id = 1
        self._events: deque[SenderEvent] = deque()
        self.broken: KvwireError | None = None
        self.resumes = 0
        self.chunks_resent = 0
        self._want(0)  # the first stream creates the session; the others join it

    # -- streams -------------------------------------------------------------------------

    def _want(self, index: int) -> None:
        slot = self._slots[index]
        if not slot.wanted:
            slot.wanted = True
            self._events.append(StreamWanted(index=index))

    def stream_opened(self, index: int, now: float) -> None:
        """The I/O layer connected slot ``index``: the handshake starts."""
        cfg = self.config
        slot = self._slots[index]
        slot.wanted = False
        slot.open = False
        slot.conn = Connection(Role.CLIENT, ConnectionConfig(
            secret=cfg.secret, codecs=cfg.codecs, max_frame_size=cfg.max_frame_size,
            session_id=self.session_id, stream_index=index, handshake_timeout=cfg.connect_timeout,
            idle_timeout=cfg.idle_timeout,
        ), now=now, nonce_source=self._nonce)
        slot.conn.initiate()

    def stream_failed(self, index: int, now: float) -> None:
        """Connecting slot ``index`` failed (refused, unreachable)."""
        self._slots[index].wanted = False
        self._slots[index].conn = None
        self._retry(index, now, ConnectionLostError(f"cannot connect stream {index}"))

    def receive_data(self, index: int, data: bytes, now: float) -> None:
        conn = self._slots[index].conn
        if conn is None:
            return
        conn.receive_data(data, now)
        self._process(index, now)
        self._pump()

    def data_to_send(self, index: int) -> bytes:
        conn = self._slots[index].conn
        return b"" if conn is None else b"".join(bytes(p) for p in conn.data_to_send())

    def is_closed(self, index: int) -> bool:
        conn = self._slots[index].conn
        return conn is not None and conn.closed_event is not None

    def next_event(self) -> SenderEvent | None:
        return self._events.popleft() if self._events else None

    @property
    def open_streams(self) -> list[int]:
        return [i for i, s in enumerate(self._slots) if s.open]

    # -- transfers -----------------------------------------------------------------------

    def begin(
        self, request_id: str, *, num_layers: int, num_kv_heads: int, head_dim: int, dtype_id: int = 1,
        model: str = "", meta: bytes = b"{}", blocks: tuple[BlockVersion, ...] = (), now: float,
    ) -> int:
        """Start a transfer; returns its id.  Chunks follow with :meth:`add_chunk`."""
        if self.broken is not None:
            raise self.broken
        tid = self._next_id
        self._next_id += 1
        begin = Begin(transfer_id=tid, num_layers=num_layers, num_kv_heads=num_kv_heads,
                      head_dim=head_dim, dtype_id=dtype_id, model=model, request_id=request_id,
                      meta=meta, blocks=blocks)
        timeout = self.config.transfer_timeout
        self._transfers[tid] = _Transfer(OutgoingTransfer(tid, num_layers), begin,
                                         None if timeout is None else now + timeout)
        for slot in self._slots:
            if slot.open and slot.conn is not None:
                slot.conn.send_begin(begin)
                break
        return tid

    def add_chunk(self, transfer_id: int, chunk: Chunk) -> None:
        t = self._transfers.get(transfer_id)
        if t is None or t.error is not None:
            return
        t.queue.append((chunk, chunk_frame_size(len(chunk.params), len(chunk.payload))))
        self._pump()

    def producer_done(self, transfer_id: int) -> None:
        t = self._transfers.get(transfer_id)
        if t is not None and t.error is None:
            t.state.producer_done = True
            self._check_done(t)

    def abort(self, transfer_id: int, error: KvwireError) -> None:
        t = self._transfers.get(transfer_id)
        if t is not None:
            self._fail(t, error, reset=True)

    # -- time ----------------------------------------------------------------------------

    def get_timer(self) -> float | None:
        times: list[float | None] = []
        for s in self._slots:
            times.append(s.reconnect_at)
            if s.conn is not None:
                times.append(s.conn.get_timer())
        times += [t.deadline for t in self._transfers.values()]
        real = [x for x in times if x is not None]
        return min(real) if real else None

    def handle_timer(self, now: float) -> None:
        for i, s in enumerate(self._slots):
            if s.conn is not None:
                when = s.conn.get_timer()
                if when is not None and now >= when:
                    s.conn.handle_timer(now)
                    self._process(i, now)
            if s.reconnect_at is not None and now >= s.reconnect_at:
                s.reconnect_at = None
                self._want(i)
        for t in list(self._transfers.values()):
            if t.deadline is not None and now >= t.deadline:
                self._fail(t, TransferTimeoutError(f"transfer {t.begin.request_id!r} did not complete in time"),
                           reset=True)
        self._pump()

    # -- internals -----------------------------------------------------------------------

    def _process(self, index: int, now: float) -> None:
        slot = self._slots[index]
        conn = slot.conn
        while conn is not None and (ev := conn.next_event()) is not None:
            if isinstance(ev, ChunkAcked):
                t = self._transfers.get(ev.address.transfer_id)
                if t is not None:
                    t.state.on_ack(ev.address)
                    self._check_done(t)
            elif isinstance(ev, TransferAccepted | CreditGranted):
                t = self._transfers.get(ev.transfer_id)
                if t is not None:
                    if isinstance(ev, TransferAccepted):
                        t.state.accepted = True
                    t.state.raise_limit(ev.layer_limit)
            elif isinstance(ev, TransferReset):
                t = self._transfers.get(ev.transfer_id)
                if t is not None:
                    self._fail(t, ev.error(), reset=False)
            elif isinstance(ev, HandshakeComplete):
                self._on_open(index, ev)
            elif isinstance(ev, ConnectionClosed):
                self._on_closed(index, ev, now)

    def _on_open(self, index: int, ev: HandshakeComplete) -> None:
        slot = self._slots[index]
        if self.session_id == NO_SESSION:
            self.session_id = ev.session_id
            for i in range(1, len(self._slots)):
                self._want(i)
        slot.open = True
        slot.attempts = 0
        assert slot.conn is not None
        for t in self._transfers.values():  # a BEGIN lost with a broken stream goes again
            if not t.state.accepted and t.error is None:
                slot.conn.send_begin(t.begin)

    def _on_closed(self, index: int, ev: ConnectionClosed, now: float) -> None:
        slot = self._slots[index]
        was_open = slot.open
        slot.open = False
        slot.conn = None
        if self.broken is not None:
            return
        if self.session_id == NO_SESSION:
            self._break(ev.error or ConnectionLostError("the first stream closed during the handshake"))
            return
        if ev.code == ErrorCode.UNKNOWN_SESSION or (ev.error is not None and not ev.resumable and not was_open):
            self._break(ev.error or ConnectionLostError("the receiver lost the session"))
            return
        self._requeue(index)
        clean = ev.goaway and ev.code == ErrorCode.NO_ERROR and self.open_streams
        if clean:
            return
        if not ev.resumable and was_open:
            self._break(ev.error or ConnectionLostError(f"stream {index} closed"))
            return
        if was_open:
            self.resumes += 1
            if self.resumes > self.config.max_reconnects:
                self._break(ConnectionLostError(f"gave up after {self.config.max_reconnects} reconnects"))
                return
            for t in list(self._transfers.values()):
                t.reconnects += 1
                if t.reconnects > self.config.max_transfer_reconnects:
                    self._fail(t, ConnectionLostError("the transfer lived through too many broken streams"),
                               reset=True)
        self._retry(index, now, ev.error or ConnectionLostError(f"stream {index} broke"))

    def _retry(self, index: int, now: float, error: KvwireError) -> None:
        slot = self._slots[index]
        if self.config.reconnect_attempts <= 0 or slot.attempts >= self.config.reconnect_attempts:
            if not self.open_streams and not any(s.conn is not None or s.reconnect_at is not None
                                                 for s in self._slots):
                self._break(ConnectionLostError(f"could not resume the session: {error}"))
            return
        slot.reconnect_at = now + self.config.reconnect_backoff * (2 ** slot.attempts)
        slot.attempts += 1

    def _requeue(self, index: int) -> None:
        """What the closed stream carried unacknowledged goes back to the front of the queue."""
        for t in self._transfers.values():
            lost = [s for s in t.state.unacked.values() if s.stream == index]
            for s in reversed(lost):
                del t.state.unacked[s.address]
                if s.chunk is not None:
                    t.queue.appendleft((s.chunk, s.wire_size))
                    self.chunks_resent += 1

    def _pump(self) -> None:
        """Put queued chunks on the streams with credit, for granted layers only."""
        for t in self._transfers.values():
            while t.error is None and t.state.accepted and t.queue:
                chunk, size = t.queue[0]
                if chunk.layer >= t.state.layer_limit:
                    break
                best: int | None = None
                conn: Connection | None = None
                for i, s in enumerate(self._slots):
                    c = s.conn
                    if (
                        s.open and c is not None and c.state is State.OPEN and c.can_send_chunk(size)
                        and (conn is None or c.send_credit > conn.send_credit)
                    ):
                        best, conn = i, c
                if best is None or conn is None:
                    return
                if chunk.address in t.state.unacked:
                    t.queue.popleft()  # already on a stream (a re-send raced its ack)
                    continue
                conn.send_chunk(chunk, size)
                t.queue.popleft()
                t.state.on_sent(SentChunk(address=chunk.address, stream=best, wire_size=size,
                                          kv_bytes=0, chunk=chunk))

    def _check_done(self, t: _Transfer) -> None:
        if t.error is None and not t.done and t.state.complete and not t.queue:
            t.done = True
            del self._transfers[t.state.transfer_id]
            self._events.append(TransferDone(transfer_id=t.state.transfer_id, chunks=t.state.chunks_sent,
                                             wire_bytes=t.state.wire_bytes))

    def _fail(self, t: _Transfer, error: KvwireError, *, reset: bool) -> None:
        if t.error is not None or t.done:
            return
        t.error = error
        t.queue.clear()
        self._transfers.pop(t.state.transfer_id, None)
        if reset:
            for s in self._slots:
                if s.open and s.conn is not None:
                    s.conn.send_reset(t.state.transfer_id, error.code, str(error)[:160])
                    break
        self._events.append(TransferFailed(transfer_id=t.state.transfer_id, error=error))

    def _break(self, error: KvwireError) -> None:
        if self.broken is None:
            self.broken = error
            self._events.append(SessionFailed(error=error))
        for t in list(self._transfers.values()):
            self._fail(t, error, reset=False)
        for s in self._slots:
            s.reconnect_at = None
            if s.conn is not None and s.conn.closed_event is None:
                s.conn.close(ErrorCode.SESSION_LOST, "another stream of this session was lost")


__all__ = [
    "SenderConfig",
    "SenderCore",
    "SenderEvent",
    "SessionFailed",
    "StreamWanted",
    "TransferDone",
    "TransferFailed",
]
