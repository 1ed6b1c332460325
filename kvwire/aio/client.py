"""The sending side: ``kvwire.connect()`` and ``peer.send()``, a pump around the sans-IO
:class:`kvwire.session.SenderCore`.

The core decides everything (handshakes, striping, credit, acks, resume, reconnect backoff,
deadlines); this module opens the TCP/TLS connections it asks for, feeds it bytes and
``now``, writes what it has to send, arms one timer at its ``get_timer()``, turns its events
into the delivery-rate estimate, log lines and wake-ups of ``send()``, and sets the
in-flight limit and the streams in use from :mod:`kvwire.control`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
import os
import socket
import ssl as _ssl
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

from kvwire.aio._logtext import address, code_name, printable
from kvwire.aio._send import AUTO, SendProgress, SendState, clock, make_chooser
from kvwire.aio._send import send as _send
from kvwire.aio._stream import Pump, Stream, on_this_host
from kvwire.aio.tcpinfo import read_tcp_info
from kvwire.codec import available_codecs, codec_by_id, get_codec
from kvwire.control import (
    CodecChooser,
    DeliveryRateEstimator,
    InflightController,
    StreamController,
)
from kvwire.control.streams import StreamReading, StreamSampler
from kvwire.errors import (
    AuthenticationError,
    ConnectionLostError,
    ErrorCode,
    IncompatiblePeerError,
    KvwireError,
    ProtocolError,
    TransferTimeoutError,
    UsageError,
    detached,
)
from kvwire.options import Layers
from kvwire.session.options import ClientOptions, Receipt, check_port, check_seconds
from kvwire.session.sender import (
    SESSION_GONE,
    ChunkDelivered,
    ChunkLost,
    ChunkSent,
    ReceiverCosts,
    SenderCore,
    SessionFailed,
    StreamClosed,
    StreamGivenUp,
    StreamWanted,
    TransferCredit,
    TransferDone,
    TransferFailed,
    begin_fields,
)
from kvwire.spec import KVSpec
from kvwire.wire.connection import NO_SESSION, Connection
from kvwire.wire.frames import BlockVersion, FrameType

_log = logging.getLogger("kvwire")
#: Wire bytes acknowledged per measurement of the transport's CPU cost (for ``auto``).
TRANSPORT_SAMPLE_BYTES = 32 << 20
#: Share of a measurement's wire bytes one codec must have for it to count as that codec's.
CODEC_SHARE = 0.75
#: Seconds of acknowledgements the estimator's delivery rate (``statistics()["wire_gbps"]``)
#: averages, and over which KV bytes per wire byte are counted for ``goodput_gbps``.
GOODPUT_WINDOW = 0.5
#: Seconds a connection attempt to one of a host name's addresses runs alone before the
#: next address is tried beside it (RFC 8305's Connection Attempt Delay): the first attempt
#: to connect wins, the others are closed.  One that fails starts the next at once.
CONNECT_ATTEMPT_DELAY = 0.25

#: One of ``getaddrinfo()``'s answers: family, type, proto, canonical name, socket address.
AddrInfo = tuple[int, int, int, str, tuple[Any, ...]]


def runnable_ns() -> int | None:
    """Nanoseconds the calling thread has been running or waiting for a CPU (Linux's
    ``/proc/thread-self/schedstat``: time on a CPU, time waiting on a run queue), or
    ``None`` where unreadable."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as fh:
            run, wait = fh.read().split()[:2]
        return int(run) + int(wait)
    except (OSError, ValueError):
        return None


def _text(exc: BaseException) -> str:
    """``exc``'s own text; '' where it has none (``ssl.SSLError()`` reads '()')."""
    text = str(exc)
    return "" if text == "()" and not exc.args else text


def _reason(exc: BaseException) -> str:
    """``exc``'s text for an error message, or its type's name where it has none (a bare
    ``ConnectionResetError()``: not 'cannot connect to host:port: ')."""
    return _text(exc) or type(exc).__name__


def server_host(host: str) -> str:
    """``host`` as a client is given it, less the brackets of an IPv6 address written as
    in a URL (``[::1]``, as ``kvwire bench --peer`` and the vLLM connector take it);
    brackets around anything else are a UsageError."""
    if host.startswith("[") and host.endswith("]"):
        inner = host[1:-1]
        try:
            ipaddress.IPv6Address(inner)
        except ValueError:
            raise UsageError(f"host {host!r}: brackets enclose an IPv6 address only") from None
        return inner
    return host


def _check_codec(name: object) -> None:
    """A codec ``send()`` may be given: ``"auto"`` or a registered codec's name (UsageError,
    listing them all, for any other)."""
    if name == AUTO:
        return
    try:
        get_codec(name)  # type: ignore[arg-type]
    except UsageError:
        if not isinstance(name, str):
            raise
        raise UsageError(f"unknown codec {name!r}; known: {AUTO}, {', '.join(sorted(available_codecs()))}") from None


#: How many of the first bytes a server sent an error shows (escaped) when they are no
#: kvwire frame: what answered is something else (an HTTP server, say).
FIRST_BYTES_SHOWN = 40

#: What a handshake error says where one side uses TLS and the other does not: a plain
#: client a server closed before answering, and a TLS client a server answered without TLS.
PLAIN_TO_TLS_HINT = "(a server that requires TLS closes a plain client this way: pass ssl=)"
TLS_TO_PLAIN_HINT = "(the server answered without TLS: is it serving without ssl=?)"


def _first_bytes(data: bytes) -> str:
    """``data`` (the first bytes a server sent) for an error: escaped, cut after
    :data:`FIRST_BYTES_SHOWN` ("..." then says so)."""
    return repr(data[:FIRST_BYTES_SHOWN]) + ("..." if len(data) > FIRST_BYTES_SHOWN else "")


class _ClientStream(Stream):
    """A client's stream, which keeps the first :data:`FIRST_BYTES_SHOWN` bytes it read and
    the connection its handshake ran on: a handshake that fails on what answered can say
    that it is no kvwire server, and what it sent (:meth:`Peer._handshake_error`)."""

    def __init__(self, owner: Any, key: int) -> None:
        super().__init__(owner, key)
        self.first = b""
        self.handshake: Connection | None = None
        self._reading: memoryview | None = None  # where the read under way goes, while first is short

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self.made:
            self.handshake = self.conn

    def get_buffer(self, sizehint: int) -> memoryview:
        buf = super().get_buffer(sizehint)
        self._reading = buf if len(self.first) <= FIRST_BYTES_SHOWN and self._current() else None
        return buf

    def buffer_updated(self, nbytes: int) -> None:
        if (reading := self._reading) is not None:
            self._reading = None
            self.first += bytes(reading[:min(nbytes, FIRST_BYTES_SHOWN + 1 - len(self.first))])
        super().buffer_updated(nbytes)

    def connection_lost(self, exc: Exception | None) -> None:
        self._reading = None
        super().connection_lost(exc)


def default_server_hostname(host: str) -> str:
    """The name TLS checks a server's certificate against when ``server_hostname`` is not
    given: ``host``, an IPv6 address without its ``%scope`` (which names an interface of
    this host, not the server: no certificate holds it)."""
    return host.partition("%")[0] if ":" in host else host


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _scoped(host: str, infos: Sequence[AddrInfo]) -> list[AddrInfo]:
    """``getaddrinfo()``'s answers for ``host``, a scoped IPv6 address (``fe80::1%eth0``)
    with its scope: uvloop's answers it with ``scope_id`` 0, which the kernel refuses for a
    link-local address (EINVAL)."""
    _, sep, scope = host.partition("%")
    if not sep or ":" not in host:
        return list(infos)
    try:
        index = int(scope) if scope.isdigit() else socket.if_nametoindex(scope)
    except OSError:
        return list(infos)
    return [(family, type_, proto, name, (*addr[:3], index))
            if family == socket.AF_INET6 and len(addr) >= 4 and not addr[3] else (family, type_, proto, name, addr)
            for family, type_, proto, name, addr in infos]


