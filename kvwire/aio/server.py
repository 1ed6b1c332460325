"""The receiving side: ``kvwire.serve()``, sessions of striped streams, incoming transfers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import ssl as _ssl
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import numpy as np

from kvwire.aio import _gpu
from kvwire.aio._checks import check_number
from kvwire.aio._pool import default_pool
from kvwire.aio._stream import NOTSENT_LOWAT, StreamProtocol, finish_tasks, wait_closed
from kvwire.codec import RawCodec, TensorKind, available_codecs, codec_by_id, numpy_dtype
from kvwire.consistency.blocks import block_from_key
from kvwire.errors import (
    AuthenticationError,
    ConnectionLostError,
    ErrorCode,
    KvwireError,
    LimitExceededError,
    ProtocolError,
    RegistryUnavailableError,
    StaleVersionError,
    TransferAbortedError,
    TransferTimeoutError,
    UsageError,
    error_from_code,
)
from kvwire.session.receiver import MAX_BLOCK_VERSION, admit_begin, check_chunk_size, wire_text
from kvwire.spec import KVCache, KVSpec, Layer
from kvwire.wire import (
    Begin,
    ChunkReceived,
    ClientAuthenticated,
    Connection,
    ConnectionClosed,
    ConnectionConfig,
    Event,
    HandshakeComplete,
    IncomingTransfer,
    Role,
    TransferBegun,
    TransferReset,
)
from kvwire.wire.connection import NO_FINGERPRINT, NO_SESSION
from kvwire.wire.frames import MAX_MAX_FRAME_SIZE, MIN_MAX_FRAME_SIZE, Chunk, ChunkAddress
from kvwire.wire.transfer import ChunkVerdict

RAW_CODEC_ID = RawCodec.codec_id
_log = logging.getLogger("kvwire")
# Error text in a RESET is short and never the peer's text in full (WIRE_TEXT_LIMIT).
_wire_text = wire_text


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerOptions:
    """Limits and defaults of a server.  Every bound is enforced before allocating."""

    max_frame_size: int = 4 * 1024 * 1024 + 64 * 1024
    """Largest frame body accepted (a CHUNK body is 26 bytes + params + payload)."""
    window: int = 32 * 1024 * 1024
    """Connection credit: CHUNK bytes a client may have unacknowledged on one stream."""
    max_transfers: int = 64
    """Transfers in progress per session (more are refused with LIMIT_EXCEEDED)."""
    transfer_buffer_bytes: int = 256 * 1024 * 1024
    """Bytes of received layers buffered per transfer before the application takes
    them (at least one layer is always granted, so a transfer can always progress)."""
    max_tokens: int = 256 * 1024
    """Largest token count per layer accepted (bounds one layer's allocation)."""
    max_sessions: int = 256
    """Concurrent client sessions (peers)."""
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
    completed ones the application has not taken yet.  A transfer that would go beyond
    it fails with LIMIT_EXCEEDED."""
    claim_timeout: float | None = 60.0
    """Seconds an arrived transfer waits for ``accept()``/``expect()`` to claim it; then
    it is dropped (aborted if still arriving).  None: kept until the server closes."""
    max_meta_bytes: int = 64 * 1024
    """Largest ``meta`` (JSON object) a transfer may carry."""

    def __post_init__(self) -> None:
        for name in ("max_transfers", "transfer_buffer_bytes", "max_tokens", "max_sessions",
                     "max_streams", "handshake_timeout", "max_layer_bytes", "max_chunk_bytes",
                     "max_buffer_bytes"):
            check_number(self, name)
        for name in ("idle_timeout", "transfer_timeout", "claim_timeout"):
            check_number(self, name, none_ok=True)
        check_number(self, "resume_timeout", zero_ok=True)
        check_number(self, "max_meta_bytes", zero_ok=True)
        if not MIN_MAX_FRAME_SIZE <= self.max_frame_size <= MAX_MAX_FRAME_SIZE:
            raise UsageError(f"max_frame_size must be in [{MIN_MAX_FRAME_SIZE}, {MAX_MAX_FRAME_SIZE}]")
        if self.window < self.max_frame_size:
            raise UsageError("window must be at least max_frame_size (one frame must fit)")


class Transfer:
    """One incoming KV cache: its metadata, its layers as they complete, or all of it.

    Iterate (``async for layer in transfer``) to receive :class:`~kvwire.Layer` objects
    in completion order, or ``await transfer.collect()`` for the whole cache; not both.
    """

    def __init__(self, session: _Session, begin: Begin, spec: KVSpec, meta: dict[str, Any], opts: ServerOptions) -> None:
        self._session = session
        self.transfer_id = begin.transfer_id
        self.request_id = begin.request_id
        self.spec = spec
        self.meta = meta
        self.blocks = _decode_blocks(begin)
        # With a registry: resolved once the blocks are published at completion; the
        # last layer is held back until then, so a stale cache never completes.
        self.final_check: asyncio.Future[None] | None = None
        self._buffer_bytes = opts.transfer_buffer_bytes
        self._codecs = frozenset(session.server.codecs)
        self._gpu = _gpu.GpuReceiver(opts.device) if opts.device != "cpu" else None
        # Raw payloads being received straight into their layer, by chunk address.
        self._inplace: dict[ChunkAddress, _Reservation] = {}
        # One layer until the first chunk tells the layer size; then as many as the
        # buffer budget holds (see on_chunk).
        self._window = 1
        self.state = IncomingTransfer(
            begin.transfer_id, spec.num_layers, layer_limit=1, max_tokens=opts.max_tokens,
        )
        self._dtype = numpy_dtype(spec.dtype)
        self._arrays: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        # The caller's memory layers go to (Server.expect(into=...)); layers begun before
        # it was named stay in _arrays and are copied there when complete.
        self._into: Any = None
        self._ready: deque[int] = deque()
        self._changed = asyncio.Event()
        self._error: KvwireError | None = None
        self._yielded = 0
        self._consumer: str | None = None
        self.wire_bytes = 0
        self.deadline: asyncio.TimerHandle | None = None
        self._accepted = False
        self._opts = opts
        self._held = 0  # bytes of layer arrays counted in the server's buffer budget
        self.claimed = False  # handed to the application by accept()/expect()
        self.claim_timer: asyncio.TimerHandle | None = None
        self.started = asyncio.get_event_loop().time()
        self.finished: float | None = None

    # -- application side ---------------------------------------------------------------

    def __aiter__(self) -> AsyncIterator[Layer]:
        self._claim("iterate")
        return self._layers()

    async def collect(self, *, timeout: float | None = None, device: str | None = None) -> KVCache:
        """Wait for every layer; return them as a :class:`~kvwire.KVCache` in layer order.

        ``device`` ("cpu", "gpu" or "gpu:N") states where the arrays must be; it must match
        the server's ``device`` option (layers are decoded where they will be used).
        """
        if device is not None and (device == "cpu") != (self._gpu is None):
            raise UsageError(f"this server decodes on {'gpu' if self._gpu else 'cpu'}; serve(device={device!r}) to change it")
        self._claim("collect")
        got: dict[int, tuple[Any, Any]] = {}

        async def run() -> None:
            async for layer in self._layers():
                got[layer.index] = (layer.k, layer.v)

        try:
            await asyncio.wait_for(run(), timeout)
        except KvwireError:
            raise
        except TimeoutError:
            raise TransferTimeoutError(f"transfer {self.request_id!r} not complete in {timeout} s") from None
        return KVCache(self.spec, [got[i] for i in range(self.spec.num_layers)])

    @property
    def complete(self) -> bool:
        return self.state.complete

    def attach(self, into: Any) -> None:
        """Receive the layers not yet begun straight into ``into`` (for instance a
        :class:`kvwire.paged.PagedDestination`); ones already begun are copied there.

        ``into`` provides ``check(spec, layer_tokens)``, ``view(...)``, ``write(...)`` and
        ``layer(index)``.  Its memory is the caller's, so every layer is granted at once.
        """
        if self._gpu:
            raise UsageError("into= needs a server with device='cpu'")
        try:
            into.check(self.spec, self.state.layer_tokens)
        except KvwireError as exc:
            self.fail(exc)
            self._session.bury(self, exc)
            stream = self._session.any_stream()
            if stream is not None:
                stream.conn.send_reset(self.transfer_id, exc.code, _wire_text(str(exc)))
                stream.flush()
            raise
        self._into = into
        self._session.grant(self, self.spec.num_layers)

    def _claim(self, how: str) -> None:
        if self._consumer is not None:
            raise UsageError(f"transfer already consumed by {self._consumer}(); use one of iteration or collect()")
        self._consumer = how

    def abort(self, reason: str = "") -> None:
        """Give up on this transfer: its layers are dropped and the sender's ``send()``
        fails promptly with :class:`~kvwire.TransferAbortedError` (nothing happens if
        the transfer already failed).  Leaving ``async for`` early or a ``collect()``
        that times out aborts too."""
        if self._error is not None:
            return
        why = f"receiver aborted transfer {self.request_id!r}"
        err = TransferAbortedError(f"{why}: {reason}" if reason else why)
        self.fail(err, even_if_complete=True)
        server = self._session.server
        server.count("transfers_aborted")
        _log.info("transfer %r aborted by the application: %s", self.request_id, reason or "no reason given")
        self._session.bury(self, err)
        stream = self._session.any_stream()
        if stream is not None:
            stream.conn.send_reset(self.transfer_id, err.code, _wire_text(str(err)))
            stream.flush()

    async def _layers(self) -> AsyncIterator[Layer]:
        try:
            async for layer in self._layers_in_order():
                yield layer
        finally:
            if self._yielded < self.spec.num_layers and self._error is None:
                self.abort("the application stopped taking layers")

    async def _layers_in_order(self) -> AsyncIterator[Layer]:
        while self._yielded < self.spec.num_layers:
            if self._ready:
                if self._yielded == self.spec.num_layers - 1 and self.final_check is not None:
                    if not self.final_check.done():
                        self._changed.clear()
                        await self._changed.wait()
                        continue
                    self.final_check.result()  # raises StaleVersionError / RegistryUnavailableError
                index = self._ready.popleft()
                if index in self._arrays:
                    k, v = self._arrays.pop(index)
                    self._release(2 * k.nbytes)
                    if self._into is not None:
                        for kind, part in enumerate((k, v)):
                            self._into.write(index, kind, 0, part, int(part.shape[0]))
                        k, v = self._into.layer(index)
                else:
                    k, v = self._into.layer(index)
                self._yielded += 1
                self._session.grant(self, self._yielded + self._window)
                yield Layer(index, k, v)
                continue
            if self._error is not None:
                raise self._error
            self._changed.clear()
            await self._changed.wait()

    # -- network side ---------------------------------------------------------------------

    def _check(self, chunk: Chunk) -> Any:
        """Raise unless ``chunk`` may belong to this transfer; returns its codec."""
        if not self._accepted:
            raise ProtocolError("CHUNK before the transfer was accepted")
        st = self.state
        first = st.layer_tokens is None
        st.check(chunk)
        check_chunk_size(
            chunk, self.spec.num_kv_heads * self.spec.head_dim * self.spec.itemsize,
            max_chunk_bytes=self._opts.max_chunk_bytes, max_layer_bytes=self._opts.max_layer_bytes,
        )
        codec = codec_by_id(chunk.codec_id)
        if codec.name not in self._codecs:
            raise error_from_code(ErrorCode.UNSUPPORTED_CODEC, f"codec {codec.name!r} is not accepted here")
        if first and self._into is not None:
            self._into.check(self.spec, chunk.layer_tokens)
        if first:
            layer_bytes = 2 * chunk.layer_tokens * self.spec.num_kv_heads * self.spec.head_dim * self.spec.itemsize
            self._window = max(1, self._buffer_bytes // max(1, layer_bytes))
            self._session.grant(self, self._yielded + self._window)
        return codec

    def _out(self, chunk: Chunk) -> Any:
        """The slice of the layer's K or V array this chunk fills (allocated on first use)."""
        if self._into is not None and chunk.layer not in self._arrays:
            out = self._into.view(chunk.layer, chunk.kind, chunk.token_start, chunk.token_count, chunk.layer_tokens)
            if out is None:  # not one contiguous region there: decode, then scatter
                out = np.empty((chunk.token_count, self.spec.num_kv_heads, self.spec.head_dim), self._dtype)
            return out
        arrays = self._arrays.get(chunk.layer)
        if arrays is None:
            shape = (chunk.layer_tokens, self.spec.num_kv_heads, self.spec.head_dim)
            nbytes = 2 * chunk.layer_tokens * self.spec.num_kv_heads * self.spec.head_dim * self.spec.itemsize
            self._session.server.reserve_bytes(nbytes)  # LimitExceededError past the budget
            self._held += nbytes
            if self._gpu is not None:
                arrays = (self._gpu.empty(shape, self.spec.dtype), self._gpu.empty(shape, self.spec.dtype))
            else:
                pool = default_pool()  # reused, pre-faulted memory: no page faults per transfer
                arrays = (pool.empty(shape, self._dtype), pool.empty(shape, self._dtype))
            self._arrays[chunk.layer] = arrays
        return arrays[chunk.kind][chunk.token_start : chunk.token_start + chunk.token_count]

    def _decode_on_gpu(self, codec: Any, chunk: Chunk, out: Any) -> None:
        assert self._gpu is not None
        self._gpu.decode(codec, chunk.params, chunk.payload, out, self.spec.dtype, TensorKind(chunk.kind))

    def sink(self, head: Chunk, size: int, stream: StreamProtocol) -> memoryview | None:
        """Where a raw chunk's payload can be received directly: its place in the layer.

        The header has not passed its CRC yet, so nothing here may change the transfer's
        state, and the region must hold no verified bytes and not be arriving on another
        stream: a corrupted copy can then only spoil bytes no one has accepted yet.
        """
        st = self.state
        if (
            self._gpu or head.codec_id != RAW_CODEC_ID or head.params or self._error is not None
            or not self._accepted or st.layer_tokens is None or head.layer_tokens != st.layer_tokens
            or head.layer >= min(st.layer_limit, st.num_layers) or head.token_count == 0
            or head.token_start + head.token_count > head.layer_tokens
        ):
            return None
        end = head.token_start + head.token_count
        if st.overlaps_received(head.layer, head.kind, head.token_start, head.token_count):
            return None
        for r in self._inplace.values():
            if r.layer == head.layer and r.kind == head.kind and r.start < end and head.token_start < r.end:
                return None
        if self._into is not None and head.layer not in self._arrays:
            out = self._into.view(head.layer, head.kind, head.token_start, head.token_count, head.layer_tokens)
            if out is None:
                return None
        else:
            try:
                out = self._out(head)
            except (KvwireError, MemoryError):
                return None  # on_chunk meets the same failure and fails the transfer
        if out.nbytes != size:
            return None
        view = memoryview(out.reshape(-1).view(np.uint8))
        self._inplace[head.address] = _Reservation(view, stream, head.layer, head.kind, head.token_start, end)
        return view

    def release(self, stream: StreamProtocol) -> None:
        """``stream`` is gone: its in-place reservations free their regions."""
        for address in [a for a, r in self._inplace.items() if r.stream is stream]:
            del self._inplace[address]

    def _evict_overlapping(self, chunk: Chunk) -> None:
        """A copy of these tokens is about to be stored: any other stream still reading
        into that region in place is switched to a private buffer first."""
        end = chunk.token_start + chunk.token_count
        for address, r in list(self._inplace.items()):
            if r.layer == chunk.layer and r.kind == chunk.kind and r.start < end and chunk.token_start < r.end:
                r.stream.conn.abandon_payload(r.view)
                del self._inplace[address]

    def on_chunk(self, ev: ChunkReceived) -> bool:
        """Verify and store a chunk; True when it was new.  Raises KvwireError to reset.

        A chunk counts as received only once its bytes are in place: a failure to
        allocate or decode leaves the transfer's bookkeeping as it was (a re-sent copy is
        not mistaken for a duplicate) and becomes a typed error, whatever raised it.
        """
        chunk = ev.chunk
        codec = self._check(chunk)
        res = self._inplace.get(chunk.address)
        inplace = res is not None and chunk.payload is res.view
        if inplace:
            del self._inplace[chunk.address]
        if self.state.classify(chunk) is ChunkVerdict.DUPLICATE:
            self.state.add(chunk)  # counted as a duplicate
            return False
        try:
            self._store(codec, chunk, inplace)
        except KvwireError:
            raise
        except MemoryError:
            raise LimitExceededError(f"out of memory storing a chunk of layer {chunk.layer}") from None
        except Exception as exc:  # a codec or allocator failing on peer-chosen input
            raise ProtocolError(
                f"chunk of layer {chunk.layer} could not be decoded ({type(exc).__name__})"
            ) from exc
        self.state.add(chunk)
        self.wire_bytes += ev.wire_size
        st = self.state
        if st.layer_complete(chunk.layer):
            self._ready.append(chunk.layer)
            if st.complete:
                self.finished = asyncio.get_event_loop().time()
                if self.deadline is not None:
                    self.deadline.cancel()
            self._changed.set()
        return True

    def _store(self, codec: Any, chunk: Chunk, inplace: bool) -> None:
        """Put a new chunk's data in its place (decoded)."""
        if self._gpu:
            self._decode_on_gpu(codec, chunk, self._out(chunk))
        elif not inplace:
            self._evict_overlapping(chunk)
            out = self._out(chunk)
            codec.decode(
                chunk.params, chunk.payload, shape=out.shape, dtype=self.spec.dtype,
                kind=TensorKind(chunk.kind), out=out,
            )
            if self._into is not None and chunk.layer not in self._arrays:
                self._into.write(chunk.layer, chunk.kind, chunk.token_start, out, chunk.layer_tokens)

    def _release(self, nbytes: int) -> None:
        nbytes = min(nbytes, self._held)
        self._held -= nbytes
        self._session.server.release_bytes(nbytes)

    def fail(self, error: KvwireError, *, even_if_complete: bool = False) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
        if self._error is None and (even_if_complete or not self.state.complete):
            self._error = error
            self._arrays.clear()  # never hand out a half-filled cache
            self._release(self._held)
            self._ready.clear()
            self._changed.set()
        if self.claim_timer is not None:
            self.claim_timer.cancel()
            self.claim_timer = None


@dataclass(slots=True)
class _Reservation:
    """A layer region a stream is reading a raw payload into, before its CRC is checked."""

    view: memoryview
    stream: StreamProtocol
    layer: int
    kind: int
    start: int
    end: int


class _Session:
    """The streams of one client session and the transfers they carry."""

    def __init__(self, server: Server, session_id: bytes) -> None:
        self.server = server
        self.session_id = session_id
        self.streams: dict[int, StreamProtocol] = {}
        self.transfers: dict[int, Transfer] = {}
        self.closed = False
        self.lose_timer: asyncio.TimerHandle | None = None
        # Why recent transfers failed: a chunk of one still arriving gets the RESET again
        # before its ACK on the same stream, so the sender never mistakes it for success.
        self.tombstones: OrderedDict[int, KvwireError] = OrderedDict()
        # Transfers that completed and were handed over: a late duplicate chunk of one (its
        # ack was lost with a broken stream) is acknowledged again, nothing more.
        self.completed: OrderedDict[int, None] = OrderedDict()

    def bury(self, transfer: Transfer, error: KvwireError) -> None:
        self.transfers.pop(transfer.transfer_id, None)
        self.tombstones[transfer.transfer_id] = error
        while len(self.tombstones) > 4096:
            self.tombstones.popitem(last=False)

    def repeat_reset(self, stream: StreamProtocol, transfer_id: int) -> bool:
        """Send again the RESET of a recently failed transfer; False if it did not fail."""
        error = self.tombstones.get(transfer_id)
        if error is None:
            return False
        stream.conn.send_reset(transfer_id, error.code, _wire_text(str(error)))
        return True

    def grant(self, transfer: Transfer, limit: int) -> None:
        limit = min(limit, transfer.spec.num_layers)
        if limit <= transfer.state.layer_limit or self.closed:
            return
        transfer.state.layer_limit = limit
        stream = self.any_stream()
        if stream is not None:
            stream.conn.send_credit_frame(transfer.transfer_id, limit)
            stream.flush()

    def any_stream(self) -> StreamProtocol | None:
        for s in self.streams.values():
            if s.is_open:
                return s
        return None

    def lose(self, error: KvwireError) -> None:
        """A stream broke: every unfinished transfer fails, the other streams close."""
        if self.closed:
            return
        self.closed = True
        if self.lose_timer is not None:
            self.lose_timer.cancel()
        for t in self.transfers.values():
            t.fail(error)
        for s in list(self.streams.values()):
            if s.transport is not None:
                s.abort(ErrorCode.SESSION_LOST, "another stream of this session was lost")
        self.server._sessions.pop(self.session_id, None)


class Server:
    """A running kvwire server; use through ``async with kvwire.serve(...)``."""

    def __init__(
        self, host: str, port: int, *, secret: bytes, ssl: _ssl.SSLContext | None,
        options: ServerOptions, registry: Any = None,
    ) -> None:
        if not isinstance(secret, bytes | bytearray) or len(secret) < 8:
            raise UsageError("secret must be bytes of at least 8 bytes")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise UsageError(f"port must be an int in [0, 65535], got {port!r}")
        self.host = host
        self._requested_port = port
        self._secret = bytes(secret)
        self._ssl = ssl
        self.options = options
        codecs = options.codecs or tuple(available_codecs())
        for name in codecs:
            if name not in available_codecs():
                raise UsageError(f"unknown codec {name!r}")
        self.codecs = tuple(codecs)
        _gpu.parse_device(options.device)  # UsageError for an unknown or unusable device
        self._fingerprints = {s.fingerprint for s in options.specs}
        self._server: asyncio.Server | None = None
        self._sessions: dict[bytes, _Session] = {}
        self._streams: set[StreamProtocol] = set()
        self._arrivals: OrderedDict[int, Transfer] = OrderedDict()
        self._accept_waiters: deque[asyncio.Future[Transfer]] = deque()
        self._expect_waiters: dict[str, deque[asyncio.Future[Transfer]]] = {}
        self._expect_into: dict[asyncio.Future[Transfer], Any] = {}
        self._arrival_seq = 0
        self.registry = registry
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0
        self.transfers_accepted = 0
        self.transfers_refused = 0
        self.buffered_bytes = 0  # layer arrays held (see ServerOptions.max_buffer_bytes)
        self.counters: dict[str, int] = {}

    def count(self, what: str) -> None:
        self.counters[what] = self.counters.get(what, 0) + 1

    def reserve_bytes(self, nbytes: int) -> None:
        """Count ``nbytes`` of layer arrays against the server-wide budget."""
        if self.buffered_bytes + nbytes > self.options.max_buffer_bytes:
            self.count("buffer_budget_refusals")
            raise LimitExceededError(
                f"the server holds {self.buffered_bytes} bytes of received layers; "
                f"{nbytes} more exceeds max_buffer_bytes={self.options.max_buffer_bytes}"
            )
        self.buffered_bytes += nbytes

    def release_bytes(self, nbytes: int) -> None:
        self.buffered_bytes -= nbytes

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(
                self._make_protocol, self.host, self._requested_port, ssl=self._ssl,
                ssl_handshake_timeout=self.options.handshake_timeout if self._ssl else None,
            )
        except OSError as exc:
            raise ConnectionLostError(f"cannot listen on {self.host}:{self._requested_port}: {exc}") from exc
        sock = self._server.sockets[0]
        self.port = int(sock.getsockname()[1])

    def _make_protocol(self) -> StreamProtocol:
        opts = self.options
        cfg = ConnectionConfig(
            secret=self._secret, codecs=self.codecs, max_frame_size=opts.max_frame_size,
            window=opts.window, max_transfers=opts.max_transfers,
            handshake_timeout=opts.handshake_timeout, idle_timeout=opts.idle_timeout,
        )
        loop = asyncio.get_event_loop()
        proto = StreamProtocol(
            Connection(Role.SERVER, cfg, now=loop.time()), self._on_event,
            notsent_lowat=opts.notsent_lowat, pause_reading_when_blocked=True,
        )
        proto.on_made = self._streams.add
        proto.conn.set_payload_sink(lambda head, size: self._sink(proto, head, size))
        return proto

    def _sink(self, stream: StreamProtocol, head: Chunk, size: int) -> memoryview | None:
        sess: _Session | None = stream.owner
        transfer = sess.transfers.get(head.transfer_id) if sess is not None else None
        return transfer.sink(head, size, stream) if transfer is not None else None

    # -- public API -------------------------------------------------------------------------

    async def accept(self, *, timeout: float | None = None) -> Transfer:
        """The next incoming transfer not claimed by :meth:`expect`."""
        if self._arrivals:
            _, t = self._arrivals.popitem(last=False)
            self._claimed(t)
            return t
        fut: asyncio.Future[Transfer] = asyncio.get_running_loop().create_future()
        self._accept_waiters.append(fut)
        return await self._wait(fut, timeout, "accept()")

    async def expect(self, request_id: str, *, timeout: float | None = None, into: Any = None) -> Transfer:
        """The transfer for ``request_id``, whether it arrived already or arrives later.

        ``into`` (e.g. a :class:`kvwire.paged.PagedDestination`) receives the layers into
        the caller's memory; see :meth:`Transfer.attach`.
        """
        if self._expect_waiters.get(request_id):
            raise UsageError(f"expect({request_id!r}) is already waiting for that request")
        for tid, t in self._arrivals.items():
            if t.request_id == request_id:
                del self._arrivals[tid]
                self._claimed(t)
                if into is not None:
                    t.attach(into)
                return t
        fut: asyncio.Future[Transfer] = asyncio.get_running_loop().create_future()
        self._expect_waiters.setdefault(request_id, deque()).append(fut)
        if into is not None:
            self._expect_into[fut] = into
        try:
            return await self._wait(fut, timeout, f"expect({request_id!r})")
        finally:
            self._expect_into.pop(fut, None)
            waiters = self._expect_waiters.get(request_id)
            if waiters is not None:
                if fut in waiters:
                    waiters.remove(fut)
                if not waiters:
                    del self._expect_waiters[request_id]

    @staticmethod
    async def _wait(fut: asyncio.Future[Transfer], timeout: float | None, what: str) -> Transfer:
        try:
            return await asyncio.wait_for(fut, timeout)
        except KvwireError:
            raise
        except TimeoutError:
            raise TransferTimeoutError(f"{what} timed out after {timeout} s") from None

    def statistics(self) -> dict[str, Any]:
        """A snapshot: sessions, connections, transfers, bytes held, and event counts
        (``authentication_failures``, ``resumes``, ``goaways_received``, aborts, ...)."""
        return {
            "sessions": len(self._sessions),
            "connections": len(self._streams),
            "transfers_accepted": self.transfers_accepted,
            "transfers_refused": self.transfers_refused,
            "pending_arrivals": len(self._arrivals),
            "buffered_bytes": self.buffered_bytes,
            **self.counters,
        }

    async def close(self) -> None:
        """Stop listening, close every connection and end every task and timer this server
        started (the one teardown path: after it returns nothing of it is pending)."""
        if self._server is not None:
            self._server.close()
        streams = list(self._streams)
        for s in streams:
            s.abort(ErrorCode.NO_ERROR, "server closing")
        for sess in list(self._sessions.values()):
            sess.lose(ConnectionLostError("server closed"))
        for t in list(self._arrivals.values()):
            self._claimed(t)  # only to cancel its claim timer: the server is going away
        for fut in list(self._accept_waiters):
            if not fut.done():
                fut.set_exception(ConnectionLostError("server closed"))
        for waiters in self._expect_waiters.values():
            for fut in waiters:
                if not fut.done():
                    fut.set_exception(ConnectionLostError("server closed"))
        await finish_tasks(self._tasks)
        await wait_closed(streams, 1.0)
        if self._server is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)

    async def __aenter__(self) -> Server:
        await self.start()
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    # -- events -------------------------------------------------------------------------------

    def _on_event(self, stream: StreamProtocol, ev: Event) -> None:
        if isinstance(ev, ChunkReceived):
            self._on_chunk(stream, ev)
        elif isinstance(ev, ClientAuthenticated):
            self._on_authenticated(stream, ev)
        elif isinstance(ev, HandshakeComplete):
            sess = self._sessions.get(ev.session_id)
            if sess is not None:
                sess.streams[ev.stream_index] = stream
                stream.owner = sess
                stream.index = ev.stream_index
                if sess.lose_timer is not None:
                    sess.lose_timer.cancel()
                    sess.lose_timer = None
                if sess.transfers or sess.tombstones or sess.completed:
                    self.count("resumes")
                    _log.info("kvwire: session %s resumed stream %d", sess.session_id.hex()[:8], ev.stream_index)
                # A reconnecting client may have lost CREDIT frames with its old stream.
                for t in sess.transfers.values():
                    if not t.complete and t._error is None and t.state.layer_limit > 1:
                        stream.conn.send_credit_frame(t.transfer_id, t.state.layer_limit)
        elif isinstance(ev, TransferBegun):
            self._on_begin(stream, ev.frame)
        elif isinstance(ev, TransferReset):
            sess = stream.owner
            if sess is not None:
                t = sess.transfers.get(ev.transfer_id)
                if t is not None:
                    err = ev.error()
                    t.fail(err)
                    self.count("transfers_aborted_by_peer")
                    _log.info("transfer %r reset by the client: %s", t.request_id, _wire_text(ev.message))
                    # The tombstone repeats the code, not the peer's text.
                    sess.bury(t, error_from_code(ev.code, "reset by the client"))
        elif isinstance(ev, ConnectionClosed):
            self._streams.discard(stream)
            self._log_close(stream, ev)
            sess = stream.owner
            if sess is None or sess.closed:
                return
            if sess.streams.get(stream.index) is stream:
                del sess.streams[stream.index]
            for t in sess.transfers.values():
                t.release(stream)
            unfinished = any(not t.complete for t in sess.transfers.values())
            # A break is resumable even when every transfer is complete here: the
            # client may still wait for acknowledgements that were lost with the stream.
            if ev.resumable and self.options.resume_timeout > 0:
                if not any(s.is_open for s in sess.streams.values()) and sess.lose_timer is None:
                    sess.lose_timer = asyncio.get_event_loop().call_later(
                        self.options.resume_timeout, sess.lose,
                        ConnectionLostError("the client did not reconnect in time"),
                    )
            elif ev.error is not None or unfinished:
                sess.lose(ev.error or ConnectionLostError("client connection closed mid-transfer"))
            elif not sess.streams:
                self._sessions.pop(sess.session_id, None)

    def _log_close(self, stream: StreamProtocol, ev: ConnectionClosed) -> None:
        peer = stream.transport.get_extra_info("peername") if stream.transport is not None else None
        if isinstance(ev.error, AuthenticationError):
            self.count("authentication_failures")
            _log.warning("kvwire: authentication failed for %s: %s", peer or "a client", ev.error)
        elif ev.goaway:
            self.count("goaways_received")
            _log.info("kvwire: GOAWAY from %s: code 0x%04x %s", peer or "a client", ev.code, ev.message[:160])

    def _on_authenticated(self, stream: StreamProtocol, ev: ClientAuthenticated) -> None:
        if ev.fingerprint != NO_FINGERPRINT and self._fingerprints and ev.fingerprint not in self._fingerprints:
            stream.conn.refuse(ErrorCode.INCOMPATIBLE_SPEC, "this server does not accept that KV layout")
            return
        if ev.session_id == NO_SESSION:
            if len(self._sessions) >= self.options.max_sessions:
                stream.conn.refuse(ErrorCode.LIMIT_EXCEEDED, "server has reached max_sessions")
                return
            sid = secrets.token_bytes(16)
            self._sessions[sid] = _Session(self, sid)
        else:
            sid = ev.session_id
            sess = self._sessions.get(sid)
            if sess is None or sess.closed:
                stream.conn.refuse(ErrorCode.UNKNOWN_SESSION, "no such session")
                return
            old = sess.streams.get(ev.stream_index)
            if old is not None:
                # The client reconnects a slot whose old connection we still think is up
                # (a half-open TCP connection): the new one replaces it.
                del sess.streams[ev.stream_index]
                for t in sess.transfers.values():
                    t.release(old)
                old.owner = None
                old.abort(ErrorCode.SESSION_LOST, "replaced by a reconnected stream")
            if len(sess.streams) >= self.options.max_streams:
                stream.conn.refuse(ErrorCode.LIMIT_EXCEEDED, "stream limit reached")
                return
        stream.conn.welcome(sid, self.codecs)

    def _on_begin(self, stream: StreamProtocol, begin: Begin) -> None:
        sess: _Session | None = stream.owner
        if sess is None:
            raise ProtocolError("BEGIN before the session was set up")
        tid = begin.transfer_id
        existing = sess.transfers.get(tid)
        if existing is not None and existing.request_id == begin.request_id:
            # The client re-sent BEGIN after a broken stream: answer again (unless the
            # registry check still runs; its outcome will be sent).
            if existing._accepted:
                stream.conn.send_accept(tid, existing.state.layer_limit)
            return
        if sess.repeat_reset(stream, tid):
            return
        try:
            if tid in sess.transfers:
                raise error_from_code(ErrorCode.DUPLICATE_TRANSFER, f"transfer id {tid} is already in use")
            # Completed transfers the application has not claimed hold memory too.
            active = sum(1 for t in sess.transfers.values() if not t.complete or not t.claimed)
            spec, meta = admit_begin(
                begin, active=active, max_transfers=self.options.max_transfers,
                max_meta_bytes=self.options.max_meta_bytes, fingerprints=self._fingerprints,
            )
        except KvwireError as exc:
            self.transfers_refused += 1
            stream.conn.send_reset(tid, exc.code, _wire_text(str(exc)))
            return
        transfer = Transfer(sess, begin, spec, meta, self.options)
        # Completed transfers the application has not taken stay until consumed; drop
        # the bookkeeping of ones it has.
        for old_id in [i for i, t in sess.transfers.items() if t._consumer is not None and t.complete]:
            del sess.transfers[old_id]
            sess.completed[old_id] = None
            while len(sess.completed) > 4096:
                sess.completed.popitem(last=False)
        sess.transfers[tid] = transfer
        if self.options.transfer_timeout is not None:
            transfer.deadline = asyncio.get_running_loop().call_later(
                self.options.transfer_timeout, self._expire, sess, transfer
            )
        if self.registry is not None and transfer.blocks:
            loop = asyncio.get_running_loop()
            transfer.final_check = loop.create_future()
            self._spawn(self._verify_and_accept(stream, sess, transfer))
            return
        self._accept(stream, transfer)

    def _expire(self, sess: _Session, transfer: Transfer) -> None:
        if transfer.complete or transfer._error is not None:
            return
        err = TransferTimeoutError(
            f"transfer {transfer.request_id!r} not complete after {self.options.transfer_timeout} s"
        )
        transfer.fail(err)
        sess.bury(transfer, err)
        stream = sess.any_stream()
        if stream is not None:
            stream.conn.send_reset(transfer.transfer_id, err.code, _wire_text(str(err)))
            stream.flush()

    def _accept(self, stream: StreamProtocol, transfer: Transfer) -> None:
        transfer._accepted = True
        self.transfers_accepted += 1
        stream.conn.send_accept(transfer.transfer_id, transfer.state.layer_limit)
        stream.flush()
        self._deliver(transfer)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _verify_and_accept(self, stream: StreamProtocol, sess: _Session, transfer: Transfer) -> None:
        """Refuse a transfer unless the registry holds every one of its blocks fresh at the
        announced version, before any data moves (docs/consistency.md: ``check_many``).

        Fail closed: a version the registry never issued (it lost its data, or a peer made
        one up) is stale like an old one, so a peer can only announce, and the server
        only ever publishes, versions the registry already confirmed.
        """
        error: KvwireError | None
        made_up = [b for b, v in transfer.blocks if not 0 <= v < MAX_BLOCK_VERSION]
        if made_up:
            error = _stale(made_up)
        else:
            try:
                stale = await self.registry.check_many(transfer.blocks)
            except KvwireError as exc:
                error = RegistryUnavailableError(f"registry check failed: {exc}")
            else:
                error = _stale(stale) if stale else None
        if error is not None:
            self.transfers_refused += 1
            transfer.fail(error)
            sess.bury(transfer, error)
            stream.conn.send_reset(transfer.transfer_id, error.code, _wire_text(str(error)))
            stream.flush()
            # An expect() of this request learns it now rather than at its timeout: blocks
            # refused as stale do not become fresh, so this cache will never be handed out.
            for fut in self._expect_waiters.get(transfer.request_id, ()):
                if not fut.done():
                    fut.set_exception(error)
            return
        self._accept(stream, transfer)

    async def _publish_and_ack(self, stream: StreamProtocol, transfer: Transfer, address: ChunkAddress) -> None:
        """Publish a completed transfer's blocks, then release the last acknowledgement.

        The sender completes only on that ack, and a RESET sent first on the same stream
        fails it instead; either way both sides agree on the outcome.
        """
        assert transfer.final_check is not None
        try:
            rejected = await self.registry.publish(transfer.blocks)
            error: KvwireError | None = _stale(rejected) if rejected else None
        except KvwireError as exc:
            error = RegistryUnavailableError(f"registry publish failed: {exc}")
        if error is None:
            transfer.final_check.set_result(None)
        else:
            transfer.final_check.set_exception(error)
            transfer.final_check.exception()
            transfer.fail(error, even_if_complete=True)
            if transfer._session is not None:
                transfer._session.bury(transfer, error)
            stream.conn.send_reset(transfer.transfer_id, error.code, _wire_text(str(error)))
        transfer._changed.set()
        stream.conn.send_ack(address)
        stream.flush()

    def _deliver(self, transfer: Transfer) -> None:
        waiters = self._expect_waiters.get(transfer.request_id)
        while waiters:
            fut = waiters.popleft()
            if not fut.done():
                into = self._expect_into.pop(fut, None)
                if into is not None:
                    try:
                        transfer.attach(into)
                    except KvwireError as exc:
                        fut.set_exception(exc)
                        return
                self._claimed(transfer)
                fut.set_result(transfer)
                return
        while self._accept_waiters:
            fut = self._accept_waiters.popleft()
            if not fut.done():
                self._claimed(transfer)
                fut.set_result(transfer)
                return
        self._arrival_seq += 1
        self._arrivals[self._arrival_seq] = transfer
        if self.options.claim_timeout is not None:
            transfer.claim_timer = asyncio.get_running_loop().call_later(
                self.options.claim_timeout, self._unclaimed, self._arrival_seq
            )

    @staticmethod
    def _claimed(transfer: Transfer) -> None:
        transfer.claimed = True
        if transfer.claim_timer is not None:
            transfer.claim_timer.cancel()
            transfer.claim_timer = None

    def _unclaimed(self, seq: int) -> None:
        """No accept()/expect() took this transfer in time: drop it and its memory."""
        transfer = self._arrivals.pop(seq, None)
        if transfer is None:
            return
        transfer.claim_timer = None
        self.count("transfers_unclaimed")
        _log.info("transfer %r dropped: not claimed within %s s", transfer.request_id, self.options.claim_timeout)
        transfer.abort(f"not claimed by the application within {self.options.claim_timeout} s")

    def _on_chunk(self, stream: StreamProtocol, ev: ChunkReceived) -> None:
        sess: _Session | None = stream.owner
        addr = ev.chunk.address
        if sess is None:
            stream.conn.send_ack(addr)
            return
        transfer = sess.transfers.get(addr.transfer_id)
        if transfer is not None and transfer._error is None:
            try:
                new = transfer.on_chunk(ev)
            except KvwireError as exc:
                transfer.fail(exc)
                sess.bury(transfer, exc)
            else:
                if transfer.complete and transfer.final_check is not None:
                    # The last ack waits for the registry's verdict (a re-sent copy too).
                    if new:
                        self._spawn(self._publish_and_ack(stream, transfer, addr))
                    else:
                        self._spawn(self._ack_after_final(stream, transfer, addr))
                    return
        if sess.repeat_reset(stream, addr.transfer_id):
            pass
        elif transfer is None and addr.transfer_id not in sess.completed:
            # Never begun (or long forgotten): the data was not stored, so say so first.
            stream.conn.send_reset(addr.transfer_id, ErrorCode.PROTOCOL_ERROR, "no such transfer")
        # Chunks of failed transfers are acknowledged too, after the RESET on the same
        # stream: the ack returns the connection credit, the RESET the outcome.
        stream.conn.send_ack(addr)

    async def _ack_after_final(self, stream: StreamProtocol, transfer: Transfer, address: ChunkAddress) -> None:
        assert transfer.final_check is not None
        try:
            await asyncio.shield(transfer.final_check)
        except KvwireError as exc:
            stream.conn.send_reset(transfer.transfer_id, exc.code, _wire_text(str(exc)))
        stream.conn.send_ack(address)
        stream.flush()


