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
(:meth:`ReceiverCore.registry_published`).  The core never waits.  Every call is answered,
also one whose transfer failed meanwhile (the I/O layer may cancel a check then, never a
publish): until it is, that transfer counts against an allowance of its own beside
``max_transfers`` (see ``ReceiverCore._orphan``), so a session has at most twice
``max_transfers`` calls running.

Memory: layer buffers come from a :class:`LayerStore` (by default ``allocate``, which may
raise MemoryError, and ``decode``) and are counted against ``max_buffer_bytes`` until the
application takes the layer or the transfer ends; so is what BEGIN makes the server keep
(prefix blocks and meta, :func:`begin_footprint`), until the last layer is taken.  Layers
granted past a transfer's first are reserved in that budget from the grant until they are
allocated, and granted only within the room left (docs/protocol.md 8.2): transfers that
together want more than it wait for credit (a layer taken gives its room back to its own
transfer; room freed otherwise goes to those waiting, in the order they began waiting), and
an eighth of the budget is kept from windows for first layers.  A transfer is accepted only
once the room left holds its first layer at an estimate (from the first layers of its layout
its own session sent whole recently, at most an eighth of the budget unless the smallest of
them is larger; for a session with none yet, from every session's, at most the eighth;
docs/protocol.md 8.2), reserved until that layer arrives: BEGINs past the room wait to
start, in their order (see ReceiverCore._admit).  A chunk
counts as received only after its bytes are in place.  Raw payloads may be read straight
into their layer (the payload sink of each connection): that happens before the frame's
CRC is checked, so it changes no transfer state; only the verified chunk does.
"""

from __future__ import annotations

import hashlib
import heapq
import secrets
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from kvwire.codec import available_codecs, codec_by_id, get_codec
from kvwire.codec.entropy import decompressed_size
from kvwire.consistency.blocks import block_from_key
from kvwire.errors import (
    AuthenticationError,
    ConnectionLostError,
    ErrorCode,
    IncompatiblePeerError,
    KvwireError,
    LimitExceededError,
    ProtocolError,
    StaleVersionError,
    TransferAbortedError,
    TransferTimeoutError,
    UsageError,
    detached,
    error_from_code,
)
from kvwire.session.meta import meta_footprint, parse_meta
from kvwire.session.quoting import quoted_id
from kvwire.spec import DTYPE_BY_ID, KVSpec, closest_spec, spec_differences
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
    Report,
    Role,
    State,
    TransferBegun,
    TransferReset,
)
from kvwire.wire.connection import NO_FINGERPRINT, NO_SESSION, SHUTTING_DOWN
from kvwire.wire.frames import (
    DEFAULT_MAX_FRAME_SIZE,
    DEFAULT_WINDOW,
    KIND_KV,
    Buffer,
    encode_body,
    sink_problem,
)
from kvwire.wire.transfer import RANGE_BYTES, kinds_overlap, split_kv

#: The least room past max_buffer_bytes for what a server remembers of its transfers
#: besides their layers (prefix block lists, meta, token ranges): an eighth of the budget,
#: at least this (8192 ranges), so a small budget filled by layers still takes chunks.
KEPT_ROOM_MIN = 1 << 20
#: Windows are granted into max_buffer_bytes less this share of it (max_buffer_bytes //
#: FIRST_LAYER_SHARE), kept for first layers: ACCEPT grants a transfer's first layer before
#: its size is known, so its room is kept at an estimate (see ReceiverCore._admit), and a
#: first layer larger than that which finds no room fails its transfer (docs/protocol.md 8.2).
FIRST_LAYER_SHARE = 8
#: First layers a session's history remembers the footprint of, per layout and of any
#: layout (each one received whole; not those received into a destination): a transfer's
#: first layer's estimate comes from those its own session sent of its layout (of any
#: layout if none), and it is accepted once the room left holds that estimate (see
#: ReceiverCore._estimate, ReceiverCore._admit).  One session's history never sets the
#: estimate of another that has its own.
RECENT_FIRST_LAYERS = 64
#: Layouts whose recent first layers a session's history remembers (the least recently
#: seen forgotten); a session keeps at most this many of RECENT_FIRST_LAYERS each, plus
#: those of any layout, and its history goes with it.
LAYOUTS_REMEMBERED = 8
#: Layouts whose recent first layers the server remembers across sessions, for the first
#: transfers of a session that has no history yet (their estimate is at most the share of
#: the budget kept for first layers: another session's sizes can delay them that little).
#: Each layout's, and the any-layout one, keep one figure per session for the last
#: SESSIONS_REMEMBERED sessions that sent a first layer whole: the largest of that
#: session's own recent ones, so one session cannot flush or lower the others'.
SERVER_LAYOUTS_REMEMBERED = 64
SESSIONS_REMEMBERED = 64

#: Failed transfers a session remembers why (see _Session.tombstones): each its RESET's
#: code and text, so at most about WIRE_TEXT_LIMIT * 4 + 200 bytes apiece.
TOMBSTONES_KEPT = 4096
#: Recent RESETs of a session kept to be said again when the stream they went out on
#: closes (see _Session.resets).
_RESETS_KEPT = 256

#: Completed transfers whose data is gone a session remembers (see _Session.completed).
COMPLETED_KEPT = 4096
#: What ``ReceiverCore.counters`` counts, each from 0.
COUNTERS = (
    "transfers_accepted", "transfers_refused", "transfers_aborted", "transfers_aborted_by_peer",
    "transfers_unclaimed", "failed_arrivals_expired", "buffer_budget_refusals", "credit_waits",
    "authentication_failures", "resumes", "goaways_received", "connections_dropped", "admission_waits",
)
#: Size of the deadline heap at which it is first compacted (see ``_compact_timers``).
TIMERS_COMPACT_MIN = 1024

Key = tuple[bytes, int]
"""A transfer's identity on a server: (session id, transfer id)."""


def _request_digest(request_id: str) -> bytes:
    """What a session keeps of a completed transfer's request id (at most 64 KiB): 8 bytes."""
    return hashlib.blake2b(request_id.encode("utf-8", "surrogatepass"), digest_size=8).digest()


def _begin_digest(begin: Begin) -> bytes:
    """What a session keeps of a BEGIN once the transfer no longer keeps it whole (its meta
    and prefix blocks let go when its last layer is taken): 8 bytes, of its body."""
    h = hashlib.blake2b(digest_size=8)
    for part in encode_body(begin)[1]:
        h.update(part)
    return h.digest()


#: The fields of BEGIN besides its ids, as a refusal of a BEGIN that repeats both with
#: another of them names them: its layout (named with both values) and what it holds
#: (named only).
_LAYOUT_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "dtype_id", "model")
_HELD_FIELDS = ("meta", "blocks")


def _begin_differences(kept: Begin, begin: Begin, *, whole: bool) -> str:
    """How ``begin`` differs from ``kept`` (same ids), in a few words: its layout fields as
    both have them; meta and blocks only by name (``whole``: ``kept`` still has them; else
    they may be what differs)."""
    said = []
    for name in _LAYOUT_FIELDS:
        old, new = getattr(kept, name), getattr(begin, name)
        if old != new:
            said.append(f"{name} {new!r}, not {old!r}" if name == "model" else f"{name} {new}, not {old}")
    if whole:
        said += [name for name in _HELD_FIELDS if getattr(kept, name) != getattr(begin, name)]
    elif not said:
        said.append("meta or prefix blocks")
    return "; ".join(said)


def _in_use(tid: int, begin: Begin, existing: _Incoming | None, done: bytes | None) -> str:
    """Why a BEGIN of transfer id ``tid`` the session has (``existing``, or ``done``: what a
    completed one left) is refused with DUPLICATE_TRANSFER: it is not a re-send of it."""
    if existing is not None and existing.begin.request_id == begin.request_id:
        what = _begin_differences(existing.begin, begin, whole=not existing.begin_digest)
        return f"transfer id {tid} is already in use by a BEGIN of the same request id with other fields ({what})"
    if done is not None and done[:8] == _request_digest(begin.request_id):
        return (f"transfer id {tid} was used by a completed transfer of the same request id with other "
                "fields (layout, model, meta or prefix blocks)")
    return f"transfer id {tid} is already in use"


Allocate = Callable[[int], memoryview]
#: Where a raw payload can be read straight into: one byte buffer, or several in order.
Region = memoryview | tuple[memoryview, ...]
Decode = Callable[[Chunk, memoryview], None]

#: Versions registries issue are below this; anything above was never issued.
MAX_BLOCK_VERSION = 1 << 53
_CONN, _SESSION, _DEADLINE, _CLAIM = range(4)  # kinds of deadline (see ReceiverCore._note)
#: Longest text this side puts in a RESET (peer text is never echoed back in full).
WIRE_TEXT_LIMIT = 160
#: Budget bytes of one prefix block of a transfer beyond twice its key's length (the key
#: as received, and the block id handed to the application): the objects that hold them
#: and its version (about 230 bytes measured; see :func:`begin_footprint`).
BLOCK_ENTRY_BYTES = 256

#: Hex digits of a layout's fingerprint an INCOMPATIBLE_SPEC refusal names.
FP_SHOWN = 12

#: Bytes of a transfer's request id and model (UTF-8, together) kept without a charge: a
#: short id costs nothing, one up to its 65535-byte limit counts (see :func:`begin_footprint`).
FREE_ID_BYTES = 256


def _note_session(sessions: OrderedDict[bytes, int], session_id: bytes, footprint: int) -> None:
    """``footprint`` is ``session_id``'s figure in ``sessions`` (one entry per session, the
    most recently noted last); past SESSIONS_REMEMBERED the least recent goes."""
    sessions[session_id] = footprint
    sessions.move_to_end(session_id)
    while len(sessions) > SESSIONS_REMEMBERED:
        sessions.popitem(last=False)


T = TypeVar("T")


def _layout_entry(history: OrderedDict[bytes, T], fingerprint: bytes, layouts: int, new: Callable[[], T]) -> T:
    """``history``'s entry for the layout ``fingerprint`` (``new()`` if it has none), now the
    most recently seen; past ``layouts`` layouts the least recently seen goes."""
    entry = history.get(fingerprint)
    if entry is None:
        entry = history[fingerprint] = new()
        while len(history) > layouts:
            history.popitem(last=False)
    else:
        history.move_to_end(fingerprint)
    return entry


class _LayoutRefused(IncompatiblePeerError):
    """INCOMPATIBLE_SPEC for a valid layout that is not among those the server accepts
    (:func:`admit_begin`): refused again whenever it is sent, unlike a BEGIN whose layout
    is malformed (an undefined dtype, a size out of range)."""


def wire_text(text: str) -> str:
    return text if len(text) <= WIRE_TEXT_LIMIT else text[: WIRE_TEXT_LIMIT - 3] + "..."


def stale_error(blocks: Sequence[object], why: str = "") -> StaleVersionError:
    """The error of a transfer refused (or unpublished) for stale prefix blocks: the first
    eight named, the rest counted."""
    shown = ", ".join(repr(b) for b in list(blocks)[:8])
    more = f" and {len(blocks) - 8} more" if len(blocks) > 8 else ""
    return StaleVersionError(f"stale prefix blocks{why}: {shown}{more}")


def _block_bytes(begin: Begin) -> int:
    """Budget bytes of ``begin``'s prefix block list (a share of :func:`begin_footprint`)."""
    return sum(2 * len(bv.block) + BLOCK_ENTRY_BYTES for bv in begin.blocks)


def begin_footprint(begin: Begin, meta: Mapping[str, object]) -> int:
    """Budget bytes of what ``begin`` makes the server keep with its transfer besides its
    layers, at about the memory it takes: the prefix block list, a meta that is not empty
    (as received and as parsed), and the request id and model past their first
    :data:`FREE_ID_BYTES`.  Counted against ``max_buffer_bytes`` from BEGIN until the
    transfer fails or its last layer is taken: a BEGIN may carry thousands of blocks, and
    a request id of 64 KiB."""
    blocks = _block_bytes(begin)
    ids = len(begin.request_id.encode("utf-8", "surrogatepass")) + len(begin.model.encode("utf-8", "surrogatepass"))
    # The meta as received is kept whatever it parses to (b"{}" and 64 KiB of spaces too).
    meta_bytes = (len(begin.meta) if begin.meta != b"{}" else 0) + (meta_footprint(meta) if meta else 0)
    return blocks + meta_bytes + max(0, ids - FREE_ID_BYTES)


