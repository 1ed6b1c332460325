"""One kvwire TCP connection as a sans-IO state machine.

Bytes go in through :meth:`Connection.receive_data` (``b""`` is EOF), events come out of
:meth:`Connection.next_event`, bytes to write come out of :meth:`Connection.data_to_send`.
Time is passed in as ``now``; :meth:`Connection.get_timer` says when the connection next
needs :meth:`Connection.handle_timer`.

The client is the side that opens the TCP connection and sends KV caches; the server
receives them.  Every frame a state does not expect is a protocol error, per the table
``_TRANSITIONS``.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

from kvwire.errors import (
    AuthenticationError,
    ConnectionLostError,
    ErrorCode,
    IncompatiblePeerError,
    KvwireError,
    LimitExceededError,
    ProtocolError,
    TransferTimeoutError,
    UsageError,
    error_from_code,
)
from kvwire.wire.frames import (
    DEFAULT_MAX_FRAME_SIZE,
    DEFAULT_WINDOW,
    FINGERPRINT_SIZE,
    HANDSHAKE_MAX_BODY,
    KIND_KV,
    KV_CHUNK_VERSION,
    MAX_MAX_FRAME_SIZE,
    MIN_MAX_FRAME_SIZE,
    MIN_PROTOCOL_VERSION,
    NONCE_SIZE,
    PROTOCOL_VERSION,
    SESSION_ID_SIZE,
    Accept,
    Ack,
    Auth,
    Begin,
    Buffer,
    Challenge,
    CheckedPayload,
    Chunk,
    ChunkAddress,
    Credit,
    Frame,
    FrameDecoder,
    FrameType,
    GoAway,
    Hello,
    MalformedHello,
    PayloadSink,
    Ping,
    Pong,
    Report,
    Reset,
    UnknownFrame,
    Welcome,
    encode_chunk_checked_as_written,
    encode_frame,
    plain_parts,
    welcome_unsigned,
)

NO_SESSION = bytes(SESSION_ID_SIZE)
NO_FINGERPRINT = bytes(FINGERPRINT_SIZE)
#: Largest ``max_transfers`` a server may announce: WELCOME's u32 (never 0, docs/protocol.md 4.4).
MAX_TRANSFERS = (1 << 32) - 1
#: The reason of a server's clean GOAWAY as it shuts down.
SHUTTING_DOWN = "the server is shutting down"
#: The only GOAWAY messages a server sends before the client proved the secret (docs/protocol.md
#: 5.8): fixed texts, the same for every peer, that tell nothing the code does not.  A wrong
#: proof always gets its text; a clean close only this one, and only where it was its reason
#: (any other reason is dropped, as is every other code's message).
PRE_AUTH_MESSAGES = {ErrorCode.AUTHENTICATION_FAILED: "authentication failed", ErrorCode.NO_ERROR: SHUTTING_DOWN}


class Role(Enum):
    CLIENT = auto()
    SERVER = auto()


class State(Enum):
    CLIENT_IDLE = auto()
    CLIENT_HELLO_SENT = auto()
    CLIENT_AUTH_SENT = auto()
    SERVER_AWAIT_HELLO = auto()
    SERVER_CHALLENGE_SENT = auto()
    SERVER_AUTHENTICATED = auto()  # proof checked; the shell decides on the session
    OPEN = auto()
    CLOSED = auto()


# ---------------------------------------------------------------------------------------
# Events.


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientAuthenticated:
    """Server side: the client proved the secret.  Call ``welcome()`` or ``refuse()``."""

    session_id: bytes  # all zero: the client asks for a new session
    stream_index: int
    codecs: tuple[str, ...]
    fingerprint: bytes  # all zero: the client did not pin a KV layout
    max_frame_size: int


@dataclass(frozen=True, slots=True, kw_only=True)
class HandshakeComplete:
    """The connection is authenticated both ways and open."""

    session_id: bytes
    stream_index: int
    peer_codecs: tuple[str, ...]
    peer_max_frame_size: int
    window: int
    max_transfers: int
    hello_rtt: float | None = None
    """Client side: seconds from HELLO to CHALLENGE (one round trip of the path, the server's
    answer included), when the shell passed ``now``; None otherwise."""
    version: int = MIN_PROTOCOL_VERSION
    """The protocol version the handshake agreed on."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferBegun:
    frame: Begin


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferAccepted:
    transfer_id: int
    layer_limit: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkReceived:
    chunk: Chunk
    wire_size: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkAcked:
    address: ChunkAddress
    wire_size: int


@dataclass(frozen=True, slots=True, kw_only=True)
class CreditGranted:
    transfer_id: int
    layer_limit: int


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferReset:
    transfer_id: int
    code: int
    message: str

    def error(self) -> KvwireError:
        """The error the RESET fails its transfer with: its code's (section 11).  NO_ERROR
        is no reason for a transfer to fail (one that succeeds ends by its last ACK): a
        RESET carrying it is a ProtocolError, like one with a code not in the table."""
        if self.code == ErrorCode.NO_ERROR:
            return ProtocolError(f"peer reset the transfer with code NO_ERROR: {self.message}",
                                 code=ErrorCode.PROTOCOL_ERROR)
        return error_from_code(self.code, self.message)