def _interleave(infos: Sequence[AddrInfo]) -> list[AddrInfo]:
    """``getaddrinfo()``'s answers in the order they are tried: as it sorted them (RFC 6724),
    the address families alternating after the first address (RFC 8305, 4)."""
    by_family: dict[int, deque[AddrInfo]] = {}
    for info in infos:
        by_family.setdefault(info[0], deque()).append(info)
    queues = list(by_family.values())
    order: list[AddrInfo] = []
    while queues:
        for q in queues:
            order.append(q.popleft())
        queues = [q for q in queues if q]
    return order


def _attempt_error(exc: BaseException) -> BaseException:
    """A connect attempt's error, its text the same on every loop: asyncio's names the
    address as a tuple ('Connect call failed ('::1', 7070, 0, 0)'), uvloop's does not."""
    if isinstance(exc, OSError) and exc.errno is not None and exc.errno > 0:
        return OSError(exc.errno, os.strerror(exc.errno))
    return exc


async def _attempt(loop: asyncio.AbstractEventLoop, info: AddrInfo) -> socket.socket:
    """A TCP socket connected to ``info``'s address (closed if that fails or is cancelled)."""
    family, type_, proto, _, addr = info
    sock = socket.socket(family, type_, proto)
    try:
        sock.setblocking(False)
        if family == socket.AF_INET6 and len(addr) >= 4 and addr[3]:
            # An address with a scope (link-local): uvloop's sock_connect resolves
            # address[:2] again, which keeps the scope only written into the host.
            addr = (f"{addr[0]}%{addr[3]}", *addr[1:])
        await loop.sock_connect(sock, addr)
    except BaseException:
        sock.close()
        raise
    return sock


async def connect_first(
    loop: asyncio.AbstractEventLoop, infos: Sequence[AddrInfo], delay: float = CONNECT_ATTEMPT_DELAY,
) -> tuple[socket.socket, AddrInfo]:
    """A TCP socket connected to the first of ``infos`` to answer, and which one it was:
    they are tried in order, each attempt started ``delay`` seconds after the one before
    it or as soon as that one fails, so a dead address does not keep the others waiting
    (Happy Eyeballs, RFC 8305: ``loop.create_connection()`` has no ``happy_eyeballs_delay``
    on uvloop).  The attempts still running when one wins (or when this is cancelled) are
    cancelled, and any socket they made closed; none outlives the call.  All failing, it
    raises their error (one text, or each address's)."""
    queue = deque(infos)
    if not queue:
        raise OSError("getaddrinfo() returned no address")
    pending: dict[asyncio.Task[socket.socket], AddrInfo] = {}
    errors: list[tuple[AddrInfo, BaseException]] = []
    over = False

    def settle(task: asyncio.Task[socket.socket]) -> None:
        """Once the race is over: a socket an attempt made and nobody took is closed."""
        if over and not task.cancelled() and task.exception() is None:
            task.result().close()

    try:
        while queue or pending:
            if queue:
                info = queue.popleft()
                task = loop.create_task(_attempt(loop, info))
                task.add_done_callback(settle)
                pending[task] = info
            done, _ = await asyncio.wait(pending, timeout=delay if queue else None,
                                         return_when=asyncio.FIRST_COMPLETED)
            winner: tuple[socket.socket, AddrInfo] | None = None
            for task in done:
                info = pending.pop(task)
                exc = task.exception()
                if exc is not None:
                    errors.append((info, exc))
                elif winner is None:
                    winner = (task.result(), info)
                else:
                    task.result().close()
            if winner is not None:
                return winner
    finally:
        over = True
        for task in pending:
            if task.done():
                settle(task)
            else:
                task.cancel()  # (settled by its callback as it ends)
        if pending:
            await asyncio.wait(pending)
    if len(errors) == 1 or len({_reason(_attempt_error(e)) for _, e in errors}) == 1:
        raise _attempt_error(errors[0][1])
    raise OSError("; ".join(f"{address(info[4])}: {_reason(_attempt_error(e))}" for info, e in errors))


class _TransportMeter:
    """The event loop thread's CPU seconds per wire byte acknowledged, fed to ``auto``:
    on that thread run the framing, checksums and the kernel's copy of every write (the
    encoders run on workers).  A measurement whose bytes were nearly all one codec's
    (``CODEC_SHARE``) is that codec's too, with the share of its time the thread was
    runnable (:func:`runnable_ns`: near 1 when the CPU, not the path, held the sender
    back).  Paused while the peer is idle (from the end of its last send to the start of
    the next), so time the application spent on the loop between transfers is not
    counted, while a measurement runs on across transfers: sends of a few MiB one after
    another each carry less than one (with a restart at every send, ``auto`` never
    measured raw and kept it on a link where int4 delivered twice its goodput).  The
    peer's first measurement is not fed: it counts the first use of every code path
    (over loopback 0.74 ns a byte against 0.25 after it, and raw, measured first, looked
    CPU-bound)."""

    def __init__(self) -> None:
        self._warm = False
        self._bytes = 0
        self._by_codec: dict[str, int] = {}
        self._cpu, self._wall, self._runnable = time.thread_time(), clock(), runnable_ns()
        # (thread CPU, wall clock, runnable ns) when the peer went idle; None while busy.
        self._paused: tuple[float, float, int | None] | None = (self._cpu, self._wall, self._runnable)

    def pause(self) -> None:
        """The peer went idle: what the loop's thread does until :meth:`resume` is not
        counted."""
        if self._paused is None:
            self._paused = (time.thread_time(), clock(), runnable_ns())

    def resume(self) -> None:
        """A send begins on an idle peer: the measurement goes on, the idle time left out."""
        if (paused := self._paused) is None:
            return
        self._paused = None
        cpu, wall, runnable = paused
        self._cpu += time.thread_time() - cpu
        self._wall += clock() - wall
        now_runnable = runnable_ns()
        if self._runnable is not None and runnable is not None and now_runnable is not None:
            self._runnable += now_runnable - runnable
        else:
            self._runnable = None  # (this measurement gives no runnable share)

    def delivered(self, wire_bytes: int, chooser: CodecChooser, codec: str) -> None:
        self._bytes += wire_bytes
        self._by_codec[codec] = self._by_codec.get(codec, 0) + wire_bytes
        if self._bytes >= TRANSPORT_SAMPLE_BYTES:
            # (an acknowledgement after the last send ended, the peer idle: measured up to
            # the pause, the idle time in neither this measurement nor the next)
            cpu, wall, runnable = self._paused or (time.thread_time(), clock(), runnable_ns())
            top = max(self._by_codec, key=self._by_codec.__getitem__)
            own = top if self._by_codec[top] >= CODEC_SHARE * self._bytes else None
            share = None
            if runnable is not None and self._runnable is not None and wall > self._wall:
                share = (runnable - self._runnable) / 1e9 / (wall - self._wall)
            if self._warm:
                chooser.observe_transport(self._bytes, cpu - self._cpu, own, runnable=share)
            self._warm = True
            self._bytes, self._cpu, self._wall, self._runnable = 0, cpu, wall, runnable
            self._by_codec.clear()