def admit_begin(
    begin: Begin, *, active: int, max_transfers: int, max_meta_bytes: int,
    fingerprints: frozenset[bytes] | set[bytes] = frozenset(), unclaimed: int = 0,
    specs: tuple[KVSpec, ...] = (),
) -> tuple[KVSpec, dict[str, object]]:
    """Validate a BEGIN for a session with ``active`` transfers in progress or unclaimed
    (``unclaimed`` of them complete, waiting for the application to claim them).

    Returns the transfer's layout and meta; raises the error its RESET carries (section
    7.1 of docs/protocol.md): LIMIT_EXCEEDED, INCOMPATIBLE_SPEC or PROTOCOL_ERROR.  A
    layout not among ``fingerprints`` is named by fingerprint, and, where ``specs`` (the
    layouts of ``fingerprints``) has them, by the fields in which it differs from the
    closest of them, with both values.
    """
    if active >= max_transfers:
        # (within WIRE_TEXT_LIMIT: the RESET carries it)
        held = f", {unclaimed} complete and not claimed by the receiver's application" if unclaimed else ""
        raise LimitExceededError(
            f"{active} transfers of the session held (max_transfers={max_transfers}){held}: "
            "retry once one ends" + (" or is claimed" if unclaimed else ""))
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
        # The fingerprints first, then the fields that differ from the closest layout
        # accepted, with both values (the model field cut where they differ), the whole
        # within WIRE_TEXT_LIMIT: a layout's repr (its model field) can be longer.
        accepted = sorted(fp.hex()[:FP_SHOWN] for fp in fingerprints)
        more = f" and {len(accepted) - 4} more" if len(accepted) > 4 else ""
        head = (f"this server does not accept KV layout {spec.fingerprint.hex()[:FP_SHOWN]} "
                f"(it accepts {', '.join(accepted[:4])}{more}): ")
        closest = closest_spec(specs, spec)
        tail = str(spec) if closest is None else spec_differences(closest, spec, WIRE_TEXT_LIMIT - len(head))
        raise _LayoutRefused(head + tail)
    if len(begin.meta) > max_meta_bytes:
        raise LimitExceededError(f"meta of {len(begin.meta)} bytes exceeds max_meta_bytes={max_meta_bytes}")
    meta = parse_meta(begin.meta)
    try:
        for bv in begin.blocks:
            block_from_key(bv.block.decode("utf-8"))
    except (UnicodeDecodeError, UsageError):
        raise ProtocolError("BEGIN carries a malformed block id") from None
    return spec, meta


def check_chunk_size(chunk: Chunk, spec: KVSpec, *, max_chunk_bytes: int, max_layer_bytes: int) -> None:
    """Refuse (LIMIT_EXCEEDED) a chunk that would decode beyond ``max_chunk_bytes``, whose
    compressed payload would decompress beyond it, or that belongs to a layer beyond
    ``max_layer_bytes``, before anything is allocated or decompressed: the sizes come from
    the chunk's header and params, which the peer chose.  What is decompressed is the
    inner codec's payload, not the decoded data, and can be the larger: an int4 payload
    holds 8 bytes of scale and minimum a group, and the params choose the group size."""
    bytes_per_token = spec.num_kv_heads * spec.head_dim * spec.itemsize
    size = chunk_span(chunk, bytes_per_token, 0)[1]
    if size > max_chunk_bytes:
        raise LimitExceededError(f"a chunk of {size} bytes exceeds this server's max_chunk_bytes")
    if 2 * chunk.layer_tokens * bytes_per_token > max_layer_bytes:
        raise LimitExceededError(
            f"a layer of {2 * chunk.layer_tokens * bytes_per_token} bytes exceeds this server's max_layer_bytes"
        )
    if chunk.kind == KIND_KV or chunk.codec_id == 0:  # raw (codec 0), nothing to decompress
        return
    try:
        inner = decompressed_size(codec_by_id(chunk.codec_id), chunk.params,
                                  (chunk.token_count, spec.num_kv_heads, spec.head_dim), spec.dtype, chunk.kind)
    except ProtocolError:
        # An unknown codec or params whose size cannot be worked out: the checks after
        # this one, or the decode before it decompresses anything, refuse them.
        return
    if inner > max_chunk_bytes:
        raise LimitExceededError(
            f"a chunk whose payload decompresses to {inner} bytes exceeds this server's max_chunk_bytes"
        )


