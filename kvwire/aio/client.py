"""The sending side: ``kvwire.connect()`` and ``peer.send()`` over striped streams."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import ssl as _ssl
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import numpy as np

from kvwire.aio._arrays import as_device_array, as_host_array, is_device_array, iterate_layers
from kvwire.aio._checks import check_number
from kvwire.aio._codec_speed import codec_speeds
from kvwire.aio._stream import NOTSENT_LOWAT, StreamProtocol, finish_tasks, wait_closed
from kvwire.aio.tcpinfo import read_tcp_info
from kvwire.codec import TensorKind, available_codecs, get_codec, numpy_dtype
from kvwire.consistency.blocks import block_key
from kvwire.control import (
    CodecCandidate,
    CodecChooser,
    DeliveryRateEstimator,
    InflightController,
    StreamController,
    StreamSample,
    window_limited_from_counters,
)
from kvwire.errors import (
    AuthenticationError,
    ConnectionLostError,
    ErrorCode,
    IncompatiblePeerError,
    KvwireError,
    ProtocolError,
    TransferAbortedError,
    TransferTimeoutError,
    UsageError,
)
from kvwire.options import Layers
from kvwire.spec import KVSpec
from kvwire.wire import (
    Begin,
    BlockVersion,
    Chunk,
    ChunkAcked,
    Connection,
    ConnectionClosed,
    ConnectionConfig,
    CreditGranted,
    Event,
    HandshakeComplete,
    OutgoingTransfer,
    Role,
    SentChunk,
    TransferAccepted,
    TransferReset,
    chunk_frame_size,
    plan_chunks,
)
from kvwire.wire.connection import NO_FINGERPRINT, NO_SESSION
from kvwire.wire.frames import MAX_MAX_FRAME_SIZE, MIN_MAX_FRAME_SIZE, encode_body

_log = logging.getLogger("kvwire")


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientOptions:
    """Settings of a client session."""

    chunk_bytes: int = 1 << 20
    """Target size of one chunk of K or V before encoding."""
    max_frame_size: int = 4 * 1024 * 1024 + 64 * 1024
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
    """Broken streams one transfer lives through; one more fails it with ConnectionLostError."""

    def __post_init__(self) -> None:
        for name in ("chunk_bytes", "connect_timeout", "max_streams"):
            check_number(self, name)
        check_number(self, "idle_timeout", none_ok=True)
        for name in ("reconnect_attempts", "reconnect_backoff", "max_reconnects", "max_transfer_reconnects"):
            check_number(self, name, zero_ok=True)
        if not MIN_MAX_FRAME_SIZE <= self.max_frame_size <= MAX_MAX_FRAME_SIZE:
            raise UsageError(f"max_frame_size must be in [{MIN_MAX_FRAME_SIZE}, {MAX_MAX_FRAME_SIZE}]")


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
    seconds: float
    """From ``send()`` until the last acknowledgement."""
    time_to_first_layer: float | None = None
    """Seconds from ``send()`` until every chunk of the first layer was acknowledged."""
    estimated_gbps: float | None = None
    """The session's bandwidth estimate (from acknowledgements) when the send completed."""
    rtt_ms: float | None = None
    """The session's minimum RTT estimate when the send completed."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def goodput_gbps(self) -> float:
        return self.kv_bytes * 8 / self.seconds / 1e9 if self.seconds > 0 else 0.0


#: Measurement clock (uvloop's loop clock ticks in whole milliseconds).
_clock = time.perf_counter

AUTO = "auto"
#: Codecs ``auto`` chooses among, most precise first.
AUTO_CANDIDATES = ("raw", "fp8", "int8", "int4")


class _Outgoing:
    """Sender-side state of one transfer inside a peer."""

    def __init__(self, transfer_id: int, num_layers: int, loop: asyncio.AbstractEventLoop) -> None:
        self.state = OutgoingTransfer(transfer_id, num_layers)
        self.accepted: asyncio.Future[None] = loop.create_future()
        self.done: asyncio.Future[None] = loop.create_future()
        self.credit = asyncio.Event()
        self.failed = asyncio.Event()
        self.reconnects = 0  # broken streams this transfer lived through
        self.layer_acked: dict[int, int] = {}  # layer -> chunks not yet acked
        self.first_layer_at: float | None = None
        self.error: KvwireError | None = None
        self.begin: Begin | None = None

    def fail(self, error: KvwireError) -> None:
        if self.error is None:
            self.error = error
        for fut in (self.accepted, self.done):
            if not fut.done():
                fut.set_exception(error)
                fut.exception()  # retrieved: a failure nobody awaits is not "never retrieved"
        self.credit.set()
        self.failed.set()


class Peer:
    """A client session of one or more TCP streams to one server; see :func:`kvwire.connect`."""

    def __init__(
        self, host: str, port: int, *, secret: bytes, streams: int | str, codec: str,
        ssl: _ssl.SSLContext | None, options: ClientOptions, server_hostname: str | None = None,
    ) -> None:
        if not isinstance(secret, bytes | bytearray) or len(secret) < 8:
            raise UsageError("secret must be bytes of at least 8 bytes")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port <= 65535:
            raise UsageError(f"port must be an int in [1, 65535], got {port!r}")
        self.stream_controller: StreamController | None = None
        if streams == AUTO:
            streams = options.max_streams
            self.stream_controller = StreamController(max_streams=streams)
        if isinstance(streams, bool) or not isinstance(streams, int) or not 1 <= streams <= 64:
            raise UsageError("streams must be an int in [1, 64] or 'auto'")
        if codec != AUTO:
            get_codec(codec)  # unknown names fail here, before any connection
        self.host = host
        self.port = port
        self._secret = bytes(secret)
        self._nstreams = streams
        self.codec = codec
        self._ssl = ssl
        self._server_hostname = server_hostname
        self.options = options
        self.streams: list[StreamProtocol] = []
        self.session_id = NO_SESSION
        self.server_codecs: tuple[str, ...] = ()
        self.max_transfers = 0
        self._transfers: dict[int, _Outgoing] = {}
        self._ids = itertools.count(1)
        self._capacity = asyncio.Event()
        self._handshakes: dict[StreamProtocol, asyncio.Future[HandshakeComplete]] = {}
        self._broken: KvwireError | None = None
        self._closed = False
        self.bytes_sent = 0
        self.estimator = DeliveryRateEstimator()
        # Bytes in flight kept near one to two bandwidth-delay products across streams.
        self.inflight = InflightController(streams=self._nstreams, chunk_bytes=options.chunk_bytes)
        self.chooser: CodecChooser | None = None
        self._reconnecting: set[int] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.reconnects = 0
        self.resumes = 0
        self.chunks_resent = 0
        self.counters: dict[str, int] = {}
        self._waiting_senders = 0

    # -- connection setup ---------------------------------------------------------------

    async def open(self) -> None:
        try:
            first = await self._open_stream(0, NO_SESSION)
            self.session_id = first.session_id
            self.server_codecs = first.peer_codecs
            self.max_transfers = first.max_transfers
            if self.codec == AUTO:
                self.chooser = self._make_chooser()
            elif self.codec not in self.server_codecs:
                raise IncompatiblePeerError(
                    f"server does not accept codec {self.codec!r} (it accepts {', '.join(self.server_codecs)})",
                    code=ErrorCode.UNSUPPORTED_CODEC,
                )
            if self._nstreams > 1:
                await asyncio.gather(
                    *(self._open_stream(i, self.session_id) for i in range(1, self._nstreams))
                )
        except BaseException:
            await self.close()
            raise

    async def _open_stream(self, index: int, session_id: bytes) -> HandshakeComplete:
        loop = asyncio.get_running_loop()
        opts = self.options
        cfg = ConnectionConfig(
            secret=self._secret, codecs=tuple(available_codecs()), max_frame_size=opts.max_frame_size,
            fingerprint=opts.spec.fingerprint if opts.spec is not None else NO_FINGERPRINT,
            session_id=session_id, stream_index=index, handshake_timeout=opts.connect_timeout,
            idle_timeout=opts.idle_timeout,
        )
        conn = Connection(Role.CLIENT, cfg, now=loop.time())
        conn.initiate()
        proto = StreamProtocol(conn, self._on_event, notsent_lowat=opts.notsent_lowat)
        proto.owner = self
        proto.index = index
        fut: asyncio.Future[HandshakeComplete] = loop.create_future()
        self._handshakes[proto] = fut
        if index < len(self.streams):
            self.streams[index] = proto
        else:
            self.streams.append(proto)
        try:
            await asyncio.wait_for(
                loop.create_connection(
                    lambda: proto, self.host, self.port, ssl=self._ssl,
                    server_hostname=self._server_hostname if self._ssl else None,
                    ssl_handshake_timeout=opts.connect_timeout if self._ssl else None,
                ),
                opts.connect_timeout,
            )
            hs = await asyncio.wait_for(fut, opts.connect_timeout)
            if session_id != NO_SESSION and hs.session_id != session_id:
                proto.abort(ErrorCode.PROTOCOL_ERROR, "joined the wrong session")
                raise ProtocolError("the server put this stream in another session")
            return hs
        except KvwireError:
            raise  # the handshake's own verdict (refused, timed out, lost)
        except TimeoutError:
            proto.abort(ErrorCode.TIMEOUT, "handshake timed out")
            raise TransferTimeoutError(f"connecting to {self.host}:{self.port} timed out") from None
        except _ssl.SSLCertVerificationError as exc:
            raise AuthenticationError(f"TLS certificate verification failed: {exc}") from exc
        except _ssl.SSLError as exc:
            raise ConnectionLostError(f"TLS handshake with {self.host}:{self.port} failed: {exc}") from exc
        except OSError as exc:
            raise ConnectionLostError(f"cannot connect to {self.host}:{self.port}: {exc}") from exc
        finally:
            self._handshakes.pop(proto, None)

    # -- public API ----------------------------------------------------------------------

    async def send(
        self,
        request_id: str,
        spec: KVSpec,
        layers: Layers,
        *,
        meta: dict[str, Any] | None = None,
        codec: str | None = None,
        timeout: float | None = None,
        blocks: Sequence[tuple[Any, int]] | None = None,
        deadline: float | None = None,
    ) -> Receipt:
        """Send one KV cache; return when the receiver has acknowledged every chunk.

        ``layers`` is a sequence, iterable or async iterable of ``(k, v)`` arrays shaped
        ``[tokens, num_kv_heads, head_dim]`` of ``spec.dtype``; each layer is sent as soon
        as it is produced.  Arrays must not be modified until ``send()`` returns.

        ``codec`` overrides the session's codec for this transfer; ``"auto"`` picks one per
        chunk from the live bandwidth estimate and each codec's measured encode speed, and
        with ``deadline`` (seconds) steps down in precision only as far as needed to finish
        in time.  ``timeout`` bounds the whole send (TransferTimeoutError).  ``blocks``
        lists the ``(block id, version)`` of the prefix blocks this cache holds.
        """
        if not isinstance(spec, KVSpec):
            raise UsageError("spec must be a kvwire.KVSpec")
        if not isinstance(request_id, str) or not request_id or len(request_id.encode()) > 0xFFFF:
            raise UsageError("request_id must be a non-empty str of at most 65535 UTF-8 bytes")
        codec_name = codec or self.codec
        if codec_name == AUTO:
            if self.chooser is None:
                self.chooser = self._make_chooser()
        else:
            get_codec(codec_name)
        if codec_name != AUTO and codec_name not in self.server_codecs:
            raise IncompatiblePeerError(
                f"server does not accept codec {codec_name!r}", code=ErrorCode.UNSUPPORTED_CODEC
            )
        if meta is not None and not isinstance(meta, dict):
            raise UsageError("meta must be a dict (it travels as a JSON object)")
        try:
            meta_bytes = json.dumps(meta or {}, separators=(",", ":")).encode()
        except (TypeError, ValueError, RecursionError) as exc:
            raise UsageError(f"meta must be JSON-serialisable: {exc}") from None
        block_versions = tuple(
            BlockVersion(block=_block_key(b), version=_version(v)) for b, v in (blocks or ())
        )
        if len(block_versions) > 0xFFFF:
            raise UsageError("at most 65535 blocks per transfer")
        if deadline is not None and codec_name != AUTO:
            raise UsageError("deadline= steers codec='auto'; with a fixed codec use timeout=")
        work = self._send(request_id, spec, layers, meta_bytes, codec_name, block_versions, deadline)
        if timeout is None:
            return await work
        try:
            return await asyncio.wait_for(work, timeout)
        except KvwireError:
            raise
        except TimeoutError:
            raise TransferTimeoutError(f"send({request_id!r}) did not complete in {timeout} s") from None

    async def _send(
        self, request_id: str, spec: KVSpec, layers: Any, meta: bytes, codec_name: str,
        blocks: tuple[BlockVersion, ...], deadline: float | None,
    ) -> Receipt:
        self._check_usable()
        loop = asyncio.get_running_loop()
        started = _clock()
        tid = next(self._ids)
        out = _Outgoing(tid, spec.num_layers, loop)
        self._transfers[tid] = out
        used: dict[str, int] = {}
        kv_bytes = 0
        try:
            out.begin = Begin(
                transfer_id=tid, num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads,
                head_dim=spec.head_dim, dtype_id=spec.dtype_id, model=spec.model,
                request_id=request_id, meta=meta, blocks=blocks,
            )
            primary = await self._any_open_stream()
            begin_size = sum(len(p) for p in encode_body(out.begin)[1])
            if begin_size > primary.conn.peer_max_frame_size:
                raise UsageError(
                    f"meta and blocks take {begin_size} bytes; the server accepts frames of "
                    f"at most {primary.conn.peer_max_frame_size}"
                )
            primary.conn.send_begin(out.begin)
            primary.flush()
            index = -1
            tokens: int | None = None
            producer = iterate_layers(layers)
            while True:
                item = await _next_or_fail(producer, out)
                if item is None:
                    break
                k_raw, v_raw = item
                index += 1
                if index >= spec.num_layers:
                    raise UsageError(f"layers yielded more than spec.num_layers={spec.num_layers}")
                on_device = is_device_array(k_raw)
                if on_device:
                    k = as_device_array(k_raw, spec, f"layer {index} k")
                    v = as_device_array(v_raw, spec, f"layer {index} v")
                else:
                    k = as_host_array(k_raw, spec, f"layer {index} k")
                    v = as_host_array(v_raw, spec, f"layer {index} v")
                if k.shape[0] != v.shape[0] or (tokens is not None and k.shape[0] != tokens):
                    raise UsageError("every k and v of a cache must have the same token count")
                tokens = k.shape[0]
                kv_bytes += k.nbytes + v.nbytes
                await out.accepted
                await _layer_credit(out, index)
                await self._send_layer(out, spec, index, k, v, codec_name, used, started, deadline)
            if index + 1 != spec.num_layers:
                raise UsageError(f"layers yielded {index + 1} layers, spec.num_layers={spec.num_layers}")
            out.state.producer_done = True
            if out.state.complete and not out.done.done():
                out.done.set_result(None)
            await out.done
        except BaseException as exc:
            if out.error is None:
                # Tell the receiver this transfer will not complete.
                code = exc.code if isinstance(exc, KvwireError) else ErrorCode.CANCELLED
                for s in self.streams:
                    if s.is_open:
                        s.conn.send_reset(tid, code, f"sender aborted: {exc}"[:200])
                        s.flush()
                        break
            if isinstance(exc, asyncio.CancelledError | KvwireError):
                raise
            if isinstance(exc, Exception):
                # The producer's own exception stays the cause.
                raise TransferAbortedError(f"layer producer failed: {exc!r}") from exc
            raise
        finally:
            self._transfers.pop(tid, None)
        seconds = _clock() - started
        snap = self.estimator.snapshot()
        if codec_name == AUTO and len(used) == 1:
            codec_name = next(iter(used))
        return Receipt(
            request_id=request_id, transfer_id=tid, codec=codec_name, kv_bytes=kv_bytes,
            wire_bytes=out.state.wire_bytes, chunks=out.state.chunks_sent, seconds=seconds,
            time_to_first_layer=(out.first_layer_at - started) if out.first_layer_at else None,
            estimated_gbps=snap.bandwidth_bps / 1e9 if snap.bandwidth_bps else None,
            rtt_ms=snap.min_rtt * 1e3 if snap.min_rtt is not None else None,
            extra={"chunks_by_codec": used},
        )

    async def _send_layer(
        self, out: _Outgoing, spec: KVSpec, index: int, k: Any, v: Any, codec_name: str,
        used: dict[str, int], started: float, deadline: float | None,
    ) -> None:
        """Chunk, encode and put one layer on the wire (K first, then V)."""
        tokens = int(k.shape[0])
        bpt = spec.num_kv_heads * spec.head_dim * spec.itemsize
        on_device = not isinstance(k, np.ndarray)  # already a CuPy array (see _send)
        plan = plan_chunks(tokens, bpt, self.options.chunk_bytes)
        out.layer_acked[index] = 2 * len(plan)

        def pick() -> Any:
            if codec_name != AUTO:
                return get_codec(codec_name)
            assert self.chooser is not None
            left = None if deadline is None else deadline - (_clock() - started)
            remaining = (spec.num_layers - index) * 2 * tokens * bpt
            return get_codec(self.chooser.choose(
                self.estimator.bandwidth_bps,
                remaining_bytes=remaining if deadline is not None else None,
                time_left=left,
            ).codec)

        for kind, arr in ((TensorKind.K, k), (TensorKind.V, v)):
            source = (
                self._encode_on_device(pick(), arr, kind, plan, spec.dtype) if on_device
                else self._host_chunks(arr, kind, plan, pick)
            )
            async for start, count, codec, enc in source:
                used[codec.name] = used.get(codec.name, 0) + 1
                payload = enc.payload
                plen = payload.nbytes if hasattr(payload, "nbytes") else len(payload)
                chunk = Chunk(
                    transfer_id=out.state.transfer_id, layer=index, kind=int(kind),
                    codec_id=enc.codec_id, token_start=start, token_count=count,
                    layer_tokens=tokens, params=enc.params, payload=payload,
                )
                await self._put_chunk(out, chunk, chunk_frame_size(len(enc.params), plen), count * bpt)

    async def _encode(self, codec: Any, x: Any, kind: TensorKind) -> Any:
        """Encode one chunk; quantizing codecs run off the event loop so acks keep flowing."""
        if codec.lossless and "+" not in codec.name:
            return codec.encode(x, kind)
        t0 = time.perf_counter()
        enc = await asyncio.get_running_loop().run_in_executor(None, codec.encode, x, kind)
        if self.chooser is not None:
            self.chooser.observe_encode(codec.name, x.nbytes * 2 // x.itemsize, time.perf_counter() - t0)
            plen = enc.payload.nbytes if hasattr(enc.payload, "nbytes") else len(enc.payload)
            self.chooser.observe_size(codec.name, x.nbytes * 2 // x.itemsize, plen + len(enc.params))
        return enc

    async def _host_chunks(
        self, arr: Any, kind: TensorKind, plan: list[tuple[int, int]], pick: Any
    ) -> AsyncIterator[tuple[int, int, Any, Any]]:
        for start, count in plan:
            codec = pick()
            yield start, count, codec, await self._encode(codec, arr[start : start + count], kind)

    async def _encode_on_device(
        self, codec: Any, x: Any, kind: TensorKind, plan: list[tuple[int, int]], dtype: str
    ) -> AsyncIterator[tuple[int, int, Any, Any]]:
        """Chunks of a CuPy tensor: quantized on its GPU in one launch, the payloads copied to
        pinned host memory overlapped with sending (kvwire/aio/_gpu.py).

        ``raw`` (and ``raw+...``) has no kernel: the chunks are copied to the host as they are.
        """
        from kvwire.aio import _gpu

        if codec.name.split("+")[0] == "raw":
            async for start, count, host in _gpu.copy_raw_chunks(x, plan):
                if dtype == "bfloat16":
                    host = host.view(numpy_dtype("bfloat16"))
                yield start, count, codec, await self._encode(codec, host, kind)
            return
        t0 = time.perf_counter()
        async for start, count, enc in _gpu.encode_chunks(codec, x, kind, plan, dtype):
            if start == 0 and self.chooser is not None:
                self.chooser.observe_encode(codec.name, x.size * 2, time.perf_counter() - t0)
            yield start, count, codec, enc

    def _make_chooser(self) -> CodecChooser:
        candidates = []
        for name in AUTO_CANDIDATES:
            if name in self.server_codecs:
                ratio = get_codec(name).encoded_size_ratio((256, 8, 128), "float16")
                enc, dec = codec_speeds(name)  # the receiver's decode measured here
                candidates.append(CodecCandidate(name=name, size_ratio=ratio, encode_bytes_per_s=enc, decode_bytes_per_s=dec))
        if not candidates:
            raise IncompatiblePeerError(
                "codec 'auto' needs at least one of " + ", ".join(AUTO_CANDIDATES) + " on the server",
                code=ErrorCode.UNSUPPORTED_CODEC,
            )
        return CodecChooser(candidates)

    async def _put_chunk(self, out: _Outgoing, chunk: Chunk, wire_size: int, kv_bytes: int) -> None:
        while True:
            if out.error is not None:
                raise out.error
            self._check_usable()
            if not self.inflight.may_send(self.estimator, wire_size, _clock()):
                await self._wait_capacity()
                continue
            best: StreamProtocol | None = None
            for s in self.streams[: self.active_streams]:
                if (
                    s.is_open and s.writable.is_set() and s.conn.can_send_chunk(wire_size)
                    and (best is None or s.conn.send_credit > best.conn.send_credit)
                ):
                    best = s
            if best is not None:
                sent_at = _clock()  # RTT counts from the send, not from after the write
                best.conn.send_chunk(chunk, wire_size)
                best.flush()
                out.state.on_sent(
                    SentChunk(address=chunk.address, stream=best.index, wire_size=wire_size,
                              kv_bytes=kv_bytes, chunk=chunk)
                )
                self.bytes_sent += wire_size
                self.estimator.on_send(
                    chunk.address, wire_size, sent_at, app_limited=self._app_limited(wire_size),
                )
                return
            await self._wait_capacity()

    async def _wait_capacity(self) -> None:
        """Wait for an ack, a writable stream, a reconnect or a break (counted as queued data)."""
        self._capacity.clear()
        self._waiting_senders += 1
        try:
            await self._capacity.wait()
        finally:
            self._waiting_senders -= 1

    def statistics(self) -> dict[str, Any]:
        """A snapshot: the bandwidth/RTT estimate, bytes in flight, and per stream credit,
        bytes and (on Linux, direct paths) the kernel's TCP_INFO view."""
        snap = self.estimator.snapshot()
        streams = []
        for s in self.streams:
            entry: dict[str, Any] = {
                "index": s.index,
                "open": s.is_open,
                "bytes_sent": s.conn.bytes_sent,
                "credit": s.conn.send_credit,
                "chunks_in_flight": len(s.conn.in_flight_chunks()),
            }
            sock = s.transport.get_extra_info("socket") if s.transport is not None else None
            info = read_tcp_info(sock) if sock is not None else None
            if info is not None:
                entry["tcp"] = {
                    "rtt_ms": info.rtt_us / 1e3 if info.rtt_us is not None else None,
                    "delivery_rate_gbps": info.delivery_rate * 8 / 1e9 if info.delivery_rate is not None else None,
                    "cwnd": info.snd_cwnd,
                    "total_retrans": info.total_retrans,
                    "notsent_bytes": info.notsent_bytes,
                }
            streams.append(entry)
        return {
            "session_id": self.session_id.hex(),
            "estimated_gbps": snap.bandwidth_bps / 1e9 if snap.bandwidth_bps else None,
            "goodput_gbps": snap.goodput_bps / 1e9 if snap.goodput_bps else None,
            "min_rtt_ms": snap.min_rtt * 1e3 if snap.min_rtt is not None else None,
            "srtt_ms": snap.srtt * 1e3 if snap.srtt is not None else None,
            "bytes_in_flight": snap.bytes_in_flight,
            "inflight_target": self.inflight.update(self.estimator, _clock()),
            "streams": streams,
            "transfers_in_flight": len(self._transfers),
            "bytes_sent": self.bytes_sent,
            "reconnects": self.reconnects,
            "chunks_resent": self.chunks_resent,
            **self.counters,
        }

    async def close(self) -> None:
        """Close every stream and end every task this peer started (the one teardown
        path: after it returns nothing of the peer is pending).  Idempotent."""
        if self._closed:
            return
        self._closed = True
        err = ConnectionLostError("peer closed")
        for out in list(self._transfers.values()):
            out.fail(err)
        self._capacity.set()
        for s in self.streams:
            s.abort(ErrorCode.NO_ERROR, "client closing")
        await finish_tasks(self._tasks)
        await wait_closed(self.streams, 1.0)

    async def __aenter__(self) -> Peer:
        await self.open()
        if self.stream_controller is not None:
            self._spawn(self._control_streams())
        return self

    @property
    def active_streams(self) -> int:
        """Streams chunks are striped over now (all of them unless ``streams="auto"``)."""
        return self.stream_controller.streams if self.stream_controller is not None else len(self.streams)

    async def _control_streams(self) -> None:
        """Every controller period: one sample per stream in use, then grow or shrink."""
        ctl = self.stream_controller
        assert ctl is not None
        last: dict[int, tuple[int, Any]] = {}
        period = 0.25
        while not self._closed:
            await asyncio.sleep(period)
            samples = []
            for s in self.streams[: ctl.streams]:
                sock = s.transport.get_extra_info("socket") if s.transport is not None else None
                info = read_tcp_info(sock) if sock is not None else None
                prev_bytes, prev_info = last.get(s.index, (s.acked_bytes, None))
                limited = False
                if info is not None and prev_info is not None:
                    limited = window_limited_from_counters(
                        busy_us=_delta(info.busy_time_us, prev_info.busy_time_us),
                        rwnd_limited_us=_delta(info.rwnd_limited_us, prev_info.rwnd_limited_us),
                        sndbuf_limited_us=_delta(info.sndbuf_limited_us, prev_info.sndbuf_limited_us),
                    )
                samples.append(StreamSample(
                    delivery_rate_bps=(s.acked_bytes - prev_bytes) * 8 / period, window_limited=limited,
                ))
                last[s.index] = (s.acked_bytes, info)
            idle = not self._transfers or (self._waiting_senders == 0 and self.estimator.bytes_in_flight == 0)
            ctl.evaluate(samples, _clock(), app_limited=idle)

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    # -- internals -----------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise self._broken
        if self._closed:
            raise ConnectionLostError("peer is closed")

    async def _any_open_stream(self) -> StreamProtocol:
        """An open stream; while every slot is reconnecting, wait for one (or the break)."""
        while True:
            self._check_usable()
            for s in self.streams:
                if s.is_open:
                    return s
            if not self._reconnecting:
                raise ConnectionLostError("no open stream")
            self._capacity.clear()
            await self._capacity.wait()

    def _app_limited(self, wire_size: int) -> bool:
        """Whether data sent now measures the producer rather than the link.

        As in TCP's rate sampling: nothing else is queued and what is in flight is below
        the estimated bandwidth-delay product, so the pipe is not full.
        """
        if self._waiting_senders:
            return False
        est = self.estimator
        if est.max_filter_bps is None or est.min_rtt is None:
            return False  # no estimate yet: every sample is welcome
        bdp = est.max_filter_bps / 8 * est.min_rtt
        return est.bytes_in_flight + wire_size < bdp

    def on_writable(self, stream: StreamProtocol) -> None:
        self._capacity.set()

    def _on_event(self, stream: StreamProtocol, ev: Event) -> None:
        if isinstance(ev, ChunkAcked):
            out = self._transfers.get(ev.address.transfer_id)
            self._capacity.set()
            if out is None:
                self.estimator.on_loss(ev.address)
                return
            sent = out.state.on_ack(ev.address)
            self.estimator.on_ack(ev.address, _clock())
            stream.acked_bytes += ev.wire_size
            if sent is not None:
                left = out.layer_acked.get(sent.address.layer, 0) - 1
                out.layer_acked[sent.address.layer] = left
                if left == 0 and out.first_layer_at is None:
                    out.first_layer_at = _clock()
            if out.state.complete and not out.done.done():
                out.done.set_result(None)
        elif isinstance(ev, TransferAccepted):
            out = self._transfers.get(ev.transfer_id)
            if out is not None:
                out.state.accepted = True
                out.state.raise_limit(ev.layer_limit)
                if not out.accepted.done():
                    out.accepted.set_result(None)
                out.credit.set()
        elif isinstance(ev, CreditGranted):
            out = self._transfers.get(ev.transfer_id)
            if out is not None:
                out.state.raise_limit(ev.layer_limit)
                out.credit.set()
        elif isinstance(ev, TransferReset):
            out = self._transfers.get(ev.transfer_id)
            if out is not None:
                self.count("transfers_reset_by_peer")
                _log.info("kvwire: transfer %d reset by the server: %s", ev.transfer_id, ev.message[:200])
                out.fail(ev.error())
        elif isinstance(ev, HandshakeComplete):
            fut = self._handshakes.get(stream)
            if fut is not None and not fut.done():
                fut.set_result(ev)
        elif isinstance(ev, ConnectionClosed):
            err = ev.error or ConnectionLostError(_closed_reason(ev, stream.index))
            if ev.goaway:
                self.count("goaways_received")
                _log.info("kvwire: %s", _closed_reason(ev, stream.index))
            if isinstance(ev.error, AuthenticationError):
                self.count("authentication_failures")
                _log.warning("kvwire: authentication with %s:%s failed: %s", self.host, self.port, ev.error)
            fut = self._handshakes.get(stream)
            if fut is not None and not fut.done():
                fut.set_exception(err)
                fut.exception()  # retrieved: its waiter may be gone (cancelled by close())
                return
            if self._closed or self._broken is not None or self.streams[stream.index] is not stream:
                return
            if ev.resumable and self.options.reconnect_attempts > 0:
                self._resume(stream)
            elif ev.goaway and ev.code == ErrorCode.NO_ERROR and any(s.is_open for s in self.streams):
                # A clean goodbye on one stream: acks may still be on their way on the
                # others; the session ends when the last one closes.  What this stream
                # carried unacknowledged goes again on the others.
                self._resume(stream, reconnect=False)
            else:
                self._break(err)

    def _reset_on_any_stream(self, transfer_id: int, error: KvwireError) -> None:
        for s in self.streams:
            if s.is_open:
                s.conn.send_reset(transfer_id, error.code, str(error)[:200])
                s.flush()
                return

    def count(self, what: str) -> None:
        self.counters[what] = self.counters.get(what, 0) + 1

    def _break(self, error: KvwireError) -> None:
        """The session is over: every transfer fails with ``error``, every stream closes."""
        if self._broken is None:
            self._broken = error
        for out in list(self._transfers.values()):
            out.fail(self._broken)
        self.estimator.forget_all()
        self._capacity.set()
        for s in self.streams:
            if s.transport is not None:
                s.abort(ErrorCode.SESSION_LOST, "another stream of this session was lost")

    def _resume(self, dead: StreamProtocol, *, reconnect: bool = True) -> None:
        """Re-send what ``dead`` carried unacknowledged (and reconnect its slot).

        Bounded per session and per transfer: a fault that comes back after every
        reconnect ends in ConnectionLostError instead of a loop.
        """
        opts = self.options
        if reconnect:
            self.resumes += 1
            self.count("resumes")
            _log.info("kvwire: stream %d to %s:%s broke; resuming (%d of at most %d)",
                      dead.index, self.host, self.port, self.resumes, opts.max_reconnects)
            if self.resumes > opts.max_reconnects:
                self._break(ConnectionLostError(
                    f"stream {dead.index} broke again after {opts.max_reconnects} reconnects: giving up"
                ))
                return
            for out in list(self._transfers.values()):
                if out.error is not None:
                    continue
                out.reconnects += 1
                if out.reconnects > opts.max_transfer_reconnects:
                    err = ConnectionLostError(
                        f"transfer {out.state.transfer_id} lived through {opts.max_transfer_reconnects} "
                        "broken streams: giving up"
                    )
                    out.fail(err)
                    self._reset_on_any_stream(out.state.transfer_id, err)
        lost = []
        for out in self._transfers.values():
            for sent in out.state.unacked.values():
                if sent.stream == dead.index and out.error is None:
                    lost.append((out, sent))
                    self.estimator.on_loss(sent.address)
        for _, sent in lost:
            sent.stream = -1  # in limbo until re-sent
        if reconnect:
            self._spawn(self._reconnect(dead.index))
        if lost:
            self._spawn(self._resend(lost))
        self._capacity.set()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _resend(self, lost: list[tuple[_Outgoing, SentChunk]]) -> None:
        for out, sent in lost:
            if out.error is not None or sent.address not in out.state.unacked or sent.chunk is None:
                continue
            try:
                await self._put_chunk(out, sent.chunk, sent.wire_size, sent.kv_bytes)
                self.chunks_resent += 1
            except KvwireError:
                return  # the transfer or the session failed; its waiters were told

    async def _reconnect(self, index: int) -> None:
        if index in self._reconnecting:
            return
        self._reconnecting.add(index)
        opts = self.options
        try:
            delay = opts.reconnect_backoff
            last: KvwireError = ConnectionLostError("stream lost")
            for _ in range(opts.reconnect_attempts):
                await asyncio.sleep(delay)
                delay *= 2
                if self._closed or self._broken is not None:
                    return
                try:
                    await self._open_stream(index, self.session_id)
                    self.reconnects += 1
                    # A BEGIN lost with the broken stream is sent again (the server
                    # answers a repeated BEGIN with its ACCEPT).
                    stream = self.streams[index]
                    for out in self._transfers.values():
                        if out.begin is not None and not out.state.accepted and out.error is None:
                            stream.conn.send_begin(out.begin)
                    stream.flush()
                    self._capacity.set()
                    return
                except (ConnectionLostError, TransferTimeoutError) as exc:
                    last = exc
                    if isinstance(exc, ConnectionLostError) and exc.code == ErrorCode.UNKNOWN_SESSION:
                        break  # the receiver restarted: its half of the session is gone
                except KvwireError as exc:
                    last = exc
                    break
            if not any(s.is_open for s in self.streams):
                self._break(ConnectionLostError(f"could not resume the session: {last}"))
        finally:
            self._reconnecting.discard(index)


