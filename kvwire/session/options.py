"""The public data of a session, no I/O: each side's options (validated, and turned into
its core's config in one place) and the :class:`Receipt` of a completed send.

``kvwire.aio`` re-exports them (``kvwire.aio.ClientOptions``, ``kvwire.aio.ServerOptions``,
``kvwire.Receipt``); :mod:`kvwire.options` spells their fields out as typed keywords.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from kvwire.codec import available_codecs
from kvwire.errors import UsageError
from kvwire.session.receiver import ReceiverConfig
from kvwire.session.sender import SenderConfig
from kvwire.spec import KVSpec
from kvwire.wire.connection import MAX_TRANSFERS, NO_FINGERPRINT
from kvwire.wire.frames import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_MAX_FRAME_SIZE,
    DEFAULT_WINDOW,
    MAX_MAX_FRAME_SIZE,
    MIN_MAX_FRAME_SIZE,
)

#: Most streams a session may have (client and server).
MAX_STREAMS = 64
#: TCP_NOTSENT_LOWAT is a C int.
_MAX_LOWAT = (1 << 31) - 1

#: Unsent bytes the kernel may hold before the socket stops polling writable; keeps small
#: frames (acks, credits) from queueing behind a full send buffer.
NOTSENT_LOWAT = 1 << 20


def check_number(owner: object, name: str, *, none_ok: bool = False, zero_ok: bool = False) -> None:
    """:class:`~kvwire.UsageError` unless ``owner.<name>`` is a finite number > 0 (>= 0 with
    ``zero_ok``; None is also accepted with ``none_ok``).  Booleans, NaN and infinities are
    refused (where None is accepted, it is the way to say "no limit")."""
    check_value(name, getattr(owner, name), none_ok=none_ok, zero_ok=zero_ok)


def check_seconds(name: str, value: object) -> None:
    """:class:`~kvwire.UsageError` unless ``value`` (the argument ``name`` of a call) is a
    finite number of seconds > 0 or None (no limit): the rule ``serve()`` applies to its
    timeouts."""
    check_value(name, value, none_ok=True)


def check_value(name: str, value: object, *, none_ok: bool = False, zero_ok: bool = False) -> None:
    """:func:`check_number`'s rule for a value named ``name``.  An int too large for a
    float (``10**400``) is no finite number of seconds either: refused as NaN is."""
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not _finite(value):
        hint = " (None for no limit)" if none_ok else ""
        raise UsageError(f"{name} must be a finite number{hint}, got {shown(value)}")
    if value < 0 or (value == 0 and not zero_ok):
        raise UsageError(f"{name} must be {'>= 0' if zero_ok else '> 0'}, got {shown(value)}")


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past the largest float
        return False


#: Longest text of a refused value an error message quotes.
_SHOWN_CHARS = 80


def shown(value: object) -> str:
    """``repr(value)`` for an error message, bounded: an int of more than 64 bits is named
    by its size (the repr of one past 4300 digits raises ValueError), a longer repr is cut
    at :data:`_SHOWN_CHARS`, and one that fails names the value's type."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an int of {value.bit_length()} bits"
    try:
        text = repr(value)
    except Exception:
        return f"a {type(value).__name__}"
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "..."


def check_index(name: str, value: object, minimum: int, maximum: int | None = None) -> int:
    """``value`` as an int (numpy's ints too, not a bool nor a float) in [``minimum``,
    ``maximum``]; :class:`~kvwire.UsageError` otherwise."""
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise UsageError(f"{name} must be an int, got {shown(value)}") from None
    if number < minimum or (maximum is not None and number > maximum):
        bound = f"[{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
        raise UsageError(f"{name} must be an int {bound}, got {shown(value)}")
    return number