def chunk_span(chunk: Chunk, bytes_per_token: int, layer_bytes: int) -> tuple[int, int]:
    """``(offset, nbytes)`` of ``chunk``'s data in its layer's bytes (K, then V, each half
    of ``layer_bytes``).  For a KV chunk ``offset`` is that of its K range (its V range lies
    half a layer further) and ``nbytes`` the size of both."""
    nbytes = chunk.token_count * bytes_per_token
    if chunk.kind == KIND_KV:
        return chunk.token_start * bytes_per_token, 2 * nbytes
    return chunk.kind * (layer_bytes // 2) + chunk.token_start * bytes_per_token, nbytes


def raw_decode(chunk: Chunk, dest: memoryview) -> None:
    """The ``raw`` codec: the payload is the data."""
    if chunk.codec_id != 0 or chunk.params:
        raise error_from_code(ErrorCode.UNSUPPORTED_CODEC, f"codec id {chunk.codec_id} is not accepted")
    payload = memoryview(chunk.payload_buffer).cast("B")
    if len(payload) != len(dest):
        raise ProtocolError(f"raw payload of {len(payload)} bytes, expected {len(dest)}")
    dest[:] = payload


def byte_buffer(nbytes: int) -> memoryview:
    return memoryview(bytearray(nbytes))


class LayerStore:
    """Where the layers of transfers live; the core decides, the store only holds bytes.

    ``allocate`` gives the buffer of one layer when its first chunk is stored (it may raise
    MemoryError or a KvwireError; nothing has changed then).  ``decode`` puts a verified
    chunk's data in place; ``region`` names where a raw payload can be read straight into:
    one writable byte buffer, or a tuple of them that the payload fills in order (a
    scattered place: a KV chunk's K and V of part of a layer, blocks of a paged cache), or
    None (not possible).  ``offset`` is the chunk's byte offset in the layer (K, then V)
    and ``nbytes`` its decoded size, both at the spec's dtype (:func:`chunk_span`).  A KV
    chunk (raw K and V of one token range) is decoded as its K and its V chunk
    (:func:`~kvwire.wire.transfer.split_kv`); ``region`` may be asked for one, with the
    offset of its K range and the size of both.
    """

    def allocate(self, key: Key, chunk: Chunk, nbytes: int) -> Any:
        raise NotImplementedError

    def decode(self, key: Key, chunk: Chunk, buffer: Any, offset: int, nbytes: int) -> None:
        raise NotImplementedError

    def region(self, key: Key, head: Chunk, buffer: Any, offset: int, nbytes: int) -> Region | None:
        return None

    def footprint(self, nbytes: int) -> int:
        """The memory a layer of ``nbytes`` takes once allocated: what ``max_buffer_bytes``
        and ``transfer_buffer_bytes`` count.  A store allocating in coarser units (a pool's
        smallest buffer) says so here, or tiny layers would hold far more than is counted."""
        return nbytes

    def opened(self, key: Key, spec: KVSpec) -> None:
        """A transfer was accepted: its layers of ``spec`` may be allocated from now on."""

    def closed(self, key: Key) -> None:
        """A transfer failed or handed over every layer: nothing more is allocated for it."""


class ByteStore(LayerStore):
    """Layers as flat byte buffers from ``allocate``, chunks decoded by ``decode``."""

    def __init__(self, allocate: Allocate = byte_buffer, decode: Decode = raw_decode) -> None:
        self._allocate = allocate
        self._decode = decode

    def allocate(self, key: Key, chunk: Chunk, nbytes: int) -> Any:
        return self._allocate(nbytes)

    def decode(self, key: Key, chunk: Chunk, buffer: Any, offset: int, nbytes: int) -> None:
        self._decode(chunk, buffer[offset : offset + nbytes])

    def region(self, key: Key, head: Chunk, buffer: Any, offset: int, nbytes: int) -> Region | None:
        if not isinstance(buffer, memoryview):
            return None
        if head.kind == KIND_KV and (offset or nbytes != len(buffer)):
            # K and V of part of the layer: two places, the K range's and the V range's
            half = nbytes // 2
            v_at = len(buffer) // 2 + offset
            return (buffer[offset : offset + half], buffer[v_at : v_at + half])
        return buffer[offset : offset + nbytes]


@dataclass(frozen=True, slots=True, kw_only=True)
class ReceiverConfig:
    """Limits and deadlines of a receiving server (made by ``ServerOptions.receiver_config``)."""

    secret: bytes = field(repr=False)
    codecs: tuple[str, ...] = ("raw",)
    """Codecs accepted (a CHUNK in another one fails its transfer with UNSUPPORTED_CODEC)."""
    fingerprints: frozenset[bytes] = frozenset()
    """KV layouts accepted (``KVSpec.fingerprint``); empty accepts any valid layout."""
    specs: tuple[KVSpec, ...] = ()
    """The layouts of ``fingerprints``, where known: a refusal names the fields in which a
    layout sent differs from the closest of them."""
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    window: int = DEFAULT_WINDOW
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
    """A transfer was accepted (after the registry gate, if any): hand it to the application."""

    key: Key
    request_id: str
    meta: dict[str, object]
    num_layers: int
    layer_tokens_known: bool = False
    spec: KVSpec | None = None
    blocks: tuple[tuple[bytes, int], ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerReady:
    """Every byte of a layer is in place (the last one of a gated transfer: and published)."""

    key: Key
    layer: int
    wire_bytes: int = 0
    """Bytes on the wire of the transfer's chunks stored so far (its total on the last layer)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferFailed:
    """A transfer failed with ``error`` (its layers are dropped, the sender was told).

    ``claimable``: it had arrived (:class:`TransferArrived`) and nobody had claimed it, and
    it stays among :meth:`ReceiverCore.unclaimed`, in its place, until it is claimed or a
    :class:`TransferDropped` says it is forgotten: the application claiming it is handed
    the failure, as one that claimed it before it failed is.

    ``refused``: its BEGIN was refused for its KV layout (INCOMPATIBLE_SPEC, ``error``
    the text its RESET carried): a valid layout, not among ``ReceiverConfig.fingerprints``,
    on connection ``cid``.  Nothing of it was kept but its tombstone (a copy of that BEGIN
    is answered with the same RESET and no event), and a layout refused is refused again,
    so what waits for a transfer of ``request_id`` may be failed with it.  A malformed
    layout (an undefined dtype, ...) is refused with no event."""

    key: Key
    error: KvwireError
    request_id: str = ""
    claimable: bool = False
    refused: bool = False
    cid: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferDropped:
    """A failed transfer nobody claimed (see :attr:`TransferFailed.claimable`) is forgotten:
    its claim deadline passed, more failed than the server keeps, or the server closed."""

    key: Key
    request_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class RegistryCheck:
    """Ask the registry's ``check_many`` for ``blocks`` and answer with
    :meth:`ReceiverCore.registry_checked`, also once the transfer failed (after a
    :class:`TransferFailed` of ``key`` the check may be cancelled: it only reads)."""

    key: Key
    blocks: tuple[tuple[bytes, int], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class RegistryPublish:
    """Ask the registry's ``publish`` for ``blocks`` and answer with
    :meth:`ReceiverCore.registry_published`, also once the transfer failed (never
    cancelled for that)."""

    key: Key
    blocks: tuple[tuple[bytes, int], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class AuthenticationFailed:
    """A client on connection ``cid`` did not prove the secret."""

    cid: int
    error: KvwireError


@dataclass(frozen=True, slots=True, kw_only=True)
class GoawayReceived:
    cid: int
    code: int
    message: str


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamResumed:
    session_id: bytes
    stream_index: int
    cid: int | None = None
    """The connection that resumed it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferAborted:
    """A transfer was given up: by the application, for want of a claim, or by the peer."""

    key: Key
    request_id: str
    reason: str
    by_peer: bool = False
    cid: int | None = None
    """The connection its RESET came on (``by_peer``), else the one that carried its BEGIN."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectionDropped:
    """Connection ``cid`` closed other than cleanly, and no other event says why (not a
    failed authentication, not a GOAWAY received, not an internal error, not the server
    closing): the peer broke a rule (``PROTOCOL_ERROR``, ``INTEGRITY_ERROR``, ...), fell
    silent past a deadline (``TIMEOUT``), was refused (``UNKNOWN_SESSION``, a limit), was
    closed with its session (``SESSION_LOST``), or closed it without a GOAWAY
    (``by_peer``).  One per connection at most, for the I/O layer to log; ``reason`` is
    at most :data:`WIRE_TEXT_LIMIT` characters and may quote the peer."""

    cid: int
    code: int
    reason: str
    by_peer: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class InternalError:
    """Handling input from ``cid`` raised ``error`` (a bug): the connection was closed with
    INTERNAL_ERROR; the I/O layer logs it."""

    cid: int
    error: Exception


ReceiverEvent = (
    TransferArrived | LayerReady | TransferFailed | TransferDropped | RegistryCheck | RegistryPublish
    | AuthenticationFailed | GoawayReceived | StreamResumed | TransferAborted | ConnectionDropped
    | InternalError
)


# -- state ---------------------------------------------------------------------------------


@dataclass(slots=True)
class _Reservation:
    """A layer region a connection is reading a raw payload into, before its CRC is checked."""

    view: Region
    cid: int
    layer: int
    kind: int
    start: int
    end: int

    def overlaps(self, layer: int, kind: int, start: int, end: int) -> bool:
        return (self.layer == layer and kinds_overlap(self.kind, kind)
                and self.start < end and start < self.end)


@dataclass(eq=False)
class _Incoming:
    key: Key
    begin: Begin
    spec: KVSpec
    meta: dict[str, object]
    state: IncomingTransfer
    deadline: float | None
    accepted: bool = False
    claimed: bool = False
    claim_deadline: float | None = None
    error: KvwireError | None = None
    buffers: dict[int, Any] = field(default_factory=dict)
    costs: dict[int, int] = field(default_factory=dict)  # budget bytes per held layer
    held: int = 0  # budget bytes: its layers (costs), prefix blocks and meta, ranges
    kept: int = 0  # of held: what the server remembers of it besides layers (blocks, meta, ranges)
    range_cost: int = 0  # budget bytes of the token ranges its state remembers
    wire_bytes: int = 0
    taken: int = 0
    window: int = 1
    sized: bool = False  # its first chunk is stored: layer_cost is known
    learned: bool = False  # its layer 0 was received whole: in its session's history (_learn)
    layer_cost: int = 0  # budget bytes of one of its layers (the store's footprint)
    reserved: int = 0  # budget bytes of its layers granted and not allocated (see _reserve)
    external: bool = False  # new layers go to the caller's memory: all granted, not counted
    inplace: dict[ChunkAddress, _Reservation] = field(default_factory=dict)
    publish_pending: list[tuple[int, ChunkAddress]] = field(default_factory=list)
    published: bool = False
    gated: bool = False  # goes through the registry gate
    last_layer: int | None = None  # held back until the registry publish succeeds
    begin_cid: int | None = None  # the connection that carried BEGIN: ACCEPT goes there
    limit_cid: int | None = None  # the connection that carried its latest layer limit (ACCEPT, CREDIT)
    # _begin_digest of its BEGIN once ``begin`` no longer holds it whole (meta and prefix
    # blocks let go): what a BEGIN repeating its ids must match to be a re-send.
    begin_digest: bytes = b""
    footprint: int = 0  # budget bytes of what BEGIN made the server keep (begin_footprint)
    checked: bool = False  # passed the registry gate (or goes through none)
    roomed: bool = False  # its first layer has room: its estimate is reserved until it arrives
    estimate: int = 0  # budget bytes reserved for its first layer until it arrives (see _admit)
    counted: bool = False  # among ReceiverCore.held_transfers (see ReceiverCore._recount)
    calling: bool = False  # a registry call of it (RegistryCheck, RegistryPublish) is unanswered
    bpt: int = field(default=0, init=False)
    """Bytes of one token of K (or of V), fixed by BEGIN: worked out once, not per chunk."""

    def __post_init__(self) -> None:
        self.bpt = self.begin.num_kv_heads * self.begin.head_dim * self.spec.itemsize

    @property
    def complete(self) -> bool:
        return self.state.complete and (self.published or not self.gated)


@dataclass(slots=True)
class _Failed:
    """A transfer that failed after it arrived and before anyone claimed it, kept so that
    it can still be claimed (handed out failed) until ``claim_deadline``: its request id,
    and the budget bytes of what its BEGIN made the server keep (the I/O layer's view of
    it holds its meta and prefix blocks), never a layer."""

    request_id: str
    claim_deadline: float | None
    kept: int
    # Of ``kept``, its prefix block list's bytes while a registry call of it still runs
    # (:meth:`ReceiverCore._orphan`): counted here once, and handed to that call's entry
    # if it is claimed or dropped before the call is answered.
    calling_bytes: int = 0


@dataclass(eq=False)
class _Session:
    session_id: bytes
    streams: dict[int, int] = field(default_factory=dict)  # stream index -> connection id
    transfers: dict[int, _Incoming] = field(default_factory=dict)
    # Why recent transfers failed: the code and text of their RESET (at most
    # WIRE_TEXT_LIMIT characters), the last TOMBSTONES_KEPT.
    tombstones: OrderedDict[int, tuple[ErrorCode, str]] = field(default_factory=OrderedDict)
    # Completed transfers the application has taken, the last COMPLETED_KEPT: their ids,
    # each with a digest of its request id and one of its whole BEGIN, 8 bytes each (a
    # BEGIN matching both digests is answered as a re-send; one with the same ids and
    # anything else different is a duplicate).
    completed: OrderedDict[int, bytes] = field(default_factory=OrderedDict)
    # Transfers this side failed and told the client so, each with the open connections its
    # RESET went out on (empty: none, no stream was open): that RESET may be lost with them.
    # When the last of them closes, one still open says it again; when none is, the stream
    # that joins (see ReceiverCore._say_again).
    resets: OrderedDict[int, set[int]] = field(default_factory=OrderedDict)
    # Footprints of the last first layers of its transfers received whole, by layout and
    # of any layout: what a first layer of its next transfers is estimated at
    # (ReceiverCore._estimate).  Another session's estimate it sets only through the
    # server's one figure per session, at most the eighth, for sessions with no history.
    first_layers: OrderedDict[bytes, deque[int]] = field(default_factory=OrderedDict)
    first_layers_any: deque[int] = field(default_factory=lambda: deque(maxlen=RECENT_FIRST_LAYERS))
    lose_at: float | None = None
    closed: bool = False
    unreported: int = 0  # CHUNK bytes received since the last REPORT to this session
    version: int | None = None  # the protocol version every stream of it speaks (6.1)

    def tombstone(self, tid: int, code: ErrorCode, text: str) -> None:
        """Keep why transfer ``tid`` failed (its RESET's code and text), the last
        TOMBSTONES_KEPT."""
        self.tombstones[tid] = (code, text)
        while len(self.tombstones) > TOMBSTONES_KEPT:
            self.tombstones.popitem(last=False)


class ReceiverCore:
    """Every connection, session and transfer of one receiving server (sans-IO)."""

    def __init__(
        self, config: ReceiverConfig, *, allocate: Allocate = byte_buffer, decode: Decode = raw_decode,
        nonce_source: Callable[[int], bytes] = secrets.token_bytes, store: LayerStore | None = None,
    ) -> None:
        self.config = config
        # The wire ids of config.codecs (the registered ones), for the check of every CHUNK.
        self._codecs_accepted = frozenset(
            get_codec(name).codec_id for name in available_codecs() if name in config.codecs)
        self._store = store if store is not None else ByteStore(allocate, decode)
        self._nonce = nonce_source
        self._conns: dict[int, Connection] = {}
        self._conn_session: dict[int, _Session] = {}
        self._sessions: dict[bytes, _Session] = {}
        self._live: dict[Key, _Incoming] = {}  # not failed, not every layer taken
        self._unclaimed: dict[Key, None] = {}  # arrived and not claimed, in arrival order
        # Of those, the ones that failed meanwhile (see _keep_failed), oldest failure first;
        # the same keys by the session they came on while it is open (at most max_transfers
        # each, oldest failure first), and those of sessions that are gone, in the order the
        # sessions went (see _bound_failed).
        self._failed: dict[Key, _Failed] = {}
        self._failed_open: dict[bytes, dict[Key, None]] = {}
        self._failed_gone: dict[Key, None] = {}
        # Transfers the server holds for their sessions (see _recount): at most
        # max_sessions * max_transfers together, those of sessions that have ended included
        # (complete, and not claimed; kept in ``_held_gone``), see _check_held.
        self._held = 0
        self._held_gone: dict[Key, None] = {}
        self.held_refusals = 0
        """BEGINs refused because the server held :attr:`held_limit` transfers (see
        :meth:`_check_held`): the I/O layer logs that they were (a client is told only by
        its RESET)."""
        self.held_at_refusal = (0, 0)
        """At the last of :attr:`held_refusals`: :attr:`held_transfers` and
        :attr:`held_of_ended_sessions` (what the I/O layer's line says held the room)."""
        # Registry calls still unanswered whose transfer failed meanwhile (see _orphan),
        # each with the budget bytes of the block list it holds (counted in kept_bytes until
        # it is answered): an allowance of their own beside max_transfers and held_limit,
        # by session while it is open (``_orphans_open``), and server-wide (see _check_calls).
        self._orphans: dict[Key, int] = {}
        self._orphans_open: dict[bytes, dict[Key, None]] = {}
        self._events: deque[ReceiverEvent] = deque()
        self._dirty: set[int] = set()
        self._timers: list[tuple[float, int, tuple[int, Any]]] = []
        self._timer_at: dict[tuple[int, Any], float] = {}
        self._timer_seq = 0
        self._timers_compact_at = TIMERS_COMPACT_MIN
        self.buffered_bytes = 0
        self.reserved_bytes = 0
        """Budget bytes of layers granted and not yet allocated (each transfer's window past
        what it holds, once its layer size is known; see ``_reserve``): counted against
        max_buffer_bytes with the layers held, so that a granted layer always finds room."""
        # Transfers that want more layers than the room left lets them have, oldest waiting
        # first (see _offer): given credit again as room frees (_regrant).
        self._waiting: dict[Key, None] = {}
        # Transfers admitted (BEGIN passed every check) whose first layer has no room yet,
        # in the order of their BEGINs: accepted as room frees (_admit, _admit_waiting).
        self._admitting: dict[Key, None] = {}
        # Transfers given room for their first layer at an estimate of 0 (no first layer
        # received whole yet, of their session or any other): their estimate is reserved
        # once one is, as far as room holds it (_learn, _estimate_unestimated).
        self._unestimated: dict[Key, None] = {}
        # Footprints of the last first layers received whole, of every session, by layout
        # and of any layout: the estimate of a first layer of a session with no history of
        # its own (at most the share kept for first layers, see _estimate).
        # (by layout, then session id: the largest of each session's own recent first
        # layers, so one session cannot flush or lower the others')
        self._first_layers: OrderedDict[bytes, OrderedDict[bytes, int]] = OrderedDict()
        self._first_layers_any: OrderedDict[bytes, int] = OrderedDict()
        # The time given by the latest call (every call that can accept a transfer gives it):
        # a transfer accepted as room frees starts its claim deadline then (_admit_waiting).
        self._now = 0.0
        self._regrant_held = 0  # while positive, _regrant waits (a session's transfers failing)
        self._closing = False  # the server is closing (close): nothing is accepted or granted
        self.kept_bytes = 0
        """Of buffered_bytes: what the server remembers of its transfers besides their layers
        (prefix block lists, meta, token ranges), which may take it past max_buffer_bytes by
        an eighth of it, at least KEPT_ROOM_MIN (layers alone stay within it)."""
        self.chunk_bytes_received = 0
        """Bytes of CHUNK frames received, every session together (what :meth:`report`'s
        transport cost is per)."""
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)

    # -- connections ---------------------------------------------------------------------

    def connection_made(self, cid: int, now: float, started: float | None = None) -> None:
        """Connection ``cid`` is up; ``started``: when it was accepted, if earlier (before a
        TLS handshake): its handshake deadline counts from then."""
        self._now = now
        cfg = self.config
        ccfg = ConnectionConfig(
            secret=cfg.secret, codecs=cfg.codecs, max_frame_size=cfg.max_frame_size,
            window=cfg.window, max_transfers=cfg.max_transfers,
            handshake_timeout=cfg.handshake_timeout, idle_timeout=cfg.idle_timeout,
        )
        conn = Connection(Role.SERVER, ccfg, now=now, started=started, nonce_source=self._nonce)
        conn.set_payload_sink(lambda head, size: self._sink(cid, head, size))
        self._conns[cid] = conn
        self._dirty.add(cid)
        self._note(_CONN, cid)

    def connection(self, cid: int) -> Connection | None:
        """The connection itself, for ``get_buffer()`` (zero-copy reads); feed what was
        read through :meth:`buffer_updated`."""
        return self._conns.get(cid)

    def receive_data(self, cid: int, data: bytes, now: float) -> None:
        """Bytes from connection ``cid`` (``b""``: the peer closed or the connection broke)."""
        self._now = now
        conn = self._conns.get(cid)
        if conn is not None:
            conn.receive_data(data, now)
            self._process(cid, now)

    def buffer_updated(self, cid: int, nbytes: int, now: float) -> bool:
        """``nbytes`` were read into ``connection(cid).get_buffer()``.  False: they were
        bytes of an unfinished frame only, nothing changed (no pump needed)."""
        self._now = now
        conn = self._conns.get(cid)
        if conn is None or not conn.buffer_updated(nbytes, now):
            return False
        self._process(cid, now)
        if conn.start_deferred(now):  # a CHUNK behind those frames: its payload's place
            self._process(cid, now)
        return True

    def get_buffer(self, cid: int) -> memoryview:
        """A buffer for the next read of ``cid`` (zero-copy); then :meth:`buffer_updated`."""
        conn = self._conns.get(cid)
        return conn.get_buffer() if conn is not None else memoryview(bytearray(65536))

    def scatter_buffers(self, cid: int) -> list[memoryview]:
        """Buffers for a scatter read of ``cid`` (a payload received into several places:
        see :meth:`Connection.scatter_buffers`), or none; then :meth:`buffer_updated`."""
        conn = self._conns.get(cid)
        return [] if conn is None else conn.scatter_buffers()

    def payload_remaining(self, cid: int) -> int:
        """Bytes of the frame ``cid`` is reading that are sure to arrive before anything
        can happen on it (see :attr:`Connection.payload_remaining`)."""
        conn = self._conns.get(cid)
        return 0 if conn is None else conn.payload_remaining

    def buffers_to_send(self, cid: int) -> list[Buffer]:
        """What ``cid`` has to write, payloads not copied."""
        conn = self._conns.get(cid)
        return [] if conn is None else conn.data_to_send()

    def data_to_send(self, cid: int) -> bytes:
        return b"".join(bytes(p) for p in self.buffers_to_send(cid))

    def take_dirty(self) -> set[int]:
        """Connections that may have bytes to send or be closing since the last call."""
        dirty, self._dirty = self._dirty, set()
        return dirty

    def is_closed(self, cid: int) -> bool:
        """Whether the I/O layer should close ``cid`` once its last bytes are written."""
        conn = self._conns.get(cid)
        return conn is None or conn.closed_event is not None

    def forget(self, cid: int) -> None:
        """The I/O layer closed ``cid``; nothing more will come from it."""
        self._release_reservations(cid)
        self._conns.pop(cid, None)
        self._conn_session.pop(cid, None)
        self._dirty.discard(cid)

    def close(self, now: float) -> None:
        """The server is closing: it accepts and grants nothing from now on.  Every transfer
        in progress fails, complete ones nobody has taken whole included, and so do those
        admitted and still waiting to start (or for the registry's verdict): each sender is
        told first by a ``RESET(SESSION_LOST)`` saying the server is shutting down (the
        error each transfer fails with), then every connection says GOAWAY, and every
        session is lost.  The transfers fail under ``_regrant_held``: the room one frees
        never starts a transfer waiting to start (docs/protocol.md 10)."""
        self._now = now
        self._closing = True
        self._regrant_held += 1  # (nothing to give room to: every transfer fails)
        try:
            for t in list(self._live.values()):
                self._unclaimed.pop(t.key, None)  # (nobody can claim it now)
                error = ConnectionLostError(f"transfer {quoted_id(t.begin.request_id)}: {SHUTTING_DOWN}",
                                            code=ErrorCode.SESSION_LOST)
                self._fail(t, error, reset=True, even_if_complete=True)
            for cid, conn in list(self._conns.items()):
                conn.close(ErrorCode.NO_ERROR, SHUTTING_DOWN)
                self._dirty.add(cid)
            for sess in list(self._sessions.values()):
                self._lose(sess, ConnectionLostError("server closed"))
        finally:
            self._regrant_held -= 1
        for cid in list(self._conns):
            self._process(cid, now)
        for t in self._live.values():
            t.deadline = t.claim_deadline = None
        for key in list(self._failed):  # nobody can claim them now
            self._drop_failed(key)

    @property
    def connections(self) -> list[int]:
        return list(self._conns)

    @property
    def sessions(self) -> int:
        return len(self._sessions)

    @property
    def sessions_by_version(self) -> dict[int, int]:
        """The open sessions by the protocol version their streams speak (6.1)."""
        counts: dict[int, int] = {}
        for sess in self._sessions.values():
            if sess.version is not None:
                counts[sess.version] = counts.get(sess.version, 0) + 1
        return counts

    # -- application ---------------------------------------------------------------------

    def next_event(self) -> ReceiverEvent | None:
        return self._events.popleft() if self._events else None

    def unclaimed(self, request_id: str | None = None) -> list[Key]:
        """Arrived transfers the application has not claimed, in arrival order (only those
        of ``request_id`` if given).  Those that failed since they arrived are among them
        (see :attr:`TransferFailed.claimable`) until claimed or dropped."""
        return [k for k in self._unclaimed if request_id is None or self._request_id(k) == request_id]

    def is_unclaimed(self, key: Key) -> bool:
        """Whether ``key`` is among :meth:`unclaimed` (in constant time)."""
        return key in self._unclaimed

    def _request_id(self, key: Key) -> str:
        t = self._live.get(key)
        return t.begin.request_id if t is not None else self._failed[key].request_id

    @property
    def failed_unclaimed(self) -> int:
        """Failed transfers kept for the application to claim (see :meth:`unclaimed`)."""
        return len(self._failed)

    @property
    def failed_kept_limit(self) -> int:
        """Most failed transfers nobody claimed the server keeps: as many as it may have
        transfers in progress, ``max_sessions * max_transfers``.  Each session keeps at
        most ``max_transfers`` of its own (one more forgets that session's oldest failure,
        never another session's), so the sessions open keep at most this many together;
        past it, only failures of sessions that are gone are forgotten, those whose
        session went first (see :meth:`_bound_failed`)."""
        return self.config.max_sessions * self.config.max_transfers

    @property
    def held_limit(self) -> int:
        """Most transfers the server holds for its sessions together, ``max_sessions *
        max_transfers``: each session holds at most ``max_transfers`` (in progress, or
        complete and not claimed), and complete ones nobody claimed stay held when their
        session ends, until claimed, dropped at ``claim_timeout``, or the server closes.
        Past it every BEGIN is refused (see :meth:`_check_held`)."""
        return self.config.max_sessions * self.config.max_transfers

    @property
    def held_transfers(self) -> int:
        """Transfers the server holds for its sessions (at most :attr:`held_limit`):
        admitted and not failed, neither both complete and claimed nor taken whole.  Those
        that failed while a registry call of theirs ran are not among them (see
        :meth:`_orphan` and :attr:`registry_calls`)."""
        return self._held

    @property
    def held_of_ended_sessions(self) -> int:
        """Of :attr:`held_transfers`: complete transfers of sessions that have ended, which
        nobody claimed yet (freed only by claiming them, or by ``claim_timeout``)."""
        return len(self._held_gone)

    @property
    def registry_calls(self) -> int:
        """Registry calls asked for (:class:`RegistryCheck`, :class:`RegistryPublish`) and
        not answered yet, those whose transfer failed meanwhile included: at most
        ``2 * max_transfers`` a session, ``2 *`` :attr:`held_limit` in all (see
        :meth:`_check_calls`)."""
        return sum(1 for t in self._live.values() if t.calling) + len(self._orphans)

    def _recount(self, t: _Incoming) -> None:
        """``t`` may have started or stopped being held (see :attr:`held_transfers`): it is
        while it is live (not failed, not every layer taken) and not both complete and
        claimed."""
        held = self._live.get(t.key) is t and not (t.complete and t.claimed)
        if held != t.counted:
            t.counted = held
            self._held += 1 if held else -1
            if not held:
                self._held_gone.pop(t.key, None)

    def _check_held(self) -> None:
        """Refuse a BEGIN (LIMIT_EXCEEDED) while the server holds :attr:`held_limit`
        transfers.  The sessions open never take it there (each holds at most
        ``max_transfers``, and they are at most ``max_sessions``): only complete transfers
        of sessions that have ended, which nobody claimed, do.  Those cannot be dropped to
        make room (the application may still claim them), so a client that closes its
        session and opens another, again and again, makes the server refuse transfers
        instead of holding more of them, until the application claims them or their
        ``claim_timeout`` drops them."""
        limit = self.held_limit
        held = self._held
        if held >= limit:
            self.held_refusals += 1
            self.held_at_refusal = (held, len(self._held_gone))
            # (within WIRE_TEXT_LIMIT: the RESET carries it)
            raise LimitExceededError(
                f"the server holds {held} transfers (max_sessions x max_transfers = {limit}), "
                f"{len(self._held_gone)} complete from ended sessions, not claimed by its application: retry later")

    def _check_calls(self, sess: _Session, active: int) -> None:
        """Refuse a BEGIN that would make a registry call (LIMIT_EXCEEDED) while failed
        transfers whose call still runs (:meth:`_orphan`) use up their allowance: those of
        ``sess`` with its ``active`` transfers (in progress, or not claimed) reach twice
        ``max_transfers``, or those of the server with its :attr:`held_transfers` twice
        :attr:`held_limit`.  The allowance is theirs alone, beside ``max_transfers`` and
        :attr:`held_limit`: a client that gives up a transfer while its call runs (the
        server cancels a check, never a publish, and hears of the end later) may begin
        another at once.  Every transfer that may still call (gated, not yet published) is
        among the held and active ones, and a failure only moves it among the failed
        awaiting: so a session never has more than ``2 * max_transfers`` calls running, the
        server ``2 * held_limit``."""
        cap = 2 * self.config.max_transfers
        own = len(self._orphans_open.get(sess.session_id, ()))
        if own and active + own >= cap:
            # (within WIRE_TEXT_LIMIT: the RESET carries it)
            raise LimitExceededError(
                f"{own} failed transfers of the session awaiting the registry, {active} held "
                f"(together at most 2 x max_transfers = {cap}): retry once the registry answers")
        cap = 2 * self.held_limit
        if self._orphans and self._held + len(self._orphans) >= cap:
            raise LimitExceededError(
                f"the server has {len(self._orphans)} failed transfers awaiting the registry, {self._held} "
                f"held (together at most 2 x max_sessions x max_transfers = {cap}): retry later")

    def _orphan(self, t: _Incoming, *, shared: bool = False) -> None:
        """``t`` failed with a registry call of it unanswered.  Its memory was given back,
        but the call still runs, holding its block list (up to a frame's worth), so until it
        is answered ``t`` counts among the failed transfers awaiting the registry: its
        session's while that session is open, and the server's in any case, each an
        allowance beside ``max_transfers`` and :attr:`held_limit` (:meth:`_check_calls`:
        gated BEGINs past it are refused with LIMIT_EXCEEDED); and its block list stays in
        :attr:`kept_bytes` (the budget's share past ``max_buffer_bytes`` for what the
        server remembers).  The I/O layer may cancel a check (it only reads), never a
        publish; it answers either (:meth:`registry_checked`, :meth:`registry_published`)
        once it ended.  With ``shared``, ``t`` is kept failed to claim (:meth:`_keep_failed`),
        whose footprint counts its block list already: the call's entry counts nothing until
        that record is claimed or dropped (:meth:`_unkeep_failed` moves the bytes here), so
        the block list is never counted twice."""
        t.calling = False
        kept = 0 if shared else _block_bytes(t.begin)
        self._orphans[t.key] = kept
        self.kept_bytes += kept
        self.buffered_bytes += kept
        if t.key[0] in self._sessions:
            self._orphans_open.setdefault(t.key[0], {})[t.key] = None

    def _answered(self, key: Key) -> bool:
        """The answer to a registry call of ``key`` whose transfer failed (True: it frees
        that transfer's place and its block list's bytes, and is otherwise ignored)."""
        kept = self._orphans.pop(key, None)
        if kept is None:
            return False
        self._unkeep(kept)
        own = self._orphans_open.get(key[0])
        if own is not None:
            own.pop(key, None)
            if not own:
                del self._orphans_open[key[0]]
        return True

    def claim(self, key: Key, now: float) -> None:
        """The application takes arrived transfer ``key`` (one that failed since it arrived
        too: it is handed out failed, and forgotten here)."""
        self._now = now
        self._unclaimed.pop(key, None)
        if (f := self._failed.pop(key, None)) is not None:
            self._unindex_failed(key)
            self._unkeep_failed(key, f)
            self._regrant()
            return
        t = self._transfer(key)
        if t is not None:
            t.claimed = True
            t.claim_deadline = None
            self._recount(t)

    def attach(self, key: Key, now: float) -> None:
        """Layers not begun yet go to the caller's memory (not counted in the budget), so
        every layer is granted at once."""
        self._now = now
        t = self._transfer(key)
        if t is not None:
            t.external = True
            self._grant(t, t.begin.num_layers)
            self._reserve(t)  # its granted layers no longer count: room for others
            self._regrant()

    def pop_layer(self, key: Key, layer: int, now: float) -> Any:
        """A complete layer's buffer, handed over: its memory leaves the budget, and the
        sender gets credit for one more layer in the room it leaves (the transfer keeps the
        window it has); room past that goes to the transfers waiting for it first, then to
        the transfers waiting to start (see :meth:`_admit`)."""
        self._now = now
        t = self._transfer(key)
        if t is None or t.error is not None or layer not in t.buffers:
            raise ConnectionLostError("no such transfer or layer")
        buf = t.buffers.pop(layer)
        self._release(t, t.costs.pop(layer, 0))
        t.taken += 1
        if t.taken >= t.begin.num_layers:
            self._live.pop(key, None)
            self._recount(t)
            self._waiting.pop(key, None)
            self._reserve(t)
            self._store.closed(key)
            # Its prefix blocks and meta are the application's now: the server forgets them
            # (the transfer's id stays, to answer a re-sent BEGIN) and gives their budget back.
            t.begin_digest = _begin_digest(t.begin)  # (what a BEGIN re-sent must match)
            t.begin = replace(t.begin, meta=b"", blocks=())
            t.meta = {}
            self._release_all(t)
            self._regrant()
        else:
            # The room its layer leaves is its own first (even within the share kept for
            # first layers): a transfer whose application takes its layers keeps the window
            # it has, so it always goes on.  Room past that goes to those waiting, oldest
            # first (it among them, in its place, if it waits), then to it.
            want = min(t.taken + t.window, t.begin.num_layers)
            if t.sized and want > t.state.layer_limit and self._room() >= t.layer_cost:
                self._grant(t, t.state.layer_limit + 1)
            self._regrant()
            if t.key not in self._waiting:
                self._offer(t)
        return buf

    def take_layer(self, key: Key, layer: int, now: float) -> tuple[bytes, bytes]:
        """The K and V bytes of a complete layer (see :meth:`pop_layer`)."""
        buf = self.pop_layer(key, layer, now)
        half = len(buf) // 2
        return bytes(buf[:half]), bytes(buf[half:])

    def abort(self, key: Key, reason: str, now: float) -> None:
        """The application gives up on the transfer (the sender is told): it is not kept
        for anyone to claim."""
        self._now = now
        t = self._transfer(key)
        if t is None or t.error is not None:
            return
        self._unclaimed.pop(key, None)
        self._count("transfers_aborted")
        why = f"receiver aborted transfer {quoted_id(t.begin.request_id)}"
        self._events.append(TransferAborted(key=key, request_id=t.begin.request_id, reason=reason, cid=t.begin_cid))
        self._fail(t, TransferAbortedError(f"{why}: {reason}" if reason else why), reset=True, even_if_complete=True)

    def fail(self, key: Key, error: KvwireError, now: float) -> None:
        """Fail a transfer with ``error``; the sender is told (RESET).  It is not kept for
        anyone to claim (the I/O layer that fails it knows)."""
        self._now = now
        t = self._transfer(key)
        if t is not None:
            self._unclaimed.pop(key, None)
            self._fail(t, error, reset=True, even_if_complete=True)

    def registry_checked(self, key: Key, stale: Sequence[object] | None, error: KvwireError | None, now: float) -> None:
        """The answer to a :class:`RegistryCheck` (stale blocks, or the registry's error).
        Every check asked for is answered, also once its transfer failed (the I/O layer may
        have cancelled it then: with any error), and only once: until then that transfer
        keeps its place (see :meth:`_orphan`)."""
        self._now = now
        if self._answered(key):
            return
        t = self._transfer(key)
        if t is None or t.error is not None:
            return
        t.calling = False
        if error is not None or stale:
            self._count("transfers_refused")
            self._fail(t, error or stale_error(stale or ()), reset=True, answer=True)
            return
        t.checked = True
        if t.roomed:  # (else accepted once its first layer has room: _admit_waiting)
            self._accept(t, now)

    def registry_published(self, key: Key, error: KvwireError | None, now: float) -> None:
        """The answer to a :class:`RegistryPublish`: the held acknowledgements go out, each
        after the RESET on its own connection if publishing failed.  Answered also once its
        transfer failed, as a check is (:meth:`registry_checked`)."""
        self._now = now
        if self._answered(key):
            return
        t = self._transfer(key)
        if t is None:
            return
        t.calling = False
        pending, t.publish_pending = t.publish_pending, []
        sess = self._sessions.get(key[0])
        if error is not None:
            self._fail(t, error, reset=False, even_if_complete=True)
        else:
            t.published = True
            t.deadline = None
            self._recount(t)
            if t.last_layer is not None:
                self._events.append(LayerReady(key=key, layer=t.last_layer, wire_bytes=t.wire_bytes))
        for cid, address in pending:
            conn = self._conn(cid)
            if conn is not None:
                if sess is not None:
                    self._repeat_reset(sess, cid, conn, key[1])
                conn.send_ack(address)

    # -- time ----------------------------------------------------------------------------

    def report(self, transport_s_per_byte: float | None, decode_s_per_element: Mapping[int, float]) -> int:
        """Tell every session that sent CHUNK bytes since it was last told what receiving
        costs this server (a REPORT on one of its open connections; advisory, see
        docs/protocol.md 4.10): ``transport_s_per_byte``, CPU seconds per byte of CHUNK
        frames received, decoding excluded (None: not measured), and by codec id the CPU
        seconds per element decoded.  The I/O layer measures them over an interval of its
        choosing and calls this at most once per interval.  Returns the sessions told."""
        report = Report.of_seconds(transport_s_per_byte, decode_s_per_element)
        if not report.transport_ns_per_mib and not report.decode:
            return 0
        told = 0
        for sess in self._sessions.values():
            if sess.closed or not sess.unreported:
                continue
            conn = self._any_conn(sess)
            if conn is not None and conn.state is State.OPEN:
                conn.send_report(report)
                sess.unreported = 0
                told += 1
        return told

    def get_timer(self) -> float | None:
        """The earliest deadline of any connection, session or transfer (None: none)."""
        # (self._timers read anew each time: a compaction replaces the list)
        while self._timers:
            when, _, name = self._timers[0]
            if self._timer_valid(name, when):
                return when
            if self._timers and self._timers[0][2] is name:
                # The entry _timer_valid put in place of a stale one, at the deadline's current
                # value (an entry's name is in no other entry: _note makes a new one).
                return self._timers[0][0]
        return None

    def handle_timer(self, now: float) -> None:
        self._now = now
        while self._timers and self._timers[0][0] <= now:
            when, _, name = self._timers[0]
            if not self._timer_valid(name, when):
                continue
            heapq.heappop(self._timers)
            del self._timer_at[name]
            kind, ident = name
            if kind == _CONN:
                conn = self._conns.get(ident)
                if conn is not None:
                    conn.handle_timer(now)
                    self._process(ident, now)
            elif kind == _SESSION:
                self._lose(self._sessions[ident], ConnectionLostError("the client did not reconnect in time"))
            elif kind == _DEADLINE:
                t = self._live[ident]
                if t.roomed:
                    what, why = "not complete", ""
                else:
                    what, why = "not started", ": no room for its first layer in max_buffer_bytes"
                self._fail(t, TransferTimeoutError(
                    f"transfer {quoted_id(t.begin.request_id)} {what} after {self.config.transfer_timeout} s{why}"
                ), reset=True)
            elif ident in self._failed:
                # (counted when it failed: by the peer, a deadline, a broken rule; not as
                # a transfer nobody claimed, which is one that arrived whole and healthy)
                self._count("failed_arrivals_expired")
                self._drop_failed(ident)
            else:
                self._count("transfers_unclaimed")
                self.abort(ident, f"not claimed by the application within {self.config.claim_timeout} s", now)

    # -- deadlines -----------------------------------------------------------------------
    #
    # One heap over every deadline, so that get_timer() costs O(log n) per call, not a scan
    # of every connection and transfer.  An entry is a hint: the deadline's current value
    # (``_timer_value``) is the truth.  A deadline that moves later keeps its old entry,
    # which is replaced by the new value when it reaches the top; one that moves earlier
    # or appears is pushed by ``_note``.  A deadline that goes away (a transfer completed
    # or failed, a connection gone) leaves its entry until it reaches the top, minutes
    # later for a transfer's: so once the heap has doubled since it was last compacted,
    # ``_note`` drops every entry whose deadline is gone (a peer opening and ending
    # transfers fast would otherwise grow it without bound, outside the buffer budget).

    def _timer_value(self, name: tuple[int, Any]) -> float | None:
        kind, ident = name
        if kind == _CONN:
            conn = self._conns.get(ident)
            return conn.get_timer() if conn is not None else None
        if kind == _SESSION:
            sess = self._sessions.get(ident)
            return sess.lose_at if sess is not None else None
        t = self._live.get(ident)
        if t is None:
            f = self._failed.get(ident) if kind == _CLAIM else None
            return f.claim_deadline if f is not None else None
        return t.deadline if kind == _DEADLINE else (None if t.claimed else t.claim_deadline)

    def _note(self, kind: int, ident: Any) -> None:
        """Deadline ``(kind, ident)`` may have appeared or moved earlier."""
        name = (kind, ident)
        when = self._timer_value(name)
        if when is not None and (name not in self._timer_at or when < self._timer_at[name]):
            self._timer_at[name] = when
            self._timer_seq += 1
            heapq.heappush(self._timers, (when, self._timer_seq, name))
            if len(self._timers) >= self._timers_compact_at:
                self._compact_timers()

    def _compact_timers(self) -> None:
        """Keep only the entries of deadlines that still exist, one per deadline (its
        hint); next compaction once the heap has doubled again (amortized O(1) a push)."""
        self._timer_at = {name: when for name, when in self._timer_at.items() if self._timer_value(name) is not None}
        self._timers = [e for e in self._timers if self._timer_at.get(e[2]) == e[0]]
        heapq.heapify(self._timers)
        self._timers_compact_at = max(TIMERS_COMPACT_MIN, 2 * len(self._timers))

    def _timer_valid(self, name: tuple[int, Any], when: float) -> bool:
        """Whether the heap's top entry ``(when, name)`` is due as it says; if not, it is
        dropped, or, where it was its deadline's latest entry and the deadline moved,
        replaced in place by one at the deadline's current value."""
        current = self._timer_value(name)
        hinted = self._timer_at.get(name) == when  # (the entry is its deadline's hint)
        if hinted and current == when:
            return True
        if hinted and current is not None:
            # Its deadline moved: the entry is replaced by one at its current value (what
            # _note would push once it was dropped), the heap no larger.
            self._timer_at[name] = current
            self._timer_seq += 1
            heapq.heapreplace(self._timers, (current, self._timer_seq, name))
            return False
        heapq.heappop(self._timers)
        if hinted:
            del self._timer_at[name]
        return False

    # -- internals -----------------------------------------------------------------------

    def _count(self, what: str) -> None:
        self.counters[what] = self.counters.get(what, 0) + 1

    def _transfer(self, key: Key) -> _Incoming | None:
        return self._live.get(key)

    def _conn(self, cid: int) -> Connection | None:
        conn = self._conns.get(cid)
        if conn is not None:
            self._dirty.add(cid)
        return conn

    def _open(self, cid: int) -> Connection | None:
        """Connection ``cid`` if it is known and open (not marked to send)."""
        conn = self._conns.get(cid)
        return conn if conn is not None and conn.closed_event is None else None

    def _any_conn(self, sess: _Session, prefer: int | None = None) -> Connection | None:
        """An open connection of ``sess``: ``prefer``'s while it is one of them and open."""
        found = self._any_open(sess, prefer)
        return found[1] if found is not None else None

    def _any_open(self, sess: _Session, prefer: int | None = None) -> tuple[int, Connection] | None:
        """An open connection of ``sess`` and its id: ``prefer``'s while it is one of them
        and open."""
        cids: Iterable[int] = sess.streams.values()
        if prefer is not None and prefer in cids:
            cids = (prefer, *cids)
        for cid in cids:
            if (conn := self._open(cid)) is not None:
                self._dirty.add(cid)
                return cid, conn
        return None

    def _every_open(self, sess: _Session) -> list[tuple[int, Connection]]:
        """Every open connection of ``sess`` and its id."""
        found = []
        for cid in sess.streams.values():
            if (conn := self._open(cid)) is not None:
                self._dirty.add(cid)
                found.append((cid, conn))
        return found

    def _open_streams(self, sess: _Session) -> set[int]:
        """The ids of the open connections of ``sess``."""
        return {c for c in sess.streams.values() if self._open(c) is not None}

    def _process(self, cid: int, now: float) -> None:
        conn = self._conn(cid)
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
                    self._on_reset(cid, ev)
                elif isinstance(ev, ConnectionClosed):
                    self._on_closed(cid, ev, now)
            except KvwireError as exc:
                conn.close(exc.code, wire_text(str(exc)))
            except Exception as exc:  # a bug or a failing hook: never a silent hang
                conn.close(ErrorCode.INTERNAL_ERROR, f"internal error ({type(exc).__name__})")
                self._events.append(InternalError(cid=cid, error=exc))
        self._note(_CONN, cid)

    def _on_authenticated(self, conn: Connection, ev: ClientAuthenticated) -> None:
        if conn.state is not State.SERVER_AUTHENTICATED:
            # The connection failed after its AUTH, on a frame read with it (a client must
            # wait for WELCOME): it opens no session and replaces no stream.
            return
        if self._closing:  # (a connection made after close(): no session, no transfer)
            conn.close(ErrorCode.NO_ERROR, SHUTTING_DOWN)
            return
        fps = self.config.fingerprints
        if ev.fingerprint != NO_FINGERPRINT and fps and ev.fingerprint not in fps:
            conn.refuse(ErrorCode.INCOMPATIBLE_SPEC, "this server does not accept that KV layout")
            return
        if ev.session_id == NO_SESSION:
            if len(self._sessions) >= self.config.max_sessions:
                conn.refuse(ErrorCode.LIMIT_EXCEEDED, "server has reached max_sessions")
                return
            sid = self._nonce(16)
            self._sessions[sid] = _Session(sid, version=conn.version)
        else:
            sid = ev.session_id
            sess = self._sessions.get(sid)
            if sess is None or sess.closed:
                conn.refuse(ErrorCode.UNKNOWN_SESSION, "no such session")
                return
            if conn.version != sess.version:
                # Every stream of a session speaks one version (its chunks may go on any):
                # the join is refused, the session and its streams go on.
                conn.refuse(ErrorCode.UNSUPPORTED_VERSION,
                            f"this session speaks protocol version {sess.version}, this stream {conn.version}")
                return
            old = sess.streams.pop(ev.stream_index, None)
            if old is not None and old in self._conns:
                # The client reconnects a slot whose old connection still looks up (a
                # half-open TCP connection): the new one replaces it.  Its close, later,
                # finds no session (_on_closed): what it carried is let go of now.
                self._release_reservations(old)
                self._conn_session.pop(old, None)
                self._stream_gone(sess, old)
                self._conns[old].close(ErrorCode.SESSION_LOST, "replaced by a reconnected stream")
                self._dirty.add(old)
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
        sess.lose_at = None
        if sess.transfers or sess.tombstones or sess.completed:
            self._count("resumes")
            self._events.append(StreamResumed(session_id=sess.session_id, stream_index=ev.stream_index, cid=cid))
        self._say_again(sess, cid, conn)

    def _say_again(self, sess: _Session, cid: int, conn: Connection) -> None:
        """Send on ``conn`` (connection ``cid``) what the session's client waits for and may
        have lost with a stream that closed (``conn`` a stream that joins, or one still open
        when another closes), and no open stream of the session carries: a CREDIT
        with the current layer_limit of each incomplete transfer whose limit is above
        ACCEPT's 1, and the RESET of each transfer this side failed recently
        (``sess.resets``), each whose copies all went out on connections now closed, or on
        none.  Each goes out once on one stream, which then carries it: a sender whose
        chunks were all acknowledged, waiting for a layer grant, sends nothing that would
        draw it out again, and would wait for ever.  What an open stream carries is not
        said again (a session's kept RESETs would go out on every join and every break).
        A client ignores a CREDIT at or below the limit it has and a RESET for a transfer
        it does not have."""
        carriers = self._open_streams(sess)  # (``conn`` carries nothing yet when it joins)
        for t in sess.transfers.values():
            if (t.error is None and t.accepted and not t.state.complete and t.state.layer_limit > 1
                    and t.limit_cid not in carriers):
                conn.send_credit_frame(t.key[1], t.state.layer_limit)
                t.limit_cid = cid
        for tid, on in list(sess.resets.items()):
            if not on & carriers:
                self._repeat_reset(sess, cid, conn, tid)  # (nothing for a tombstone gone meanwhile)

    def _on_reset(self, cid: int, ev: TransferReset) -> None:
        sess = self._conn_session.get(cid)
        t = sess.transfers.get(ev.transfer_id) if sess is not None else None
        if t is None or t.error is not None:
            return
        if t.complete and t.claimed:
            return  # too late to matter: the application has the whole cache; nothing fails
        # A complete transfer nobody claimed fails too: its sender's send() did not succeed,
        # so handing it out would deliver what the sender reports as not sent (and a retry
        # would make a second one).  Counted and reported only as what fails a transfer.
        self._count("transfers_aborted_by_peer")
        self._events.append(TransferAborted(
            key=t.key, request_id=t.begin.request_id, reason=wire_text(ev.message), by_peer=True, cid=cid,
        ))
        # The tombstone repeats the code, not the peer's text (NO_ERROR or an unknown code
        # as PROTOCOL_ERROR, the error the transfer failed with).
        error = ev.error()
        self._fail(t, error, reset=False, even_if_complete=True,
                   tombstone=error_from_code(error.code, "reset by the client"))

    def _on_closed(self, cid: int, ev: ConnectionClosed, now: float) -> None:
        if isinstance(ev.error, AuthenticationError):
            self._count("authentication_failures")
            self._events.append(AuthenticationFailed(cid=cid, error=ev.error))
        elif ev.goaway:
            self._count("goaways_received")
            self._events.append(GoawayReceived(cid=cid, code=ev.code, message=wire_text(ev.message)))
        elif ev.by_peer or (ev.error is not None and ev.code != ErrorCode.INTERNAL_ERROR):
            # (An internal error is an event of its own; a clean close of this side's, the
            # server closing, is no drop.)
            self._count("connections_dropped")
            reason = str(ev.error) if ev.error is not None else ev.message
            self._events.append(ConnectionDropped(cid=cid, code=ev.code, reason=wire_text(reason), by_peer=ev.by_peer))
        self._release_reservations(cid)
        sess = self._conn_session.pop(cid, None)
        if sess is None or sess.closed:
            return
        self._stream_gone(sess, cid)
        # A break is resumable even when every transfer is complete here: the client may
        # still wait for acknowledgements that were lost with the stream.
        if ev.resumable and self.config.resume_timeout > 0:
            if (other := self._any_open(sess)) is not None:
                # The session goes on with its other streams, and the broken one may never
                # come back (a client gives a slot up whose reconnects fail): CREDITs and
                # RESETs it carried go again on one still open.
                self._say_again(sess, *other)
            elif sess.lose_at is None:
                sess.lose_at = now + self.config.resume_timeout
                self._note(_SESSION, sess.session_id)
        elif ev.error is not None or any(not t.complete for t in sess.transfers.values()):
            # (the connection's error may have been raised decoding a frame: kept detached)
            self._lose(sess, detached(ev.error) if ev.error is not None
                       else ConnectionLostError("client connection closed mid-transfer"))
        elif not sess.streams:
            self._session_gone(sess)
        elif (other := self._any_open(sess)) is not None:
            self._say_again(sess, *other)  # (a clean close: RESETs it carried may be unread)

    def _stream_gone(self, sess: _Session, cid: int) -> None:
        """Connection ``cid`` is no stream of ``sess`` any more (it closed, or a connection
        that re-joined its slot replaced it): what it carried is carried by none until a
        stream says it again, and nothing of the session keeps its id (a client re-joining
        its slots again and again leaves nothing behind)."""
        for index, c in list(sess.streams.items()):
            if c == cid:
                del sess.streams[index]
        for on in sess.resets.values():
            on.discard(cid)
        for t in sess.transfers.values():
            if t.limit_cid == cid:
                t.limit_cid = None

    def _lose(self, sess: _Session, error: KvwireError) -> None:
        """Every unfinished transfer of the session fails, its other streams close.  Its
        transfers fail under ``_regrant_held``; the room goes to those waiting once, at the
        end (a session of thousands of transfers, each failing, would walk the queues each
        time)."""
        sess.closed = True
        sess.lose_at = None
        self._regrant_held += 1
        try:
            for t in list(sess.transfers.values()):
                self._fail(t, error, reset=False)
        finally:
            self._regrant_held -= 1
        for c in sess.streams.values():
            conn = self._conn(c)
            if conn is not None:
                conn.close(ErrorCode.SESSION_LOST, "another stream of this session was lost")
        self._session_gone(sess)
        self._regrant()

    def _session_gone(self, sess: _Session) -> None:
        """``sess`` is forgotten (lost, or closed cleanly): the failed transfers of it
        still kept to be claimed are counted with those of other sessions gone."""
        self._sessions.pop(sess.session_id, None)
        if (own := self._failed_open.pop(sess.session_id, None)) is not None:
            self._failed_gone.update(own)
        # Its transfers still held (complete, and not claimed: the others failed, or it
        # would not have ended) stay claimable, counted among the server's (_check_held).
        self._held_gone.update((t.key, None) for t in sess.transfers.values() if t.counted)
        self._orphans_open.pop(sess.session_id, None)  # (still among _orphans, the server's)

    def _on_begin(self, cid: int, conn: Connection, begin: Begin, now: float) -> None:
        sess = self._conn_session.get(cid)
        if sess is None:
            raise ProtocolError("BEGIN before the session was set up")
        tid = begin.transfer_id
        existing = sess.transfers.get(tid)
        if existing is not None and existing.begin.request_id == begin.request_id and (
            existing.begin == begin if not existing.begin_digest else existing.begin_digest == _begin_digest(begin)
        ):
            # Re-sent after a broken stream (a client sends the same BEGIN again: one with
            # the same ids and anything else different is a duplicate, below): answer again
            # (unless the registry check still runs; its outcome will be sent, on this
            # stream: the client re-sent it here because the one that carried it broke,
            # which this side may not know yet).
            existing.begin_cid = cid
            if existing.accepted:
                conn.send_accept(tid, existing.state.layer_limit)
                existing.limit_cid = cid
            return
        if self._repeat_reset(sess, cid, conn, tid):
            return
        done = sess.completed.get(tid)
        if done is not None and done == _request_digest(begin.request_id) + _begin_digest(begin):
            # Re-sent, the transfer long complete and its data taken: every layer was granted.
            conn.send_accept(tid, begin.num_layers)
            return
        cfg = self.config
        try:
            if existing is not None or done is not None:
                raise error_from_code(ErrorCode.DUPLICATE_TRANSFER, _in_use(tid, begin, existing, done))
            if (sess.session_id, tid) in self._orphans:
                # (its tombstone forgotten meanwhile)
                raise error_from_code(ErrorCode.DUPLICATE_TRANSFER,
                                      f"transfer id {tid} is still in use: a registry call for it runs")
            # Completed transfers the application has not claimed hold memory too.  Failed
            # ones whose registry call still runs have an allowance of their own (_check_calls).
            active = sum(1 for t in sess.transfers.values() if not t.complete or not t.claimed)
            unclaimed = sum(1 for t in sess.transfers.values() if t.complete and not t.claimed)
            spec, meta = admit_begin(begin, active=active, max_transfers=cfg.max_transfers,
                                     max_meta_bytes=cfg.max_meta_bytes, fingerprints=cfg.fingerprints,
                                     unclaimed=unclaimed, specs=cfg.specs)
            self._check_held()
            if cfg.registry and begin.blocks:  # (it will make a registry call)
                self._check_calls(sess, active)
            extra = begin_footprint(begin, meta)
            if extra and not self._kept_room(extra):
                self._count("buffer_budget_refusals")
                raise LimitExceededError(
                    f"the server holds {self.buffered_bytes} bytes of transfers; the prefix blocks and "
                    f"meta of this one take {extra} more, which exceeds max_buffer_bytes={cfg.max_buffer_bytes} "
                    f"and the room past it its bookkeeping may take"
                )
        except KvwireError as exc:
            self._count("transfers_refused")
            text = wire_text(str(exc))
            conn.send_reset(tid, exc.code, text)
            if isinstance(exc, _LayoutRefused):
                # A layout the server does not accept is refused again when sent again: the
                # refusal is the transfer id's tombstone, so a copy of this BEGIN (re-sent
                # when a stream breaks, or on a stream that opens while it is unanswered) is
                # answered with it (_repeat_reset), counted and said to the application once.
                sess.tombstone(tid, exc.code, text)
                self._events.append(TransferFailed(key=(sess.session_id, tid), error=error_from_code(exc.code, text),
                                                   request_id=begin.request_id, refused=True, cid=cid))
            return
        t = _Incoming(
            key=(sess.session_id, tid), begin=begin, spec=spec, meta=meta,
            state=IncomingTransfer(tid, begin.num_layers, layer_limit=1, max_tokens=cfg.max_tokens),
            deadline=None if cfg.transfer_timeout is None else now + cfg.transfer_timeout,
            begin_cid=cid, footprint=extra,
        )
        # Completed transfers the application has taken leave only their id behind.
        for old, x in [(i, x) for i, x in sess.transfers.items() if x.claimed and x.complete and not x.buffers]:
            del sess.transfers[old]
            sess.completed[old] = _request_digest(x.begin.request_id) + (x.begin_digest or _begin_digest(x.begin))
            while len(sess.completed) > COMPLETED_KEPT:
                sess.completed.popitem(last=False)
        sess.transfers[tid] = t
        self._live[t.key] = t
        self._recount(t)
        self._keep(t, extra)  # given back when it fails or its last layer is taken
        self._note(_DEADLINE, t.key)
        if cfg.registry and begin.blocks:
            t.gated = True
            blocks = tuple((bv.block, bv.version) for bv in begin.blocks)
            # Fail closed: a version the registry never issued is stale like an old one.
            # Named as the sender gave them (admit_begin checked that each key decodes).
            made_up = [block_from_key(b.decode("utf-8")) for b, v in blocks if not 0 <= v < MAX_BLOCK_VERSION]
            if made_up:
                self._count("transfers_refused")
                self._fail(t, stale_error(made_up, " (versions never issued)"), reset=True, answer=True)
                return
            self._events.append(RegistryCheck(key=t.key, blocks=blocks))
            t.calling = True
        else:
            t.checked = True
        self._admit(t)
        if t.roomed and t.checked:
            self._accept(t, now)

    def _admit(self, t: _Incoming) -> None:
        """``t`` passed every check at BEGIN: it is accepted (with its registry verdict, if
        it goes through the gate) only once its first layer has room.  ACCEPT grants that
        layer before its size is known, so the room is kept for it at an estimate
        (:meth:`_estimate`: from the first layers of its layout its session sent whole
        recently, of any layout if it sent none of this one; for a session that sent none,
        from those of every session, at most the share kept for first layers; 0 before any
        was received whole),
        reserved from now until its first chunk allocates it.  It has room when no transfer
        waits to start before it and the room left (the share kept from windows included)
        holds its estimate; else it waits to start, in the order of BEGINs, until room frees
        (:meth:`_admit_waiting`).  Its sender waits for ACCEPT meanwhile, its transfer
        deadline running; it counts against max_transfers from its BEGIN."""
        est = self._estimate(t)
        if not self._admitting and self._room() >= est:
            self._give_room(t, est)
        else:
            self._admitting[t.key] = None
            self._count("admission_waits")

    def _give_room(self, t: _Incoming, est: int) -> None:
        """``t``'s first layer has room: its estimate ``est`` is reserved from now (one of
        0, before any session's first layer was received whole, is reserved once one is,
        see :meth:`_learn`)."""
        t.roomed = True
        t.estimate = est
        if not est:
            self._unestimated[t.key] = None
        self._reserve(t)

    def _admit_waiting(self) -> None:
        """The transfers waiting to start are given room, the one that began first first,
        while the room left holds its first layer's estimate (accepted then, if the registry
        gate let them through)."""
        while self._admitting:
            key = next(iter(self._admitting))
            t = self._live.get(key)
            if t is None or t.error is not None:
                del self._admitting[key]
                continue
            est = self._estimate(t)
            if self._room() < est:
                return
            del self._admitting[key]
            self._give_room(t, est)
            if t.checked:
                self._accept(t, self._now)

    def _estimate(self, t: _Incoming) -> int:
        """What ``t``'s first layer is reserved at until it arrives (see :meth:`_admit`): the
        largest of the recent first layers its own session sent whole of its layout (of
        any layout if none; 0 if none at all), but no more than the share of the budget
        kept from windows for first layers, or the smallest of them where that is larger:
        one large first layer (one long prompt) does not hold every later transfer of its
        layout back from starting while the room would hold an ordinary one.  A session
        with no history of its own (its first transfers) is estimated from the other
        sessions' histories (the largest recent first layer of each of the last sessions
        that sent one whole, of its layout, else of any), never past the share: one session
        moves only its own figure, so it can hold another back no further than a cold
        start's reserve, nor bring its estimate below what the other sessions sent.
        A first layer larger than its estimate takes what room there is, or fails."""
        share = self._first_layer_share()
        fp = t.spec.fingerprint
        sess = self._sessions.get(t.key[0])
        if sess is not None and (recent := sess.first_layers.get(fp) or sess.first_layers_any):
            return min(max(recent), max(share, min(recent)))
        latest = (self._first_layers.get(fp) or self._first_layers_any).values()
        return min(max(latest), share) if latest else 0

    def _learn(self, t: _Incoming) -> None:
        """``t``'s layer 0 was received whole (every chunk of it stored): its footprint is
        remembered in its session's history for the estimates of that session's first
        layers to come (not that of a transfer received into a destination: the budget
        does not count its layers; never one of a transfer that failed before its layer 0
        was whole, which a peer's one chunk declaring a huge layer would be), and in the
        server's, for sessions with no history yet.  Transfers given room at an estimate
        of 0 (before any first layer was received whole) have theirs reserved
        (:meth:`_estimate_unestimated`)."""
        t.learned = True
        sess = self._sessions.get(t.key[0])
        if t.external or sess is None:
            return
        fp = t.spec.fingerprint
        recent = _layout_entry(sess.first_layers, fp, LAYOUTS_REMEMBERED, lambda: deque(maxlen=RECENT_FIRST_LAYERS))
        recent.append(t.layer_cost)
        sess.first_layers_any.append(t.layer_cost)
        of_layout = _layout_entry(self._first_layers, fp, SERVER_LAYOUTS_REMEMBERED, OrderedDict)
        _note_session(of_layout, t.key[0], max(recent))
        _note_session(self._first_layers_any, t.key[0], max(sess.first_layers_any))
        self._estimate_unestimated()

    def _estimate_unestimated(self) -> None:
        """Transfers given room at an estimate of 0 (before any first layer was received
        whole) have their estimate reserved once one was (see :meth:`_learn`), in the order
        they were given room, as far as the room left holds it; those it does not hold yet
        are reserved as room frees (:meth:`_regrant`), before any transfer waiting to start
        is given room."""
        if not self._first_layers_any:
            return  # (none received whole yet: every estimate is still 0)
        while self._unestimated:
            key = next(iter(self._unestimated))
            u = self._live.get(key)
            if u is None or u.error is not None or u.sized or u.buffers or u.external:
                del self._unestimated[key]
                continue
            est = self._estimate(u)
            if self._room() < est:
                return
            del self._unestimated[key]
            u.estimate = est
            self._reserve(u)

    @property
    def waiting_to_start(self) -> int:
        """Transfers admitted whose ACCEPT waits for room for their first layer in
        max_buffer_bytes (see :meth:`_admit`)."""
        return len(self._admitting)

    def _accept(self, t: _Incoming, now: float) -> None:
        t.accepted = True
        self._store.opened(t.key, t.spec)
        self._count("transfers_accepted")
        sess = self._sessions.get(t.key[0])
        # On the stream that carried BEGIN while it is open (the spec), else on any.
        found = self._any_open(sess, prefer=t.begin_cid) if sess is not None else None
        if found is not None:
            t.limit_cid, conn = found
            conn.send_accept(t.key[1], t.state.layer_limit)
        if not t.claimed:
            self._unclaimed[t.key] = None
        if self.config.claim_timeout is not None and not t.claimed:
            t.claim_deadline = now + self.config.claim_timeout
            self._note(_CLAIM, t.key)
        self._events.append(TransferArrived(
            key=t.key, request_id=t.begin.request_id, meta=t.meta, num_layers=t.begin.num_layers,
            spec=t.spec, blocks=tuple((bv.block, bv.version) for bv in t.begin.blocks),
        ))

    def _repeat_reset(self, sess: _Session, cid: int, conn: Connection, tid: int) -> bool:
        """Send again the RESET of a recently failed transfer on ``conn`` (connection
        ``cid``, which then carries it, if it is kept); False if it did not fail."""
        why = sess.tombstones.get(tid)
        if why is None:
            return False
        conn.send_reset(tid, *why)
        if (on := sess.resets.get(tid)) is not None:
            # (only open connections carry it: any other is let go of here too)
            on.difference_update([c for c in on if self._open(c) is None])
            on.add(cid)
        return True

    def _reserve(self, t: _Incoming) -> None:
        """Count what ``t`` has granted and not allocated (its layers below ``layer_limit``
        neither taken nor held, at its layer's footprint) in :attr:`reserved_bytes`: from
        when its layer size is known (its first chunk stored) until it fails, ends, or is
        received into a destination (its new layers not counted)."""
        n = 0
        if not t.external and t.error is None and self._live.get(t.key) is t:
            if t.sized:
                n = max(0, t.state.layer_limit - t.taken - len(t.buffers)) * t.layer_cost
            elif t.roomed and not t.buffers:
                n = t.estimate  # its first layer's, until that layer is allocated (_admit)
        self.reserved_bytes += n - t.reserved
        t.reserved = n

    def _room(self) -> int:
        """Budget bytes no layer holds or is granted."""
        return self.config.max_buffer_bytes - (self.buffered_bytes - self.kept_bytes) - self.reserved_bytes

    def _window_room(self) -> int:
        """Room windows are granted into: the room left less the share kept for first
        layers (:data:`FIRST_LAYER_SHARE`)."""
        return self._room() - self._first_layer_share()

    def _first_layer_share(self) -> int:
        """The bytes of the budget kept from windows for first layers
        (:data:`FIRST_LAYER_SHARE`): the most a first layer's estimate is, unless the smallest
        recent first layer is larger."""
        return self.config.max_buffer_bytes // FIRST_LAYER_SHARE

    def _offer(self, t: _Incoming) -> None:
        """Grant ``t`` its window, ``taken + W`` layers, as far as the room left holds it:
        ``taken + min(W, layers it holds or has reserved + whole layers that fit in the
        room for windows)`` (never less than it has: a limit does not decrease).  Short of
        its window, it waits among :attr:`_waiting` (its sender waits for credit) until
        room frees."""
        want = min(t.taken + t.window, t.begin.num_layers)
        limit = t.state.layer_limit
        if want > limit:
            if t.external or not t.sized:
                self._grant(t, want)
            else:
                self._grant(t, min(want, limit + max(0, self._window_room()) // t.layer_cost))
        if want <= t.state.layer_limit:
            self._waiting.pop(t.key, None)
        elif t.key not in self._waiting:
            self._waiting[t.key] = None
            self._count("credit_waits")

    def _regrant(self) -> None:
        """Room may have freed: the transfers waiting for credit are offered it again, the
        one waiting longest first, each within what is left, until one is still short of
        its window (what is left is less than one of its layers: no transfer that waited
        less passes it); then the transfers waiting to start (:meth:`_admit_waiting`).
        Nothing, once the server is closing."""
        if self._regrant_held or self._closing:
            return
        while self._waiting and self._window_room() > 0:
            key = next(iter(self._waiting))
            t = self._live.get(key)
            sess = self._sessions.get(key[0])
            if t is None or t.error is not None or sess is None or sess.closed:
                del self._waiting[key]  # (a lost session's transfers are failing)
                continue
            self._offer(t)
            if key in self._waiting:
                break
        self._estimate_unestimated()
        self._admit_waiting()

    @property
    def waiting_for_room(self) -> int:
        """Transfers granted less than their window for want of room in max_buffer_bytes,
        their senders waiting for credit."""
        return len(self._waiting)

    def _grant(self, t: _Incoming, limit: int) -> None:
        limit = min(limit, t.begin.num_layers)
        if limit <= t.state.layer_limit or t.error is not None:
            return
        t.state.layer_limit = limit
        self._reserve(t)
        if t.external or min(t.taken + t.window, t.begin.num_layers) <= limit:
            self._waiting.pop(t.key, None)  # (its whole window granted: it waits no more)
        sess = self._sessions.get(t.key[0])
        found = self._any_open(sess) if sess is not None else None
        if found is not None and t.accepted:
            t.limit_cid, conn = found
            conn.send_credit_frame(t.key[1], limit)

    def _charge(self, t: _Incoming, nbytes: int) -> None:
        t.held += nbytes
        self.buffered_bytes += nbytes

    def _release(self, t: _Incoming, nbytes: int) -> None:
        nbytes = min(nbytes, t.held)
        t.held -= nbytes
        self.buffered_bytes -= nbytes

    def _keep(self, t: _Incoming, nbytes: int) -> None:
        """Charge what the server remembers of ``t`` besides its layers."""
        t.kept += nbytes
        self.kept_bytes += nbytes
        self._charge(t, nbytes)

    def _forget(self, t: _Incoming, nbytes: int) -> None:
        nbytes = min(nbytes, t.kept)
        t.kept -= nbytes
        self.kept_bytes -= nbytes
        self._release(t, nbytes)

    def _release_all(self, t: _Incoming) -> None:
        self._forget(t, t.kept)
        self._release(t, t.held)
        t.range_cost = 0

    def _kept_room(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more of what the server remembers besides layers fit: up to an
        eighth past max_buffer_bytes (at least KEPT_ROOM_MIN), so layers that fill the budget
        leave room for it."""
        limit = self.config.max_buffer_bytes
        return self.buffered_bytes + nbytes <= limit + max(limit // 8, KEPT_ROOM_MIN)

    def _fail(
        self, t: _Incoming, error: KvwireError, *, reset: bool, even_if_complete: bool = False,
        tombstone: KvwireError | None = None, answer: bool = False,
    ) -> None:
        """``t`` fails with ``error``; with ``reset``, the client is told by a RESET: one
        that ``answer``s its BEGIN (the registry's verdict) on the stream that carried the
        last BEGIN, as an ACCEPT goes; any other (the application gave up, a deadline, the
        server closing) on every open stream of the session.  A stream may be stalled (its
        client not reading, its path stuck): a RESET queued there behind unread bytes would
        reach the sender only once that stream broke (its idle timeout), while the sender
        went on sending.  The client fails the transfer at the first copy it reads and
        ignores the others (docs/protocol.md 10: a RESET for a transfer it does not have)."""
        if t.error is not None or (t.complete and not even_if_complete):
            return
        t.error = error
        claim_deadline = t.claim_deadline
        t.buffers.clear()
        t.costs.clear()
        self._release_all(t)
        self._reserve(t)  # (nothing reserved once failed)
        self._waiting.pop(t.key, None)
        self._admitting.pop(t.key, None)
        self._unestimated.pop(t.key, None)
        for r in t.inplace.values():  # never written again once the transfer is gone
            conn = self._conns.get(r.cid)
            if conn is not None:
                conn.abandon_payload(r.view)
        t.inplace.clear()
        t.deadline = t.claim_deadline = None
        self._live.pop(t.key, None)
        self._recount(t)
        claimable = t.key in self._unclaimed
        calling = t.calling
        if calling:
            self._orphan(t, shared=claimable)
        if claimable:
            self._keep_failed(t, claim_deadline, calling=calling)
        if t.accepted:
            self._store.closed(t.key)
        sess = self._sessions.get(t.key[0])
        if sess is not None:
            sess.transfers.pop(t.key[1], None)
            # Why it failed: a chunk of it still arriving gets the RESET again before its
            # ACK on the same stream, so the sender never mistakes it for success.  Only
            # the code and the text as on the wire: never an exception (see detached()),
            # and never more text than a RESET carries.
            why = tombstone or error
            sess.tombstone(t.key[1], why.code, wire_text(str(why)))
            carriers: list[tuple[int, Connection]] = []
            if reset:
                if answer:
                    # On the stream that carried the last BEGIN, as an ACCEPT goes: a
                    # registry's stale verdict answers a BEGIN the client may have sent
                    # again on another stream because the first one broke.
                    found = self._any_open(sess, prefer=t.begin_cid)
                    carriers = [found] if found is not None else []
                else:
                    carriers = self._every_open(sess)
                sess.resets[t.key[1]] = {cid for cid, _ in carriers}
                while len(sess.resets) > _RESETS_KEPT:
                    sess.resets.popitem(last=False)
                for _, conn in carriers:
                    conn.send_reset(t.key[1], error.code, wire_text(str(error)))
            # Acknowledgements held for the registry's verdict go out now, each after the
            # RESET on its own stream: every CHUNK gets its ACK (the stream's credit comes
            # back), and none reads as success.
            held, t.publish_pending = t.publish_pending, []
            told = {cid for cid, _ in carriers}
            for cid, address in held:
                if (c := self._conn(cid)) is not None:
                    if cid not in told:
                        self._repeat_reset(sess, cid, c, t.key[1])
                        told.add(cid)
                    c.send_ack(address)
        self._events.append(TransferFailed(key=t.key, error=error, request_id=t.begin.request_id, claimable=claimable))
        if claimable:
            self._bound_failed(t.key)
        self._regrant()  # its layers' room, held and granted, is free

    def _keep_failed(self, t: _Incoming, claim_deadline: float | None, *, calling: bool = False) -> None:
        """``t`` failed after it arrived, and nobody has claimed it: it stays in its place
        among the arrivals to claim (the application is handed it failed, whenever it asks,
        as one that claimed it before it failed is), until its claim deadline as if it had
        not failed, with no layer and only the budget bytes of what its BEGIN made the
        server keep (the I/O layer's view of it holds its meta and prefix blocks); with
        ``calling``, a registry call of it still runs (:meth:`_orphan`, whose entry counts
        none of the block list this footprint holds)."""
        self._failed[t.key] = _Failed(
            t.begin.request_id, claim_deadline, t.footprint, _block_bytes(t.begin) if calling else 0)
        if t.key[0] in self._sessions:
            self._failed_open.setdefault(t.key[0], {})[t.key] = None
        else:
            self._failed_gone[t.key] = None
        self.kept_bytes += t.footprint
        self.buffered_bytes += t.footprint
        self._note(_CLAIM, t.key)

    def _bound_failed(self, key: Key) -> None:
        """After ``key`` was kept failed: its session keeps at most ``max_transfers``
        failed transfers (its oldest failure forgotten first), so a client beginning and
        resetting transfers without end forgets only its own, never another client's.
        The open sessions, at most ``max_sessions``, keep at most
        :attr:`failed_kept_limit` together; past that bound, failures of sessions that
        are gone (lost, or closed) are forgotten, those whose session went first."""
        own = self._failed_open.get(key[0])
        while own is not None and len(own) > self.config.max_transfers:
            self._drop_failed(next(iter(own)))
        while len(self._failed) > self.failed_kept_limit and self._failed_gone:
            self._drop_failed(next(iter(self._failed_gone)))

    def _unindex_failed(self, key: Key) -> None:
        """``key`` is no longer kept failed: out of its session's failures."""
        self._failed_gone.pop(key, None)
        own = self._failed_open.get(key[0])
        if own is not None:
            own.pop(key, None)
            if not own:
                del self._failed_open[key[0]]

    def _unkeep(self, nbytes: int) -> None:
        self.kept_bytes -= nbytes
        self.buffered_bytes -= nbytes

    def _unkeep_failed(self, key: Key, f: _Failed) -> None:
        """Give back the bytes of failed record ``f`` (claimed, or dropped), but for its
        block list while a registry call of it still runs: those move to that call's entry
        (:meth:`_orphan`), given back when it is answered."""
        kept = f.kept
        if f.calling_bytes and key in self._orphans:
            self._orphans[key] += f.calling_bytes
            kept -= f.calling_bytes
        self._unkeep(kept)

    def _drop_failed(self, key: Key) -> None:
        """Forget a failed transfer nobody claimed (see :meth:`_keep_failed`)."""
        f = self._failed.pop(key)
        self._unindex_failed(key)
        self._unclaimed.pop(key, None)
        self._unkeep_failed(key, f)
        self._events.append(TransferDropped(key=key, request_id=f.request_id))
        self._regrant()

    def _on_chunk(self, cid: int, conn: Connection, ev: ChunkReceived) -> None:
        chunk = ev.chunk
        addr = chunk.address
        sess = self._conn_session.get(cid)
        self.chunk_bytes_received += ev.wire_size
        if sess is not None:
            sess.unreported += ev.wire_size
        if sess is None:
            conn.send_ack(addr)
            return
        t = sess.transfers.get(addr.transfer_id)
        if t is not None and t.error is None:
            try:
                new = self._store_chunk(cid, t, chunk, ev.wire_size, addr)
            except KvwireError as exc:
                self._fail(t, detached(exc), reset=False)
            else:
                if t.gated and t.state.complete and not t.published:
                    # The last ack waits for the registry's verdict (a re-sent copy too).
                    t.publish_pending.append((cid, addr))
                    if new and len(t.publish_pending) == 1:
                        self._events.append(RegistryPublish(
                            key=t.key, blocks=tuple((bv.block, bv.version) for bv in t.begin.blocks),
                        ))
                        t.calling = True
                    return
        if sess.tombstones and self._repeat_reset(sess, cid, conn, addr.transfer_id):
            pass
        elif t is None and addr.transfer_id not in sess.completed:
            # Never begun (or long forgotten): the data was not stored, so say so first.
            conn.send_reset(addr.transfer_id, ErrorCode.PROTOCOL_ERROR, "no such transfer")
        # Chunks of failed transfers are acknowledged too, after the RESET on the same
        # stream: the ack returns the connection credit, the RESET the outcome.
        conn.send_ack(addr)

    def _check_chunk(self, t: _Incoming, chunk: Chunk) -> int:
        """Raise unless ``chunk`` may belong to ``t``; return its layer's size in bytes."""
        if not t.accepted:
            raise ProtocolError("CHUNK before the transfer was accepted")
        first = t.state.layer_tokens is None
        t.state.check(chunk)
        check_chunk_size(chunk, t.spec, max_chunk_bytes=self.config.max_chunk_bytes,
                         max_layer_bytes=self.config.max_layer_bytes)
        if chunk.codec_id not in self._codecs_accepted:
            name = codec_by_id(chunk.codec_id).name  # (ProtocolError for an unknown id)
            raise error_from_code(ErrorCode.UNSUPPORTED_CODEC, f"codec {name!r} is not accepted here")
        layer_bytes = 2 * chunk.layer_tokens * t.bpt
        if first:  # as many layers as transfer_buffer_bytes holds (and the whole budget), at least one
            # (granted once the chunk is stored, within the room left: see _offer)
            room = min(self.config.transfer_buffer_bytes, self.config.max_buffer_bytes)
            t.window = max(1, room // max(1, self._store.footprint(layer_bytes)))
        return layer_bytes

    def _store_chunk(
        self, cid: int, t: _Incoming, chunk: Chunk, wire_size: int = 0, address: ChunkAddress | None = None,
    ) -> bool:
        """Verify and store a chunk; True when it was new.  Raises KvwireError to reset.

        A chunk counts as received only once its bytes are in place: a failure to allocate
        or decode leaves the bookkeeping as it was (a re-sent copy is not mistaken for a
        duplicate) and becomes a typed error, whatever raised it.
        """
        layer_bytes = self._check_chunk(t, chunk)
        if address is None:
            address = chunk.address
        # (taken and put back if another connection's, rather than get then del: no
        # hashing of the address while the transfer has no reservation)
        res = t.inplace.pop(address, None)
        inplace = False
        if res is not None:
            if res.cid == cid:
                inplace = chunk.payload is res.view
            else:
                t.inplace[address] = res  # (another connection's: it stays)
        verdict = t.state.classify(chunk)
        if verdict is ChunkVerdict.DUPLICATE:
            t.state.add(chunk, verdict)
            return False
        try:
            buf = self._layer_buffer(t, chunk, layer_bytes)
            if not self._kept_room(RANGE_BYTES) and not t.state.completes(chunk):
                self._count("buffer_budget_refusals")
                raise LimitExceededError(
                    f"the server holds {self.buffered_bytes} bytes of transfers; remembering the token "
                    f"range of one more chunk exceeds max_buffer_bytes={self.config.max_buffer_bytes} "
                    f"and the room past it its bookkeeping may take"
                )
            if not inplace:
                self._evict_overlapping(t, chunk)
                for part in split_kv(chunk) if chunk.kind == KIND_KV else (chunk,):
                    self._store.decode(t.key, part, buf, *chunk_span(part, t.bpt, layer_bytes))
        except KvwireError:
            raise
        except MemoryError:
            raise LimitExceededError(f"out of memory storing a chunk of layer {chunk.layer}") from None
        except Exception as exc:  # a codec or allocator failing on peer-chosen input
            raise ProtocolError(
                f"chunk of layer {chunk.layer} could not be decoded ({type(exc).__name__})"
            ) from exc
        t.state.add(chunk, verdict)  # (classified above: its bytes are in place now)
        t.wire_bytes += wire_size
        complete = t.state.layer_complete(chunk.layer)
        if not t.sized:
            # Its layer size is known now: its granted layers are reserved from here on, and
            # the rest of its window is granted as far as the room left holds it.
            t.sized = True
            t.layer_cost = self._store.footprint(layer_bytes)
            self._unestimated.pop(t.key, None)  # (its layer 0 allocated: no estimate)
            if complete and chunk.layer == 0:  # (layer 0 in one chunk: transfers given room
                self._learn(t)  # at an estimate of 0 get theirs before its window)
            self._offer(t)  # (its layer 0, allocated, reserves nothing: _layer_buffer)
            self._regrant()  # (room its estimate kept past its footprint)
        elif complete and chunk.layer == 0 and not t.learned:
            # Its layer 0 is whole: only now is its size one its session's next first layers
            # are estimated at (a chunk declares a size; the layer received proves it).
            self._learn(t)
            self._regrant()
        # Each range remembered until its layer is complete counts in the budget.
        ranges = RANGE_BYTES * t.state.ranges
        if ranges > t.range_cost:
            self._keep(t, ranges - t.range_cost)
        else:
            self._forget(t, t.range_cost - ranges)
        t.range_cost = ranges
        if complete:
            if t.gated and t.state.complete:
                t.last_layer = chunk.layer  # ready once its blocks are published
            else:
                self._events.append(LayerReady(key=t.key, layer=chunk.layer, wire_bytes=t.wire_bytes))
                if t.state.complete:
                    t.deadline = None
                    self._recount(t)
        return True

    def _layer_buffer(self, t: _Incoming, chunk: Chunk, layer_bytes: int, *, count: bool = True) -> Any:
        """The buffer of ``chunk``'s layer, allocated on its first chunk within the budget."""
        if chunk.layer in t.buffers:
            return t.buffers[chunk.layer]
        cost = 0 if t.external else self._store.footprint(layer_bytes)
        limit = self.config.max_buffer_bytes
        held = self.buffered_bytes - self.kept_bytes  # layers alone within the budget
        # A layer granted once the size was known was reserved (its room kept, see
        # _reserve); a transfer's first layer, granted by ACCEPT, had its room kept at an
        # estimate (see _admit): it takes what the layers held and granted to every other
        # transfer leave.
        granted = self.reserved_bytes - (cost if t.sized else t.reserved)
        if cost and held + granted + cost > limit:
            if count:
                self._count("buffer_budget_refusals")
            if not t.sized:
                # (what to do first: a RESET carries WIRE_TEXT_LIMIT characters of it)
                raise LimitExceededError(
                    "the server's buffer budget is taken by other transfers: consume layers, raise "
                    "max_buffer_bytes, lower transfer_buffer_bytes, or receive into a destination "
                    f"(a first layer of {cost} bytes does not fit in max_buffer_bytes={limit}: "
                    f"{held} held, {granted} granted)"
                )
            # (a sender keeping to its credit never meets this: its layers were reserved)
            raise LimitExceededError(
                f"the server holds {self.buffered_bytes} bytes of transfers; "
                f"{cost} more exceeds max_buffer_bytes={limit}"
            )
        buf = self._store.allocate(t.key, chunk, layer_bytes)
        t.buffers[chunk.layer] = buf
        t.costs[chunk.layer] = cost
        self._charge(t, cost)
        self._reserve(t)  # (reserved, now held)
        return buf

    # -- in-place receive ------------------------------------------------------------------

    def _sink(self, cid: int, head: Chunk, size: int) -> Region | None:
        """Where a raw chunk's payload can be received directly: its place in the layer.

        The header has not passed its CRC yet, so nothing here changes what the transfer
        has received, granted or acknowledged (at most the buffer of a granted layer is
        allocated early).  The region must hold no verified bytes and not be arriving on
        another connection: a corrupted copy can only spoil bytes no one has accepted.
        """
        sess = self._conn_session.get(cid)
        t = sess.transfers.get(head.transfer_id) if sess is not None else None
        if t is None or t.error is not None or not t.accepted:
            return None
        if head.kind == KIND_KV and not ((c := self._conns.get(cid)) is not None and c.sends_kv_chunks):
            return None  # not in this connection's version: refused once verified
        st = t.state
        end = head.token_start + head.token_count
        layer_bytes = 2 * head.layer_tokens * t.bpt
        offset, nbytes = chunk_span(head, t.bpt, layer_bytes)
        if (
            head.codec_id != 0 or head.params or st.layer_tokens is None or head.layer_tokens != st.layer_tokens
            or head.layer >= st.layer_limit or head.layer >= st.num_layers or head.token_count == 0
            or end > head.layer_tokens or nbytes != size
            or st.overlaps_received(head.layer, head.kind, head.token_start, head.token_count)
            or (t.inplace and any(r.overlaps(head.layer, head.kind, head.token_start, end) for r in t.inplace.values()))
        ):
            return None
        try:
            buf = self._layer_buffer(t, head, layer_bytes, count=False)
            view = self._store.region(t.key, head, buf, offset, size)
        except Exception:
            return None  # the verified chunk meets the same failure and fails the transfer
        if view is None or sink_problem(view, size) is not None:  # (declined: never failing the connection)
            return None  # read into a private buffer: the verified chunk is decoded as any other
        t.inplace[head.address] = _Reservation(view, cid, head.layer, head.kind, head.token_start, end)
        return view

    def _evict_overlapping(self, t: _Incoming, chunk: Chunk) -> None:
        """A copy of these tokens is about to be stored: any connection still reading into
        that region in place is switched to a private buffer first."""
        end = chunk.token_start + chunk.token_count
        for address, r in list(t.inplace.items()):
            if r.overlaps(chunk.layer, chunk.kind, chunk.token_start, end):
                conn = self._conns.get(r.cid)
                if conn is not None:
                    conn.abandon_payload(r.view)
                del t.inplace[address]

    def _release_reservations(self, cid: int) -> None:
        """``cid`` is gone: its in-place reservations free their regions."""
        for t in self._live.values():
            for address in [a for a, r in t.inplace.items() if r.cid == cid]:
                del t.inplace[address]


__all__ = [
    "COUNTERS",
    "AuthenticationFailed",
    "ByteStore",
    "ConnectionDropped",
    "GoawayReceived",
    "InternalError",
    "Key",
    "LayerReady",
    "LayerStore",
    "ReceiverConfig",
    "ReceiverCore",
    "ReceiverEvent",
    "Region",
    "RegistryCheck",
    "RegistryPublish",
    "StreamResumed",
    "TransferAborted",
    "TransferArrived",
    "TransferDropped",
    "TransferFailed",
    "admit_begin",
    "begin_footprint",
    "check_chunk_size",
    "chunk_span",
    "quoted_id",
    "raw_decode",
    "wire_text",
]