class PeerLink:
    """What the event loop holds of a :class:`Peer`, through its streams (each stream's
    ``owner``), its timer and its stream controller: its core, its streams and whether it
    is closed, and the Peer itself only weakly, strongly only while a ``send()`` runs.  So
    a Peer the application drops unclosed is garbage-collected (:func:`_abort_dropped`
    aborts its connections then), and one sending is not.  What a stream asks on every
    read (its core, whether it is current, the clock) needs no Peer; what it asks once a
    frame is in (a pump) reaches the Peer, and nothing once it is gone."""

    __slots__ = ("_peer", "closed", "core", "kept", "notsent_lowat", "retired", "sending", "streams")

    now = staticmethod(Pump.now)
    #: A replaced stream's slot holds its successor, and the core's connection for the
    #: slot goes with it: a stream asks is_current on every read (see ``Owner``).
    replaces_streams = True
    fixed_connections = False

    def __init__(self, peer: Peer, core: SenderCore, notsent_lowat: int | None) -> None:
        self.core, self.notsent_lowat = core, notsent_lowat
        self.streams: list[Stream] = []  # the Peer's own lists (Peer.streams, Peer._retired)
        self.retired: list[Stream] = []
        self.closed = False  # the Peer's (Peer.closed)
        self.kept: Peer | None = None  # the Peer, while sends run
        self.sending = 0
        self._peer = weakref.ref(peer)

    def is_current(self, stream: Stream) -> bool:
        return self.streams[stream.key] is stream and not self.closed

    def pump(self) -> None:
        if (peer := self._peer()) is not None:
            peer.pump()

    def stream_made(self, stream: Stream) -> bool:
        peer = self._peer()
        return peer is not None and peer.stream_made(stream)

    def stream_lost(self, stream: Stream) -> None:
        if (peer := self._peer()) is not None:
            peer.stream_lost(stream)

    def set_writable(self, stream: Stream, writable: bool) -> None:
        if (peer := self._peer()) is not None:
            peer.set_writable(stream, writable)

    def fire(self) -> None:
        """The Peer's timer."""
        if (peer := self._peer()) is not None:
            peer._fire()

    def hold(self, peer: Peer) -> None:
        """A send() begins: the Peer is kept alive until it ends (:meth:`release`), by
        the loop that holds its streams, however its caller holds the send's task."""
        self.sending += 1
        self.kept = peer

    def release(self) -> None:
        self.sending -= 1
        if not self.sending:
            self.kept = None


def _abort_dropped(link: PeerLink, loop: asyncio.AbstractEventLoop, pid: int, what: str) -> None:
    """A Peer's finalizer: garbage-collected unclosed (``what`` names it), its streams feed
    its core no more and their connections are aborted on its loop, nothing more sent (from
    whatever thread the collection ran in; where the loop is closed already, at once, as
    far as a closed loop lets them), and a ResourceWarning says so, as an unclosed
    socket's does.  Nothing in a child made by ``fork()`` (process ``pid`` runs the loop)."""
    if os.getpid() != pid:
        return
    link.closed = True  # (its streams read into scratch from now on)
    streams = [s for s in (*link.streams, *link.retired) if s.transport is not None]
    if streams:
        try:
            loop.call_soon_threadsafe(_abort_streams, streams)
        except RuntimeError:  # the loop is closed
            _abort_streams(streams, looped=False)
    warnings.warn(f"unclosed {what}: its connections are aborted now, as it is garbage-collected; "
                  "use `async with kvwire.connect(...)` or await its close()",
                  ResourceWarning, stacklevel=1)  # (run by a collector: no caller to name)


def _abort_streams(streams: Sequence[Stream], looped: bool = True) -> None:
    """Abort a dropped Peer's streams: on their loop, or (``looped`` False) where it is
    closed, each socket closed at once all the same."""
    for s in streams:
        try:
            if looped:
                s.abort()
            else:
                s.abort_unlooped()
        except Exception:
            _log.debug("aborting a dropped peer's stream failed", exc_info=True)


async def _control_streams(ref: weakref.ref[Peer]) -> None:
    """A Peer's stream controller (``streams="auto"``): every period, one sample per
    stream in use, then grow or shrink.  Holds the Peer only while it samples: a Peer
    dropped unclosed is collected, and this ends."""
    sampler = StreamSampler()
    period = 0.25
    peer = ref()
    if peer is None:
        return
    ctl = peer.stream_controller
    assert ctl is not None
    sampler.sample(peer._stream_readings(), peer._streams_in_use(ctl.streams), clock())  # the baselines
    while not peer.closed:
        peer = None
        await asyncio.sleep(period)
        if (peer := ref()) is None:
            return
        peer._control_period(ctl, sampler)