def check_int(owner: object, name: str, *, minimum: int = 1, maximum: int | None = None,
              none_ok: bool = False) -> None:
    """:class:`~kvwire.UsageError` unless ``owner.<name>`` is an int (not a bool, not a
    float such as 1e9) in [``minimum``, ``maximum``]; None is also accepted with
    ``none_ok``.  Counts and sizes go into frames and socket options as integers."""
    value = getattr(owner, name)
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise UsageError(f"{name} must be an int, got {shown(value)}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"[{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
        raise UsageError(f"{name} must be an int {bound}, got {shown(value)}")


def _check_frame_size(size: int) -> None:
    if isinstance(size, bool) or not isinstance(size, int) or not MIN_MAX_FRAME_SIZE <= size <= MAX_MAX_FRAME_SIZE:
        raise UsageError(f"max_frame_size must be in [{MIN_MAX_FRAME_SIZE}, {MAX_MAX_FRAME_SIZE}]")


def check_port(port: object, lowest: int) -> None:
    """:class:`~kvwire.UsageError` unless ``port`` is an int in [``lowest``, 65535]."""
    if isinstance(port, bool) or not isinstance(port, int) or not lowest <= port <= 65535:
        raise UsageError(f"port must be an int in [{lowest}, 65535], got {shown(port)}")


def _check_secret(secret: object) -> bytes:
    if not isinstance(secret, bytes | bytearray) or len(secret) < 8:
        raise UsageError("secret must be bytes of at least 8 bytes")
    return bytes(secret)


#: Values of :attr:`ClientOptions.auto_codec`.
AUTO_CODEC_MODES = ("model", "measured")


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientOptions:
    """Settings of a client session."""

    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    """Target size of one chunk of K or V before encoding (at most what the server's
    frame limit holds: a smaller limit makes the chunks smaller)."""
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    """Largest frame body this side accepts."""
    connect_timeout: float = 10.0
    """Seconds for TCP connect plus handshake, per stream."""
    idle_timeout: float | None = 30.0
    """Seconds without a complete frame from the server before a stream is considered
    broken (a PING is sent after half of it)."""
    notsent_lowat: int | None = NOTSENT_LOWAT
    """TCP_NOTSENT_LOWAT (None leaves the kernel default)."""
    spec: KVSpec | None = None
    """Pin the session to one KV layout: a server that does not accept it refuses at connect."""
    reconnect_attempts: int = 5
    """When a stream breaks (EOF, reset, corruption, silence): reconnect attempts before
    the session's transfers fail with ConnectionLostError; unacknowledged chunks are
    re-sent.  0 turns resume off."""
    reconnect_backoff: float = 0.05
    """Seconds before the first reconnect attempt; doubles with each attempt."""
    max_streams: int = 8
    """With ``streams="auto"``: connections opened; the controller uses 1 to this many."""
    max_reconnects: int = 32
    """Broken streams the session resumes from in its lifetime; one more fails it with
    ConnectionLostError (a fault that repeats after every reconnect cannot loop forever)."""
    max_transfer_reconnects: int = 8
    """Broken streams one transfer lives through; one more fails it with ConnectionLostError.
    A break counts against a transfer only when the stream carried something of it: chunks
    not yet acknowledged, or its BEGIN not yet accepted.  Breaks of the session's other
    streams are bounded by ``max_reconnects`` alone."""
    auto_codec: str = "model"
    """How ``codec="auto"`` chooses: ``"model"`` from the bandwidth estimate and the
    codecs' measured CPU speeds, with probes; ``"measured"`` on each codec's KV goodput
    measured from its acknowledgements, with exploring stints (see
    ``kvwire.control.CodecChooser`` and docs/benchmarks.md for where each is ahead)."""

    def __post_init__(self) -> None:
        if self.auto_codec not in AUTO_CODEC_MODES:
            raise UsageError(f"auto_codec must be one of {', '.join(AUTO_CODEC_MODES)}, not {shown(self.auto_codec)}")
        check_int(self, "chunk_bytes")
        check_int(self, "max_streams", maximum=MAX_STREAMS)
        for name in ("reconnect_attempts", "max_reconnects", "max_transfer_reconnects"):
            check_int(self, name, minimum=0)
        check_int(self, "notsent_lowat", minimum=0, maximum=_MAX_LOWAT, none_ok=True)
        check_number(self, "connect_timeout")
        check_number(self, "idle_timeout", none_ok=True)
        check_number(self, "reconnect_backoff", zero_ok=True)
        _check_frame_size(self.max_frame_size)
        if self.spec is not None and not isinstance(self.spec, KVSpec):
            raise UsageError(f"spec must be a KVSpec or None, got {shown(self.spec)}")

    def sender_config(self, *, secret: bytes, streams: object) -> SenderConfig:
        """The session core's config for ``streams`` streams (every registered codec offered)."""
        if isinstance(streams, bool) or not isinstance(streams, int) or not 1 <= streams <= MAX_STREAMS:
            raise UsageError(f"streams must be an int in [1, {MAX_STREAMS}] or 'auto', not {shown(streams)}")
        shared = {f.name: getattr(self, f.name) for f in fields(SenderConfig) if hasattr(self, f.name)}
        fingerprint = self.spec.fingerprint if self.spec is not None else NO_FINGERPRINT
        return SenderConfig(**shared, secret=_check_secret(secret), streams=streams,
                            codecs=tuple(available_codecs()), fingerprint=fingerprint)


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerOptions:
    """Limits and defaults of a server.  Every bound is enforced before allocating."""

    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    """Largest frame body accepted (a CHUNK body is 26 bytes + params + payload)."""
    window: int = DEFAULT_WINDOW
    """Connection credit: CHUNK bytes a client may have unacknowledged on one stream."""
    max_transfers: int = 64
    """Transfers in progress per session, complete ones the application has not claimed
    included (more are refused with LIMIT_EXCEEDED).  Server-wide the server holds at
    most ``max_sessions`` x ``max_transfers`` of them, complete ones nobody claimed of
    sessions that have ended included: past that every BEGIN is refused (see
    ``max_sessions`` and ``claim_timeout``)."""
    transfer_buffer_bytes: int = 256 * 1024 * 1024
    """Bytes of received layers buffered per transfer before the application takes
    them, never more than ``max_buffer_bytes`` (at least one layer is always granted, so
    a transfer can always progress)."""
    max_tokens: int = 256 * 1024
    """Largest token count per layer accepted (bounds one layer's allocation)."""
    max_sessions: int = 256
    """Concurrent client sessions (peers).  Also bounds the transfers the server holds for
    all its sessions together: ``max_sessions`` x ``max_transfers``, in progress or
    complete and not claimed, those of sessions that have ended included (a complete
    transfer stays claimable when its session ends).  So a producer that restarts or
    reconnects, leaving transfers nobody claimed behind, may find every BEGIN refused
    with LIMIT_EXCEEDED (the server logs a WARNING saying so, at most once a minute;
    ``statistics()["held_transfers"]`` counts them) until the application claims them or
    ``claim_timeout`` drops them; raise it where one session's unclaimed transfers may
    outlive it."""
    max_streams: int = 64
    """TCP streams per session."""
    handshake_timeout: float = 10.0
    """Seconds a new connection has to complete the handshake."""
    idle_timeout: float | None = 30.0
    """Seconds without a complete frame from a client before its connection is closed
    (a PING is sent after half of it)."""
    transfer_timeout: float | None = 300.0
    """Seconds from BEGIN until a transfer must be complete; then it fails with TIMEOUT
    on both sides (None: no limit)."""
    specs: tuple[KVSpec, ...] = ()
    """KV layouts accepted; empty accepts any valid layout."""
    codecs: tuple[str, ...] = ()
    """Codecs accepted; empty means every registered codec."""
    notsent_lowat: int | None = NOTSENT_LOWAT
    """TCP_NOTSENT_LOWAT for accepted sockets (None leaves the kernel default)."""
    device: str = "cpu"
    """Where received layers live: "cpu" (numpy), or "gpu" (the current CUDA device) or
    "gpu:N" (CuPy arrays on device N; quantized chunks are dequantized by the GPU kernels
    straight into the layer; bfloat16 layers hold uint16 bit patterns)."""
    resume_timeout: float = 10.0
    """Seconds a session whose streams all broke waits for the client to reconnect before
    its unfinished transfers fail with ConnectionLostError (0: no resume)."""
    max_layer_bytes: int = 1 << 30
    """Largest layer (K and V together, at the spec dtype) accepted; the sender's token
    count and the spec's heads x head_dim are its choice, this bounds one allocation."""
    max_chunk_bytes: int = 64 << 20
    """Largest decoded size of one chunk: a compressed chunk that would expand beyond it
    is refused before anything is decompressed."""
    max_buffer_bytes: int = 4 << 30
    """Server-wide: bytes of received layers held, in transfers still arriving and in
    completed ones the application has not taken yet, each counted at the memory it takes
    (a host layer's pool slab: at least 64 KiB), of what their BEGINs made the server
    keep (prefix block lists and meta, until the last layer is taken), and of the token
    ranges it remembers until their layer is complete (128 bytes each).  Layers alone stay
    within it; the rest may take the total an eighth past it (at least 1 MiB), so layers
    that fill it still leave room.  A transfer that would go beyond is refused at BEGIN or
    fails with LIMIT_EXCEEDED."""
    claim_timeout: float | None = 60.0
    """Seconds an arrived transfer waits for ``accept()``/``expect()`` to claim it; then
    it is dropped (aborted if still arriving).  None: kept until the server closes; then
    only claiming frees the place that a transfer of a session that ended, nobody
    claiming it, takes in the server-wide ``max_sessions`` x ``max_transfers`` (see
    ``max_sessions``)."""
    max_meta_bytes: int = 64 * 1024
    """Largest ``meta`` (JSON object) a transfer may carry."""

    def __post_init__(self) -> None:
        for name in ("transfer_buffer_bytes", "max_tokens", "max_sessions", "max_streams",
                     "max_layer_bytes", "max_chunk_bytes", "max_buffer_bytes"):
            check_int(self, name)
        check_int(self, "max_transfers", maximum=MAX_TRANSFERS)
        check_int(self, "max_meta_bytes", minimum=0)
        check_int(self, "notsent_lowat", minimum=0, maximum=_MAX_LOWAT, none_ok=True)
        check_number(self, "handshake_timeout")
        for name in ("idle_timeout", "transfer_timeout", "claim_timeout"):
            check_number(self, name, none_ok=True)
        check_number(self, "resume_timeout", zero_ok=True)
        _check_frame_size(self.max_frame_size)
        check_int(self, "window", minimum=1, maximum=(1 << 64) - 1)  # WELCOME's u64
        if not all(isinstance(spec, KVSpec) for spec in self.specs):
            raise UsageError("specs must be KVSpec objects")
        if not all(isinstance(name, str) for name in self.codecs):
            raise UsageError("codecs must be a list of codec names")
        if self.window < self.max_frame_size:
            raise UsageError("window must be at least max_frame_size (one frame must fit)")

    def receiver_config(self, *, secret: bytes, registry: bool) -> ReceiverConfig:
        """The server core's config; codecs checked against the registered ones."""
        codecs = self.codecs or tuple(available_codecs())
        for name in codecs:
            if name not in available_codecs():
                raise UsageError(f"unknown codec {shown(name)}")
        shared = {f.name: getattr(self, f.name) for f in fields(ReceiverConfig) if hasattr(self, f.name)}
        shared.update(secret=_check_secret(secret), codecs=tuple(codecs), registry=registry,
                      fingerprints=frozenset(s.fingerprint for s in self.specs))
        return ReceiverConfig(**shared)


def make_server_options(spec: KVSpec | Sequence[KVSpec] | None = None, **options: Any) -> ServerOptions:
    """:class:`ServerOptions` from ``serve()``'s ``spec=`` and keywords."""
    specs: tuple[KVSpec, ...]
    if "specs" in options:
        raise UsageError("the layouts a server accepts are serve()'s spec=: a KVSpec or a list of them (not specs=)")
    if spec is None:
        specs = ()
    elif isinstance(spec, KVSpec):
        specs = (spec,)
    else:
        specs = tuple(spec)
    if "codecs" in options:
        if isinstance(options["codecs"], str | bytes):
            raise UsageError(f"codecs must be a list of codec names, not one string: {shown(options['codecs'])}")
        options["codecs"] = tuple(options["codecs"])
    unknown = set(options) - {f.name for f in fields(ServerOptions)}
    if unknown:
        raise UsageError(f"unknown serve option(s): {', '.join(sorted(unknown))}")
    return ServerOptions(specs=specs, **options)


@dataclass(frozen=True, slots=True, kw_only=True)
class Receipt:
    """What one completed ``send()`` did.  Every chunk was acknowledged by the receiver."""

    request_id: str
    transfer_id: int
    codec: str
    kv_bytes: int
    """Bytes of the cache at its spec dtype."""
    wire_bytes: int
    """Bytes of CHUNK frames put on the wire (headers, params and CRCs included)."""
    chunks: int
    """CHUNK frames put on the wire: a chunk sent again after its stream broke counts each
    time, as its bytes do in ``wire_bytes``.  ``extra["chunks_by_codec"]`` counts the
    cache's chunks by codec, each once (so its sum is below ``chunks`` after a resume)."""
    seconds: float
    """From ``send()`` until the last acknowledgement."""
    time_to_first_layer: float | None = None
    """Seconds from ``send()`` until every chunk of the first layer (layer 0 of the spec)
    was acknowledged; later layers may complete before it over several streams."""
    estimated_gbps: float | None = None
    """The session's bandwidth estimate (from acknowledgements) when the send completed."""
    rtt_ms: float | None = None
    """The session's minimum RTT estimate when the send completed."""
    extra: dict[str, Any] = field(default_factory=dict)
    """``chunks_by_codec``: the chunks of the cache each codec encoded (each chunk once,
    re-sends not counted)."""

    @property
    def goodput_gbps(self) -> float:
        """KV bytes (``kv_bytes``, at the spec's dtype) per second of ``seconds``, in
        Gbit/s; the wire's rate is ``wire_bytes`` over ``seconds``."""
        return self.kv_bytes * 8 / self.seconds / 1e9 if self.seconds > 0 else 0.0


__all__ = ["NOTSENT_LOWAT", "ClientOptions", "Receipt", "ServerOptions", "check_number", "check_port", "make_server_options"]