def _decode_blocks(begin: Begin) -> list[tuple[Any, int]]:
    try:
        return [(block_from_key(bv.block.decode("utf-8")), bv.version) for bv in begin.blocks]
    except (UnicodeDecodeError, UsageError):
        raise ProtocolError("BEGIN carries a malformed block id") from None


def _stale(blocks: Sequence[Any]) -> StaleVersionError:
    shown = ", ".join(repr(b) for b in list(blocks)[:8])
    more = f" and {len(blocks) - 8} more" if len(blocks) > 8 else ""
    return StaleVersionError(f"stale prefix blocks: {shown}{more}")


async def _open_server(host: str, port: int, *, secret: bytes, ssl: _ssl.SSLContext | None, options: ServerOptions) -> Server:
    server = Server(host, port, secret=secret, ssl=ssl, options=options)
    await server.start()
    return server


def make_server_options(spec: KVSpec | Sequence[KVSpec] | None = None, **options: Any) -> ServerOptions:
    specs: tuple[KVSpec, ...]
    if spec is None:
        specs = ()
    elif isinstance(spec, KVSpec):
        specs = (spec,)
    else:
        specs = tuple(spec)
    if "codecs" in options:
        options["codecs"] = tuple(options["codecs"])
    try:
        return ServerOptions(specs=specs, **options)
    except TypeError as exc:
        raise UsageError(f"unknown server option: {exc}") from None


__all__ = ["Server", "ServerOptions", "Transfer"]
