"""The receiving side: ``kvwire.serve()``, a pump between sockets and the session core.

Every protocol decision (sessions, admission, credit, storage, acknowledgements, resume,
deadlines, the registry gate) is :class:`kvwire.session.ReceiverCore`'s.  This module
listens, feeds each connection's bytes to the core, writes what it answers, keeps one
timer at ``core.get_timer()``, runs the registry calls the core asks for, and hands
arrived transfers to ``accept()`` / ``expect()``.  Layers are allocated and decoded by
:mod:`kvwire.aio._receive`; the application's view of a transfer is
:mod:`kvwire.aio._transfer`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import ssl as _ssl
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, fields
from types import TracebackType
from typing import Any

from kvwire.aio import _gpu
from kvwire.aio._checks import check_number
from kvwire.aio._receive import ArrayStore
from kvwire.aio._stream import NOTSENT_LOWAT, finish_tasks, tune_socket, wait_closed
from kvwire.aio._transfer import Transfer
from kvwire.codec import available_codecs
from kvwire.consistency.blocks import block_from_key
from kvwire.errors import (
    ConnectionLostError,
    KvwireError,
    RegistryUnavailableError,
    StaleVersionError,
    TransferTimeoutError,
    UsageError,
)
from kvwire.session.receiver import (
    AuthenticationFailed,
    GoawayReceived,
    InternalError,
    Key,
    LayerReady,
    ReceiverConfig,
    ReceiverCore,
    ReceiverEvent,
    RegistryCheck,
    RegistryPublish,
    StreamResumed,
    TransferAborted,
    TransferArrived,
    TransferFailed,
)
from kvwire.spec import KVSpec
from kvwire.wire import Connection
from kvwire.wire.frames import MAX_MAX_FRAME_SIZE, MIN_MAX_FRAME_SIZE

_log = logging.getLogger("kvwire")


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


class _Stream(asyncio.BufferedProtocol):
    """One accepted TCP connection: its bytes go to the core, the core's answers out.

    A side that only answers stops reading from a peer that does not read what it is
    sent: its answers (ACK, RESET, PONG) stay bounded by the write buffer limit.
    """

    def __init__(self, server: Server, cid: int, write_high: int = 4 << 20) -> None:
        self.server = server
        self.cid = cid
        self.conn: Connection | None = None
        self.transport: asyncio.Transport | None = None
        self.peer: Any = None
        self.reading_paused = False
        self.closed = asyncio.Event()
        self._write_high = write_high

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self.server._closed:  # accepted while the server was closing
            transport.close()
            self.closed.set()
            return
        self.transport = transport  # type: ignore[assignment]
        transport.set_write_buffer_limits(high=self._write_high, low=self._write_high // 4)  # type: ignore[attr-defined]
        tune_socket(transport.get_extra_info("socket"), self.server.options.notsent_lowat)
        self.peer = transport.get_extra_info("peername")
        srv = self.server
        srv._core.connection_made(self.cid, srv._now())
        self.conn = srv._core.connection(self.cid)
        srv._streams.add(self)
        srv._by_cid[self.cid] = self
        srv._pump()

    def get_buffer(self, sizehint: int) -> memoryview:
        assert self.conn is not None
        return self.conn.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        self.server._core.buffer_updated(self.cid, nbytes, self.server._now())
        self.server._pump()

    def eof_received(self) -> bool | None:
        self.server._core.receive_data(self.cid, b"", self.server._now())
        self.server._pump()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        srv = self.server
        if self.conn is None:
            return
        srv._core.receive_data(self.cid, b"", srv._now())
        self.transport = None
        srv._pump()
        srv._core.forget(self.cid)
        srv._streams.discard(self)
        srv._by_cid.pop(self.cid, None)
        self.closed.set()

    def pause_writing(self) -> None:
        tr = self.transport
        if tr is not None and not tr.is_closing():
            tr.pause_reading()
            self.reading_paused = True

    def resume_writing(self) -> None:
        tr = self.transport
        if self.reading_paused and tr is not None and not tr.is_closing():
            tr.resume_reading()
        self.reading_paused = False

    def flush(self) -> None:
        tr, conn = self.transport, self.conn
        if tr is None or conn is None or tr.is_closing():
            return
        data = conn.data_to_send()
        if data:
            tr.writelines(data)
        if self.server._core.is_closed(self.cid):
            tr.close()


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
        codecs = options.codecs or tuple(available_codecs())
        for name in codecs:
            if name not in available_codecs():
                raise UsageError(f"unknown codec {name!r}")
        _gpu.parse_device(options.device)  # UsageError for an unknown or unusable device
        self.host = host
        self.port = 0
        self._requested_port = port
        self._ssl = ssl
        self.options = options
        self.codecs = tuple(codecs)
        self.registry = registry
        self._store = ArrayStore(options.device)
        self.on_gpu = self._store.gpu is not None
        shared = {f.name: getattr(options, f.name) for f in fields(ReceiverConfig) if hasattr(options, f.name)}
        shared.update(secret=bytes(secret), codecs=self.codecs, registry=registry is not None,
                      fingerprints=frozenset(s.fingerprint for s in options.specs))
        self._core = ReceiverCore(ReceiverConfig(**shared), store=self._store)
        self._server: asyncio.Server | None = None
        self._cids = itertools.count(1)
        self._streams: set[_Stream] = set()
        self._by_cid: dict[int, _Stream] = {}
        self._transfers: dict[Key, Transfer] = {}
        self._arrivals: OrderedDict[Key, Transfer] = OrderedDict()
        self._accept_waiters: deque[asyncio.Future[Transfer]] = deque()
        self._expect_waiters: dict[str, deque[asyncio.Future[Transfer]]] = {}
        self._expect_into: dict[asyncio.Future[Transfer], Any] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._closed = False

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(
                lambda: _Stream(self, next(self._cids)), self.host, self._requested_port, ssl=self._ssl,
                ssl_handshake_timeout=self.options.handshake_timeout if self._ssl else None,
            )
        except OSError as exc:
            raise ConnectionLostError(f"cannot listen on {self.host}:{self._requested_port}: {exc}") from exc
        self.port = int(self._server.sockets[0].getsockname()[1])

    # -- public API -------------------------------------------------------------------------

    async def accept(self, *, timeout: float | None = None) -> Transfer:
        """The next incoming transfer not claimed by :meth:`expect`."""
        if self._arrivals:
            _, t = self._arrivals.popitem(last=False)
            self._core.claim(t._key)
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
        for key, t in self._arrivals.items():
            if t.request_id == request_id:
                del self._arrivals[key]
                self._core.claim(key)
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
            "sessions": self._core.sessions,
            "connections": len(self._streams),
            "pending_arrivals": len(self._arrivals),
            "buffered_bytes": self._core.buffered_bytes,
            **self._core.counters,
        }

    async def close(self) -> None:
        """Stop listening, close every connection and end every task and timer this server
        started (the one teardown path: after it returns nothing of it is pending)."""
        if self._server is not None:
            self._server.close()
        streams = list(self._streams)
        if not self._closed:
            self._core.close(self._now())
            self._pump()
            self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        waiters = [*self._accept_waiters, *(f for q in self._expect_waiters.values() for f in q)]
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

    # -- the pump ---------------------------------------------------------------------------

    @staticmethod
    def _now() -> float:
        return asyncio.get_event_loop().time()

    def _pump(self) -> None:
        """Handle the core's events, write what it queued, re-arm the one timer."""
        core = self._core
        while (ev := core.next_event()) is not None:
            try:
                self._on_event(ev)
            except Exception:
                _log.exception("kvwire: internal error handling %s", type(ev).__name__)
        for cid in core.take_dirty():
            stream = self._by_cid.get(cid)
            if stream is not None:
                stream.flush()
        if self._closed:
            return
        when = core.get_timer()
        if when != self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer_at = when
            self._timer = None if when is None else asyncio.get_event_loop().call_at(when, self._fire)

    def _fire(self) -> None:
        self._timer = self._timer_at = None
        self._core.handle_timer(self._now())
        self._pump()

    def _on_event(self, ev: ReceiverEvent) -> None:
        if isinstance(ev, LayerReady):
            t = self._transfers.get(ev.key)
            if t is not None:
                t._layer_ready(ev.layer, ev.wire_bytes)
        elif isinstance(ev, TransferArrived):
            t = Transfer(self, ev)
            self._transfers[ev.key] = t
            self._deliver(t)
        elif isinstance(ev, TransferFailed):
            self._arrivals.pop(ev.key, None)
            t = self._transfers.pop(ev.key, None)
            if t is not None:
                t._fail(ev.error)
            elif isinstance(ev.error, StaleVersionError | RegistryUnavailableError):
                # Refused by the registry before it arrived: blocks refused as stale do not
                # become fresh, so an expect() of it learns now rather than at its timeout.
                for fut in self._expect_waiters.get(ev.request_id, ()):
                    if not fut.done():
                        fut.set_exception(ev.error)
        elif isinstance(ev, RegistryCheck | RegistryPublish):
            self._spawn(self._registry_call(ev))
        elif isinstance(ev, AuthenticationFailed):
            _log.warning("kvwire: authentication failed for %s: %s", self._peer(ev.cid), ev.error)
        elif isinstance(ev, GoawayReceived):
            _log.info("kvwire: GOAWAY from %s: code 0x%04x %s", self._peer(ev.cid), ev.code, ev.message)
        elif isinstance(ev, StreamResumed):
            _log.info("kvwire: session %s resumed stream %d", ev.session_id.hex()[:8], ev.stream_index)
        elif isinstance(ev, InternalError):
            _log.error("kvwire: internal error on a connection from %s", self._peer(ev.cid), exc_info=ev.error)
        elif isinstance(ev, TransferAborted):
            who = "reset by the client" if ev.by_peer else "aborted"
            _log.info("transfer %r %s: %s", ev.request_id, who, ev.reason or "no reason given")

    def _peer(self, cid: int) -> Any:
        stream = self._by_cid.get(cid)
        return stream.peer if stream is not None and stream.peer else "a client"

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _registry_call(self, ev: RegistryCheck | RegistryPublish) -> None:
        """Ask the registry what the core asked (docs/consistency.md: ``check_many`` at
        BEGIN, ``publish`` before the last acknowledgement) and answer the core."""
        blocks = [(block_from_key(b.decode("utf-8")), v) for b, v in ev.blocks]
        what = "check" if isinstance(ev, RegistryCheck) else "publish"
        error: KvwireError | None
        try:
            if isinstance(ev, RegistryCheck):
                bad = await self.registry.check_many(blocks)
            else:
                bad = await self.registry.publish(blocks)
            error = _stale(bad) if bad else None
        except KvwireError as exc:
            error = RegistryUnavailableError(f"registry {what} failed: {exc}")
        if self._closed:
            return
        if isinstance(ev, RegistryCheck):
            self._core.registry_checked(ev.key, None, error, self._now())
        else:
            self._core.registry_published(ev.key, error, self._now())
        self._pump()

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
                self._core.claim(transfer._key)
                fut.set_result(transfer)
                return
        while self._accept_waiters:
            fut = self._accept_waiters.popleft()
            if not fut.done():
                self._core.claim(transfer._key)
                fut.set_result(transfer)
                return
        self._arrivals[transfer._key] = transfer

    # -- what a Transfer asks of the core ---------------------------------------------------------

    def _take(self, transfer: Transfer, layer: int) -> Any:
        buf = self._core.pop_layer(transfer._key, layer)
        if transfer._yielded + 1 >= transfer.spec.num_layers:
            self._transfers.pop(transfer._key, None)
        self._pump()
        return buf

    def _abort(self, transfer: Transfer, reason: str) -> None:
        self._core.abort(transfer._key, reason, self._now())
        self._pump()

    def _attach(self, transfer: Transfer, into: Any) -> None:
        key = transfer._key
        try:
            self._store.attach(key, into)
        except KvwireError as exc:
            self._core.fail(key, exc, self._now())
            self._pump()
            raise
        self._core.attach(key)
        self._pump()


def _stale(blocks: Sequence[Any]) -> StaleVersionError:
    shown = ", ".join(repr(b) for b in list(blocks)[:8])
    more = f" and {len(blocks) - 8} more" if len(blocks) > 8 else ""
    return StaleVersionError(f"stale prefix blocks: {shown}{more}")


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


__all__ = ["Server", "ServerOptions", "Transfer", "make_server_options"]