async def _layer_credit(out: _Outgoing, index: int) -> None:
    """Wait until the receiver granted credit for layer ``index`` (or the transfer failed).

    The event is cleared before the conditions are read, so a grant or a failure that
    arrived at any time before (a RESET while the layer was produced) is never lost.
    """
    while True:
        out.credit.clear()
        if out.error is not None:
            raise out.error
        if index < out.state.layer_limit:
            return
        await out.credit.wait()


async def _next_or_fail(producer: AsyncIterator[tuple[Any, Any]], out: _Outgoing) -> tuple[Any, Any] | None:
    """The producer's next layer, or the transfer's error if it fails first (a producer
    waiting on something must not keep a dead transfer's ``send()`` alive)."""
    if out.error is not None:
        raise out.error
    nxt = asyncio.ensure_future(producer.__anext__())
    failed = asyncio.ensure_future(out.failed.wait())
    try:
        await asyncio.wait({nxt, failed}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        failed.cancel()
    if nxt.done():
        try:
            item = nxt.result()
        except StopAsyncIteration:
            return None
        if out.error is not None:
            raise out.error  # failed while the layer was produced
        return item
    nxt.cancel()
    assert out.error is not None
    raise out.error


def _closed_reason(ev: ConnectionClosed, index: int) -> str:
    who = "server" if ev.by_peer else "this side"
    how = f"GOAWAY {ErrorCode(ev.code).name}" if ev.code in ErrorCode._value2member_map_ else f"code {ev.code}"
    return f"stream {index} closed by {who} ({how}: {ev.message or 'no reason given'})"


def _delta(now: int | None, before: int | None) -> int | None:
    return None if now is None or before is None else now - before


def _version(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 64:
        raise UsageError(f"a block version is an int in [0, 2**64), got {v!r}")
    return v


def _block_key(block: Any) -> bytes:
    """A block id as it travels in BEGIN: its canonical type-tagged key (``i:12``, ``b:<hex>``, ``s:<text>``)."""
    key = block_key(block).encode()
    if len(key) > 255:
        raise UsageError("block id too long for the wire (canonical key over 255 bytes)")
    return key


__all__ = ["ClientOptions", "Peer", "Receipt"]