@dataclass(frozen=True, slots=True, kw_only=True)
class PingReceived:
    opaque: int


@dataclass(frozen=True, slots=True, kw_only=True)
class PongReceived:
    opaque: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ReportReceived:
    """Client side: the server said what receiving costs it (advisory)."""

    report: Report


@dataclass(frozen=True, slots=True, kw_only=True)
class UnknownFrameReceived:
    frame: UnknownFrame


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectionClosed:
    """Terminal event. ``error`` is None for a clean close."""

    code: int
    message: str
    by_peer: bool
    error: KvwireError | None = None
    goaway: bool = False
    """The peer said why (a GOAWAY arrived); False for EOF, resets and local failures."""

    @property
    def resumable(self) -> bool:
        """The connection broke, rather than being closed on purpose: the session may
        reconnect and re-send what was not acknowledged."""
        if self.goaway:
            return self.code in RESUMABLE_CODES
        if not self.by_peer:
            return self.code in RESUMABLE_CODES
        return True  # EOF or reset without a GOAWAY


#: Error codes after which a session reconnects instead of failing its transfers:
#: corruption caught by the CRC (or a corrupted length that looks oversized) and silence
#: caught by the idle timer.  Reconnects are bounded, so a peer that keeps doing this
#: still ends up with a typed error.
RESUMABLE_CODES = frozenset({ErrorCode.INTEGRITY_ERROR, ErrorCode.TIMEOUT, ErrorCode.FRAME_TOO_LARGE})


Event = (
    ClientAuthenticated | HandshakeComplete | TransferBegun | TransferAccepted | ChunkReceived
    | ChunkAcked | CreditGranted | TransferReset | PingReceived | PongReceived
    | ReportReceived | UnknownFrameReceived | ConnectionClosed
)


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectionConfig:
    """Settings of one connection; the shell fills these from its options."""

    secret: bytes = field(repr=False)
    """Shared secret both peers prove with HMAC-SHA256."""
    codecs: tuple[str, ...] = ("raw",)
    """Codecs this side can send (client) or decode (server)."""
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    """Largest frame body this side accepts."""
    window: int = DEFAULT_WINDOW
    """Server: initial connection credit in bytes (unacknowledged CHUNK bytes)."""
    max_transfers: int = 64
    """Server: concurrent transfers per session."""
    fingerprint: bytes = NO_FINGERPRINT
    """Client: KVSpec fingerprint pinned by this session (zero: none)."""
    session_id: bytes = NO_SESSION
    """Client: session to join (zero: a new one)."""
    stream_index: int = 0
    handshake_timeout: float = 10.0
    """Seconds from the start of the connection (``Connection(started=)``: the TCP connect
    or accept, before any TLS handshake) until the handshake must be complete."""
    idle_timeout: float | None = 30.0
    """Once open: seconds without a complete frame from the peer before the connection
    is closed with TIMEOUT.  A PING goes out after half of it, so a live but quiet peer
    answers.  Must exceed the time one max-size frame takes on the link."""
    max_version: int = PROTOCOL_VERSION
    """The highest protocol version this side speaks (tests of older peers lower it)."""

    def __post_init__(self) -> None:
        if not MIN_PROTOCOL_VERSION <= self.max_version <= PROTOCOL_VERSION:
            raise UsageError(f"max_version must be in [{MIN_PROTOCOL_VERSION}, {PROTOCOL_VERSION}]")
        if not isinstance(self.secret, bytes | bytearray) or len(self.secret) < 8:
            raise UsageError("secret must be bytes of at least 8 bytes")
        if not MIN_MAX_FRAME_SIZE <= self.max_frame_size <= MAX_MAX_FRAME_SIZE:
            raise UsageError(
                f"max_frame_size must be in [{MIN_MAX_FRAME_SIZE}, {MAX_MAX_FRAME_SIZE}]"
            )
        if self.window < self.max_frame_size:
            raise UsageError("window must be at least max_frame_size")
        if not 1 <= self.max_transfers <= MAX_TRANSFERS:
            raise UsageError("max_transfers must be in [1, 2^32 - 1]")


