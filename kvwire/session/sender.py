"""The sending side of a kvwire session, sans-IO: N connections, transfers, credit, resume.

:class:`SenderCore` owns one client session: its stream slots (each a
:class:`~kvwire.wire.Connection` while connected), the transfers in flight, which chunk goes
on which stream (the one with the most connection credit among the writable streams in use,
only for layers the receiver granted, only while the bytes in flight stay within the limit
the caller sets), acknowledgements, RESETs (each on every open stream: one of them may be
stalled), and resume: when a stream breaks, what it carried unacknowledged goes back into
the re-send set (:class:`ChunkLost`), the RESETs it carried that no open stream carries, and
those of failed transfers whose BEGIN it carried unanswered, go again on the others, and a reconnect of its slot is due after a doubling backoff
(:class:`StreamWanted` tells the I/O layer to open one).
Reconnects are bounded per session and per transfer.  Every deadline goes through
:meth:`SenderCore.get_timer` / :meth:`SenderCore.handle_timer`; ``now`` is always passed in.
"""

from __future__ import annotations

import json
import secrets
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvwire.consistency.blocks import block_key, block_pairs
from kvwire.errors import (
    AuthenticationError,
    ConnectionLostError,
    ErrorCode,
    KvwireError,
    ProtocolError,
    TransferTimeoutError,
    UsageError,
)
from kvwire.session.meta import parse_meta
from kvwire.session.quoting import quoted_id
from kvwire.wire import (
    Begin,
    BlockVersion,
    Chunk,
    ChunkAcked,
    ChunkAddress,
    Connection,
    ConnectionClosed,
    ConnectionConfig,
    CreditGranted,
    HandshakeComplete,
    OutgoingTransfer,
    ReportReceived,
    Role,
    SentChunk,
    State,
    TransferAccepted,
    TransferReset,
    chunk_frame_size,
)
from kvwire.wire.connection import NO_FINGERPRINT, NO_SESSION
from kvwire.wire.frames import (
    DEFAULT_MAX_FRAME_SIZE,
    FRAME_OVERHEAD,
    KIND_KV,
    KV_CHUNK_VERSION,
    Buffer,
    CheckedPayload,
    encode_body,
    payload_nbytes,
    plain_parts,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class SenderConfig:
    """Settings of a client session (made by ``kvwire.session.options.ClientOptions.sender_config``)."""

    secret: bytes = field(repr=False)
    streams: int = 1
    codecs: tuple[str, ...] = ("raw",)
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    fingerprint: bytes = NO_FINGERPRINT
    """The KV layout this session is pinned to (all zero: none)."""
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
class StreamOpened:
    """Stream ``index`` finished its handshake (``reconnect``: its slot was open before)."""

    index: int
    handshake: HandshakeComplete
    reconnect: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamClosed:
    """Stream ``index`` closed; ``resumed``: the session goes on (and reconnects the slot,
    unless a :class:`StreamGivenUp` of it comes with this close: it is queued just before
    this event when the close used up the slot's reconnects)."""

    index: int
    closed: ConnectionClosed
    resumed: bool

    @property
    def reason(self) -> str:
        ev = self.closed
        who = "server" if ev.by_peer else "this side"
        how = f"GOAWAY {ErrorCode(ev.code).name}" if ev.code in ErrorCode._value2member_map_ else f"code {ev.code}"
        return f"stream {self.index} closed by {who} ({how}: {ev.message or 'no reason given'})"


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamGivenUp:
    """Slot ``index`` is given up while the session goes on with its other streams: its
    reconnects (or joins) were used up, or the server refused it with LIMIT_EXCEEDED (it
    allows no more streams per session).  Nothing reconnects it; chunks go on the others."""

    index: int
    error: KvwireError


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkSent:
    """A chunk went on stream ``stream``; ``queued``: more chunks were waiting behind it;
    ``waited``: it did not go out as it was added (credit, the in-flight limit or a paused
    transport held it back), so the path, not the producer, set its pace."""

    address: ChunkAddress
    stream: int
    wire_size: int
    kv_bytes: int
    queued: bool
    waited: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkDelivered:
    """The receiver acknowledged a chunk of a live transfer."""

    address: ChunkAddress
    stream: int
    wire_size: int
    kv_bytes: int
    codec_id: int
    """The chunk's codec (its wire id)."""
    layer_done: bool = False
    """This acknowledgement completed its layer: every token of K and V is acknowledged."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkLost:
    """A chunk is no longer in flight without an acknowledgement of a live transfer (its
    stream broke and it goes again, or its transfer is gone)."""

    address: ChunkAddress


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferCredit:
    """The receiver accepted the transfer and/or granted layers below ``layer_limit``."""

    transfer_id: int
    layer_limit: int


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferDone:
    transfer_id: int
    chunks: int
    wire_bytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferFailed:
    transfer_id: int
    error: KvwireError
    by_peer: bool = False
    """The receiver reset it (``error`` carries its reason)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionFailed:
    error: KvwireError


@dataclass(frozen=True, slots=True, kw_only=True)
class ReceiverCosts:
    """The server's REPORT: what receiving costs it (advisory; docs/protocol.md 4.10)."""

    transport_s_per_byte: float | None
    """CPU seconds per byte of CHUNK frames received, decoding excluded (None: not measured)."""
    decode_s_per_element: dict[int, float]
    """By codec id: CPU seconds per element decoded (only the codecs it measured)."""


SenderEvent = (
    StreamWanted | StreamOpened | StreamClosed | StreamGivenUp | ChunkSent | ChunkDelivered | ChunkLost | TransferCredit
    | TransferDone | TransferFailed | SessionFailed | ReceiverCosts
)

#: Completed transfers a session remembers for a late :meth:`SenderCore.abort`.
COMPLETED_KEPT = 1024

#: RESETs of its own a session keeps to say again (docs/protocol.md 6.3): the latest ones.
RESETS_KEPT = 256

#: Why a stream closed before its WELCOME by a clean GOAWAY without a message is gone: an
#: earlier kvwire server said only the code before the client proved the secret, where this
#: one says "the server is shutting down" (docs/protocol.md 5.8).
HANDSHAKE_GOODBYE = ("the server closed the connection during the handshake with a clean GOAWAY "
                     "(NO_ERROR, no reason given: a kvwire server does so as it shuts down)")

#: What a transfer failing as the server refused a reconnect with UNKNOWN_SESSION says
#: happened, before the server's own text (docs/protocol.md 6.3).
SESSION_GONE = "the server no longer has this session (restarted, or resume_timeout passed)"

#: Counters a session keeps (see ``kvwire.aio.Peer.statistics``).
COUNTERS = ("resumes", "reconnects", "chunks_resent", "goaways_received", "authentication_failures",
            "transfers_reset_by_peer")


@dataclass(eq=False)
class _Transfer:
    state: OutgoingTransfer
    begin: Begin
    deadline: float | None
    timeout: float | None = None
    # chunk, its address (made once: Chunk.address is a new object on every read), wire, kv bytes
    queue: deque[tuple[Chunk, ChunkAddress, int, int]] = field(default_factory=deque)
    queued_bytes: int = 0
    error: KvwireError | None = None
    reconnects: int = 0  # broken streams that carried something of it (max_transfer_reconnects)
    begin_on: set[int] = field(default_factory=set)  # slots its BEGIN went on, unanswered while not accepted
    done: bool = False
    tokens_acked: dict[int, int] = field(default_factory=dict)  # layer -> K and V tokens acknowledged


@dataclass(eq=False, slots=True)
class _SentReset:
    """A RESET this side sent, on every stream open then (one of them may be stalled: the
    stream a transfer times out on most often is): said again once none of the streams it
    went on is open any more (it may never have reached the receiver), on every stream
    still open or else on the next to open.

    Also said again, on every stream open then, once a stream that carried the transfer's
    BEGIN unanswered when it failed closes (:attr:`begins`), whichever streams carry it: the
    receiver may have read a copy on another stream before that BEGIN (a RESET for a
    transfer it does not have is ignored), then the BEGIN, and its ACCEPT was lost with the
    stream, so that nothing would tell this side it holds the transfer.  Copies sent after
    the break are read after whatever that stream delivered."""

    code: ErrorCode
    message: str
    streams: set[int] = field(default_factory=set)  # the slots carrying it; empty: none open (the next to open)
    begins: set[int] = field(default_factory=set)  # the slots its BEGIN went on, unanswered, when it failed


@dataclass(eq=False)
class _Slot:
    conn: Connection | None = None
    open: bool = False
    attempts: int = 0
    reconnect_at: float | None = None
    wanted: bool = False
    was_open: bool = False  # open at least once: the next open is a reconnect
    writable: bool = True
    window: int = 0
    tail: list[Buffer | CheckedPayload] = field(default_factory=list)  # the last bytes of a closed connection
    closed: bool = False  # its connection closed; the I/O layer closes the transport
    given_up: bool = False  # not reconnected any more (StreamGivenUp)
    acked: int = 0  # CHUNK wire bytes acknowledged on this slot, over all its connections


class SenderCore:
    """One client session (sans-IO).

    The I/O layer sets :attr:`inflight_limit` (bytes in flight beyond which no chunk goes
    while any is unacknowledged) and :attr:`active_streams` (over how many of the first
    open slots chunks are striped), and reports each transport's writability with
    :meth:`set_writable`; after changing any of them it calls :meth:`pump`.
    """

    def __init__(self, config: SenderConfig, *, nonce_source: Callable[[int], bytes] = secrets.token_bytes) -> None:
        if config.streams < 1:
            raise UsageError("streams must be >= 1")
        self.config = config
        self._nonce = nonce_source
        self.session_id = NO_SESSION
        self._slots = [_Slot() for _ in range(config.streams)]
        self._transfers: dict[int, _Transfer] = {}
        # The RESETs of the latest transfers this side failed, by transfer id, with the slot
        # each was handed to: one whose stream closes goes again (docs/protocol.md 6.3).
        self._resets: dict[int, _SentReset] = {}
        # The latest transfers that completed (every chunk acknowledged), so that a sender
        # that gives one up before it took its receipt can still tell the receiver (abort()).
        self._completed: dict[int, None] = {}
        self._next_id = 1
        self._events: deque[SenderEvent] = deque()
        self.broken: KvwireError | None = None
        # The message of the server's last clean GOAWAY (None: none since a stream last
        # opened): the server closed on purpose, so a session lost after it is lost for that.
        self._goodbye: str | None = None
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.peer_codecs: tuple[str, ...] = ()
        self.peer_max_frame_size = 0
        self.peer_window = 0
        """The first stream's WELCOME window: a CHUNK is never larger on the wire."""
        self.version: int | None = None
        """The protocol version of the session's streams (None until the first opened)."""
        self._adding: ChunkAddress | None = None  # the chunk add_chunk() is putting on a stream
        self.max_transfers = 0
        self.path_rtt: float | None = None
        """The shortest HELLO-to-CHALLENGE round trip of the session's streams (seconds;
        None until one was timed): what the path's round trip is before any data moved."""
        self.inflight_limit: int | None = None
        self.active_streams: int | None = None
        self.gate_blocked = False
        """Whether the in-flight limit held a chunk back since the caller last cleared it."""
        self._want(0)  # the first stream creates the session; the others join it

    @property
    def resumes(self) -> int:
        return self.counters["resumes"]

    @property
    def chunks_resent(self) -> int:
        return self.counters["chunks_resent"]

    # -- streams -------------------------------------------------------------------------

    def _want(self, index: int) -> None:
        slot = self._slots[index]
        if not slot.wanted:
            slot.wanted = True
            self._events.append(StreamWanted(index=index))

    def stream_opened(self, index: int, now: float, started: float | None = None) -> None:
        """The I/O layer connected slot ``index``: the handshake starts.  ``started``: when
        connecting began, if earlier (the TCP connect, a TLS handshake): the handshake
        deadline (``connect_timeout``) counts from then."""
        cfg = self.config
        slot = self._slots[index]
        slot.wanted = slot.open = False
        slot.closed = self.broken is not None  # too late: the I/O layer closes it again
        if slot.closed:
            return
        slot.writable = True
        slot.tail = []
        slot.conn = Connection(Role.CLIENT, ConnectionConfig(
            secret=cfg.secret, codecs=cfg.codecs, max_frame_size=cfg.max_frame_size,
            fingerprint=cfg.fingerprint, session_id=self.session_id, stream_index=index,
            handshake_timeout=cfg.connect_timeout, idle_timeout=cfg.idle_timeout,
        ), now=now, started=started, nonce_source=self._nonce)
        slot.conn.initiate()

    def stream_failed(self, index: int, now: float, error: KvwireError | None = None) -> None:
        """Connecting slot ``index`` failed (refused, unreachable, TLS): before the session
        exists that ends it with ``error``; later the slot is retried after a backoff."""
        slot = self._slots[index]
        slot.wanted = False
        slot.conn = None
        err = error or ConnectionLostError(f"cannot connect stream {index}")
        if self.session_id == NO_SESSION:
            self._break(err)
        else:
            self._retry(index, now, err)

    def connection(self, index: int) -> Connection | None:
        """The connection of slot ``index`` (None while it has none)."""
        return self._slots[index].conn

    def is_open(self, index: int) -> bool:
        return self._slots[index].open

    def is_given_up(self, index: int) -> bool:
        """Whether slot ``index`` was given up (:class:`StreamGivenUp`) while the session
        goes on: it will not open again."""
        return self._slots[index].given_up

    def acked_bytes(self, index: int) -> int:
        """CHUNK wire bytes acknowledged on slot ``index`` since the session began."""
        return self._slots[index].acked

    def receive_data(self, index: int, data: bytes, now: float) -> None:
        conn = self._slots[index].conn
        if conn is None:
            return
        conn.receive_data(data, now)
        self._process(index, now)
        self.pump()

    def get_buffer(self, index: int) -> memoryview:
        """A buffer for the next read of slot ``index``; then :meth:`buffer_updated`."""
        conn = self._slots[index].conn
        return conn.get_buffer() if conn is not None else memoryview(bytearray(65536))

    def buffer_updated(self, index: int, nbytes: int, now: float) -> bool:
        """``nbytes`` were read into ``get_buffer(index)``.  False: they were bytes of an
        unfinished frame only, nothing changed (no pump needed)."""
        conn = self._slots[index].conn
        if conn is None or not conn.buffer_updated(nbytes, now):
            return False
        self._process(index, now)
        self.pump()
        return True

    def scatter_buffers(self, index: int) -> list[memoryview]:
        """Buffers for a scatter read of slot ``index`` (see
        :meth:`Connection.scatter_buffers`: none here, a sender's payloads are small)."""
        conn = self._slots[index].conn
        return [] if conn is None else conn.scatter_buffers()

    def payload_remaining(self, index: int) -> int:
        """Bytes of the frame slot ``index`` is reading that are sure to arrive before
        anything can happen on it (see :attr:`Connection.payload_remaining`)."""
        conn = self._slots[index].conn
        return 0 if conn is None else conn.payload_remaining

    def buffers_to_send(self, index: int) -> list[Buffer | CheckedPayload]:
        """What slot ``index`` has to write, payloads not copied (a large payload as a
        :class:`CheckedPayload`, checksummed as it is written)."""
        slot = self._slots[index]
        if slot.conn is None:
            out, slot.tail = slot.tail, []
            return out
        return slot.conn.data_to_write()

    def data_to_send(self, index: int) -> bytes:
        return b"".join(bytes(p) for p in plain_parts(self.buffers_to_send(index)))

    def is_closed(self, index: int) -> bool:
        """Whether the connection of slot ``index`` is over (write what is left, then close)."""
        slot = self._slots[index]
        conn = slot.conn
        return slot.closed if conn is None else conn.closed_event is not None

    def set_writable(self, index: int, writable: bool) -> None:
        """The transport of slot ``index`` paused (False) or resumed (True) writing: no
        chunk goes on it meanwhile, and its PINGs are answered once it resumes (the last
        one only, :meth:`Connection.set_output_blocked`), so a server that floods PINGs and
        reads nothing does not grow what this side queues."""
        slot = self._slots[index]
        slot.writable = writable
        if slot.conn is not None:
            slot.conn.set_output_blocked(not writable)
        if writable:
            self.pump()

    def next_event(self) -> SenderEvent | None:
        return self._events.popleft() if self._events else None

    @property
    def events(self) -> deque[SenderEvent]:
        """The events not taken yet, oldest first: take them with ``popleft()`` (as
        :meth:`next_event` does).  It is the same deque for the core's life: it may be
        kept."""
        return self._events

    @property
    def open_streams(self) -> list[int]:
        return [i for i, s in enumerate(self._slots) if s.open]

    @property
    def streams_in_use(self) -> int:
        """How many streams chunks are striped over now: the first :attr:`active_streams`
        open ones (every open one while it is None).  A slot reconnecting or given up is
        not one of them (its share goes to the next open slot, :meth:`_best_stream`)."""
        n = sum(s.open for s in self._slots)
        return n if self.active_streams is None else min(n, self.active_streams)

    @property
    def bytes_in_flight(self) -> int:
        """CHUNK bytes sent on open connections and not yet acknowledged."""
        flight = 0
        for s in self._slots:
            if s.open and s.conn is not None:
                flight += s.window - s.conn.send_credit
        return flight

    # -- transfers -----------------------------------------------------------------------

    def begin(
        self, request_id: str, *, num_layers: int, num_kv_heads: int, head_dim: int, dtype_id: int = 1,
        model: str = "", meta: bytes = b"{}", blocks: tuple[BlockVersion, ...] = (), now: float,
        timeout: float | None = None,
    ) -> int:
        """Start a transfer; returns its id.  Chunks follow with :meth:`add_chunk`.

        ``timeout`` (seconds) overrides the configured transfer timeout.
        """
        if self.broken is not None:
            raise self.broken
        _check_begin(request_id, blocks)
        tid = self._next_id
        begin = Begin(transfer_id=tid, num_layers=num_layers, num_kv_heads=num_kv_heads,
                      head_dim=head_dim, dtype_id=dtype_id, model=model, request_id=request_id,
                      meta=meta, blocks=blocks)
        size = sum(len(p) for p in encode_body(begin)[1])
        if self.peer_max_frame_size and size > self.peer_max_frame_size:
            raise UsageError(f"meta and blocks take {size} bytes; the server accepts frames of "
                             f"at most {self.peer_max_frame_size}")
        self._next_id += 1
        timeout = self.config.transfer_timeout if timeout is None else timeout
        self._transfers[tid] = _Transfer(OutgoingTransfer(tid, num_layers), begin,
                                         None if timeout is None else now + timeout, timeout)
        index = self._first_open()
        if index is not None:
            self._send_begin(index, self._transfers[tid])
        return tid

    @property
    def kv_chunks(self) -> bool:
        """Whether the session's protocol version lets a chunk carry K and V together
        (kind KV); False until the first stream opened."""
        return self.version is not None and self.version >= KV_CHUNK_VERSION

    def chunk_target(self, requested: int) -> int:
        """Bytes of K or V (before encoding) to put in one chunk: ``requested``, or less
        where the server's frame limit would not hold a chunk that large (with room for
        the chunk's header and params and for an entropy stage that grows a chunk it
        cannot shrink)."""
        limit = self.peer_max_frame_size
        if not limit:
            return requested
        if self.peer_window:  # a frame is its body and FRAME_OVERHEAD: all of it within the window
            limit = min(limit, self.peer_window - FRAME_OVERHEAD)
        return max(1, min(requested, (limit - 4096) * 255 // 256))

    def add_chunk(self, transfer_id: int, chunk: Chunk, *, kv_bytes: int = 0) -> None:
        t = self._transfers.get(transfer_id)
        if t is None or t.error is not None:
            return
        if chunk.kind == KIND_KV and not self.kv_chunks:
            raise UsageError(f"a KV chunk needs protocol version {KV_CHUNK_VERSION}; the session speaks {self.version}")
        size = chunk_frame_size(len(chunk.params), payload_nbytes(chunk.payload))
        if self.peer_window and size > self.peer_window:
            # Connection credit never exceeds the window: it could wait for ever.
            raise UsageError(f"chunk frame of {size} bytes exceeds the peer's window of {self.peer_window} bytes")
        address = chunk.address
        t.queue.append((chunk, address, size, kv_bytes))
        t.queued_bytes += size
        self._adding = address
        try:
            self.pump()
        finally:
            self._adding = None

    def producer_done(self, transfer_id: int) -> None:
        t = self._transfers.get(transfer_id)
        if t is not None and t.error is None:
            t.state.producer_done = True
            self._check_done(t)

    def abort(self, transfer_id: int, error: KvwireError) -> None:
        """The application gives the transfer up: the receiver is sent a RESET.

        Also for a transfer that completed (every chunk acknowledged, :class:`TransferDone`)
        but whose sender gives up before it took the receipt (a ``send()`` cancelled then):
        it did not succeed, so the receiver is told too, best effort (it fails the transfer
        unless its application holds it already, docs/protocol.md 10)."""
        t = self._transfers.get(transfer_id)
        if t is not None:
            self._fail(t, error, reset=True)
        elif transfer_id in self._completed:
            del self._completed[transfer_id]
            self._send_reset(transfer_id, error)

    def accepted(self, transfer_id: int) -> bool:
        t = self._transfers.get(transfer_id)
        return t is not None and t.state.accepted

    def layer_limit(self, transfer_id: int) -> int:
        """Layers below this may be sent (0 for an unknown or ended transfer)."""
        t = self._transfers.get(transfer_id)
        return 0 if t is None else t.state.layer_limit

    def queued_bytes(self, transfer_id: int | None = None) -> int:
        """Wire bytes added and not yet on a stream (of one transfer, or of all)."""
        if transfer_id is None:
            return sum(t.queued_bytes for t in self._transfers.values())
        t = self._transfers.get(transfer_id)
        return 0 if t is None else t.queued_bytes

    def transfer(self, transfer_id: int) -> OutgoingTransfer | None:
        t = self._transfers.get(transfer_id)
        return None if t is None else t.state

    @property
    def transfers(self) -> int:
        return len(self._transfers)

    @property
    def waiting_to_start(self) -> int:
        """Transfers whose BEGIN has had no answer yet: a server may hold its ACCEPT until
        its buffer budget has room (docs/protocol.md 7.1)."""
        return sum(1 for t in self._transfers.values() if not t.state.accepted)

    # -- time ----------------------------------------------------------------------------

    def get_timer(self) -> float | None:
        """The earliest of the slots' reconnects, their connections' timers and the
        transfers' deadlines; None if there is none."""
        earliest: float | None = None
        for s in self._slots:
            when = s.reconnect_at
            if when is not None and (earliest is None or when < earliest):
                earliest = when
            if s.conn is not None:
                when = s.conn.get_timer()
                if when is not None and (earliest is None or when < earliest):
                    earliest = when
        for t in self._transfers.values():
            when = t.deadline
            if when is not None and (earliest is None or when < earliest):
                earliest = when
        return earliest

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
                # A server holds ACCEPT while its buffer budget has no room (protocol.md 7.1).
                why = "" if t.state.accepted else (
                    ": the server never answered its BEGIN (it holds ACCEPT while its buffer budget"
                    " has no room for a first layer)")
                self._fail(t, TransferTimeoutError(
                    f"transfer {quoted_id(t.begin.request_id)} did not complete in {t.timeout} s{why}"), reset=True)
        self.pump()

    # -- internals -----------------------------------------------------------------------

    def _open_slots(self) -> Iterator[int]:
        """The indexes of the open streams, lowest first."""
        return (i for i, s in enumerate(self._slots) if s.open and s.conn is not None)

    def _first_open(self) -> int | None:
        return next(self._open_slots(), None)

    def _process(self, index: int, now: float) -> None:
        slot = self._slots[index]
        conn = slot.conn
        while conn is not None and (ev := conn.next_event()) is not None:
            if type(ev) is ChunkAcked:  # (no subclasses: tested by exact class)
                t = self._transfers.get(ev.address.transfer_id)
                sent = t.state.on_ack(ev.address) if t is not None else None
                if t is None or sent is None:
                    self._events.append(ChunkLost(address=ev.address))
                    continue
                slot.acked += ev.wire_size
                c = sent.chunk
                assert c is not None  # kept until acknowledged
                tokens = 2 * c.token_count if c.kind == KIND_KV else c.token_count
                acked = t.tokens_acked[c.layer] = t.tokens_acked.get(c.layer, 0) + tokens
                self._events.append(ChunkDelivered(address=ev.address, stream=index, wire_size=ev.wire_size,
                                                   kv_bytes=sent.kv_bytes, codec_id=c.codec_id,
                                                   layer_done=acked == 2 * c.layer_tokens))
                self._check_done(t)
            elif isinstance(ev, TransferAccepted | CreditGranted):
                t = self._transfers.get(ev.transfer_id)
                if t is not None:
                    if isinstance(ev, TransferAccepted):
                        t.state.accepted = True
                        t.begin_on.clear()
                    t.state.raise_limit(ev.layer_limit)
                    self._events.append(TransferCredit(transfer_id=ev.transfer_id, layer_limit=t.state.layer_limit))
                    self._check_done(t)
                elif (r := self._resets.get(ev.transfer_id)) is not None and slot.open:
                    # The receiver goes on with a transfer this side failed: its BEGIN went
                    # again on another stream and was read after the RESET, which found no
                    # such transfer.  Said again here, after the frame that shows it has it.
                    conn.send_reset(ev.transfer_id, r.code, r.message)
                    r.streams.add(index)
            elif isinstance(ev, TransferReset):
                t = self._transfers.get(ev.transfer_id)
                if t is not None:
                    self.counters["transfers_reset_by_peer"] += 1
                    self._fail(t, ev.error(), reset=False, by_peer=True)
                else:  # the receiver failed it too (or never had it): ours need not go again
                    self._resets.pop(ev.transfer_id, None)
            elif isinstance(ev, ReportReceived):
                self._events.append(ReceiverCosts(transport_s_per_byte=ev.report.transport_s_per_byte,
                                                  decode_s_per_element=ev.report.decode_s_per_element))
            elif isinstance(ev, HandshakeComplete):
                self._on_open(index, ev)
            elif isinstance(ev, ConnectionClosed):
                self._on_closed(index, ev, now)

    def _on_open(self, index: int, ev: HandshakeComplete) -> None:
        slot = self._slots[index]
        assert slot.conn is not None
        if ev.hello_rtt is not None:
            self.path_rtt = ev.hello_rtt if self.path_rtt is None else min(self.path_rtt, ev.hello_rtt)
        if self.session_id == NO_SESSION:
            self.session_id = ev.session_id
            self.peer_codecs = ev.peer_codecs
            self.max_transfers = ev.max_transfers
            self.peer_max_frame_size = ev.peer_max_frame_size
            self.peer_window = ev.window
            self.version = ev.version
            for i in range(1, len(self._slots)):
                self._want(i)
        elif ev.session_id != self.session_id:
            slot.conn.close(ErrorCode.PROTOCOL_ERROR, "joined the wrong session")
            return
        elif (why := self._differs(ev)) is not None:
            # A transfer's chunks go on any stream, sized and coded by the session's values:
            # a stream that announces other ones could refuse them (docs/protocol.md 6.1).
            slot.conn.close(ErrorCode.PROTOCOL_ERROR, f"stream {index} {why}")
            return
        reconnect = slot.was_open
        self._goodbye = None  # the server took a stream after it: it is not closing
        slot.open = slot.was_open = True
        slot.attempts = 0
        slot.given_up = False
        slot.window = ev.window
        if reconnect:
            self.counters["reconnects"] += 1
        self._events.append(StreamOpened(index=index, handshake=ev, reconnect=reconnect))
        for t in self._transfers.values():  # a BEGIN lost with a broken stream goes again
            if not t.state.accepted and t.error is None:
                self._send_begin(index, t)
        for transfer_id, r in self._resets.items():  # none was open: so the receiver lets go of them now
            if not r.streams:
                slot.conn.send_reset(transfer_id, r.code, r.message)
                r.streams.add(index)

    def _differs(self, ev: HandshakeComplete) -> str | None:
        """How a joining stream's handshake differs from the session's (None: it does not):
        the version agreed, and WELCOME's max_frame_size, max_transfers and codecs."""
        if ev.version != self.version:
            return f"speaks version {ev.version}, its session {self.version}"
        if ev.peer_max_frame_size != self.peer_max_frame_size:
            return (f"was welcomed with max_frame_size {ev.peer_max_frame_size}, "
                    f"its session with {self.peer_max_frame_size}")
        if ev.max_transfers != self.max_transfers:
            return f"was welcomed with max_transfers {ev.max_transfers}, its session with {self.max_transfers}"
        if set(ev.peer_codecs) != set(self.peer_codecs):
            return (f"was welcomed with codecs {', '.join(ev.peer_codecs) or 'none'}, "
                    f"its session with {', '.join(self.peer_codecs)}")
        return None

    def _on_closed(self, index: int, ev: ConnectionClosed, now: float) -> None:
        slot = self._slots[index]
        was_open = slot.open
        assert slot.conn is not None
        slot.tail = slot.conn.data_to_write()  # a GOAWAY of ours still goes out
        slot.open = False
        slot.conn = None
        slot.closed = True
        if ev.goaway and ev.by_peer:
            self.counters["goaways_received"] += 1
            if ev.code == ErrorCode.NO_ERROR:
                self._goodbye = ev.message or self._goodbye or (
                    "the server closed the session" if was_open else HANDSHAKE_GOODBYE)
        if isinstance(ev.error, AuthenticationError):
            self.counters["authentication_failures"] += 1
        resumed = self.broken is None and self._closed_resumes(index, ev, was_open, now)
        self._events.append(StreamClosed(index=index, closed=ev, resumed=resumed))

    def _closed_resumes(self, index: int, ev: ConnectionClosed, was_open: bool, now: float) -> bool:
        """What a closed stream means for the session; whether the session goes on."""
        cfg = self.config
        if self.session_id == NO_SESSION:
            if ev.goaway and ev.by_peer and ev.code == ErrorCode.NO_ERROR and self._goodbye is not None:
                # The server closed on purpose (a kvwire server shutting down): say its
                # reason, not only that the connection closed during the handshake.
                self._break(ConnectionLostError(self._goodbye))
            else:
                self._break(ev.error or ConnectionLostError("the first stream closed during the handshake"))
            return False
        lost = ev.error or ConnectionLostError(f"stream {index} closed")
        if ev.goaway and ev.by_peer and ev.code == ErrorCode.NO_ERROR and not was_open:
            # A join (or rejoin) the server closed on purpose before its WELCOME (a kvwire
            # server shutting down): not retried.  With another stream open the session
            # goes on there (acknowledgements may still come) until that one closes too;
            # with none, it is lost for the server's goodbye.
            if self.open_streams:
                self._give_up(index, ConnectionLostError(f"stream {index}: {self._goodbye or 'closed by the server'}"))
                return self.broken is None
            self._lose(lost)
            return False
        if ev.code == ErrorCode.LIMIT_EXCEEDED and ev.error is not None and not was_open:
            # A join the server refused: the session has as many streams as it allows.
            # The session goes on with the streams it has; this slot is not retried.
            self._give_up(index, ev.error)
            return self.broken is None
        if ev.code == ErrorCode.UNKNOWN_SESSION:
            # The server's text alone ("no such session") does not say what happened to the
            # transfers: each says it, as the server's RESET for one it held does.
            gone = ev.error or ConnectionLostError("the receiver lost the session")
            self._lose(gone, lambda t: type(gone)(
                f"transfer {quoted_id(t.begin.request_id)}: {SESSION_GONE}: {gone}", code=gone.code))
            return False
        if ev.error is not None and not ev.resumable and not was_open:
            self._break(ev.error)
            return False
        if ev.resumable and cfg.reconnect_attempts > 0:
            carried = self._requeue(index)
            if was_open:
                self.counters["resumes"] += 1
                if self.resumes > cfg.max_reconnects:
                    self._break(ConnectionLostError(
                        f"stream {index} broke again after {cfg.max_reconnects} reconnects: giving up"))
                    return False
                # A break counts against the transfers it hit: those with chunks unacknowledged
                # or a BEGIN unanswered on the stream.  Another stream's breaks leave a transfer
                # alone (with N streams it would otherwise fail after max_transfer_reconnects
                # breaks spread over all of them, while the session itself goes on).
                for t in carried:
                    t.reconnects += 1
                    if t.reconnects > cfg.max_transfer_reconnects:
                        self._fail(t, ConnectionLostError(
                            f"transfer {quoted_id(t.begin.request_id)}: giving up after {t.reconnects} broken "
                            f"stream{'' if t.reconnects == 1 else 's'} "
                            f"(max_transfer_reconnects={cfg.max_transfer_reconnects})"), reset=True)
            self._retry(index, now, lost)
            return self.broken is None
        if ev.goaway and ev.code == ErrorCode.NO_ERROR and self.open_streams:
            # A clean goodbye on one stream: acks may still come on the others; what this
            # stream carried unacknowledged goes again on them.
            self._requeue(index)
            return True
        self._lose(lost)
        return False

    def _retry(self, index: int, now: float, error: KvwireError) -> None:
        slot = self._slots[index]
        if self.config.reconnect_attempts <= 0 or slot.attempts >= self.config.reconnect_attempts:
            # The connections tried: a join's first one and its retries, a broken stream's
            # reconnects (the connection that broke was no attempt).
            what = "reconnect" if slot.was_open else "join the session"
            tries = slot.attempts if slot.was_open else slot.attempts + 1
            self._give_up(index, ConnectionLostError(
                f"stream {index} could not {what} in {tries} attempt{'' if tries == 1 else 's'}: {error}"), last=error)
            return
        slot.reconnect_at = now + self.config.reconnect_backoff * (2 ** slot.attempts)
        slot.attempts += 1

    def _give_up(self, index: int, error: KvwireError, last: KvwireError | None = None) -> None:
        """No more connections for slot ``index``: the session goes on with its other
        streams, or, with none open nor coming, is lost."""
        slot = self._slots[index]
        slot.reconnect_at = None
        if not self.open_streams and not any(s.conn is not None or s.reconnect_at is not None or s.wanted
                                             for s in self._slots):
            self._lose(ConnectionLostError(f"could not resume the session: {last or error}"))
            return
        slot.given_up = True
        self._events.append(StreamGivenUp(index=index, error=error))

    def _send_begin(self, index: int, t: _Transfer) -> None:
        conn = self._slots[index].conn
        assert conn is not None
        conn.send_begin(t.begin)
        t.begin_on.add(index)

    def _requeue(self, index: int) -> list[_Transfer]:
        """What the closed stream carried unacknowledged goes back to the front of the queue,
        and BEGINs not yet answered go again on a stream still open (the one that carried
        them may never come back; a BEGIN the server has is answered by ACCEPT again), as
        do the RESETs it carried that no stream still open carries too (the receiver may
        never have read them; one it has is ignored), and those of transfers whose BEGIN it
        carried unanswered (:attr:`_SentReset.begins`), on every open stream, or on the next
        stream to open.  Returns the transfers the stream carried something of: chunks
        unacknowledged, or a BEGIN not yet answered."""
        carried: list[_Transfer] = []
        for t in self._transfers.values():
            if index in t.begin_on:
                t.begin_on.discard(index)
                if not t.state.accepted:
                    carried.append(t)
        if (opened := self._first_open()) is not None:
            for t in self._transfers.values():
                if not t.state.accepted and t.error is None:
                    self._send_begin(opened, t)
        for transfer_id, r in self._resets.items():
            if index in r.begins:
                # The receiver may have read the transfer's BEGIN from this stream after the
                # copies on the others (ignored then) and its ACCEPT was lost with it: said
                # again on every open stream, the copies there read after that BEGIN.
                r.begins.discard(index)
                r.streams.discard(index)
                self._hand_reset(transfer_id, r)
            elif index in r.streams:
                r.streams.discard(index)
                if not r.streams:  # no stream open carries it now
                    self._hand_reset(transfer_id, r)
        for t in self._transfers.values():
            lost = [s for s in t.state.unacked.values() if s.stream == index]
            if lost and t not in carried:
                carried.append(t)
            for s in reversed(lost):
                del t.state.unacked[s.address]
                self._events.append(ChunkLost(address=s.address))
                if s.chunk is not None:
                    t.queue.appendleft((s.chunk, s.address, s.wire_size, s.kv_bytes))
                    t.queued_bytes += s.wire_size
                    self.counters["chunks_resent"] += 1
        return carried

    def _best_stream(self, size: int) -> int | None:
        """The writable open stream in use with the most credit that can take ``size`` bytes.

        The streams in use are the first :attr:`active_streams` open ones: a slot that is
        down (reconnecting, or given up on while another stream is open) hands its share to
        the next open slot, so data never waits on a slot that may not come back."""
        best: int | None = None
        credit = -1
        in_use = 0
        active = self.active_streams  # (None: every open one)
        for i, s in enumerate(self._slots):
            if active is not None and in_use >= active:
                break
            if not s.open:
                continue
            in_use += 1
            c = s.conn
            if (s.writable and c is not None and c.state is State.OPEN and c.can_send_chunk(size)
                    and c.send_credit > credit):
                best, credit = i, c.send_credit
        return best

    def pump(self) -> None:
        """Put queued chunks on the streams with credit, for granted layers only, while the
        bytes in flight stay within :attr:`inflight_limit`."""
        for t in list(self._transfers.values()):
            while t.error is None and t.state.accepted and t.queue:
                chunk, address, size, kv_bytes = t.queue[0]
                if chunk.layer >= t.state.layer_limit:
                    break
                if address in t.state.unacked:
                    t.queue.popleft()  # already on a stream (a re-send raced its ack)
                    t.queued_bytes -= size
                    continue
                limit = self.inflight_limit
                if limit is not None:
                    flight = self.bytes_in_flight
                    if flight and flight + size > limit:
                        self.gate_blocked = True
                        return
                best = self._best_stream(size)
                if best is None:
                    return
                conn = self._slots[best].conn
                assert conn is not None
                conn.send_chunk(chunk, size)
                t.queue.popleft()
                t.queued_bytes -= size
                t.state.on_sent(SentChunk(address=address, stream=best, wire_size=size,
                                          kv_bytes=kv_bytes, chunk=chunk))
                self._events.append(ChunkSent(address=address, stream=best, wire_size=size,
                                              kv_bytes=kv_bytes, queued=t.queued_bytes > 0 or self._anything_queued(),
                                              waited=address != self._adding))

    def _anything_queued(self) -> bool:
        """Whether any transfer has bytes added and not yet on a stream
        (``queued_bytes() > 0``, without summing them all)."""
        for t in self._transfers.values():  # noqa: SIM110 (per-chunk path: a loop, not any())
            if t.queued_bytes:
                return True
        return False

    def _check_done(self, t: _Transfer) -> None:
        if t.error is None and not t.done and t.state.complete and not t.queue:
            t.done = True
            del self._transfers[t.state.transfer_id]
            self._completed[t.state.transfer_id] = None
            if len(self._completed) > COMPLETED_KEPT:
                del self._completed[next(iter(self._completed))]
            self._events.append(TransferDone(transfer_id=t.state.transfer_id, chunks=t.state.chunks_sent,
                                             wire_bytes=t.state.wire_bytes))

    def _fail(self, t: _Transfer, error: KvwireError, *, reset: bool, by_peer: bool = False) -> None:
        if t.error is not None or t.done:
            return
        t.error = error
        t.queue.clear()
        t.queued_bytes = 0
        self._transfers.pop(t.state.transfer_id, None)
        for s in t.state.unacked.values():
            self._events.append(ChunkLost(address=s.address))
        if reset:
            self._send_reset(t.state.transfer_id, error, begins=set() if t.state.accepted else set(t.begin_on))
        self._events.append(TransferFailed(transfer_id=t.state.transfer_id, error=error, by_peer=by_peer))

    def _send_reset(self, transfer_id: int, error: KvwireError, *, begins: set[int] | None = None) -> None:
        """Tell the receiver the transfer failed, and keep the RESET (the latest
        :data:`RESETS_KEPT`): a stream that closes before the receiver read it may have lost
        it, and it goes again (:meth:`_requeue`); else the receiver would hold the transfer
        until its own ``transfer_timeout``.  ``begins``: the streams carrying the transfer's
        BEGIN, not yet answered (:attr:`_SentReset.begins`)."""
        r = _SentReset(error.code, str(error)[:160], begins=begins or set())
        self._resets.pop(transfer_id, None)
        self._resets[transfer_id] = r
        while len(self._resets) > RESETS_KEPT:
            del self._resets[next(iter(self._resets))]
        self._hand_reset(transfer_id, r)

    def _hand_reset(self, transfer_id: int, r: _SentReset) -> None:
        """Send a kept RESET on every open stream, or, with none open now (a reconnect
        backing off), on the next one that opens (:meth:`_on_open`).

        On every one, not only the first: a transfer fails most often because a stream is
        stuck (a send that times out), and a RESET queued behind that stream's unread bytes
        would reach the receiver only once the stream broke (the idle timeout), or never if
        this side closed first, while the receiving application waited and the server held
        the transfer's buffer.  A receiver fails the transfer at the first copy it reads and
        ignores the others (docs/protocol.md 10: a RESET for a transfer that failed already,
        or that it does not have, is ignored)."""
        r.streams = set(self._open_slots())
        for i in sorted(r.streams):
            conn = self._slots[i].conn
            assert conn is not None
            conn.send_reset(transfer_id, r.code, r.message)

    def _lose(self, error: KvwireError, transfer_error: Callable[[_Transfer], KvwireError] | None = None) -> None:
        """The session is lost as its streams closed or could not resume (``error``; each
        transfer fails with ``transfer_error(t)``, or with ``error`` without one).
        Where the server said goodbye on one of them first (a clean GOAWAY: kvwire's server
        sends one on every stream as it shuts down), that is why, whichever stream closed
        last and however: the session fails with the GOAWAY's message, and each transfer
        with ``transfer '<request id>': <message>``, as the server's RESET for a transfer
        it held says it.  Without this a transfer whose BEGIN had not reached the server
        (nothing there to reset) failed with "stream N closed"."""
        reason = self._goodbye
        if reason is None:
            self._break(error, transfer_error)
            return
        self._break(ConnectionLostError(reason, code=ErrorCode.SESSION_LOST), lambda t: ConnectionLostError(
            f"transfer {quoted_id(t.begin.request_id)}: {reason}", code=ErrorCode.SESSION_LOST))

    def _break(self, error: KvwireError, transfer_error: Callable[[_Transfer], KvwireError] | None = None) -> None:
        if self.broken is None:
            self.broken = error
            self._events.append(SessionFailed(error=error))
        for t in list(self._transfers.values()):
            self._fail(t, error if transfer_error is None else transfer_error(t), reset=False)
        for s in self._slots:
            s.reconnect_at = None
            s.open = False
            if s.conn is not None and s.conn.closed_event is None:
                s.conn.close(ErrorCode.SESSION_LOST, "another stream of this session was lost")

    def close(self, now: float) -> None:
        """The application ends the session: every transfer fails, every stream says GOAWAY."""
        if self.broken is None:
            self.broken = ConnectionLostError("peer closed")
        for t in list(self._transfers.values()):
            self._fail(t, self.broken, reset=False)
        for s in self._slots:
            s.reconnect_at = None
            s.open = False
            if s.conn is not None and s.conn.closed_event is None:
                s.conn.close(ErrorCode.NO_ERROR, "client closing")


def begin_fields(meta: object, blocks: Iterable[tuple[Any, int]] | None) -> tuple[bytes, tuple[BlockVersion, ...]]:
    """What ``send(meta=, blocks=)`` puts in BEGIN: ``meta`` (a dict, None for ``{}``) as
    compact JSON in UTF-8, each block id as its canonical type-tagged key (i:12, b:<hex>,
    s:<text>).  What a receiver refuses is a UsageError here: NaN and infinities (not
    JSON) and strings that are not Unicode (a lone surrogate)."""
    if meta is not None and not isinstance(meta, dict):
        raise UsageError("meta must be a dict (it travels as a JSON object)")
    try:
        meta_bytes = json.dumps(meta or {}, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    except (TypeError, ValueError, RecursionError) as exc:  # (UnicodeEncodeError is a ValueError)
        raise UsageError(f"meta must be JSON-serialisable: {exc}") from None
    try:
        parse_meta(meta_bytes)  # what a receiver would refuse (a number beyond a double)
    except ProtocolError as exc:
        raise UsageError(f"meta must be JSON a receiver takes: {str(exc).removeprefix('BEGIN ')}") from None
    pairs = block_pairs(blocks, "blocks") if blocks is not None else []
    return meta_bytes, tuple(BlockVersion(block=block_key(b).encode(), version=v) for b, v in pairs)


def check_request_id(request_id: object) -> None:
    """UsageError unless ``request_id`` is one BEGIN can carry: a non-empty str of at most
    65535 bytes in UTF-8 (a lone surrogate has none)."""
    try:
        ok = isinstance(request_id, str) and 0 < len(request_id.encode()) <= 0xFFFF
    except UnicodeEncodeError:
        ok = False
    if not ok:
        raise UsageError(f"request_id must be a non-empty str of at most 65535 UTF-8 bytes, got {request_id!r:.80}")


def _check_begin(request_id: str, blocks: tuple[BlockVersion, ...]) -> None:
    """What BEGIN can carry: the wire's field limits, as usage errors before anything is sent."""
    check_request_id(request_id)
    if len(blocks) > 0xFFFF:
        raise UsageError("at most 65535 blocks per transfer")
    for b in blocks:
        if len(b.block) > 255:
            raise UsageError("block id too long for the wire (canonical key over 255 bytes)")
        v = b.version
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 64:
            raise UsageError(f"a block version is an int in [0, 2**64), got {v!r}")


__all__ = [
    "COUNTERS",
    "ChunkDelivered",
    "ChunkLost",
    "ChunkSent",
    "ReceiverCosts",
    "SenderConfig",
    "SenderCore",
    "SenderEvent",
    "SessionFailed",
    "StreamClosed",
    "StreamGivenUp",
    "StreamOpened",
    "StreamWanted",
    "TransferCredit",
    "TransferDone",
    "TransferFailed",
    "begin_fields",
]