class Peer(Pump):
    """A client session of one or more TCP streams to one server; see :func:`kvwire.connect`.

    Garbage-collected unclosed (dropped without ``async with`` or :meth:`close`), its
    connections are aborted (nothing more is sent) with a ResourceWarning, as an unclosed
    socket is; a ``send()`` under way keeps it alive."""

    core: SenderCore
    #: Aborts its connections once it is garbage-collected unclosed (see open()).
    _finalizer: weakref.finalize[Any, Any] | None = None

    def __init__(
        self, host: str, port: int, *, secret: bytes, streams: int | str, codec: str,
        ssl: _ssl.SSLContext | None, options: ClientOptions, server_hostname: str | None = None,
    ) -> None:
        super().__init__()
        check_port(port, 1)
        if server_hostname is not None and ssl is None:
            raise UsageError(
                "server_hostname= is the name TLS checks the server's certificate against; "
                "it needs ssl= (an SSLContext): without ssl= the connection is plain TCP"
            )
        self.stream_controller: StreamController | None = None
        if streams == AUTO:
            streams = options.max_streams
            self.stream_controller = StreamController(max_streams=streams)
        self.core = SenderCore(options.sender_config(secret=secret, streams=streams))
        self._core_events = self.core.events  # what the pump takes (one queue for the session's life)
        self._link = PeerLink(self, self.core, options.notsent_lowat)
        _check_codec(codec)  # unknown names fail here, before any connection
        host = server_host(host)
        self.host, self.port, self.codec, self.options = host, port, codec, options
        self._ssl = ssl
        self._server_hostname = server_hostname if server_hostname is not None else default_server_hostname(host)
        # The address the session's first stream reached: every later stream and every
        # resume of the session connects to it, not to whatever ``host`` resolves to then
        # (another server behind the same name does not know the session).
        self._reached: AddrInfo | None = None
        if self.stream_controller is not None:
            self.core.active_streams = self.stream_controller.streams
        self.streams: list[Stream] = self._link.streams
        # Streams a reconnect replaced whose sockets are still open (a GOAWAY being
        # written): their send queues may still hold the caller's buffers.
        self._retired: list[Stream] = self._link.retired
        self.sends: dict[int, SendState] = {}
        self.changed = asyncio.Event()
        self.estimator = DeliveryRateEstimator(goodput_window=GOODPUT_WINDOW)
        # (when, wire bytes, KV bytes) of the chunks acknowledged in the last GOODPUT_WINDOW
        # seconds before the latest acknowledgement, with their sums: what a wire byte
        # delivered carries of KV now (statistics()["goodput_gbps"]).
        self._acked_recent: deque[tuple[float, int, int]] = deque()
        self._acked_wire = self._acked_kv = 0
        # Bytes in flight kept near one to two bandwidth-delay products across streams.
        # Its floor keeps two chunks queued per stream in use (with "auto": those the
        # controller uses, not every connection opened).
        self.inflight = InflightController(streams=self.core.active_streams or self.core.config.streams,
                                           chunk_bytes=options.chunk_bytes)
        self.chooser: CodecChooser | None = None
        self.transport_meter = _TransportMeter()
        # What receiving costs the server, as its REPORTs say (statistics()["receiver"]).
        self.receiver: dict[str, Any] = {"transport_s_per_gb": None, "decode_gbps": {}}
        self._last_sent_at = -math.inf  # when the last chunk went on a stream (app-limited test)
        self.bytes_sent = 0
        self._open_error: KvwireError | None = None  # a stream that failed while open() waits
        self._open_cause: BaseException | None = None  # what failed its connect (the error's cause)
        self._opening = False
        self._opened = False  # open() succeeded (through ``async with kvwire.connect(...)``)
        self._pumping = self._again = False
        self._resumes_logged = 0
        # The one close every close() waits for (shielded: a caller cancelled does not stop it).
        self._closing: asyncio.Task[None] | None = None
        self._ended_by_close = False  # close() ended the session (it was not broken before)
        # The session's error, as ``broken`` says it, for the core's own (see _explained).
        self._said: tuple[KvwireError, KvwireError] | None = None
        self._said_lock = threading.Lock()  # (made at most once, whichever thread reads first)

    @property
    def closed(self) -> bool:
        return self._link.closed

    @closed.setter
    def closed(self, value: bool) -> None:
        self._link.closed = value

    @property
    def notsent_lowat(self) -> int | None:
        return self._link.notsent_lowat

    def timer_callback(self) -> Callable[[], None]:
        return self._link.fire  # (not the Peer's own method: the loop does not keep it alive)

    @property
    def session_id(self) -> bytes:
        return self.core.session_id

    @property
    def server_codecs(self) -> tuple[str, ...]:
        return self.core.peer_codecs

    @property
    def max_transfers(self) -> int:
        """Transfers the server takes from this session at once (its WELCOME said): see
        :meth:`send`."""
        return self.core.max_transfers

    @property
    def reconnects(self) -> int:
        return self.core.counters["reconnects"]

    @property
    def resumes(self) -> int:
        return self.core.counters["resumes"]

    @property
    def chunks_resent(self) -> int:
        return self.core.counters["chunks_resent"]

    @property
    def active_streams(self) -> int:
        """Streams chunks are striped over now: the open ones (with ``streams="auto"``, of
        those the controller uses).  A slot given up, or reconnecting, is not counted."""
        return self.core.streams_in_use

    # -- the pump ------------------------------------------------------------------------

    def pump(self) -> None:
        """Hand the core's events to their consumers, write what it has to send, re-arm
        the timer and wake ``send()``s."""
        if self._pumping:
            self._again = True  # a callback of a write: the running pump goes round again
            return
        self._pumping = True
        try:
            self._again = True
            while self._again:
                self._again = False
                self._pump_once()
        finally:
            self._pumping = False

    def _pump_once(self) -> None:
        core, events, changed = self.core, self._core_events, False
        while True:
            while events:
                changed = True
                self._on_event(events.popleft())
            limit = self.inflight.update(self.estimator, clock())
            if limit == core.inflight_limit:
                break
            core.inflight_limit = limit
            core.pump()
        for s in self.streams:
            s.flush()
        self.arm_timer()
        if changed:
            self.changed.set()

    # -- the caller's buffers the streams still hold -----------------------------------------

    def write_marks(self) -> list[tuple[Stream, int]]:
        """Where each stream's writing stands now (everything the core has to send handed
        to them first): :meth:`written_past` of it is True once all of it was written (or
        dropped), so no buffer of a send that has ended is read any more.  A send that
        failed may have left frames queued on the streams; its caller's arrays are free
        once the streams got this far."""
        self.pump()
        return [(s, s.pushed) for s in (*self.streams, *self._retired) if s.transport is not None]

    @staticmethod
    def written_past(marks: list[tuple[Stream, int]]) -> bool:
        return all(s.written() >= mark for s, mark in marks)

    # -- what a stream asks of its pump --------------------------------------------------

    def stream_made(self, stream: Stream) -> bool:
        if not self._link.is_current(stream):
            return False
        self.core.stream_opened(stream.key, self.now(), started=stream.started)
        return True

    def set_writable(self, stream: Stream, writable: bool) -> None:
        self.core.set_writable(stream.key, writable)
        if writable:
            self.pump()

    def _on_event(self, ev: Any) -> None:
        est = self.estimator
        # The two events of every chunk first, tested by exact class (no subclasses).
        if type(ev) is ChunkSent:
            self.bytes_sent += ev.wire_size
            now = clock()
            peak = est.max_filter_bps or 0
            bdp = peak / 8 * (est.min_rtt or 0)
            # As in TCP's rate sampling, a chunk with nothing queued behind it is an
            # app-limited sample (the producer, an encoder or the application, set the
            # pace, not the path) when it found the pipe running dry (less than one
            # bandwidth-delay product in flight; before the first sample no BDP is known
            # and a lone chunk measures its round trip), or when it went out as it was
            # added after the producer took longer to make it than half its time on the
            # wire at the path's peak rate (chunks larger than the BDP: an encoder slower
            # than the path keeps about one in flight, which is no measure of the path).
            # A fast producer that keeps the pipe full is never app-limited, however its
            # chunks meet the in-flight limit's gain cycle. The producer's time counts from
            # the later of the last send and its send task's return from waiting on the
            # session (for a grant, or for its queue to go out): a wait the path set is not
            # the producer's (counted, it made raw chunks look slow whenever the peak was
            # above the path's rate, after a drop, and kept the stale peak published).
            # A producer's pause sets the pace only where chunks are larger than the BDP
            # (one in flight is a full pipe by bytes) or the flight holds little beyond a
            # BDP; with more than two chunks queued past it the path drains that queue
            # through the pause and the samples measure the path (on two busy cores a raw
            # sender descheduled for 2-7 ms with 90 MB in flight at 10 Gbit/s, 20 ms,
            # marked most samples app-limited, and the stale peak was published between
            # transfers). On loopback, where a chunk is larger than the BDP, this is
            # what sends auto's raw probes while compact chunks back up at the receiver
            # (counted there, auto stayed on int4 for 80% of one run's chunks).
            st = self.sends.get(ev.address.transfer_id)
            gap = now - max(self._last_sent_at, -math.inf if st is None else st.resumed_at)
            self._last_sent_at = now
            slow = (not ev.waited and gap * peak / 8 > 0.5 * ev.wire_size
                    and (ev.wire_size > bdp or est.bytes_in_flight < bdp + 2 * ev.wire_size))
            limited = not ev.queued and (bdp <= 0 or est.bytes_in_flight < bdp or slow)
            est.on_send(ev.address, ev.wire_size, now, app_limited=limited)
        elif type(ev) is ChunkDelivered:
            now = clock()
            est.on_ack(ev.address, now)
            self._count_acked(now, ev.wire_size, ev.kv_bytes)
            if (chooser := self.chooser) is not None:
                codec = codec_by_id(ev.codec_id).name
                self.transport_meter.delivered(ev.wire_size, chooser, codec)
                if chooser.measures_goodput:
                    chooser.observe_delivered(codec, ev.kv_bytes, now, first_layer=ev.address.layer == 0,
                                              held=est.hold_limited,  # a ProbeRTT drain: no codec's pace
                                              chunk=ev.address, wire_bytes=ev.wire_size)
            # Time to first layer: the spec's first layer (layer 0), every chunk of it
            # acknowledged. Over several streams later layers may complete before it.
            if (ev.layer_done and ev.address.layer == 0 and (st := self.sends.get(ev.address.transfer_id)) is not None
                    and st.first_layer_at is None):
                st.first_layer_at = now
        elif isinstance(ev, ChunkLost):
            est.on_loss(ev.address)
        elif isinstance(ev, ReceiverCosts):
            self._receiver_costs(ev)
        elif isinstance(ev, TransferCredit):
            # (an ACCEPT, or a CREDIT: one read before its ACCEPT, on another stream, is none)
            st = self.sends.get(ev.transfer_id)
            if st is not None and self.core.accepted(ev.transfer_id):
                st.credit(ev.layer_limit)
        elif isinstance(ev, TransferDone):
            if (st := self.sends.get(ev.transfer_id)) is not None:
                st.done = ev
            if self.chooser is not None and not self.core.bytes_in_flight and not self.core.queued_bytes():
                self.chooser.observe_idle()  # until the next send, no codec sets the pace
        elif isinstance(ev, TransferFailed):
            if ev.by_peer:
                _log.info("transfer %d reset by the server %s: %s", ev.transfer_id, self._where,
                          printable(str(ev.error)))
            if (st := self.sends.get(ev.transfer_id)) is not None:
                st.fail(ev.error)
            if self.chooser is not None:
                # its chunks sent raw instead are never acknowledged
                self.chooser.observe_failed(ev.transfer_id)
                if not self.core.bytes_in_flight and not self.core.queued_bytes():
                    self.chooser.observe_idle()  # until the next send, no codec sets the pace
        elif isinstance(ev, StreamWanted):
            self.spawn(self._connect(ev.index))
        elif isinstance(ev, StreamClosed):
            self._on_closed(ev)
        elif isinstance(ev, StreamGivenUp):
            self._on_given_up(ev)
        elif isinstance(ev, SessionFailed):
            est.forget_all()
            # ``broken`` as it will be said, made here, on the loop, before anyone reads it
            # (a SyncPeer reads ``broken`` from its caller's thread)
            self._explained(self.core.broken)

    def _count_acked(self, now: float, wire_bytes: int, kv_bytes: int) -> None:
        """One chunk acknowledged: kept for the KV per wire byte of the last
        :data:`GOODPUT_WINDOW` seconds of acknowledgements (as the estimator expires its
        delivery-rate samples, by the latest acknowledgement's time)."""
        recent = self._acked_recent
        recent.append((now, wire_bytes, kv_bytes))
        self._acked_wire += wire_bytes
        self._acked_kv += kv_bytes
        horizon = now - GOODPUT_WINDOW
        while recent[0][0] <= horizon:
            _, wire, kv = recent.popleft()
            self._acked_wire -= wire
            self._acked_kv -= kv

    def _on_closed(self, ev: StreamClosed) -> None:
        closed = ev.closed
        if closed.goaway and closed.by_peer:
            _log.info("GOAWAY from %s on stream %d: %s %s", self._where, ev.index, code_name(closed.code),
                      printable(closed.message or "no reason given"))
        if isinstance(closed.error, AuthenticationError):
            _log.warning("authentication with %s failed: %s", self._where, printable(str(closed.error)))
        if ev.resumed and self.resumes > self._resumes_logged:  # not again for a failed reconnect
            self._resumes_logged = self.resumes
            _log.info("stream %d to %s broke; resuming (%d of at most %d)", ev.index, self._where,
                      self.resumes, self.options.max_reconnects)
        if self._opening and self._open_error is None and not (ev.resumed and self._session_made):
            # (a later stream of a session already made is reconnected like any other)
            # The core's verdict first: a session lost for the server's clean GOAWAY says
            # the GOAWAY's reason, not that a stream closed.
            self._open_error = self._handshake_error(ev, self.core.broken or closed.error or ConnectionLostError(ev.reason))

    def _handshake_error(self, ev: StreamClosed, err: KvwireError) -> KvwireError:
        """The error ``open()`` fails with for ``err``, which closed a stream during its
        handshake (before the session was made), of the same class and code: one the
        connection ended with itself says where, and what answered where it was no kvwire
        server (its first bytes, escaped, when the first of them was no kvwire frame: an
        HTTP server's answer, say); a failed authentication says that the secrets differ;
        a handshake not done in time names ``connect_timeout``.  Any other (a GOAWAY's
        reason, say) as it is."""
        closed = ev.closed
        if err is not closed.error:
            return err
        stream = self.streams[ev.index] if ev.index < len(self.streams) else None
        first = stream.first if isinstance(stream, _ClientStream) else b""
        conn = stream.handshake if isinstance(stream, _ClientStream) else None
        answered = conn is not None and conn.version is not None  # a CHALLENGE was taken
        where = self._where
        if isinstance(err, AuthenticationError):
            why = "" if str(err) == "authentication failed" else f" ({err})"
            return AuthenticationError(
                f"authentication with {where} failed{why}: the secret given to connect() is not "
                "the server's (the two must be the same bytes)", code=err.code)
        # What answered sent no kvwire frame first: a kvwire server's first is CHALLENGE or GOAWAY.
        alien = not answered and bool(first) and first[0] not in (FrameType.CHALLENGE, FrameType.GOAWAY)
        if isinstance(err, TransferTimeoutError) and not closed.by_peer:
            said = ("" if answered or (first and not alien) else "nothing came back" if not first
                    else f"what it sent is no kvwire frame: {_first_bytes(first)}")
            return TransferTimeoutError(
                f"{where} did not complete the kvwire handshake within connect_timeout="
                f"{self.options.connect_timeout:g} s" + (f" ({said})" if said else ""), code=err.code)
        if isinstance(err, ProtocolError) and not closed.by_peer and alien:
            return type(err)(f"{where} did not answer as a kvwire server (is that its address and port?): "
                             f"its first bytes were {_first_bytes(first)} ({err})", code=err.code)
        if isinstance(err, ConnectionLostError) and closed.by_peer and alien:
            return ConnectionLostError(
                f"{where} closed the connection during the handshake without answering as a kvwire "
                f"server: its first bytes were {_first_bytes(first)}", code=err.code)
        if isinstance(err, ConnectionLostError) and closed.by_peer and not first and self._ssl is None:
            # A TLS server takes the HELLO for a broken ClientHello and closes, sending nothing.
            return ConnectionLostError(
                f"{where} closed the connection during the handshake before sending anything "
                f"{PLAIN_TO_TLS_HINT}", code=err.code)
        return err

    def _on_given_up(self, ev: StreamGivenUp) -> None:
        """A slot the session goes on without: with a fixed stream count, ``open()`` fails
        with its error (the streams asked for cannot all open); with ``"auto"`` the peer
        settles for the streams the server lets it open."""
        self._fit_streams()
        left = self.core.open_streams
        # With "auto", a server allowing fewer streams than it tries is expected: not a warning.
        expected = self.stream_controller is not None and ev.error.code == ErrorCode.LIMIT_EXCEEDED
        _log.log(logging.INFO if expected else logging.WARNING,
                 "stream %d to %s given up (%s); the session goes on with stream(s) %s",
                 ev.index, self._where, printable(str(ev.error)), ", ".join(map(str, left)) or "none open now")
        if self._opening and self._open_error is None and self.stream_controller is None:
            self._open_error = ev.error

    @property
    def _where(self) -> str:
        """The server for a log line or an error: ``host:port`` (``[host]:port`` for IPv6);
        a name, once a stream reached one of its addresses, with that address:
        ``name (address:port)``."""
        named = address((self.host, self.port))
        reached = self._reached
        if reached is None or _is_address(self.host):
            return named
        return f"{self.host} ({address(reached[4])})"

    @property
    def _session_made(self) -> bool:
        """Whether the server welcomed a first stream: a session exists to resume."""
        return self.core.session_id != NO_SESSION

    async def _connect(self, index: int) -> None:
        """Open slot ``index``'s TCP (and TLS) connection; the handshake is the core's."""
        proto = _ClientStream(self._link, index)
        self._retired[:] = [s for s in (*self._retired, *self.streams[index:index + 1]) if s.transport is not None]
        self.streams[index:index + 1] = [proto]
        opts, loop = self.options, asyncio.get_running_loop()
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for returns the connection
            # when a cancel lands in the iteration it is made, and the task goes on.
            async with asyncio.timeout(opts.connect_timeout):
                await self._open_connection(loop, proto)
            return
        except Exception as exc:  # whatever it is, it is this stream's failure
            # Not the task's: a task ending with it would leave the slot wanted for ever
            # (open() waiting past connect_timeout, a resume never retried).
            err = self._connect_error(exc)
            cause = None if err is exc else exc
        if not self.closed and self.streams[index] is proto:
            if self._opening and self._open_error is None and not self._session_made:
                self._open_error = err  # (a later stream of the session is retried by the core)
                self._open_cause = cause
            self.core.stream_failed(index, self.now(), err)
            self.pump()

    async def _open_connection(self, loop: asyncio.AbstractEventLoop, proto: Stream) -> None:
        """Connect ``proto``: the session's first stream to the first of ``host``'s
        addresses to answer (:func:`connect_first`), which the session keeps; every later
        stream, and every resume, to that address only.  TLS checks the certificate against
        ``server_hostname`` (by default ``host``), whichever address was reached."""
        if self._reached is not None and self._session_made:
            infos: Sequence[AddrInfo] = [self._reached]
        else:
            answers = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
            infos = _interleave(_scoped(self.host, answers))
        sock, info = await connect_first(loop, infos)
        if not self._session_made:
            self._reached = info
        made = False

        def protocol() -> Stream:
            nonlocal made
            made = True  # the loop took the socket: it closes it, whatever happens next
            return proto

        try:
            await loop.create_connection(
                protocol, sock=sock, ssl=self._ssl,
                server_hostname=self._server_hostname if self._ssl else None,
                ssl_handshake_timeout=self.options.connect_timeout if self._ssl else None,
            )
        except BaseException:
            if not made:
                sock.close()
            raise

    def _connect_error(self, exc: Exception) -> KvwireError:
        """The kvwire error a failed connect of a stream ends with: a kvwire error as it is
        (a UsageError), a timeout, TLS or socket error as what it means, anything else
        (a bug, an ``ssl=`` or host asyncio cannot use) a ConnectionLostError naming it."""
        where = self._where
        if isinstance(exc, KvwireError):
            return exc
        if isinstance(exc, TimeoutError):
            return TransferTimeoutError(f"connecting to {where} timed out "
                                        f"(connect_timeout={self.options.connect_timeout:g} s)")
        if isinstance(exc, _ssl.SSLCertVerificationError):
            return AuthenticationError(f"TLS certificate verification failed: {_reason(exc)}")
        if isinstance(exc, _ssl.SSLError):
            # WRONG_VERSION_NUMBER: what came back is no TLS record (a kvwire server without
            # TLS answers the ClientHello with a GOAWAY frame).
            hint = f" {TLS_TO_PLAIN_HINT}" if getattr(exc, "reason", None) == "WRONG_VERSION_NUMBER" else ""
            return ConnectionLostError(f"TLS handshake with {where} failed: {_reason(exc)}{hint}")
        if isinstance(exc, (OSError, ValueError)):  # ValueError: a host name the resolver refuses (UnicodeError)
            return ConnectionLostError(f"cannot connect to {where}: {_reason(exc)}")
        _log.debug("connecting to %s failed unexpectedly", self._where, exc_info=exc)
        text = _text(exc)
        return ConnectionLostError(f"cannot connect to {where}: {type(exc).__name__}" + (f": {text}" if text else ""))

    # -- public API ----------------------------------------------------------------------

    async def open(self) -> None:
        """Open the session: its first stream (bounded by ``connect_timeout``: resolving
        ``host``, its TCP connect to the first of its addresses to answer, TLS and kvwire
        handshakes together), then the others join it, at the address it reached, within
        another ``connect_timeout``; so ``open()`` takes at most twice that.  One that
        fails closes the peer without waiting for the server to see its streams close
        (their sockets are dropped at once: a server that does not answer is not waited for).
        A first stream whose TCP connect or TLS handshake fails, whatever the exception,
        fails ``open()`` as it fails, with a kvwire error: TransferTimeoutError (not in
        time), AuthenticationError (the server's certificate), a UsageError as it was
        raised, ConnectionLostError for anything else; the exception is its ``__cause__``.

        With a fixed stream count every stream must open: a stream given up (its joins
        failed ``reconnect_attempts`` times, or the server refused it with LIMIT_EXCEEDED)
        fails ``open()`` with its error, one not open in time with TransferTimeoutError.
        With ``streams="auto"`` the peer goes on with the streams that opened: once every
        slot is open or given up, or when the time is up (a slot still joining then joins
        later, as a reconnect would)."""
        self._opening = True
        if self._finalizer is None:
            self._finalizer = weakref.finalize(self, _abort_dropped, self._link, asyncio.get_running_loop(),
                                               os.getpid(), f"kvwire Peer to {address((self.host, self.port))}")
            self._finalizer.atexit = False
        try:
            self.pump()
            await self._until(lambda: self._session_made, lambda: self._open_error)
            joining = asyncio.timeout(self.options.connect_timeout)
            try:
                async with joining:
                    await self._until(self._streams_settled, lambda: self._open_error)
            except TimeoutError:
                if not joining.expired():
                    raise  # the session's own error (a TransferTimeoutError is a TimeoutError)
                if self.stream_controller is None or not self.core.open_streams:
                    missing = [i for i in range(self.core.config.streams) if not self.core.is_open(i)]
                    raise TransferTimeoutError(
                        f"stream(s) {', '.join(map(str, missing))} did not join the session in "
                        f"connect_timeout={self.options.connect_timeout} s") from None
                # "auto": on with the streams open; the others join when they can
            self._use_codec(self.codec)
            self._opened = True
        except BaseException as exc:
            await self._close(linger=0.0)
            cause, self._open_cause = self._open_cause, None
            if cause is not None and exc is self._open_error:
                raise exc from cause  # (raised detached: the failed connect's own exception)
            raise
        finally:
            self._opening = False

    def _streams_settled(self) -> bool:
        """Whether ``open()`` is done waiting: every stream open, or with ``"auto"`` every
        one open or given up (at least one open)."""
        core, n = self.core, self.core.config.streams
        if self.stream_controller is None:
            return len(core.open_streams) == n
        return bool(core.open_streams) and all(core.is_open(i) or core.is_given_up(i) for i in range(n))

    def _fit_streams(self) -> None:
        """A slot was given up: the streams in use fit the slots left.  With
        ``streams="auto"`` the controller chooses among those only (the server allows fewer
        streams, or a slot could not reconnect, during open() or after it); the in-flight
        floor counts no more streams than are left."""
        core = self.core
        left = max(1, sum(not core.is_given_up(i) for i in range(core.config.streams)))
        if (ctl := self.stream_controller) is not None:
            ctl.limit(left)
            core.active_streams = ctl.streams
        self.inflight.set_streams(ctl.streams if ctl is not None else left)

    def _use_codec(self, name: str) -> None:
        """Check that the server accepts codec ``name`` (for ``auto``: make the chooser)."""
        if name == AUTO:
            if self.chooser is None:
                self.chooser = make_chooser(self.server_codecs, self.options.auto_codec)
                if self.core.path_rtt is not None:
                    self.chooser.observe_path_rtt(self.core.path_rtt)
                if any(on_this_host(s.transport) for s in self.streams):
                    self.chooser.observe_shared_host()
            return
        get_codec(name)
        if name not in self.server_codecs:
            raise IncompatiblePeerError(
                f"server does not accept codec {name!r} (it accepts {', '.join(self.server_codecs)})",
                code=ErrorCode.UNSUPPORTED_CODEC,
            )

    async def _until(self, ready: Callable[[], bool], error: Callable[[], KvwireError | None]) -> None:
        while True:
            self.changed.clear()
            err = error() or self.broken
            if err is not None:
                raise detached(err)  # raised at every call: each would add its frames
            if ready():
                return
            await self.changed.wait()

    @property
    def broken(self) -> KvwireError | None:
        """The error that ended this peer's session (the server shut down or restarted, a
        stream could not be resumed, a peer's protocol error; :meth:`close` too, a
        ConnectionLostError then), or None while it lives.  A peer whose session ended
        cannot send again (every ``send()`` raises at once, of this error's class): close
        it and ``connect()`` again.  Once :meth:`close` was called a ``send()`` says that
        the peer was closed: ``connect()`` again.  ``closed`` says only whether
        :meth:`close` was called.  A resume the server answered UNKNOWN_SESSION (it
        restarted, or ``resume_timeout`` passed) says so before the server's own text, as
        the transfers it failed do."""
        return self._explained(self.core.broken)

    def _explained(self, err: KvwireError | None) -> KvwireError | None:
        """``err`` (the core's ``broken``), but for a session the server no longer has
        (UNKNOWN_SESSION: its text, "no such session", says nothing of why): an error of
        the same class and code saying :data:`SESSION_GONE` first; made once (when the
        loop handles the session's failure, or under a lock by the first look from any
        thread), the same object at every look."""
        if err is None or err.code != ErrorCode.UNKNOWN_SESSION or SESSION_GONE in str(err):
            return err
        said = self._said
        if said is None or said[0] is not err:
            with self._said_lock:
                said = self._said
                if said is None or said[0] is not err:
                    explained = type(err)(f"{SESSION_GONE}: {err}", code=err.code)
                    explained.__cause__ = err
                    said = self._said = (err, explained)
        return said[1]

    def check_usable(self) -> None:
        err = self.broken
        # A new error each time: nothing of an earlier caller's frames is kept.
        if self._closing is not None:  # close() was called
            if err is None or self._ended_by_close:
                raise ConnectionLostError("this peer was closed: connect() again for a new session")
            raise type(err)(f"{err} (this peer's session had ended, and the peer was closed: "
                            "connect() again)", code=err.code)
        if err is not None:
            raise type(err)(f"{err} (this peer's session has ended: close it and connect() again)", code=err.code)

    async def send(
        self, request_id: str, spec: KVSpec, layers: Layers, *, meta: dict[str, Any] | None = None,
        codec: str | None = None, timeout: float | None = None, blocks: Sequence[tuple[Any, int]] | None = None,
        deadline: float | None = None,
    ) -> Receipt:
        """Send one KV cache; return when the receiver has acknowledged every chunk.

        ``layers`` is a sequence, iterable or async iterable of ``(k, v)`` arrays shaped
        ``[tokens, num_kv_heads, head_dim]`` of ``spec.dtype`` (anything else, an int, is a
        UsageError before anything is sent); each layer is sent as soon as it is produced.
        Arrays must not be modified until ``send()`` returns.  A sequence must hold
        ``spec.num_layers`` layers (UsageError before anything is sent); an iterator is
        read once past its last layer before that layer's final chunk is sent, so one
        yielding a layer too many (UsageError) or failing after its last
        (TransferAbortedError) fails a transfer the receiver has not completed.  (So a
        producer must not wait, after yielding its last layer, for the transfer to
        complete: that layer's final chunk waits for it.)

        The server takes at most :attr:`max_transfers` transfers of this session at once,
        the complete ones its application has not claimed (``expect()``/``accept()``)
        included: a send past it fails at once with LimitExceededError and leaves nothing
        behind, so it may be retried once one of them completed and was claimed.

        ``codec`` overrides the session's codec for this transfer; ``"auto"`` picks one per
        chunk from the live bandwidth estimate and each codec's measured encode speed, and
        with ``deadline`` (seconds) steps down in precision only as far as needed to finish
        in time.  ``timeout`` bounds the whole send (TransferTimeoutError).  ``blocks``
        lists the ``(block id, version)`` pairs of the prefix blocks this cache holds
        (anything else, an entry not a pair or a bare ``str``, is a UsageError).
        """
        return await self._send_noting(request_id, spec, layers, meta=meta, codec=codec, timeout=timeout,
                                       blocks=blocks, deadline=deadline)

    async def _send_noting(
        self, request_id: str, spec: KVSpec, layers: Layers, *, progress: SendProgress | None = None,
        meta: dict[str, Any] | None = None, codec: str | None = None, timeout: float | None = None,
        blocks: Sequence[tuple[Any, int]] | None = None, deadline: float | None = None,
    ) -> Receipt:
        """:meth:`send`, keeping ``progress`` up to date on the loop (whether the server
        accepted the transfer, the layers it granted, whether the send waits for credit):
        how :class:`kvwire.sync.SendHandle` knows, from another thread, whether its send
        started and what holds it."""
        if not isinstance(spec, KVSpec):
            raise UsageError("spec must be a kvwire.KVSpec")
        codec_name, meta_bytes, versions = self._send_arguments(
            codec=codec, timeout=timeout, deadline=deadline, meta=meta, blocks=blocks)
        self.check_usable()
        if not self._opened:
            raise UsageError("the peer is not connected: use `async with kvwire.connect(...) as peer`")
        self._use_codec(codec_name)
        self._link.hold(self)  # (a Peer dropped while it sends is kept until the send ends)
        try:
            return await _send(self, request_id, spec, layers, meta_bytes, codec_name, versions, deadline, timeout,
                               progress)
        finally:
            self._link.release()

    def _send_arguments(
        self, *, codec: str | None = None, timeout: float | None = None, deadline: float | None = None,
        meta: dict[str, Any] | None = None, blocks: Sequence[tuple[Any, int]] | None = None,
    ) -> tuple[str, bytes, tuple[BlockVersion, ...]]:
        """What :meth:`send` checks of its options before anything else (UsageError), and
        what it makes of them: the codec's name, BEGIN's meta bytes and block versions.
        Touches nothing of the peer, so :meth:`kvwire.sync.SyncPeer.begin` runs it in the
        caller's thread.  Whether the server accepts the codec is checked by ``send()``."""
        check_seconds("timeout", timeout)
        check_seconds("deadline", deadline)
        codec_name = codec if codec is not None else self.codec
        _check_codec(codec_name)  # a name no codec has (or not a str): UsageError
        meta_bytes, versions = begin_fields(meta, blocks)
        if deadline is not None and codec_name != AUTO:
            raise UsageError("deadline= steers codec='auto'; with a fixed codec use timeout=")
        return codec_name, meta_bytes, versions

    def _receiver_costs(self, ev: ReceiverCosts) -> None:
        """The server's REPORT: kept for :meth:`statistics`, and fed to ``auto``."""
        decode: dict[str, float] = {}
        for cid, seconds in ev.decode_s_per_element.items():
            try:
                decode[codec_by_id(cid).name] = seconds
            except KvwireError:
                continue  # a codec this side does not know: advisory, ignored
        if ev.transport_s_per_byte is not None:
            self.receiver["transport_s_per_gb"] = ev.transport_s_per_byte * 1e9
        for name, seconds in decode.items():
            # Gbit/s of fp16 out (16 bits an element), as every *_gbps figure is gigabits.
            self.receiver["decode_gbps"][name] = 16 / seconds / 1e9
        chooser = self.chooser
        if chooser is None:
            return
        if ev.transport_s_per_byte is not None:
            chooser.observe_receiver_transport(ev.transport_s_per_byte)
        for name, seconds in decode.items():
            # Only codecs the chooser counts a decode for (raw lands in place).
            if name in chooser.codecs and chooser.decode_speed(name) is not None:
                chooser.observe_decode(name, 2 << 20, seconds * (1 << 20))

    @property
    def protocol_version(self) -> int | None:
        """The wire protocol version the session agreed with the server (docs/protocol.md
        5.4: the highest both speak, 2 between two peers of this release); ``None``
        until the first stream's handshake agreed it."""
        return self.core.version

    def statistics(self) -> dict[str, Any]:
        """A snapshot: the bandwidth/RTT estimate, bytes in flight, and per stream credit,
        bytes and (on Linux, direct paths) the kernel's TCP_INFO view.

        Rates are in Gbit/s (``*_gbps``, as :mod:`kvwire.units` reads them).
        ``estimated_gbps`` is the published bandwidth estimate of the path (wire bytes);
        ``wire_gbps`` the wire bytes acknowledged per second over the last
        :data:`GOODPUT_WINDOW` seconds of samples the path, not the sender, paced;
        ``goodput_gbps`` that rate in KV bytes (at the spec's dtype, as
        :attr:`Receipt.goodput_gbps`): ``wire_gbps`` times the KV bytes per wire byte of the
        chunks acknowledged over that window (above ``wire_gbps`` with a compact codec).
        Both are ``None`` before the first such sample.  ``receiver`` is what the server's
        REPORTs say receiving costs it: ``transport_s_per_gb`` (its event loop's CPU
        seconds per GB of CHUNK frames, decodes left out) and ``decode_gbps`` (per codec,
        the Gbit/s of fp16 its decode yields on the server).  ``protocol_version`` is
        :attr:`protocol_version`.  ``transfers_in_flight`` counts the sends under way,
        ``transfers_waiting_to_start`` those of them whose BEGIN the server has not
        answered yet (it holds ACCEPT while its buffer budget has no room for a first
        layer: their ``send()`` waits, within its ``timeout``)."""
        snap = self.estimator.snapshot()
        wire_bps = snap.goodput_bps
        goodput_bps = wire_bps * self._acked_kv / self._acked_wire if wire_bps and self._acked_wire else None
        streams = []
        for s in self.streams:
            conn = s.conn
            entry: dict[str, Any] = {
                "index": s.key, "open": self.core.is_open(s.key) and s.transport is not None,
                "bytes_sent": conn.bytes_sent if conn else 0, "credit": conn.send_credit if conn else 0,
                "chunks_in_flight": len(conn.in_flight_chunks()) if conn else 0,
            }
            info = read_tcp_info(s.transport.get_extra_info("socket")) if s.transport is not None else None
            if info is not None:
                entry["tcp"] = {
                    "rtt_ms": info.rtt_us / 1e3 if info.rtt_us is not None else None,
                    "delivery_rate_gbps": info.delivery_rate * 8 / 1e9 if info.delivery_rate is not None else None,
                    "cwnd": info.snd_cwnd, "total_retrans": info.total_retrans, "dsack_dups": info.dsack_dups,
                    "notsent_bytes": info.notsent_bytes, "bytes_acked": info.bytes_acked,
                }
            streams.append(entry)
        return {
            "session_id": self.session_id.hex(),
            "protocol_version": self.core.version,
            "estimated_gbps": snap.bandwidth_bps / 1e9 if snap.bandwidth_bps else None,
            "goodput_gbps": goodput_bps / 1e9 if goodput_bps else None,
            "wire_gbps": wire_bps / 1e9 if wire_bps else None,
            "min_rtt_ms": snap.min_rtt * 1e3 if snap.min_rtt is not None else None,
            "srtt_ms": snap.srtt * 1e3 if snap.srtt is not None else None,
            "bytes_in_flight": snap.bytes_in_flight, "inflight_target": self.inflight.update(self.estimator, clock()),
            "streams": streams, "transfers_in_flight": self.core.transfers,
            "transfers_waiting_to_start": self.core.waiting_to_start, "bytes_sent": self.bytes_sent,
            "receiver": {"transport_s_per_gb": self.receiver["transport_s_per_gb"],
                         "decode_gbps": dict(self.receiver["decode_gbps"])},
            **self.core.counters,
        }

    async def close(self) -> None:
        """Close every stream and end every task this peer started (the one teardown
        path: after it returns nothing of the peer is pending; a stream whose server does
        not read its GOAWAY is dropped after a second).  Idempotent: a close() while
        another is under way waits for that one to end; a close() that is cancelled
        still closes the peer (a later close() waits for it)."""
        await self._close(linger=1.0)

    async def _close(self, linger: float) -> None:
        task = self._closing
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            task = self._closing = asyncio.get_running_loop().create_task(self._teardown(linger))
        await asyncio.shield(task)

    async def _teardown(self, linger: float) -> None:
        if self.core.broken is None:
            self._ended_by_close = True
        if not self.closed:
            self.core.close(self.now())
            self.pump()  # transfers fail, every stream writes its GOAWAY and closes
        await self.teardown([*self.streams, *(s for s in self._retired if s.transport is not None)], linger)
        self._retired.clear()
        if self._finalizer is not None:
            self._finalizer.detach()  # (closed: nothing for it to do)

    async def __aenter__(self) -> Peer:
        await self.open()
        if self.stream_controller is not None:
            self.spawn(_control_streams(weakref.ref(self)))
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    def _control_period(self, ctl: StreamController, sampler: StreamSampler) -> None:
        """One controller period (:func:`_control_streams`): one sample per stream in use,
        then grow or shrink."""
        now = clock()
        samples = sampler.sample(self._stream_readings(), self._streams_in_use(ctl.streams), now)
        core = self.core
        idle = not core.transfers or (core.queued_bytes() == 0 and self.estimator.bytes_in_flight == 0)
        ctl.evaluate(samples, now, app_limited=idle)
        if core.active_streams != ctl.streams:
            core.active_streams = ctl.streams
            self.inflight.set_streams(ctl.streams)
            sampler.use(self._streams_in_use(ctl.streams))
            core.pump()
            self.pump()

    def _streams_in_use(self, count: int) -> list[int]:
        # The streams chunks go on: the first ``count`` open ones (SenderCore._best_stream).
        return [s.key for s in self.streams if self.core.is_open(s.key)][:count]

    def _stream_readings(self) -> dict[int, StreamReading]:
        """Every open stream's acknowledged bytes and TCP_INFO time counters, now."""
        readings = {}
        for s in self.streams:
            if not self.core.is_open(s.key):
                continue
            info = read_tcp_info(s.transport.get_extra_info("socket")) if s.transport is not None else None
            readings[s.key] = StreamReading(
                acked_bytes=self.core.acked_bytes(s.key),
                busy_time_us=info.busy_time_us if info is not None else None,
                rwnd_limited_us=info.rwnd_limited_us if info is not None else None,
                sndbuf_limited_us=info.sndbuf_limited_us if info is not None else None,
            )
        return readings


__all__ = ["ClientOptions", "Peer", "Receipt"]