def _sha(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _label(version: int, role: str) -> bytes:
    return f"kvwire/{version} {role}".encode()


def client_proof(secret: bytes, hello: bytes, challenge: bytes, version: int = MIN_PROTOCOL_VERSION) -> bytes:
    """HMAC-SHA256 the client sends in AUTH (see docs/protocol.md, Authentication); each
    protocol version has its own label."""
    return hmac.new(secret, _label(version, "client") + _sha(hello) + _sha(challenge), "sha256").digest()


def server_proof(
    secret: bytes, hello: bytes, challenge: bytes, cproof: bytes, welcome: bytes, version: int = MIN_PROTOCOL_VERSION,
) -> bytes:
    """HMAC-SHA256 the server sends in WELCOME."""
    msg = _label(version, "server") + _sha(hello) + _sha(challenge) + cproof + _sha(welcome)
    return hmac.new(secret, msg, "sha256").digest()


Handler = Callable[["Connection", Frame, int], "State"]


class Connection:
    """The state of one kvwire TCP connection (either role)."""

    def __init__(
        self, role: Role, config: ConnectionConfig, *, now: float = 0.0, started: float | None = None,
        nonce_source: Callable[[int], bytes] = secrets.token_bytes,
    ) -> None:
        """``started``: when the connection began, if before ``now`` (a TLS handshake ran in
        between): the handshake deadline counts from it, so it covers the TLS handshake
        too, and only what is left of it remains for the kvwire handshake."""
        self.role = role
        self.config = config
        self.state = State.CLIENT_IDLE if role is Role.CLIENT else State.SERVER_AWAIT_HELLO
        self._nonce = nonce_source
        self._decoder = FrameDecoder(HANDSHAKE_MAX_BODY)
        self.version: int | None = None
        """The protocol version agreed (None until CHALLENGE)."""
        self._events: deque[Event] = deque()
        self._out: list[Buffer | CheckedPayload] = []
        self._deadline: float | None = (now if started is None else min(now, started)) + config.handshake_timeout
        self._last_rx = now
        self._hello_at = now  # when HELLO went out (client)
        self._rx_now: float | None = None  # the ``now`` of the frames being handled
        self.hello_rtt: float | None = None
        self._ping_due: float | None = None
        self._ping_seq = 0
        self._output_blocked = False
        self._pong_owed: int | None = None  # the latest PING's opaque, answered once unblocked
        self._hello_body = b""
        self._challenge_body = b""
        self._client_proof = b""
        self._hello: Hello | None = None
        self.session_id = NO_SESSION
        self.stream_index = config.stream_index
        self.peer_codecs: tuple[str, ...] = ()
        self.peer_max_frame_size = MIN_MAX_FRAME_SIZE
        # Flow control.  Client: credit left to send CHUNK bytes; server: CHUNK bytes
        # received and not yet acknowledged.
        self.send_credit = 0
        self.recv_unacked = 0
        self._in_flight: dict[ChunkAddress, list[int]] = {}
        self._received: dict[ChunkAddress, list[int]] = {}
        self.bytes_sent = 0
        self.closed_event: ConnectionClosed | None = None

    # -- shell API ----------------------------------------------------------------------

    def initiate(self) -> None:
        """Client: send HELLO."""
        if self.state is not State.CLIENT_IDLE:
            raise UsageError("initiate() is for a new client connection")
        cfg = self.config
        hello = Hello(
            min_version=MIN_PROTOCOL_VERSION, max_version=cfg.max_version,
            nonce=self._nonce(NONCE_SIZE), session_id=cfg.session_id,
            stream_index=cfg.stream_index, max_frame_size=cfg.max_frame_size,
            codecs=cfg.codecs, fingerprint=cfg.fingerprint,
        )
        self._hello_body = self._queue_signed(hello)
        self.state = State.CLIENT_HELLO_SENT

    def receive_data(self, data: Buffer, now: float | None = None) -> None:
        """Feed bytes read from the socket; ``b""`` means the peer closed.

        ``now`` (when given) restarts the idle timer if a whole frame arrived: bytes of a
        frame that never completes (a corrupted length) do not keep a connection alive.
        """
        if self.state is State.CLOSED:
            return
        if not data:
            self._close_locally(
                ErrorCode.NO_ERROR, "connection closed by peer", by_peer=True,
                send_goaway=False, error=None,
            )
            return
        self._take_frames(self._decoder.feed, data, now=now)

    def set_payload_sink(self, sink: PayloadSink | None) -> None:
        """Receive large CHUNK payloads into buffers ``sink`` chooses (see FrameDecoder)."""
        self._decoder.payload_sink = sink

    def abandon_payload(self, view: memoryview | tuple[memoryview, ...]) -> bool:
        """Never write ``view`` (a buffer the payload sink gave) again; see FrameDecoder."""
        return self._decoder.abandon_payload(view)

    def get_buffer(self) -> memoryview:
        """A buffer for the next read (``recv_into`` style); then call :meth:`buffer_updated`.

        Large frame bodies are read straight into their own buffer, so a CHUNK's payload
        is copied once between the socket and the codec.
        """
        return self._decoder.get_buffer()

    def scatter_buffers(self) -> list[memoryview]:
        """The rest of a payload being read into several buffers, for one scatter read
        (see :meth:`FrameDecoder.scatter_buffers`); then call :meth:`buffer_updated`.
        Empty when there is none: :meth:`get_buffer` is then the place."""
        if self.state is State.CLOSED:
            return []
        return self._decoder.scatter_buffers()

    @property
    def payload_remaining(self) -> int:
        """Bytes of the frame being read that are sure to come before it completes (see
        :attr:`FrameDecoder.payload_remaining`); an I/O layer may wait for that many
        before waking up to read (e.g. with SO_RCVLOWAT)."""
        return self._decoder.payload_remaining

    def buffer_updated(self, nbytes: int, now: float | None = None) -> bool:
        """``nbytes`` were written into the buffer :meth:`get_buffer` returned.

        Returns False when nothing but bytes of an unfinished frame arrived (no event, no
        state change: the caller has nothing to process), True otherwise.
        """
        if self.state is State.CLOSED:
            return False
        return self._take_frames(self._decoder.buffer_updated, nbytes, now=now)

    def start_deferred(self, now: float | None = None) -> bool:
        """Call after handling what :meth:`buffer_updated` produced: a large CHUNK whose
        head arrived behind other frames gets its payload's place now (the payload sink
        is asked), so the next :meth:`get_buffer` is that place.  Returns True when this
        changed something to process (an error, frames), like :meth:`buffer_updated`."""
        if self.state is State.CLOSED:
            return False
        return self._take_frames(self._decoder.start_deferred, now=now)

    def _take_frames(self, decode: Callable[..., list[tuple[Frame, int]]], *args: Any, now: float | None) -> bool:
        """Handle the frames ``decode(*args)`` completes; a decoding error fails the
        connection.  False when it completed none (nothing to process), else True."""
        try:
            frames = decode(*args)
            if not frames:
                return False
            self._handle_frames(frames, now)
            # A frame after these failed to decode: handled in order, they come first.
            self._decoder.raise_pending()
        except KvwireError as exc:
            self._fail(exc)
        except MemoryError:
            self._fail(LimitExceededError("out of memory receiving a frame"))
        return True

    def _handle_frames(self, frames: list[tuple[Frame, int]], now: float | None) -> None:
        self._rx_now = now
        if frames and now is not None:
            self._last_rx = now
        for frame, size in frames:
            if self.state is State.CLOSED:
                return
            self._dispatch(frame, size)

    def next_event(self) -> Event | None:
        return self._events.popleft() if self._events else None

    def data_to_send(self) -> list[Buffer]:
        """What to write, as buffers (payloads not copied)."""
        return plain_parts(self.data_to_write())

    def data_to_write(self) -> list[Buffer | CheckedPayload]:
        """What to write, payloads not copied, a large CHUNK payload and its trailer as one
        :class:`CheckedPayload` whose CRC is computed as it is written (``pieces()``)."""
        out, self._out = self._out, []
        self.bytes_sent += sum(map(len, out))
        return out

    def get_timer(self) -> float | None:
        """When :meth:`handle_timer` must next run (None: never)."""
        if self.state is State.CLOSED:
            return None
        if self.state is not State.OPEN:
            return self._deadline
        idle = self.config.idle_timeout
        if idle is None:
            return None
        if self._ping_due is not None and self._ping_due > self._last_rx:
            return self._last_rx + idle  # a PING is out: wait for any byte
        return self._last_rx + idle / 2

    def handle_timer(self, now: float) -> None:
        if self.state is State.CLOSED:
            return
        if self.state is not State.OPEN:
            if self._deadline is not None and now >= self._deadline:
                self._fail(TransferTimeoutError("handshake did not complete in time"))
            return
        idle = self.config.idle_timeout
        if idle is None:
            return
        if now >= self._last_rx + idle:
            self._fail(TransferTimeoutError(f"no data from the peer for {idle} s"))
        elif now >= self._last_rx + idle / 2 and not (self._ping_due is not None and self._ping_due > self._last_rx):
            self._ping_seq += 1
            self._ping_due = now
            self._queue(Ping(opaque=self._ping_seq))

    # Server: after ClientAuthenticated.
    def welcome(self, session_id: bytes, codecs: Sequence[str]) -> None:
        if self.state is State.CLOSED:
            return  # the client broke something right behind AUTH; ConnectionClosed is queued
        if self.state is not State.SERVER_AUTHENTICATED or self._hello is None:
            raise UsageError("welcome() only after ClientAuthenticated")
        cfg = self.config
        w = Welcome(
            session_id=session_id, max_frame_size=cfg.max_frame_size, window=cfg.window,
            max_transfers=cfg.max_transfers, codecs=tuple(codecs), proof=bytes(32),
        )
        unsigned = welcome_unsigned(w)
        proof = server_proof(
            cfg.secret, self._hello_body, self._challenge_body, self._client_proof, unsigned, self._agreed
        )
        self._queue(
            Welcome(
                session_id=session_id, max_frame_size=w.max_frame_size, window=w.window,
                max_transfers=w.max_transfers, codecs=w.codecs, proof=proof,
            )
        )
        self.session_id = session_id
        self.stream_index = self._hello.stream_index
        self.peer_codecs = self._hello.codecs
        self.peer_max_frame_size = self._hello.max_frame_size
        self._open()
        self._events.append(
            HandshakeComplete(
                session_id=session_id, stream_index=self.stream_index,
                peer_codecs=self.peer_codecs, peer_max_frame_size=self.peer_max_frame_size,
                window=cfg.window, max_transfers=cfg.max_transfers, version=self._agreed,
            )
        )

    def refuse(self, code: ErrorCode, message: str) -> None:
        """Close with GOAWAY(code); the error is the one ``code`` stands for."""
        self._close_locally(
            code, message, by_peer=False, send_goaway=True, error=error_from_code(code, message)
        )

    def close(self, code: ErrorCode = ErrorCode.NO_ERROR, message: str = "") -> None:
        """Send GOAWAY and close (a clean close when ``code`` is NO_ERROR)."""
        err = None if code == ErrorCode.NO_ERROR else error_from_code(code, message)
        self._close_locally(code, message, by_peer=False, send_goaway=True, error=err)

    # Client: transfers.
    def send_begin(self, begin: Begin) -> None:
        if self._require_open(Role.CLIENT):
            self._queue(begin)

    def can_send_chunk(self, wire_size: int) -> bool:
        return self.state is State.OPEN and wire_size <= self.send_credit

    def send_chunk(self, chunk: Chunk, wire_size: int) -> None:
        """Queue a CHUNK (its payload is not copied).  Needs ``wire_size`` of credit."""
        if not self._require_open(Role.CLIENT):
            raise ConnectionLostError("connection is closed")
        if wire_size > self.send_credit:
            raise UsageError("send_chunk() without enough connection credit")
        if chunk.kind == KIND_KV and not self.sends_kv_chunks:
            raise UsageError(f"a KV chunk needs protocol version {KV_CHUNK_VERSION}; this connection speaks {self.version}")
        body_limit = self.peer_max_frame_size
        if wire_size - 12 > body_limit:
            raise UsageError(f"chunk frame of {wire_size} bytes exceeds the peer's limit")
        self.send_credit -= wire_size
        self._in_flight.setdefault(chunk.address, []).append(wire_size)
        # A large payload is checksummed as it is written (CheckedPayload), not here.
        self._out.extend(filter(len, encode_chunk_checked_as_written(chunk)))  # (empty parts dropped)

    def in_flight_chunks(self) -> list[ChunkAddress]:
        """Client: chunks sent on this connection and not yet acknowledged."""
        return list(self._in_flight)

    def set_output_blocked(self, blocked: bool) -> None:
        """The I/O layer's writes of this connection backed up (True: the peer does not
        read what it is sent, or not as fast) or drained again (False).

        While they are backed up a PING is not answered at once: the PONG of the latest
        one goes out when they drain (docs/protocol.md 4.11), so a peer that sends PINGs
        and reads nothing costs this side no memory per PING, while this side goes on
        reading (acknowledgements and RESETs arrive as they come)."""
        self._output_blocked = blocked
        if not blocked and self._pong_owed is not None:
            opaque, self._pong_owed = self._pong_owed, None
            if self.state is State.OPEN:
                self._queue(Pong(opaque=opaque))

    def send_reset(self, transfer_id: int, code: ErrorCode, message: str) -> None:
        if code == ErrorCode.NO_ERROR:
            # A RESET never carries NO_ERROR (4.9: a peer takes it for PROTOCOL_ERROR). A
            # local error with no wire code of its own (a lost connection, a server
            # closing) gives the transfer up: CANCELLED.
            code = ErrorCode.CANCELLED
        if self.state is State.OPEN:
            self._queue(Reset(transfer_id=transfer_id, code=int(code), message=message))

    def send_ping(self, opaque: int) -> None:
        if self.state is State.OPEN:
            self._queue(Ping(opaque=opaque))

    # Server: transfers.
    def send_accept(self, transfer_id: int, layer_limit: int) -> None:
        if self._require_open(Role.SERVER):
            self._queue(Accept(transfer_id=transfer_id, layer_limit=layer_limit))

    def send_ack(self, address: ChunkAddress) -> None:
        """Acknowledge a chunk received on this connection (verified and stored)."""
        if not self._require_open(Role.SERVER):
            return
        sizes = self._received.pop(address, None)
        if not sizes:
            raise UsageError("send_ack() for a chunk not received on this connection")
        self.recv_unacked -= sizes.pop(0)
        if sizes:  # (copies of it received on this connection and not acknowledged yet)
            self._received[address] = sizes
        self._queue(
            Ack(
                transfer_id=address.transfer_id, layer=address.layer, kind=address.kind,
                token_start=address.token_start,
            )
        )

    def send_credit_frame(self, transfer_id: int, layer_limit: int) -> None:
        if self._require_open(Role.SERVER):
            self._queue(Credit(transfer_id=transfer_id, layer_limit=layer_limit))

    def send_report(self, report: Report) -> None:
        """Tell the client what receiving costs this server (REPORT, advisory)."""
        if self._require_open(Role.SERVER):
            self._queue(report)

    # -- internals ----------------------------------------------------------------------

    def _require_open(self, role: Role) -> bool:
        """True when open; False when closed (the send is dropped: a ConnectionClosed
        event is already queued); UsageError for a connection not yet open."""
        if self.role is not role:
            raise UsageError(f"only the {role.name.lower()} side may do that")
        if self.state is State.CLOSED:
            return False
        if self.state is not State.OPEN:
            raise UsageError(f"connection is {self.state.name}, not OPEN")
        return True

    def _queue(self, frame: Frame) -> None:
        # A control frame is small: its header, body and CRC are written as one part.
        self._out.append(b"".join(encode_frame(frame)))

    def _queue_signed(self, frame: Frame) -> bytes:
        parts = encode_frame(frame)
        self._out.extend(parts)
        return b"".join(bytes(p) for p in parts[1:-1])

    def _open(self) -> None:
        self.state = State.OPEN
        self._deadline = None
        self._ping_due = None
        self._decoder.max_body = self.config.max_frame_size

    def _dispatch(self, frame: Frame, size: int) -> None:
        ftype = type(frame)
        if ftype is GoAway:
            assert isinstance(frame, GoAway)
            err = None if frame.code == ErrorCode.NO_ERROR else error_from_code(frame.code, frame.message)
            if frame.code == ErrorCode.UNSUPPORTED_VERSION and self.state is State.CLIENT_HELLO_SENT:
                # The answer to HELLO: the server tells an unauthenticated client only the
                # code (5.8), so say what was offered.
                said = f"; the server said: {frame.message}" if frame.message else ""
                err = IncompatiblePeerError(
                    "the server speaks none of the protocol versions this client offered "
                    f"({MIN_PROTOCOL_VERSION}..{self.config.max_version}){said}",
                    code=ErrorCode.UNSUPPORTED_VERSION,
                )
            self._close_locally(
                ErrorCode(frame.code) if frame.code in ErrorCode._value2member_map_ else ErrorCode.PROTOCOL_ERROR,
                frame.message, by_peer=True, send_goaway=False, error=err, goaway=True,
            )
            return
        handler = _TRANSITIONS.get((self.state, ftype))
        if handler is None:
            if ftype is UnknownFrame and self.state is State.OPEN:
                assert isinstance(frame, UnknownFrame)
                self._events.append(UnknownFrameReceived(frame=frame))
                return
            raise ProtocolError(f"unexpected {ftype.__name__.upper()} frame in state {self.state.name}")
        self.state = handler(self, frame, size)

    def _fail(self, exc: KvwireError) -> None:
        # A HELLO's version range is checked before the rest of it (5.4): a later version's
        # HELLO may be laid out otherwise, and is refused as such.
        if (
            isinstance(exc, MalformedHello) and self.state is State.SERVER_AWAIT_HELLO
            and self._refused_versions(exc.min_version, exc.max_version)
        ):
            return
        self._close_locally(exc.code, str(exc), by_peer=False, send_goaway=True, error=exc)

    def _close_locally(
        self, code: ErrorCode, message: str, *, by_peer: bool, send_goaway: bool,
        error: KvwireError | None, goaway: bool = False,
    ) -> None:
        if self.state is State.CLOSED:
            return
        pre_auth_server = self.state in (State.SERVER_AWAIT_HELLO, State.SERVER_CHALLENGE_SENT)
        if send_goaway:
            # Before the client proved the secret it learns only the error code, or one of
            # the fixed texts of PRE_AUTH_MESSAGES.
            msg = message
            if pre_auth_server:
                fixed = PRE_AUTH_MESSAGES.get(code, "")
                msg = fixed if code == ErrorCode.AUTHENTICATION_FAILED or message == fixed else ""
            self._queue(GoAway(code=int(code), message=msg))
        if by_peer and error is None and self.state is not State.OPEN:
            error = ConnectionLostError("connection closed during the handshake")
        self.state = State.CLOSED
        self._deadline = None
        # Bytes may still arrive until the socket is gone (its GOAWAY still being written):
        # they go to scratch, not into a payload's place (caller memory a copy from another
        # stream may since have filled and delivered), which is let go of.
        self._decoder.close()
        ev = ConnectionClosed(code=int(code), message=message, by_peer=by_peer, error=error, goaway=goaway)
        self.closed_event = ev
        self._events.append(ev)

    @property
    def _agreed(self) -> int:
        assert self.version is not None, "no protocol version agreed yet"
        return self.version

    @property
    def sends_kv_chunks(self) -> bool:
        """Whether CHUNKs of kind KV (K and V together) may go out on this connection."""
        return self.version is not None and self.version >= KV_CHUNK_VERSION

    # Transition handlers: (connection, frame, wire size) -> new state.

    def _refused_versions(self, min_version: int, max_version: int) -> bool:
        """Server: refuse a HELLO whose version range (well-formed: min <= max) shares
        no version with this server's, with UNSUPPORTED_VERSION; True if it was."""
        top = self.config.max_version
        if min_version > max_version or (max_version >= MIN_PROTOCOL_VERSION and min_version <= top):
            return False
        # (For this side's log and events: the GOAWAY carries no message before AUTH, 5.8.)
        self.refuse(
            ErrorCode.UNSUPPORTED_VERSION,
            f"the client offered protocol versions {min_version}..{max_version}; "
            f"this server speaks {MIN_PROTOCOL_VERSION}..{top}",
        )
        return True

    def _on_hello(self, frame: Frame, size: int) -> State:
        assert isinstance(frame, Hello)
        if frame.min_version > frame.max_version:
            raise ProtocolError("HELLO min_version is above max_version")
        if self._refused_versions(frame.min_version, frame.max_version):
            return State.CLOSED
        top = self.config.max_version
        if not MIN_MAX_FRAME_SIZE <= frame.max_frame_size <= MAX_MAX_FRAME_SIZE:
            raise ProtocolError("HELLO max_frame_size out of range")
        self._hello = frame
        self._hello_body = _body_of(frame)
        self.version = version = min(top, frame.max_version)
        challenge = Challenge(version=version, nonce=self._nonce(NONCE_SIZE))
        self._challenge_body = self._queue_signed(challenge)
        return State.SERVER_CHALLENGE_SENT

    def _on_challenge(self, frame: Frame, size: int) -> State:
        assert isinstance(frame, Challenge)
        if not MIN_PROTOCOL_VERSION <= frame.version <= self.config.max_version:
            raise IncompatiblePeerError(f"server chose unsupported protocol version {frame.version}", code=ErrorCode.UNSUPPORTED_VERSION)
        self.version = frame.version
        self._challenge_body = _body_of(frame)
        if self._rx_now is not None:
            self.hello_rtt = max(0.0, self._rx_now - self._hello_at)
        self._client_proof = client_proof(self.config.secret, self._hello_body, self._challenge_body, frame.version)
        self._queue(Auth(proof=self._client_proof))
        return State.CLIENT_AUTH_SENT

    def _on_auth(self, frame: Frame, size: int) -> State:
        assert isinstance(frame, Auth) and self._hello is not None
        expected = client_proof(self.config.secret, self._hello_body, self._challenge_body, self._agreed)
        if not hmac.compare_digest(expected, frame.proof):
            raise AuthenticationError("client failed to prove the shared secret")
        self._client_proof = frame.proof
        h = self._hello
        self._events.append(
            ClientAuthenticated(
                session_id=h.session_id, stream_index=h.stream_index, codecs=h.codecs,
                fingerprint=h.fingerprint, max_frame_size=h.max_frame_size,
            )
        )
        return State.SERVER_AUTHENTICATED

    def _on_welcome(self, frame: Frame, size: int) -> State:
        assert isinstance(frame, Welcome)
        expected = server_proof(
            self.config.secret, self._hello_body, self._challenge_body, self._client_proof,
            welcome_unsigned(frame), self._agreed,
        )
        if not hmac.compare_digest(expected, frame.proof):
            raise AuthenticationError("server failed to prove the shared secret")
        if not MIN_MAX_FRAME_SIZE <= frame.max_frame_size <= MAX_MAX_FRAME_SIZE:
            raise ProtocolError("WELCOME max_frame_size out of range")
        if frame.window < frame.max_frame_size:
            # A CHUNK as large as the server accepts would never fit: the client would wait
            # for credit forever.
            raise ProtocolError("WELCOME window smaller than its max_frame_size")
        if frame.max_transfers == 0:
            # Every BEGIN would be refused with LIMIT_EXCEEDED: a session that can carry
            # nothing is refused here, with a reason, not at the first send.
            raise ProtocolError("WELCOME max_transfers is 0")
        self.session_id = frame.session_id
        self.peer_codecs = frame.codecs
        self.peer_max_frame_size = frame.max_frame_size
        self.send_credit = frame.window
        self._open()
        self._events.append(
            HandshakeComplete(
                session_id=frame.session_id, stream_index=self.stream_index,
                peer_codecs=frame.codecs, peer_max_frame_size=frame.max_frame_size,
                window=frame.window, max_transfers=frame.max_transfers, hello_rtt=self.hello_rtt,
                version=self._agreed,
            )
        )
        return State.OPEN

    def _on_begin(self, frame: Frame, size: int) -> State:
        assert isinstance(frame, Begin)
        if frame.transfer_id == 0:
            raise ProtocolError("transfer id 0 is reserved")
        self._events.append(TransferBegun(frame=frame))
        return State.OPEN

    def _on_chunk(self, frame: Frame, size: int) -> State:
        assert isinstance(frame, Chunk)
        if frame.kind == KIND_KV and not self.sends_kv_chunks:
            # Checked here, in frame order, not when decoding: the frames before it (HELLO
            # among them) may be decoded from the same read before any is handled.
            raise ProtocolError(f"CHUNK kind {frame.kind} is not K (0) or V (1) in version {self.version}")
        self.recv_unacked += size
        if self.recv_unacked > self.config.window:
            self.recv_unacked -= size
            raise error_from_code(
                ErrorCode.FLOW_CONTROL_ERROR, "peer sent more CHUNK bytes than its connection credit",
            )
        self._received.setdefault(frame.address, []).append(size)
        self._events.append(ChunkReceived(chunk=frame, wire_size=size))
        return State.OPEN

    def _on_accept(self, frame: Frame, size: int) -> State:
        assert isinstance(frame, Accept)
        self._events.append(TransferAccepted(transfer_id=frame.transfer_id, layer_limit=frame.layer_limit))
        return State.OPEN

    def _on_ack(self, frame: Frame, size: int) -> State:
        assert isinstance(frame, Ack)
        addr = frame.address
        sizes = self._in_flight.get(addr)
        if not sizes:
            raise ProtocolError("ACK for a chunk not in flight on this connection")
        wire = sizes.pop(0)
        if not sizes:
            del self._in_flight[addr]
        self.send_credit += wire
        self._events.append(ChunkAcked(address=addr, wire_size=wire))
        return State.OPEN

    def _on_credit(self, frame: Frame, size: int) -> State:
        assert isinstance(frame, Credit)
        self._events.append(CreditGranted(transfer_id=frame.transfer_id, layer_limit=frame.layer_limit))
        return State.OPEN

    def _on_reset(self, frame: Frame, size: int) -> State:
        assert isinstance(frame, Reset)
        self._events.append(TransferReset(transfer_id=frame.transfer_id, code=frame.code, message=frame.message))
        return State.OPEN

    def _on_report(self, frame: Frame, size: int) -> State:
        assert isinstance(frame, Report)
        self._events.append(ReportReceived(report=frame))
        return State.OPEN

    def _on_ping(self, frame: Frame, size: int) -> State:
        assert isinstance(frame, Ping)
        if self._output_blocked:
            self._pong_owed = frame.opaque  # (see set_output_blocked)
        else:
            self._queue(Pong(opaque=frame.opaque))
        self._events.append(PingReceived(opaque=frame.opaque))
        return State.OPEN

    def _on_pong(self, frame: Frame, size: int) -> State:
        assert isinstance(frame, Pong)
        self._events.append(PongReceived(opaque=frame.opaque))
        return State.OPEN


def _body_of(frame: Frame) -> bytes:
    parts = encode_frame(frame)
    return b"".join(bytes(p) for p in parts[1:-1])


_TRANSITIONS: dict[tuple[State, type], Callable[[Connection, Frame, int], State]] = {
    (State.SERVER_AWAIT_HELLO, Hello): Connection._on_hello,
    (State.CLIENT_HELLO_SENT, Challenge): Connection._on_challenge,
    (State.SERVER_CHALLENGE_SENT, Auth): Connection._on_auth,
    (State.CLIENT_AUTH_SENT, Welcome): Connection._on_welcome,
    # client -> server, once open
    (State.OPEN, Begin): Connection._on_begin,
    (State.OPEN, Chunk): Connection._on_chunk,
    # server -> client, once open
    (State.OPEN, Accept): Connection._on_accept,
    (State.OPEN, Ack): Connection._on_ack,
    (State.OPEN, Credit): Connection._on_credit,
    (State.OPEN, Report): Connection._on_report,
    # both ways
    (State.OPEN, Reset): Connection._on_reset,
    (State.OPEN, Ping): Connection._on_ping,
    (State.OPEN, Pong): Connection._on_pong,
}

#: Frames only the client may send (a server receiving any other is a protocol error).
_CLIENT_SENDS = {Begin, Chunk}
_SERVER_SENDS = {Accept, Ack, Credit, Report}


def _role_checked(
    handler: Callable[[Connection, Frame, int], State], allowed: Role
) -> Callable[[Connection, Frame, int], State]:
    def check(conn: Connection, frame: Frame, size: int) -> State:
        if conn.role is not allowed:
            raise ProtocolError(f"{type(frame).__name__.upper()} sent by the wrong side")
        return handler(conn, frame, size)

    return check


for (_state, _ftype), _handler in list(_TRANSITIONS.items()):
    if _ftype in _CLIENT_SENDS:
        _TRANSITIONS[(_state, _ftype)] = _role_checked(_handler, Role.SERVER)
    elif _ftype in _SERVER_SENDS:
        _TRANSITIONS[(_state, _ftype)] = _role_checked(_handler, Role.CLIENT)

TRANSITIONS = _TRANSITIONS
"""The state table: (state, frame class) -> handler.  Anything absent is a ProtocolError."""

__all__ = [
    "MAX_TRANSFERS",
    "NO_FINGERPRINT",
    "NO_SESSION",
    "PRE_AUTH_MESSAGES",
    "SHUTTING_DOWN",
    "TRANSITIONS",
    "ChunkAcked",
    "ChunkReceived",
    "ClientAuthenticated",
    "Connection",
    "ConnectionClosed",
    "ConnectionConfig",
    "CreditGranted",
    "Event",
    "FrameType",
    "HandshakeComplete",
    "PingReceived",
    "PongReceived",
    "ReportReceived",
    "Role",
    "State",
    "TransferAccepted",
    "TransferBegun",
    "TransferReset",
    "UnknownFrameReceived",
    "client_proof",
    "server_proof",
]
