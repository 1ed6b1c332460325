"""Frame vocabulary, encoders and the incremental frame decoder (sans-IO).

Every frame is ``header(8) + body(length) + crc32c(4)``, big-endian::

    u8 type | u8 flags | u16 reserved (0) | u32 body length | body | u32 CRC32C(header+body)

The CRC covers the header too, so a flipped bit in a chunk's address is caught like one
in its data.  docs/protocol.md is the normative description; this module follows it.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Union

from kvwire.errors import ErrorCode, FrameTooLargeError, IntegrityError, ProtocolError
from kvwire.wire.crc import crc32c, crc32c_scatter

Buffer = Union[bytes, bytearray, memoryview]

MAGIC = b"KVWIRE\r\n"
PROTOCOL_VERSION = 2
MIN_PROTOCOL_VERSION = 1
#: The protocol version from which a CHUNK may carry K and V together (``KIND_KV``).
KV_CHUNK_VERSION = 2

#: CHUNK kinds: a range of the layer's K, of its V, or (from version 2) of both, K's bytes
#: then V's, in one frame.
KIND_K, KIND_V, KIND_KV = 0, 1, 2

HEADER = struct.Struct(">BBHI")
HEADER_SIZE = HEADER.size  # 8
CRC = struct.Struct(">I")
CRC_SIZE = CRC.size  # 4
FRAME_OVERHEAD = HEADER_SIZE + CRC_SIZE

#: Frames before authentication completes may not exceed this body size, whatever the
#: configuration says: an unauthenticated peer can make us buffer at most this much.
HANDSHAKE_MAX_BODY = 16 * 1024
#: The smallest max-frame-size a peer may announce (a CHUNK must fit some payload).
MIN_MAX_FRAME_SIZE = 64 * 1024
#: The largest max-frame-size a peer may announce.
MAX_MAX_FRAME_SIZE = 1 << 30
#: kvwire's default chunk (K or V bytes before encoding, ``ClientOptions.chunk_bytes``)
#: and the max-frame-size both sides announce by default: one such chunk with room for
#: its header and codec parameters (docs/benchmarks.md measures 1, 2, 4 and 16 MiB).
DEFAULT_CHUNK_BYTES = 4 << 20
DEFAULT_MAX_FRAME_SIZE = DEFAULT_CHUNK_BYTES + 64 * 1024
#: The connection credit a kvwire server grants by default (unacknowledged CHUNK bytes per
#: stream): eight default chunks.
DEFAULT_WINDOW = 8 * DEFAULT_CHUNK_BYTES

NONCE_SIZE = 32
SESSION_ID_SIZE = 16
FINGERPRINT_SIZE = 16
PROOF_SIZE = 32


class FrameType(IntEnum):
    HELLO = 0x01
    CHALLENGE = 0x02
    AUTH = 0x03
    WELCOME = 0x04
    BEGIN = 0x10
    ACCEPT = 0x11
    CHUNK = 0x12
    ACK = 0x13
    CREDIT = 0x14
    RESET = 0x15
    REPORT = 0x16
    PING = 0x20
    PONG = 0x21
    GOAWAY = 0x30


# ---------------------------------------------------------------------------------------
# Frame bodies.  One frozen dataclass per frame type.


@dataclass(frozen=True, slots=True, kw_only=True)
class Hello:
    min_version: int
    max_version: int
    nonce: bytes
    session_id: bytes
    stream_index: int
    max_frame_size: int
    codecs: tuple[str, ...]
    fingerprint: bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class Challenge:
    version: int
    nonce: bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class Auth:
    proof: bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class Welcome:
    session_id: bytes
    max_frame_size: int
    window: int
    max_transfers: int
    codecs: tuple[str, ...]
    proof: bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockVersion:
    block: bytes
    version: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Begin:
    transfer_id: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_id: int
    model: str
    request_id: str
    meta: bytes
    blocks: tuple[BlockVersion, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Accept:
    transfer_id: int
    layer_limit: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkAddress:
    transfer_id: int
    layer: int
    kind: int
    token_start: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Chunk:
    transfer_id: int
    layer: int
    kind: int
    codec_id: int
    token_start: int
    token_count: int
    layer_tokens: int
    params: bytes
    payload: Payload
    """The codec payload.  A chunk to send may give it in parts (a KV chunk: K's bytes,
    then V's), sent one after the other as one payload, each a buffer or the
    :class:`ByteRanges` of one; a received chunk's is one buffer, or the buffers its
    payload sink named."""

    @property
    def payload_buffer(self) -> Buffer:
        """The payload as one buffer: a received chunk's as it is, one given in parts joined."""
        payload = self.payload
        if isinstance(payload, (tuple, ByteRanges)):
            return b"".join(v for p in payload_parts(payload) for v in _buffers(p))
        return payload

    @property
    def address(self) -> ChunkAddress:
        return ChunkAddress(
            transfer_id=self.transfer_id, layer=self.layer, kind=self.kind, token_start=self.token_start
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Ack:
    transfer_id: int
    layer: int
    kind: int
    token_start: int

    @property
    def address(self) -> ChunkAddress:
        return ChunkAddress(
            transfer_id=self.transfer_id, layer=self.layer, kind=self.kind, token_start=self.token_start
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Credit:
    transfer_id: int
    layer_limit: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Reset:
    transfer_id: int
    code: int
    message: str


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodeCost:
    """One codec's decode cost in a REPORT: CPU nanoseconds per 2^20 elements decoded."""

    codec_id: int
    ns_per_melem: int


def _ns_per_mi(seconds: float | None) -> int:
    """CPU ``seconds`` per byte or element as whole nanoseconds per 2^20 of them, within a
    u32 (REPORT's fields; 0: not measured)."""
    if seconds is None or not 0 < seconds < float("inf"):
        return 0
    return max(1, min(0xFFFFFFFF, round(seconds * 1e9 * (1 << 20))))


def _seconds_per_one(ns_per_mi: int) -> float:
    return ns_per_mi / 1e9 / (1 << 20)


@dataclass(frozen=True, slots=True, kw_only=True)
class Report:
    """What receiving costs the server (advisory, server to client, docs/protocol.md 4.10)."""

    transport_ns_per_mib: int
    """CPU nanoseconds per MiB of CHUNK frames received, decoding excluded (0: not measured)."""
    decode: tuple[DecodeCost, ...] = ()

    @classmethod
    def of_seconds(cls, transport_s_per_byte: float | None, decode_s_per_element: Mapping[int, float]) -> Report:
        """The REPORT of CPU seconds per byte received (None: not measured) and, by codec
        id, per element decoded; values that round to nothing are left out."""
        decode = ((c, _ns_per_mi(v)) for c, v in sorted(decode_s_per_element.items()))
        return cls(transport_ns_per_mib=_ns_per_mi(transport_s_per_byte),
                   decode=tuple(DecodeCost(codec_id=c, ns_per_melem=ns) for c, ns in decode if ns))

    @property
    def transport_s_per_byte(self) -> float | None:
        """CPU seconds per byte of CHUNK frames received (None: not measured)."""
        return _seconds_per_one(self.transport_ns_per_mib) if self.transport_ns_per_mib else None

    @property
    def decode_s_per_element(self) -> dict[int, float]:
        """By codec id, CPU seconds per element decoded (the codecs measured)."""
        return {d.codec_id: _seconds_per_one(d.ns_per_melem) for d in self.decode if d.ns_per_melem}


@dataclass(frozen=True, slots=True, kw_only=True)
class Ping:
    opaque: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Pong:
    opaque: int


@dataclass(frozen=True, slots=True, kw_only=True)
class GoAway:
    code: int
    message: str


@dataclass(frozen=True, slots=True, kw_only=True)
class UnknownFrame:
    """A frame of a type this version does not know (CRC-checked, otherwise opaque)."""

    type: int
    flags: int
    body: bytes


Frame = Union[
    Hello, Challenge, Auth, Welcome, Begin, Accept, Chunk, Ack, Credit, Reset, Report, Ping, Pong,
    GoAway, UnknownFrame,
]

# ---------------------------------------------------------------------------------------
# Small field helpers.

_U8 = struct.Struct(">B")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_HELLO_VERSIONS = struct.Struct(">8sHH")  # magic, min_version, max_version: every version's HELLO starts so
_HELLO_FIXED = struct.Struct(">32s16sHI")  # then, in versions 1 and 2: nonce, session_id, stream_index, max_frame_size
_CHALLENGE = struct.Struct(">H32s")
_WELCOME_FIXED = struct.Struct(">16sIQI")
_BEGIN_FIXED = struct.Struct(">QHHHB")
_ACCEPT = struct.Struct(">QI")
CHUNK_FIXED = struct.Struct(">QHBBIIIH")
_ACK = struct.Struct(">QHBxI")
_CREDIT = struct.Struct(">QI")
_RESET_FIXED = struct.Struct(">QH")
_PING = struct.Struct(">Q")
_REPORT_FIXED = struct.Struct(">IB")
_DECODE_COST = struct.Struct(">BI")
_BLOCK_VERSION_TAIL = struct.Struct(">Q")


class MalformedHello(ProtocolError):
    """A HELLO whose magic and version range were read, but not the rest of it as versions
    1 and 2 lay it out.  A later version's HELLO may be laid out otherwise (protocol 5.4):
    a server that shares no version in the range refuses it with UNSUPPORTED_VERSION, not
    as malformed."""

    def __init__(self, message: str, *, min_version: int, max_version: int) -> None:
        super().__init__(message)
        self.min_version = min_version
        self.max_version = max_version


class _Reader:
    """Bounds-checked reads from a frame body: every overrun is a ProtocolError."""

    __slots__ = ("_buf", "_pos", "_what")

    def __init__(self, buf: Buffer, what: str) -> None:
        self._buf = memoryview(buf)
        self._pos = 0
        self._what = what

    def take(self, n: int) -> memoryview:
        end = self._pos + n
        if end > len(self._buf):
            raise ProtocolError(f"{self._what} frame truncated")
        out = self._buf[self._pos : end]
        self._pos = end
        return out

    def unpack(self, st: struct.Struct) -> tuple[Any, ...]:
        return st.unpack(self.take(st.size))

    def u8(self) -> int:
        return self.take(1)[0]

    def u16(self) -> int:
        return int(_U16.unpack(self.take(2))[0])

    def u32(self) -> int:
        return int(_U32.unpack(self.take(4))[0])

    def text(self, n: int) -> str:
        try:
            return bytes(self.take(n)).decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError(f"{self._what} frame has invalid UTF-8") from None

    def rest(self) -> memoryview:
        out = self._buf[self._pos :]
        self._pos = len(self._buf)
        return out

    def end(self) -> None:
        if self._pos != len(self._buf):
            raise ProtocolError(f"{self._what} frame has {len(self._buf) - self._pos} trailing bytes")


def _short_text(value: str, limit: int, what: str) -> bytes:
    raw = value.encode("utf-8")
    if len(raw) > limit:
        raise ProtocolError(f"{what} longer than {limit} bytes")
    return raw


def _message(text: str) -> bytes:
    """At most 1024 bytes of UTF-8, cut on a character boundary."""
    return text.encode("utf-8")[:1024].decode("utf-8", "ignore").encode("utf-8")


def _codec_list(codecs: Sequence[str]) -> bytes:
    if len(codecs) > 255:
        raise ProtocolError("too many codecs")
    out = bytearray(_U8.pack(len(codecs)))
    for name in codecs:
        raw = _short_text(name, 255, "codec name")
        out += _U8.pack(len(raw)) + raw
    return bytes(out)


def _read_codec_list(r: _Reader) -> tuple[str, ...]:
    return tuple(r.text(r.u8()) for _ in range(r.u8()))


# ---------------------------------------------------------------------------------------
# Encoding.


class ByteRanges:
    """Part of a payload whose bytes are ranges of one buffer, in order (the rows of a
    paged cache's blocks): ``base`` (bytes, format ``B``) and ``spans``, a C-contiguous
    buffer of int64 ``(start, size)`` pairs, each range non-empty.  The compiled send queue
    writes them as they are, with no Python object per range; :meth:`views` gives a view
    per range for every other path.  (A destination's ranges to decode into may also name
    rows written nowhere, with a start of -1; those have no view.)"""

    __slots__ = ("base", "nbytes", "spans")

    def __init__(self, base: memoryview, spans: Buffer, nbytes: int) -> None:
        self.base = base
        self.spans = spans
        self.nbytes = nbytes

    def views(self) -> list[memoryview]:
        pairs = memoryview(self.spans).cast("B").cast("q").tolist()
        if any(pairs[i] < 0 for i in range(0, len(pairs), 2)):
            raise ValueError("a range written nowhere (start -1) has no view")
        base = self.base
        return [base[pairs[i] : pairs[i] + pairs[i + 1]] for i in range(0, len(pairs), 2)]


Payload = Union[Buffer, ByteRanges, tuple[Union[Buffer, ByteRanges], ...]]
"""A CHUNK's payload: one buffer, byte ranges of one, or parts of either kind in order."""


def payload_parts(payload: Payload) -> tuple[Buffer | ByteRanges, ...]:
    """A payload's parts in order (one for a payload given whole)."""
    return payload if isinstance(payload, tuple) else (payload,)


def payload_nbytes(payload: Payload) -> int:
    """Bytes of a payload, whatever its parts (an array's ``nbytes``, not its ``len``;
    byte ranges' sum)."""
    total = 0
    for part in payload_parts(payload):
        if isinstance(part, ByteRanges):
            total += part.nbytes
            continue
        nbytes = getattr(part, "nbytes", None)
        total += len(part) if nbytes is None else int(nbytes)
    return total


def _buffers(part: Buffer | ByteRanges) -> list[memoryview]:
    """A payload part as byte views (one, or one per range)."""
    if isinstance(part, ByteRanges):
        return part.views()
    return [_byte_view(part)]


def _head(ftype: FrameType, body_parts: Sequence[Buffer], more: int = 0, flags: int = 0) -> tuple[bytes, int]:
    """The header of a frame whose body is ``body_parts`` and ``more`` bytes after them,
    and the CRC32C of header and parts."""
    length = more
    for part in body_parts:
        length += memoryview(part).nbytes  # bytes, whatever the item size
    header = HEADER.pack(ftype, flags, 0, length)
    crc = crc32c(header)
    for part in body_parts:
        crc = crc32c(part, crc)
    return header, crc


def _frame(ftype: FrameType, body_parts: Sequence[Buffer], flags: int = 0) -> list[Buffer]:
    header, crc = _head(ftype, body_parts, flags=flags)
    return [header, *body_parts, CRC.pack(crc)]


def _chunk_head(frame: Chunk) -> list[Buffer]:
    """A CHUNK's body before its payload: the fixed fields, then the params."""
    fixed = CHUNK_FIXED.pack(
        frame.transfer_id, frame.layer, frame.kind, frame.codec_id, frame.token_start,
        frame.token_count, frame.layer_tokens, len(frame.params),
    )
    return [fixed, frame.params]


def encode_body(frame: Frame) -> tuple[FrameType, list[Buffer]]:
    """The frame type and body parts of ``frame`` (payloads are not copied)."""
    if isinstance(frame, Chunk):
        return FrameType.CHUNK, [*_chunk_head(frame), *(v for p in payload_parts(frame.payload) for v in _buffers(p))]
    if isinstance(frame, Ack):
        return FrameType.ACK, [_ACK.pack(frame.transfer_id, frame.layer, frame.kind, frame.token_start)]
    if isinstance(frame, Credit):
        return FrameType.CREDIT, [_CREDIT.pack(frame.transfer_id, frame.layer_limit)]
    if isinstance(frame, Accept):
        return FrameType.ACCEPT, [_ACCEPT.pack(frame.transfer_id, frame.layer_limit)]
    if isinstance(frame, Begin):
        model = _short_text(frame.model, 255, "model id")
        rid = _short_text(frame.request_id, 0xFFFF, "request id")
        if len(frame.blocks) > 0xFFFF:
            raise ProtocolError("too many blocks")
        parts = bytearray(
            _BEGIN_FIXED.pack(
                frame.transfer_id, frame.num_layers, frame.num_kv_heads, frame.head_dim, frame.dtype_id
            )
        )
        parts += _U8.pack(len(model)) + model
        parts += _U16.pack(len(rid)) + rid
        parts += _U32.pack(len(frame.meta)) + frame.meta
        parts += _U16.pack(len(frame.blocks))
        for bv in frame.blocks:
            if len(bv.block) > 255:
                raise ProtocolError("block id longer than 255 bytes")
            parts += _U8.pack(len(bv.block)) + bv.block + _BLOCK_VERSION_TAIL.pack(bv.version)
        return FrameType.BEGIN, [bytes(parts)]
    if isinstance(frame, Reset):
        msg = _message(frame.message)
        return FrameType.RESET, [_RESET_FIXED.pack(frame.transfer_id, frame.code), _U16.pack(len(msg)), msg]
    if isinstance(frame, GoAway):
        msg = _message(frame.message)
        return FrameType.GOAWAY, [_U16.pack(frame.code), _U16.pack(len(msg)), msg]
    if isinstance(frame, Report):
        _check_report(frame)
        body = bytearray(_REPORT_FIXED.pack(frame.transport_ns_per_mib, len(frame.decode)))
        for d in frame.decode:
            body += _DECODE_COST.pack(d.codec_id, d.ns_per_melem)
        return FrameType.REPORT, [bytes(body)]
    if isinstance(frame, Ping):
        return FrameType.PING, [_PING.pack(frame.opaque)]
    if isinstance(frame, Pong):
        return FrameType.PONG, [_PING.pack(frame.opaque)]
    if isinstance(frame, Hello):
        fixed = _HELLO_VERSIONS.pack(MAGIC, frame.min_version, frame.max_version) + _HELLO_FIXED.pack(
            frame.nonce, frame.session_id, frame.stream_index, frame.max_frame_size,
        )
        return FrameType.HELLO, [fixed + _codec_list(frame.codecs) + frame.fingerprint]
    if isinstance(frame, Challenge):
        return FrameType.CHALLENGE, [_CHALLENGE.pack(frame.version, frame.nonce)]
    if isinstance(frame, Auth):
        return FrameType.AUTH, [frame.proof]
    if isinstance(frame, Welcome):
        return FrameType.WELCOME, [welcome_unsigned(frame) + frame.proof]
    if isinstance(frame, UnknownFrame):
        raise ProtocolError("unknown frames are not sent")
    raise TypeError(f"not a frame: {frame!r}")


def _check_report(frame: Report) -> None:
    if len(frame.decode) > 255:
        raise ProtocolError("REPORT has more than 255 decode entries")
    ids = [d.codec_id for d in frame.decode]
    if len(set(ids)) != len(ids):
        raise ProtocolError("REPORT names a codec twice")
    if not 0 <= frame.transport_ns_per_mib <= 0xFFFFFFFF or any(
        not (0 <= d.codec_id <= 0xFF and 0 <= d.ns_per_melem <= 0xFFFFFFFF) for d in frame.decode
    ):
        raise ProtocolError("REPORT field out of range")


def welcome_unsigned(frame: Welcome) -> bytes:
    """The WELCOME body without its proof (what the server's proof signs)."""
    return (
        _WELCOME_FIXED.pack(frame.session_id, frame.max_frame_size, frame.window, frame.max_transfers)
        + _codec_list(frame.codecs)
    )


def encode_frame(frame: Frame) -> list[Buffer]:
    """``frame`` as a list of buffers for ``writelines`` (payload views are not copied)."""
    ftype, parts = encode_body(frame)
    return _frame(ftype, parts)


#: Payloads at least this large are sent as a :class:`CheckedPayload` by a connection.
CHECK_AS_WRITTEN = 256 * 1024
#: A CheckedPayload up to this size is one piece (checksummed, then written whole); a
#: larger one is written in pieces of CHECK_AS_WRITTEN.  Measured on loopback
#: (docs/benchmarks.md): 4 MiB chunks in 256 KiB pieces were fastest; a 1 MiB chunk in
#: pieces was slower than written whole.
WRITE_WHOLE = 1 << 20


class CheckedPayload:
    """The end of a CHUNK frame, its payload and CRC32C trailer, with the CRC computed as
    the payload is written rather than in a pass of its own before.

    ``crc`` is the CRC of the frame up to the payload.  The payload is ``payload`` followed
    by the buffers of ``rest`` (a KV chunk's V after its K), one CRC over all of them.
    :meth:`pieces` yields the payload in segments, each checksummed just before it is
    handed out (so the write that follows reads it from the cache), then the trailer;
    :meth:`parts` gives payload and trailer at once.  Both read the payload as it is when
    they run (the caller's arrays must not change until the send is acknowledged).
    """

    __slots__ = ("_size", "crc", "payload", "rest")

    def __init__(self, payload: memoryview | ByteRanges, crc: int,
                 rest: tuple[memoryview | ByteRanges, ...] = ()) -> None:
        self.payload = payload
        self.crc = crc
        self.rest = rest
        self._size = payload.nbytes + sum(v.nbytes for v in rest) + CRC_SIZE

    @property
    def views(self) -> tuple[memoryview | ByteRanges, ...]:
        """The payload's buffers in order (bytes, format ``B``, or byte ranges of one)."""
        return (self.payload, *self.rest)

    def buffers(self) -> list[memoryview]:
        """The payload's bytes in order as views, each range of a :class:`ByteRanges` one."""
        return [b for v in self.views for b in _buffers(v)]

    def __len__(self) -> int:
        return self._size

    def pieces(self, segment: int | None = None) -> Iterator[memoryview | bytes]:
        crc = self.crc
        for payload in self.buffers():
            step = segment
            if step is None:
                step = payload.nbytes if payload.nbytes <= WRITE_WHOLE else CHECK_AS_WRITTEN
            for at in range(0, payload.nbytes, step):
                piece = payload[at : at + step]
                crc = crc32c(piece, crc)
                yield piece
        yield CRC.pack(crc)

    def parts(self) -> list[Buffer]:
        crc = self.crc
        views = self.buffers()
        for v in views:
            crc = crc32c(v, crc)
        return [*views, CRC.pack(crc)]


def plain_parts(parts: list[Buffer | CheckedPayload]) -> list[Buffer]:
    """``parts`` with each :class:`CheckedPayload` as its payload and trailer."""
    for p in parts:
        if isinstance(p, CheckedPayload):
            break
    else:
        return parts  # type: ignore[return-value]  # no CheckedPayload in it
    return [q for p in parts for q in (p.parts() if isinstance(p, CheckedPayload) else (p,))]


def encode_chunk_checked_as_written(chunk: Chunk) -> list[Buffer | CheckedPayload]:
    """A CHUNK frame as :func:`encode_frame` gives it, except that a payload of at least
    :data:`CHECK_AS_WRITTEN` bytes and the trailer are one :class:`CheckedPayload` (its
    :class:`ByteRanges` parts kept as they are)."""
    views = [p if isinstance(p, ByteRanges) else _byte_view(p) for p in payload_parts(chunk.payload)]
    size = sum(v.nbytes for v in views)
    head = _chunk_head(chunk)
    if size < CHECK_AS_WRITTEN:
        return [*_frame(FrameType.CHUNK, [*head, *(b for v in views for b in _buffers(v))])]
    header, crc = _head(FrameType.CHUNK, head, size)
    views = [v for v in views if v.nbytes]
    return [header, *head, CheckedPayload(views[0], crc, tuple(views[1:]))]


def _byte_view(part: Buffer) -> memoryview:
    """``part`` as a 1-d view of bytes (so len() of every part is its byte count)."""
    view = memoryview(part)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def frame_bytes(frame: Frame) -> bytes:
    """``frame`` as one ``bytes`` object (tests, fuzz corpora)."""
    return b"".join(bytes(p) for p in encode_frame(frame))


def chunk_frame_size(params_len: int, payload_len: int) -> int:
    """Bytes on the wire of a CHUNK frame with these params and payload sizes."""
    return FRAME_OVERHEAD + CHUNK_FIXED.size + params_len + payload_len


# ---------------------------------------------------------------------------------------
# Decoding.


def _bad_kind(kind: int, max_kind: int) -> ProtocolError:
    known = "K (0), V (1) or KV (2)" if max_kind >= KIND_KV else "K (0) or V (1)"
    return ProtocolError(f"CHUNK kind {kind} is not {known}")


def decode_body(ftype: int, flags: int, body: Buffer, *, max_kind: int = KIND_KV) -> Frame:
    """Parse a CRC-verified body.  Raises ProtocolError for any malformation.

    ``max_kind``: the highest CHUNK kind accepted (``KIND_V`` for version 1 alone)."""
    if ftype == FrameType.CHUNK:
        r = _Reader(body, "CHUNK")
        tid, layer, kind, codec_id, start, count, ltok, plen = r.unpack(CHUNK_FIXED)
        params = bytes(r.take(int(plen)))
        payload = r.rest()
        if kind > max_kind:
            raise _bad_kind(kind, max_kind)
        return Chunk(
            transfer_id=int(tid), layer=int(layer), kind=int(kind), codec_id=int(codec_id),
            token_start=int(start), token_count=int(count), layer_tokens=int(ltok),
            params=params, payload=payload,
        )
    if ftype == FrameType.ACK:
        r = _Reader(body, "ACK")
        tid, layer, kind, start = r.unpack(_ACK)
        r.end()
        return Ack(transfer_id=int(tid), layer=int(layer), kind=int(kind), token_start=int(start))
    if ftype == FrameType.CREDIT:
        r = _Reader(body, "CREDIT")
        tid, limit = r.unpack(_CREDIT)
        r.end()
        return Credit(transfer_id=int(tid), layer_limit=int(limit))
    if ftype == FrameType.ACCEPT:
        r = _Reader(body, "ACCEPT")
        tid, limit = r.unpack(_ACCEPT)
        r.end()
        return Accept(transfer_id=int(tid), layer_limit=int(limit))
    if ftype == FrameType.BEGIN:
        r = _Reader(body, "BEGIN")
        tid, nl, nh, hd, dt = r.unpack(_BEGIN_FIXED)
        model = r.text(r.u8())
        rid = r.text(r.u16())
        meta = bytes(r.take(r.u32()))
        blocks = []
        for _ in range(r.u16()):
            block = bytes(r.take(r.u8()))
            (version,) = r.unpack(_BLOCK_VERSION_TAIL)
            blocks.append(BlockVersion(block=block, version=int(version)))
        r.end()
        return Begin(
            transfer_id=int(tid), num_layers=int(nl), num_kv_heads=int(nh), head_dim=int(hd),
            dtype_id=int(dt), model=model, request_id=rid, meta=meta, blocks=tuple(blocks),
        )
    if ftype == FrameType.RESET:
        r = _Reader(body, "RESET")
        tid, code = r.unpack(_RESET_FIXED)
        msg = r.text(r.u16())
        r.end()
        return Reset(transfer_id=int(tid), code=int(code), message=msg)
    if ftype == FrameType.GOAWAY:
        r = _Reader(body, "GOAWAY")
        code = r.u16()
        msg = r.text(r.u16())
        r.end()
        return GoAway(code=code, message=msg)
    if ftype == FrameType.REPORT:
        r = _Reader(body, "REPORT")
        transport, count = r.unpack(_REPORT_FIXED)
        decode = tuple(DecodeCost(codec_id=int(c), ns_per_melem=int(ns))
                       for c, ns in (r.unpack(_DECODE_COST) for _ in range(count)))
        r.end()
        report = Report(transport_ns_per_mib=int(transport), decode=decode)
        _check_report(report)
        return report
    if ftype in (FrameType.PING, FrameType.PONG):
        r = _Reader(body, "PING")
        (opaque,) = r.unpack(_PING)
        r.end()
        cls = Ping if ftype == FrameType.PING else Pong
        return cls(opaque=int(opaque))
    if ftype == FrameType.HELLO:
        r = _Reader(body, "HELLO")
        magic, vmin, vmax = r.unpack(_HELLO_VERSIONS)
        if magic != MAGIC:
            raise ProtocolError("not a kvwire peer (bad magic)")
        try:
            nonce, sid, idx, mfs = r.unpack(_HELLO_FIXED)
            codecs = _read_codec_list(r)
            fp = bytes(r.take(FINGERPRINT_SIZE))
            r.end()
        except ProtocolError as exc:
            raise MalformedHello(str(exc), min_version=int(vmin), max_version=int(vmax)) from None
        return Hello(
            min_version=int(vmin), max_version=int(vmax), nonce=bytes(nonce), session_id=bytes(sid),
            stream_index=int(idx), max_frame_size=int(mfs), codecs=codecs, fingerprint=fp,
        )
    if ftype == FrameType.CHALLENGE:
        r = _Reader(body, "CHALLENGE")
        version, nonce = r.unpack(_CHALLENGE)
        r.end()
        return Challenge(version=int(version), nonce=bytes(nonce))
    if ftype == FrameType.AUTH:
        r = _Reader(body, "AUTH")
        proof = bytes(r.take(PROOF_SIZE))
        r.end()
        return Auth(proof=proof)
    if ftype == FrameType.WELCOME:
        r = _Reader(body, "WELCOME")
        sid, mfs, window, maxt = r.unpack(_WELCOME_FIXED)
        codecs = _read_codec_list(r)
        proof = bytes(r.take(PROOF_SIZE))
        r.end()
        return Welcome(
            session_id=bytes(sid), max_frame_size=int(mfs), window=int(window),
            max_transfers=int(maxt), codecs=codecs, proof=proof,
        )
    return UnknownFrame(type=ftype, flags=flags, body=bytes(body))


PayloadSink = Callable[[Chunk, int], "memoryview | tuple[memoryview, ...] | None"]
"""Called with a CHUNK's fields (empty payload) and its payload length before the payload
arrives; returns a writable buffer of exactly that length for it, a tuple of writable byte
buffers that together are that long (the payload is scattered over them, in order: see
:meth:`FrameDecoder.scatter_buffers`), or None."""

#: Most buffers :meth:`FrameDecoder.scatter_buffers` hands out for one read.
SCATTER_MAX = 512


def scatter_nbytes(dest: memoryview | tuple[memoryview, ...]) -> int:
    """Bytes a payload sink's buffer (or tuple of buffers) holds."""
    if isinstance(dest, tuple):
        return sum(v.nbytes for v in dest)
    return dest.nbytes


class _BigFrame:
    """A frame too large to gather in the shared buffer, read in stages.

    CHUNK: the fixed fields and params (``pre``), then the payload into ``dest`` (the
    payload sink's buffer or one of its own), then the CRC.  Other frames: the whole body
    into ``dest``, then the CRC.
    """

    __slots__ = ("crc", "dest", "filled", "ftype", "header", "length", "malformed", "pre", "pre_need", "running",
                 "seg", "seg_off", "size", "stage")

    PRE, DEST, CRC = 0, 1, 2

    def __init__(self, header: bytes, ftype: int, length: int) -> None:
        self.header = header
        self.ftype = ftype
        self.length = length
        self.pre = bytearray()
        self.pre_need = CHUNK_FIXED.size if ftype == FrameType.CHUNK else 0
        # Where the body (a CHUNK's payload) goes: one buffer, or several in order (a
        # scattered payload: ``seg``, ``seg_off`` is where the next byte goes); ``size``
        # bytes in all, ``filled`` of them in.
        self.dest: memoryview | tuple[memoryview, ...] | None = None
        self.size = 0
        self.filled = 0
        self.seg = self.seg_off = 0
        self.crc = bytearray()
        # Why the body cannot be a valid frame, found before its CRC could be checked: it
        # is read to scratch, and refused as a protocol error once the CRC holds.
        self.malformed: str | None = None
        # CRC32C of header, pre and dest[:filled], kept up as bytes land (while they are
        # still in the cache) so the payload is not read a second time at the end
        self.running = 0
        if self.pre_need:
            self.stage = self.PRE
        else:
            # Any other frame: its whole body goes into a buffer of its own.
            self.running = crc32c(header)
            self.dest = memoryview(bytearray(length))
            self.size = length
            self.stage = self.DEST if length else self.CRC


#: A CHUNK's frame header and fixed fields: what is read after a big frame's body.
_CHUNK_HEAD = HEADER_SIZE + CHUNK_FIXED.size


def _is_tls_client_hello(ftype: int, flags: int, reserved: int, length: int) -> bool:
    """Whether a frame header's 8 bytes are the start of a TLS ClientHello, as a client
    that speaks TLS first sends: a TLS record header (content type 22, handshake; version
    3.x; a 2-byte length), then the handshake message's type (1, ClientHello) and the
    first 2 bytes of its 3-byte length."""
    return (ftype == _TLS_HANDSHAKE_RECORD and flags == _TLS_MAJOR_VERSION
            and reserved >> 8 <= _TLS_MAX_MINOR_VERSION
            and (length >> 16) & 0xFF == _TLS_CLIENT_HELLO)


_TLS_HANDSHAKE_RECORD = 0x16
_TLS_MAJOR_VERSION = 0x03
_TLS_MAX_MINOR_VERSION = 0x04  # SSL 3.0 (0x0300) to TLS 1.3's legacy 0x0303, with room
_TLS_CLIENT_HELLO = 0x01


class FrameDecoder:
    """Turns a byte stream into frames.

    ``max_body`` is checked against each header before any of the body is buffered.
    Bodies above ``big_body`` get a buffer of their own (read into directly through
    :meth:`get_buffer`), so payload views handed out stay valid while later bytes
    arrive.  With a ``payload_sink``, a large CHUNK's payload is read straight into the
    buffer the sink returns (its final place), and the CRC is checked there.
    """

    def __init__(
        self, max_body: int, *, big_body: int = 64 * 1024, scratch_size: int = 16 * 1024,
        payload_sink: PayloadSink | None = None,
    ) -> None:
        self.max_body = max_body
        self._big_body = big_body
        self._buf = bytearray()
        self._pos = 0
        self._big: _BigFrame | None = None
        self.bytes_received = 0
        self._scratch = memoryview(bytearray(scratch_size))
        self._handed_dest = False
        self._handed_views: Sequence[memoryview] = ()  # of a scattered payload, as handed out
        self._deferred = False  # a big CHUNK waits in the buffer (see _defer)
        self._error: Exception | None = None  # what stopped decoding (see feed)
        self.payload_sink = payload_sink
        self.max_kind = KIND_KV
        """The highest CHUNK kind accepted (``KIND_V`` for version 1 alone).  A
        :class:`~kvwire.wire.Connection` leaves it and checks a KV chunk against the version
        it agreed on as it handles the frame, in frame order."""

    # -- recv_into style --------------------------------------------------------------

    def get_buffer(self) -> memoryview:
        """Where the next read should go: the rest of a big frame's body, or scratch.

        With a payload sink, once a big frame's body is in, the read after it is sized
        to its CRC and the fixed fields of the frame after it: if that is a CHUNK, none
        of its payload lands in scratch (to be copied to its place later), and
        :meth:`start_deferred` gives it its place before the next read.
        """
        big = self._big
        if big is not None:
            if big.stage == _BigFrame.DEST:
                dest = big.dest
                assert dest is not None
                self._handed_dest = True
                if isinstance(dest, tuple):
                    view = dest[big.seg][big.seg_off :]
                    self._handed_views = (view,)
                    return view
                return dest[big.filled :]
            if big.stage == _BigFrame.CRC and self.payload_sink is not None:
                self._handed_dest = False
                return self._scratch[: CRC_SIZE - len(big.crc) + _CHUNK_HEAD]
        self._handed_dest = False
        return self._scratch

    def scatter_buffers(self) -> list[memoryview]:
        """Where the next read should go when a payload is being read into several buffers
        (a payload sink returned a tuple): the rest of them, in order (at most
        ``SCATTER_MAX``), for one scatter read (``recvmsg_into``); then
        :meth:`buffer_updated` with the bytes read.  Empty when no such payload is being
        read (:meth:`get_buffer` is then the only place)."""
        big = self._big
        if big is None or big.stage != _BigFrame.DEST or not isinstance(big.dest, tuple):
            return []
        self._handed_dest = True
        segs = big.dest
        views = [segs[big.seg][big.seg_off :], *segs[big.seg + 1 : big.seg + SCATTER_MAX]]
        self._handed_views = views
        return views

    def buffer_updated(self, nbytes: int) -> list[tuple[Frame, int]]:
        """Account for ``nbytes`` written into the last :meth:`get_buffer` (or
        :meth:`scatter_buffers`); return frames."""
        if not self._handed_dest:
            return self.feed(self._scratch[:nbytes])
        self._handed_dest = False
        big = self._big
        assert big is not None and big.dest is not None
        self.bytes_received += nbytes
        if isinstance(big.dest, tuple):
            # The views handed out start at (seg, seg_off), then whole segments follow.
            big.running, index, offset = crc32c_scatter(self._handed_views, nbytes, big.running)
            self._handed_views = ()
            if index:
                big.seg += index
                big.seg_off = offset
            else:
                big.seg_off += offset
            big.filled += nbytes
        else:
            big.running = crc32c(big.dest[big.filled : big.filled + nbytes], big.running)
            big.filled += nbytes
        if big.filled == big.size:
            big.stage = _BigFrame.CRC
        return []

    @staticmethod
    def _fill_segments(big: _BigFrame, nbytes: int, src: memoryview) -> None:
        """Advance a scattered payload by ``nbytes`` copied from ``src``, each piece
        checksummed as it lands."""
        segs = big.dest
        assert isinstance(segs, tuple)
        done = 0
        while done < nbytes:
            seg = segs[big.seg]
            take = min(seg.nbytes - big.seg_off, nbytes - done)
            piece = seg[big.seg_off : big.seg_off + take]
            piece[:] = src[done : done + take]
            big.running = crc32c(piece, big.running)
            done += take
            big.seg_off += take
            if big.seg_off == seg.nbytes:
                big.seg += 1
                big.seg_off = 0
        big.filled += nbytes

    # -- plain bytes --------------------------------------------------------------------

    def feed(self, data: Buffer) -> list[tuple[Frame, int]]:
        """Add ``data``; return the frames it completed with their wire sizes.

        A frame that cannot be decoded (a CRC mismatch, a header over the limit, a
        malformed body) raises, unless frames before it completed in the same call: those
        are returned, and the error waits for :meth:`raise_pending` (the frames before
        the failing one are processed, docs/protocol.md 3.4).  No frame after it is
        decoded: every later call raises the error."""
        if self._error is not None:
            raise self._error
        out: list[tuple[Frame, int]] = []
        try:
            self._feed(data, out)
        except Exception as exc:
            if not out:
                raise
            self._error = exc
        return out

    def raise_pending(self) -> None:
        """Raise the error that stopped the frames a :meth:`feed` returned, if any."""
        if self._error is not None:
            raise self._error

    def _feed(self, data: Buffer, out: list[tuple[Frame, int]]) -> None:
        self.bytes_received += len(data)
        self._deferred = False  # the buffered bytes are taken up again here
        view = memoryview(data)
        while True:
            if self._big is not None:
                view = self._feed_big(view, out)
                if self._big is not None:
                    return  # the big frame wants more than there is
                continue
            if view:
                if self._pos and self._pos == len(self._buf):
                    self._buf.clear()
                    self._pos = 0
                if not self._buf and len(view) >= HEADER_SIZE:
                    # Nothing buffered: a big frame can start straight from this view.
                    ftype, length = self._check_header(view)
                    need = HEADER_SIZE + length + CRC_SIZE
                    if length + CRC_SIZE > self._big_body and len(view) < need:
                        if self._defer(ftype, out):
                            self._buf += view  # (it waits there, its header checked: see _defer)
                            return
                        self._big = _BigFrame(bytes(view[:HEADER_SIZE]), ftype, length)
                        view = view[HEADER_SIZE:]
                        continue
                self._buf += view
                view = view[len(view) :]
            avail = len(self._buf) - self._pos
            if avail < HEADER_SIZE:
                self._compact()
                return
            ftype, length = self._check_header(memoryview(self._buf)[self._pos : self._pos + HEADER_SIZE])
            need = HEADER_SIZE + length + CRC_SIZE
            if length + CRC_SIZE > self._big_body and avail < need:
                if self._defer(ftype, out):
                    self._compact()
                    return
                header = bytes(self._buf[self._pos : self._pos + HEADER_SIZE])
                rest = bytes(self._buf[self._pos + HEADER_SIZE :])
                self._buf.clear()
                self._pos = 0
                self._big = _BigFrame(header, ftype, length)
                view = memoryview(rest)
                continue
            if avail < need:
                self._compact()
                return
            start = self._pos
            self._pos += need
            mv = memoryview(self._buf)
            try:
                header = bytes(mv[start : start + HEADER_SIZE])
                body_crc = bytes(mv[start + HEADER_SIZE : start + need])
            finally:
                mv.release()
            out.append((self._finish(header, memoryview(body_crc), self.max_kind), need))

    def _defer(self, ftype: int, out: list[tuple[Frame, int]]) -> bool:
        """Whether an unfinished big CHUNK waits in the buffer until the frames before it
        are handed over: the payload sink decides where its payload goes from what the
        receiver has processed (the first chunk of a transfer tells it the layer's size),
        so it is asked only after they are.  The frame needs more bytes anyway, and those
        come with the next read, or :meth:`start_deferred` starts it once they are handled."""
        if bool(out) and ftype == FrameType.CHUNK and self.payload_sink is not None:
            self._deferred = True
            return True
        return False

    def start_deferred(self) -> list[tuple[Frame, int]]:
        """Start the big CHUNK that waits in the buffer (see :meth:`_defer`), now that the
        frames before it were handled: its payload sink is asked, so the next
        :meth:`get_buffer` is the payload's place.  Returns the frames completed (none: a
        deferred frame needs more bytes than are buffered); raises like :meth:`feed`."""
        if not self._deferred:
            return []
        self._deferred = False
        return self.feed(b"")

    def _check_header(self, head: memoryview) -> tuple[int, int]:
        ftype, flags, reserved, length = HEADER.unpack(head[:HEADER_SIZE])
        if length > self.max_body:
            if self._at_stream_start(head) and _is_tls_client_hello(ftype, flags, reserved, length):
                raise FrameTooLargeError(
                    "the first bytes are a TLS ClientHello, not a kvwire frame: this server does "
                    "not use TLS (or the client expects TLS)"
                )
            raise FrameTooLargeError(
                f"frame type 0x{ftype:02x} announces {length} bytes, limit {self.max_body}"
            )
        # The reserved field is checked after the CRC (see _check_reserved): a flipped bit
        # there is line noise, an integrity error, not a peer breaking the protocol.
        return int(ftype), int(length)

    def _at_stream_start(self, head: memoryview) -> bool:
        """Whether ``head``, a header :meth:`_check_header` was given, is the first of the
        stream (no byte before it was taken): ``head`` is either the whole of what is left
        of a feed with nothing buffered, or a slice of the buffer at ``_pos``.  Asked only
        for a header that failed, off the path of frames that decode."""
        if not self._buf:
            return self.bytes_received == len(head)
        return self._pos == 0 and self.bytes_received == len(self._buf)

    def _feed_big(self, view: memoryview, out: list[tuple[Frame, int]]) -> memoryview:
        """Advance the big frame with ``view``; return what is left of it."""
        big = self._big
        assert big is not None
        if big.stage == _BigFrame.PRE:
            take = min(big.pre_need - len(big.pre), len(view))
            big.pre += view[:take]
            view = view[take:]
            if len(big.pre) < big.pre_need:
                return view
            if big.pre_need == CHUNK_FIXED.size:
                plen = int(CHUNK_FIXED.unpack(big.pre)[-1])
                big.pre_need += plen
                if big.pre_need > big.length:
                    # Before the CRC can be checked: as likely a corrupted length as a bad
                    # peer.  The rest of the body goes to scratch; the CRC then tells which.
                    big.malformed = "CHUNK params longer than its body"
                    big.pre_need = len(big.pre)
                    plen = 0
                if plen:
                    return self._feed_big(view, out)
            self._start_dest(big)
        if big.stage == _BigFrame.DEST:
            dest = big.dest
            assert dest is not None
            take = min(big.size - big.filled, len(view))
            # (take 0: nothing of the payload in view, the read that started it ended with its head)
            if take:
                if isinstance(dest, tuple):
                    self._fill_segments(big, take, view)
                else:
                    dest[big.filled : big.filled + take] = view[:take]
                    big.running = crc32c(view[:take], big.running)
                    big.filled += take
            view = view[take:]
            if big.filled < big.size:
                return view
            big.stage = _BigFrame.CRC
        take = min(CRC_SIZE - len(big.crc), len(view))
        big.crc += view[:take]
        view = view[take:]
        if len(big.crc) == CRC_SIZE:
            self._big = None
            out.append((self._finish_big(big), HEADER_SIZE + big.length + CRC_SIZE))
        return view

    def _start_dest(self, big: _BigFrame) -> None:
        size = big.length - len(big.pre)
        dest: memoryview | tuple[memoryview, ...] | None = None
        if big.ftype == FrameType.CHUNK and self.payload_sink is not None and big.malformed is None:
            head = _chunk_from(big.pre, b"", self.max_kind)
            if head is not None:
                dest = self.payload_sink(head, size)
                if dest is not None and (problem := sink_problem(dest, size)) is not None:
                    raise ValueError(problem)
        big.dest = dest if dest is not None else memoryview(bytearray(size))
        big.size = size
        big.seg = big.seg_off = 0
        big.running = crc32c(big.header + big.pre)
        big.stage = _BigFrame.DEST if size else _BigFrame.CRC

    def _finish_big(self, big: _BigFrame) -> Frame:
        assert big.dest is not None
        (expected,) = CRC.unpack(big.crc)
        if big.running != expected:
            raise IntegrityError(f"CRC32C mismatch on frame type 0x{big.ftype:02x}")
        _check_reserved(big.header)
        if big.malformed is not None:
            raise ProtocolError(big.malformed)
        if big.ftype == FrameType.CHUNK:
            chunk = _chunk_from(big.pre, big.dest, self.max_kind)
            if chunk is None:
                raise _bad_kind(CHUNK_FIXED.unpack_from(big.pre)[2], self.max_kind)
            return chunk
        assert not isinstance(big.dest, tuple)  # only a CHUNK's payload goes to a sink
        return decode_body(big.ftype, big.header[1], big.dest)

    def close(self) -> None:
        """No frame will be taken any more (the connection closed): the unfinished one is
        dropped, so the place its payload was being read into is neither written again
        nor held, and every later read goes to scratch."""
        self._big = None
        self._buf = bytearray()
        self._pos = 0
        self._handed_dest = False
        self._handed_views = ()
        self._deferred = False
        self._error = None

    def abandon_payload(self, view: memoryview | tuple[memoryview, ...]) -> bool:
        """Stop reading the current frame into ``view`` (what the payload sink returned):
        the rest goes to a private copy, so ``view`` is never written again.  True if it
        was in use."""
        big = self._big
        if big is None or big.dest is None or big.dest is not view:
            return False
        private = memoryview(bytearray(big.size))
        if isinstance(view, tuple):
            at = 0
            for seg in view:
                take = min(seg.nbytes, big.filled - at)
                if take <= 0:
                    break
                private[at : at + take] = seg[:take]
                at += take
        else:
            private[: big.filled] = view[: big.filled]
        big.dest = private
        return True

    def _compact(self) -> None:
        if self._pos:
            del self._buf[: self._pos]
            self._pos = 0

    @property
    def payload_remaining(self) -> int:
        """Bytes of a large frame's body that will be read straight into its buffer before
        the frame can complete (0 when no such body is being read): the peer has
        committed to sending at least this many more bytes."""
        big = self._big
        if big is None or big.stage != _BigFrame.DEST or big.dest is None:
            return 0
        return big.size - big.filled

    @property
    def buffered(self) -> int:
        """Bytes held while waiting for the rest of a frame."""
        big = 0
        if self._big is not None:
            big = len(self._big.pre) + self._big.filled + len(self._big.crc)
        return len(self._buf) - self._pos + big

    @staticmethod
    def _finish(header: bytes, body_crc: memoryview, max_kind: int) -> Frame:
        body = body_crc[:-CRC_SIZE]
        (expected,) = CRC.unpack(body_crc[-CRC_SIZE:])
        if crc32c(body, crc32c(header)) != expected:
            raise IntegrityError(f"CRC32C mismatch on frame type 0x{header[0]:02x}")
        _check_reserved(header)
        ftype, flags, _, _ = HEADER.unpack(header)
        return decode_body(ftype, flags, body, max_kind=max_kind)


def sink_problem(dest: object, size: int) -> str | None:
    """What makes a payload sink's answer unusable, or None: it must be writable bytes
    (a 1-D, C-contiguous memoryview of bytes, or a tuple of such, none empty among
    several), ``size`` of them in all."""
    views = dest if isinstance(dest, tuple) else (dest,)
    total = 0
    for v in views:
        if type(v) is not memoryview or v.readonly or v.ndim != 1 or v.itemsize != 1 or not v.c_contiguous:
            return "payload sink returned a buffer that is not writable bytes (a 1-D memoryview of bytes)"
        if not v.nbytes and len(views) > 1:
            return "payload sink returned an empty buffer among several"
        total += v.nbytes
    if not views or total != size:
        return "payload sink returned a buffer of the wrong size"
    return None


def _check_reserved(header: bytes) -> None:
    """A CRC-verified header with reserved bits set was sent that way: a protocol error."""
    if header[2] or header[3]:
        raise ProtocolError("reserved header bits set")


def _chunk_from(pre: Buffer, payload: Buffer | tuple[memoryview, ...], max_kind: int) -> Chunk | None:
    """A Chunk from its fixed fields + params and a payload; None for a kind above ``max_kind``."""
    tid, layer, kind, codec_id, start, count, ltok, _plen = CHUNK_FIXED.unpack_from(pre)
    if kind > max_kind:
        return None
    return Chunk(
        transfer_id=tid, layer=layer, kind=kind, codec_id=codec_id, token_start=start,
        token_count=count, layer_tokens=ltok, params=bytes(memoryview(pre)[CHUNK_FIXED.size :]),
        payload=payload,
    )


__all__ = [
    "CHUNK_FIXED",
    "CRC_SIZE",
    "FINGERPRINT_SIZE",
    "FRAME_OVERHEAD",
    "HANDSHAKE_MAX_BODY",
    "HEADER_SIZE",
    "KIND_K",
    "KIND_KV",
    "KIND_V",
    "KV_CHUNK_VERSION",
    "MAGIC",
    "NONCE_SIZE",
    "PROOF_SIZE",
    "PROTOCOL_VERSION",
    "SCATTER_MAX",
    "SESSION_ID_SIZE",
    "Accept",
    "Ack",
    "Auth",
    "Begin",
    "BlockVersion",
    "ByteRanges",
    "Challenge",
    "Chunk",
    "ChunkAddress",
    "Credit",
    "DecodeCost",
    "ErrorCode",
    "Frame",
    "FrameDecoder",
    "FrameType",
    "GoAway",
    "Hello",
    "PayloadSink",
    "Ping",
    "Pong",
    "Report",
    "Reset",
    "UnknownFrame",
    "Welcome",
    "chunk_frame_size",
    "decode_body",
    "encode_frame",
    "frame_bytes",
    "payload_nbytes",
    "payload_parts",
    "scatter_nbytes",
]
