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
import errno
import inspect
import itertools
import logging
import math
import os
import socket
import ssl as _ssl
import sys
import time
import weakref
from collections import OrderedDict, deque
from types import TracebackType
from typing import Any

from kvwire.aio import _gpu
from kvwire.aio._logtext import address, code_name, printable, scoped_host
from kvwire.aio._pool import default_max_bytes
from kvwire.aio._receive import ArrayStore, check_destination
from kvwire.aio._stream import REPLY_QUEUE_HIGH, REPLY_QUEUE_LOW, Pump, Stream
from kvwire.aio._transfer import Transfer
from kvwire.consistency.blocks import block_from_key
from kvwire.consistency.registry import Registry
from kvwire.errors import (
    ConnectionLostError,
    ErrorCode,
    KvwireError,
    RegistryUnavailableError,
    StaleVersionError,
    TransferTimeoutError,
    UsageError,
)
from kvwire.session.options import ServerOptions, check_port, check_seconds, make_server_options
from kvwire.session.receiver import (
    AuthenticationFailed,
    ConnectionDropped,
    GoawayReceived,
    InternalError,
    Key,
    LayerReady,
    ReceiverCore,
    ReceiverEvent,
    RegistryCheck,
    RegistryPublish,
    StreamResumed,
    TransferAborted,
    TransferArrived,
    TransferDropped,
    TransferFailed,
    quoted_id,
    stale_error,
)
from kvwire.session.sender import check_request_id
from kvwire.units import format_size, is_ipv6

_log = logging.getLogger("kvwire")

#: Error codes of a connection this server closed for which the peer is not to blame (it
#: fell silent, was closed with its session, or resumed one the server no longer has):
#: logged at INFO; any other (a rule the peer broke, a limit, a corrupted frame) at WARNING.
_QUIET_CODES = frozenset({ErrorCode.NO_ERROR, ErrorCode.TIMEOUT, ErrorCode.SESSION_LOST,
                          ErrorCode.UNKNOWN_SESSION, ErrorCode.CANCELLED})


#: Seconds over which the server measures what receiving costs it, and tells the clients
#: that sent data meanwhile (REPORT, docs/protocol.md 4.10).
REPORT_INTERVAL = 0.25
#: Fewest CHUNK bytes received in an interval for its transport cost to be reported, and
#: fewest elements a codec decoded for its decode cost to be.
REPORT_MIN_BYTES = 1 << 20
REPORT_MIN_ELEMENTS = 1 << 18
#: An interval longer than this (seconds) went by without data (the pump runs as data
#: arrives): whatever else the loop did meanwhile is not receiving's cost.
REPORT_IDLE = 1.0
#: Least seconds between two log lines saying that transfers wait to start for room in
#: ``max_buffer_bytes`` (an INFO line while any waits, at most this often).
ROOM_LOG_INTERVAL = 60.0
#: Least seconds between two log lines saying that BEGINs were refused because the server
#: holds ``max_sessions`` x ``max_transfers`` transfers (a WARNING while any are, at most
#: this often).
HELD_LOG_INTERVAL = 60.0
#: Seconds of the intervals in which the log says that BEGINs were refused for their KV
#: layout: a WARNING a reason, at most once an interval for one reason and for at most
#: REFUSED_LINES_PER_INTERVAL reasons; the first refusal after an interval in which some
#: went unsaid is preceded by one line counting them and their reasons.
REFUSED_LOG_INTERVAL = 60.0
#: Most lines of distinct reasons of those refusals in one REFUSED_LOG_INTERVAL.
REFUSED_LINES_PER_INTERVAL = 5
#: Reasons of those refusals remembered (those said, the least recently said forgotten
#: first, and those counted unsaid: past this many, "at least" this many).
REFUSED_REASONS_KEPT = 64


class _CostMeter:
    """What receiving costs this server, measured on the event loop's thread (where the
    core reads, checks and decodes every chunk): its CPU time per CHUNK byte received,
    decoding and allocating layers excluded, and each codec's decode time per element,
    over intervals of :data:`REPORT_INTERVAL`.  The loop's CPU time is the whole
    process's view of that thread: every session, and whatever else the application runs
    on the loop. (Allocating is left out because a slab new to the pool is faulted in
    once: on a busy host one interval spent 70 ms of its 130 doing so, and reported 1.0
    ns a byte where the others reported 0.25-0.35.)"""

    def __init__(self, core: ReceiverCore, store: ArrayStore) -> None:
        self._core, self._store = core, store
        self._at: float | None = None
        self._cpu = self._bytes = self._allocated = 0
        self._decoded: dict[int, tuple[int, int]] = {}

    def tick(self, now: float) -> None:
        """Report if an interval has passed since the last (or start one); one longer
        than :data:`REPORT_IDLE` only starts the next."""
        if self._at is not None and now - self._at < REPORT_INTERVAL:
            return
        cpu, received = time.thread_time_ns(), self._core.chunk_bytes_received
        decoded = {c: (e, ns) for c, (e, ns) in self._store.decoded.items()}
        allocated = self._store.allocated_ns
        if self._at is not None and now - self._at <= REPORT_IDLE:
            wire = received - self._bytes
            decode: dict[int, float] = {}
            decode_ns = 0
            for c, (e, ns) in decoded.items():
                e0, ns0 = self._decoded.get(c, (0, 0))
                decode_ns += ns - ns0
                if c != 0 and e - e0 >= REPORT_MIN_ELEMENTS:  # raw lands in place: nothing to decode
                    decode[c] = (ns - ns0) / 1e9 / (e - e0)
            own = cpu - self._cpu - decode_ns - (allocated - self._allocated)
            transport = own / 1e9 / wire if wire >= REPORT_MIN_BYTES else None
            if transport is not None and transport <= 0:
                transport = None
            if transport is not None or decode:
                self._core.report(transport, decode)
        self._at, self._cpu, self._bytes, self._decoded = now, cpu, received, decoded
        self._allocated = allocated


def _abort_handed(fut: asyncio.Future[Transfer], why: str) -> None:
    """A wait that ends (cancelled) after its transfer was handed over: nobody will take
    that transfer, so it must not go on (into the caller's memory, or held here) until
    its session ends."""
    if fut.done() and not fut.cancelled() and fut.exception() is None:
        fut.result().abort(why)


def _let_go(server: weakref.ref[Server], loop: asyncio.AbstractEventLoop, key: Key, request_id: str) -> None:
    """A transfer handed to the application was garbage collected (on whatever thread
    collected it): its server hears of it on its loop."""
    s = server()
    if s is not None and not loop.is_closed():
        s._letting_go[key] = request_id  # (close() fails it too if it runs first)
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(s._let_go, key)


def check_ssl_context(ssl: object, *, server_side: bool) -> None:
    """:class:`UsageError` unless ``ssl`` is None or an :class:`ssl.SSLContext` that can
    serve this side: asyncio refuses anything else only once the loop uses it (a raw
    TypeError when a server starts; a client's connect task died on it, and ``open()``
    waited for ever), and a context made for the other side (``PROTOCOL_TLS_CLIENT`` on
    a server, ``PROTOCOL_TLS_SERVER`` on a client) fails every handshake.  A context of
    the generic ``PROTOCOL_TLS`` may serve either side and is taken."""
    if ssl is None:
        return
    if not isinstance(ssl, _ssl.SSLContext):
        made = (
            "ssl.create_default_context(ssl.Purpose.CLIENT_AUTH) with load_cert_chain(...)" if server_side
            else "ssl.create_default_context() with the CA to trust"
        )
        raise UsageError(f"ssl must be an ssl.SSLContext ({made}) or None, not {type(ssl).__name__}")
    if server_side and ssl.protocol == _ssl.PROTOCOL_TLS_CLIENT:
        raise UsageError(
            "ssl is a client-side context (PROTOCOL_TLS_CLIENT, as ssl.create_default_context() "
            "makes it): a server needs ssl.create_default_context(ssl.Purpose.CLIENT_AUTH) with "
            "its certificate loaded (load_cert_chain)"
        )
    if not server_side and ssl.protocol == _ssl.PROTOCOL_TLS_SERVER:
        raise UsageError(
            "ssl is a server-side context (PROTOCOL_TLS_SERVER, as "
            "ssl.create_default_context(ssl.Purpose.CLIENT_AUTH) makes it): a client needs "
            "ssl.create_default_context() with the CA to trust"
        )


class _TlsAccept(asyncio.Protocol):
    """A connection a TLS server accepted, from the TCP accept until its TLS handshake
    ended.  The server holds it (:meth:`Server.close` aborts it: a handshake under way
    neither outlives the server nor completes after it closed), runs the handshake
    (``loop.start_tls``, bounded by ``handshake_timeout``), logs one that fails with the
    peer's address, and hands a connection whose handshake succeeded to its
    :class:`Stream`.  The stream is made at the accept, as on plain TCP: the kvwire
    handshake deadline counts from there (docs/protocol.md 5.9).

    This is the protocol of the TCP transport until the handshake begins, and then of
    the TLS transport until the stream takes over.  Bytes read before the handshake
    began (uvloop starts reading once ``connection_made`` returns, a pause there
    notwithstanding: the ClientHello) are handed to the TLS protocol before it starts;
    what arrives decrypted before the stream took over (a HELLO right behind the
    client's last handshake message), an EOF, or the connection's loss are kept and
    given to the stream."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.stream = server._new_stream()
        self.transport: asyncio.Transport | None = None  # the plain TCP one
        self.peer: Any = None
        self._plain = bytearray()  # read before the handshake began: TLS records
        self._early = bytearray()  # decrypted before the stream took over
        self._eof = False
        self._lost = False
        self._attached = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.peer = transport.get_extra_info("peername")
        transport.pause_reading()  # type: ignore[attr-defined]  # (the stdlib loop: until start_tls)
        if self.server._closing:
            transport.abort()  # type: ignore[attr-defined]
            return
        self.server._handshaking.add(self)
        self.server.spawn(self._handshake())

    def data_received(self, data: bytes) -> None:
        if self.transport is not None and self.transport.get_protocol() is self:
            self._plain += data  # the TCP transport's: the handshake has not begun
        else:
            self._early += data

    def eof_received(self) -> bool | None:
        self._eof = True
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._attached:  # (scheduled before the stream took over)
            self.stream.connection_lost(exc)
        self._lost = True
        self.server._handshaking.discard(self)

    def abort(self) -> None:
        # Let go of here too, not only when the handshake task ends: a task cancelled
        # before its first step (the server closing as it accepted) never runs its body.
        self.server._handshaking.discard(self)
        if self.transport is not None:
            self.transport.abort()

    def _hand_plain(self) -> None:
        """Run once ``start_tls`` made its TLS protocol the TCP transport's (that task's
        first step, just before this) and before the protocol starts (scheduled after
        this): what was read before goes into it first, in order."""
        raw = self.transport
        proto = raw.get_protocol() if raw is not None else None
        plain, self._plain = self._plain, bytearray()
        if not plain or proto is None or proto is self or raw is None or raw.is_closing():
            return
        view = memoryview(plain)
        try:
            while view:
                buf = proto.get_buffer(len(view))  # type: ignore[attr-defined]
                n = min(len(buf), len(view))
                buf[:n] = view[:n]
                proto.buffer_updated(n)  # type: ignore[attr-defined]
                view = view[n:]
        except Exception:  # (a TLS protocol that takes no bytes this way: the handshake fails)
            raw.abort()

    async def _handshake(self) -> None:
        server, raw = self.server, self.transport
        assert raw is not None and server._ssl is not None
        loop = asyncio.get_running_loop()
        try:
            if self._lost or raw.is_closing():  # the client closed before the handshake began
                raise ConnectionResetError("connection closed")
            starting = asyncio.ensure_future(loop.start_tls(
                raw, self, server._ssl, server_side=True,
                ssl_handshake_timeout=server.options.handshake_timeout,
            ))
            loop.call_soon(self._hand_plain)
            tls = await starting
        except Exception as exc:
            raw.abort()
            self._failed(exc)
            return
        except BaseException:
            raw.abort()
            raise
        finally:
            server._handshaking.discard(self)
        if tls is None or self._lost:  # the connection closed as the handshake ended
            self._failed(None)
            return
        if server._closing:
            tls.abort()
            return
        self._attached = True
        tls.set_protocol(self.stream)
        self.stream.connection_made(tls)
        if not self.stream.made:
            return
        early, self._early = memoryview(self._early), bytearray()
        while early and self.stream.transport is not None:
            buf = self.stream.get_buffer(len(early))
            n = min(len(buf), len(early))
            if n == 0:  # (never: the stream always has room for a frame's header)
                tls.abort()
                return
            buf[:n] = early[:n]
            self.stream.buffer_updated(n)
            early = early[n:]
        if self._eof and self.stream.transport is not None:
            self.stream.eof_received()

    def _failed(self, exc: Exception | None) -> None:
        """Count and log a handshake that failed (not one the server's close ended): a
        warning, as a failed kvwire authentication is; the peer closing the connection
        meanwhile (a health check, a client that gave up or refused the certificate) at
        INFO."""
        if self.server._closing:
            return
        self.server._tls_failures += 1
        if exc is None or isinstance(exc, ConnectionResetError | BrokenPipeError):
            _log.info("%s closed the connection during the TLS handshake", address(self.peer))
        else:
            _log.warning("TLS handshake failed for %s: %s", address(self.peer),
                         printable(str(exc) or type(exc).__name__))


def _check_registry(registry: Any) -> None:
    """:class:`UsageError` unless ``registry`` is None or has the ``check_many`` and
    ``publish`` the server awaits (async methods, or those of a whole
    :class:`~kvwire.consistency.Registry`): anything else (a URL, ``False``, a method)
    would fail every transfer with blocks later, with a text the peer receives."""
    if registry is None:
        return
    kind = type(registry).__name__
    if isinstance(registry, type):
        raise UsageError(f"registry must be a registry instance, not the class {registry.__name__}")
    missing = [name for name in _REGISTRY_CALLS if not callable(getattr(registry, name, None))]
    if missing:
        raise UsageError(
            f"registry must be a kvwire.consistency registry (MemoryRegistry, RedisRegistry, or an "
            f"object with async check_many and publish), not {kind}: it has no {' or '.join(missing)}"
        )
    if not isinstance(registry, Registry):
        sync = [name for name in _REGISTRY_CALLS if not inspect.iscoroutinefunction(getattr(registry, name))]
        if sync:
            raise UsageError(f"registry {kind}: {' and '.join(sync)} must be async (the server awaits them)")


_REGISTRY_CALLS = ("check_many", "publish")


def _where(host: str, port: int) -> str:
    """Where a server was asked to listen, for an error: ``host:port`` (``[host]:port``
    for IPv6)."""
    return f"every interface, port {port}" if host == "" else address((host, port))


async def _passive_addresses(loop: asyncio.AbstractEventLoop, host: str) -> list[tuple[Any, ...]]:
    """Each ``(family, type, proto, sockaddr)`` to listen on for ``host`` (``""``: every
    interface of each family), as ``loop.create_server`` resolves it, without repeats, in
    the resolver's order."""
    infos = await loop.getaddrinfo(host or None, 0, family=socket.AF_UNSPEC, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    found: dict[tuple[Any, ...], tuple[Any, ...]] = {}
    for family, kind, proto, _name, sockaddr in infos:
        found.setdefault((family, sockaddr), (family, kind, proto, sockaddr))
    if not found:
        raise OSError(f"{host!r} names no address")
    return list(found.values())


def _bound_socket(info: tuple[Any, ...], port: int) -> socket.socket:
    """A socket listening on ``info``'s address and ``port``, made as
    ``loop.create_server`` makes one: SO_REUSEADDR (POSIX), an IPv6 one IPv6-only."""
    family, kind, proto, sockaddr = info
    sock = socket.socket(family, kind, proto)
    try:
        if _REUSE_ADDRESS:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, True)
        if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, True)
        sock.bind((sockaddr[0], port, *sockaddr[2:]))
        sock.listen(BACKLOG)  # (where another socket holds the port too, this may be what fails)
    except BaseException:
        sock.close()
        raise
    return sock


_REUSE_ADDRESS = os.name == "posix" and sys.platform != "cygwin"  # (as asyncio's create_server)


def _listen_on_one_port(infos: list[tuple[Any, ...]], port: int) -> list[socket.socket]:
    """A listening socket on each of ``infos``' addresses, all on ``port``; with ``port``
    0, on the port the system picks for the first, tried again (:data:`PORT_TRIES` in all)
    where another holds that port on one of the others.  An address that cannot be
    listened on raises OSError (naming it, of several)."""
    for _ in range(PORT_TRIES):
        sockets: list[socket.socket] = []
        try:
            for info in infos:
                at = port or (sockets[0].getsockname()[1] if sockets else 0)
                try:
                    sockets.append(_bound_socket(info, at))
                except OSError as err:
                    if len(infos) == 1:
                        raise
                    where = address((info[3][0], at, *info[3][2:]))
                    raise OSError(err.errno, f"{err.strerror or err} on {where}") from None
        except OSError as exc:
            for sock in sockets:
                sock.close()
            if port or not sockets or exc.errno != errno.EADDRINUSE:
                raise
            continue
        except BaseException:
            for sock in sockets:
                sock.close()
            raise
        return sockets
    raise OSError(errno.EADDRINUSE, f"no port was free on all its {len(infos)} addresses in {PORT_TRIES} tries")


#: Tries at finding one free port for every address a host names (``port=0``): each try
#: takes the port the system gives the first address, and fails where another holds that
#: port on one of the others.
PORT_TRIES = 8
#: The listening sockets' backlog (asyncio's default).
BACKLOG = 100


class Server(Pump):
    """A running kvwire server; use through ``async with kvwire.serve(...)``.

    It listens on every address ``host`` names, all on one port: ``""`` every interface of
    both families (``0.0.0.0`` and ``::``), ``"0.0.0.0"`` every IPv4 interface, ``"::"``
    every IPv6 interface and IPv6 only (each IPv6 socket is IPv6-only, as asyncio makes
    it: an IPv4 client is not taken, another program may listen on ``0.0.0.0`` on the same
    port), a name each address it resolves to (``localhost``: ``127.0.0.1`` and ``::1``
    where both are listed); an IPv6 address with or without brackets (``"::1"`` or
    ``"[::1]"``, as ``connect()`` takes it; brackets around anything else are a
    UsageError).  With ``port=0`` the system picks a port free on them all
    (:data:`PORT_TRIES` tries, then :class:`~kvwire.ConnectionLostError`); :attr:`port`
    is that port and :attr:`addresses` every ``(host, port)`` listened on, once started.
    """

    #: A stream's connection id is never given to another connection: a stream reads
    #: into its core connection straight (see ``Stream``).
    fixed_connections = True

    core: ReceiverCore

    def __init__(
        self, host: str, port: int, *, secret: bytes, ssl: _ssl.SSLContext | None,
        options: ServerOptions, registry: Any = None,
    ) -> None:
        super().__init__()
        if not isinstance(host, str):  # (asyncio's raw TypeError only once it listened)
            raise UsageError(f"host must be a str (a name or an address, '0.0.0.0' for every "
                             f"IPv4 interface), not {type(host).__name__}")
        if host.startswith("["):  # an IPv6 address as in a URL, as connect() takes it
            if not (host.endswith("]") and is_ipv6(host[1:-1])):
                raise UsageError(f"host {host!r}: brackets enclose an IPv6 address only")
            host = host[1:-1]
        check_port(port, 0)
        check_ssl_context(ssl, server_side=True)
        _check_registry(registry)
        config = options.receiver_config(secret=secret, registry=registry is not None)
        _gpu.parse_device(options.device)  # UsageError for an unknown or unusable device
        default_max_bytes()  # a bad KVWIRE_RECV_POOL_MB fails here, not every transfer once one arrives
        self.host = host
        self.port = 0
        #: Every ``(host, port)`` the server listens on, once started (a link-local IPv6
        #: host with its zone: ``fe80::1%eth0``); all share :attr:`port`.
        self.addresses: tuple[tuple[str, int], ...] = ()
        self._requested_port = port
        self._ssl = ssl
        self.options, self.notsent_lowat = options, options.notsent_lowat
        self.codecs = config.codecs
        self.registry = registry
        self._store = ArrayStore(options.device)
        self.on_gpu = self._store.gpu is not None
        self.core = ReceiverCore(config, store=self._store)
        self._costs = _CostMeter(self.core, self._store)
        self._servers: list[asyncio.Server] = []  # one per address listened on
        self._cids = itertools.count(1)
        self._by_cid: dict[int, Stream] = {}
        self._handshaking: set[_TlsAccept] = set()  # accepted, their TLS handshake under way
        # Transfers not yet handed to the application, and those being taken (iterated or
        # collected), are held here.  One handed out and not yet taken is held only weakly,
        # so one the application lets go of is aborted (its layers dropped, the sender
        # told) instead of held until the session ends.
        self._transfers: dict[Key, Transfer] = {}
        self._handed: weakref.WeakValueDictionary[Key, Transfer] = weakref.WeakValueDictionary()
        self._letting_go: dict[Key, str] = {}  # handed out, garbage collected, not aborted yet: request ids
        self._finalizers: dict[Key, weakref.finalize[Any, Any]] = {}  # of those in _handed
        # Arrived in the pump under way, handed to a waiting accept() / expect() once its
        # events are all handled (see pump()).
        self._arriving: deque[Key] = deque()
        self._accept_waiters: deque[asyncio.Future[Transfer]] = deque()
        self._expect_waiters: dict[str, deque[asyncio.Future[Transfer]]] = {}
        self._expect_into: dict[asyncio.Future[Transfer], Any] = {}
        self._closing = False  # from the start of close(): nothing new may wait
        # The one close every close() waits for (shielded: a caller cancelled does not stop it).
        self._close_task: asyncio.Task[None] | None = None
        self._tls_failures = 0  # TLS handshakes that did not complete (not ended by close())
        self._room_logged_at = -math.inf  # when the log last said transfers wait to start (see pump)
        # When the log last said BEGINs were refused at max_sessions x max_transfers, the
        # core's count of those refusals at the last pump, and how many of them no line has
        # said yet (refused within HELD_LOG_INTERVAL of a line; see _log_held_full).
        self._held_logged_at = -math.inf
        self._held_refusals_seen = 0
        self._held_refusals_unlogged = 0
        # Of BEGINs refused for their layout (see _log_refused): when the log interval began
        # and how many reasons its lines said; per reason said, when; and the refusals no
        # line has said since the last count of them, with (some of) their reasons.
        self._refused_interval_at = -math.inf
        self._refused_lines = 0
        self._refused_logged: OrderedDict[str, float] = OrderedDict()
        self._refused_unsaid = 0
        self._refused_unsaid_reasons: set[str] = set()
        # The registry checks running, by transfer (one a transfer at most: the core refuses
        # a BEGIN of an id whose call still runs): cancelled when their transfer fails.
        self._checks: dict[Key, asyncio.Task[KvwireError | None]] = {}

    async def start(self) -> None:
        if self._closing:
            raise UsageError("the server is closed: make a new one")
        if self._servers:
            raise UsageError("the server is already listening")
        loop = asyncio.get_running_loop()
        # Plain TCP, TLS begun on each connection by its _TlsAccept: a server with ssl=
        # given to asyncio could neither close a connection still in its handshake (asyncio
        # knows of none until the handshake ends) nor tell of one that failed.
        factory: Any = (lambda: _TlsAccept(self)) if self._ssl is not None else self._new_stream
        try:
            infos = await _passive_addresses(loop, self.host)
            sockets = _listen_on_one_port(infos, self._requested_port)
        except OSError as exc:
            raise ConnectionLostError(f"cannot listen on {_where(self.host, self._requested_port)}: {exc}") from exc
        # One asyncio server per socket (asyncio takes one socket per server), so that every
        # address has the same port: asyncio's own, given host and port 0, binds each to a
        # port of its own.
        names = [sock.getsockname() for sock in sockets]
        servers: list[asyncio.Server] = []
        try:
            for sock in sockets:
                servers.append(await loop.create_server(factory, sock=sock, backlog=BACKLOG))
            if self._closing:  # (closed meanwhile: it would listen on)
                raise ConnectionLostError("the server was closed while it started")
        except BaseException:
            for server in servers:
                server.close()
            for sock in sockets[len(servers):]:
                sock.close()
            raise
        self._servers = servers
        self.port = int(names[0][1])
        self.addresses = tuple((scoped_host(name), int(name[1])) for name in names)

    # -- public API -------------------------------------------------------------------------

    async def accept(self, *, timeout: float | None = None) -> Transfer:
        """The next incoming transfer not claimed by :meth:`expect`, in arrival order.

        One that failed after it arrived and before anyone claimed it (its sender reset
        it, its session was lost, ...) is handed out too, in its place, until its
        ``claim_timeout`` passes: iterating or collecting it raises the error it failed
        with, as it would had it been claimed before it failed."""
        check_seconds("timeout", timeout)
        self._check_open()
        if (t := self._arrived()) is not None:
            return t
        fut: asyncio.Future[Transfer] = asyncio.get_running_loop().create_future()
        self._accept_waiters.append(fut)
        try:
            return await self._wait(fut, timeout, "accept()")
        except BaseException:
            _abort_handed(fut, "accept() was cancelled")
            raise
        finally:
            if fut in self._accept_waiters:
                self._accept_waiters.remove(fut)

    async def expect(self, request_id: str, *, timeout: float | None = None, into: Any = None) -> Transfer:
        """The transfer for ``request_id``, whether it arrived already or arrives later.

        ``into`` (e.g. a :class:`kvwire.paged.PagedDestination`) receives the layers into
        the caller's memory; see :meth:`Transfer.attach`.  Several transfers may carry one
        request id (requests that share a prompt, or a name derived from it): several
        ``expect()`` of that id wait side by side and take one transfer each, in the order
        they were made, as the transfers arrive in order.  ``into`` on a server with
        ``device="gpu"`` raises :class:`~kvwire.UsageError` at once; a destination that
        refuses the transfer (its ``check()`` raises) fails it, on both sides, and this
        raises that error: the destination's own :class:`~kvwire.KvwireError`, or one
        (``INTERNAL_ERROR``) naming the transfer, the call and what it raised, the
        original as its cause.  An ``into`` without a destination's methods (``check``,
        ``view``, ``write``, ``layer``) raises :class:`~kvwire.UsageError` at once.

        A transfer of ``request_id`` that failed after it arrived and before anyone claimed
        it (its sender reset it, its session was lost, ...) is handed out too, in its place
        among the arrivals of that id, until its ``claim_timeout`` passes: iterating it
        raises the error it failed with, as it would had this been waiting when it arrived
        (``into`` is not called then, and receives nothing).  A BEGIN of ``request_id`` the
        server refuses for its KV layout (``INCOMPATIBLE_SPEC``: not the ``spec=`` it was
        given) fails the oldest ``expect()`` of that id waiting, at once, with that refusal
        (:class:`~kvwire.IncompatiblePeerError`, naming the fields that differ): one
        ``expect()`` a transfer, its BEGIN re-sent or not.  A malformed layout (an
        undefined dtype, ...) fails none.
        """
        check_request_id(request_id)
        check_seconds("timeout", timeout)
        self._check_open()
        if into is not None and self.on_gpu:
            raise UsageError("into= needs a server with device='cpu' (a GPU server decodes into its own arrays)")
        check_destination(into)
        if (t := self._arrived(request_id)) is not None:  # (then none of this id is waiting)
            if into is not None:
                self._attach_claimed(t, into)
            return t
        fut: asyncio.Future[Transfer] = asyncio.get_running_loop().create_future()
        self._expect_waiters.setdefault(request_id, deque()).append(fut)
        if into is not None:
            self._expect_into[fut] = into
        try:
            return await self._wait(fut, timeout, f"expect({request_id!r})")
        except BaseException:
            _abort_handed(fut, f"expect({request_id!r}) was cancelled")
            raise
        finally:
            self._expect_into.pop(fut, None)
            waiters = self._expect_waiters.get(request_id)
            if waiters is not None:
                if fut in waiters:
                    waiters.remove(fut)
                if not waiters:
                    del self._expect_waiters[request_id]

    def unclaimed_request_ids(self) -> list[str]:
        """The request ids of the arrived transfers :meth:`accept` or :meth:`expect` would
        hand out now, oldest first, one per transfer (several transfers may carry one id,
        which is then listed as many times).  Those that failed after they arrived and
        before anyone claimed them are among them, in their place, since accept() and
        expect() hand them out too (until their ``claim_timeout`` passes); statistics()'s
        ``failed_arrivals`` counts them.  A snapshot: it claims nothing, and a transfer
        listed may be claimed, or dropped, before the caller expects its id.  A closed
        server lists none.  Call it on the server's loop (a
        :class:`~kvwire.sync.SyncServer` has one for other threads)."""
        if self._closing:  # (what arrived is dropped: nothing hands it out any more)
            return []
        return [t.request_id for key in self.core.unclaimed() if (t := self._transfers.get(key)) is not None]

    def _check_open(self) -> None:
        if self._closing:
            raise ConnectionLostError("the server is closed")
        if not self._servers:  # nothing could ever arrive
            raise UsageError("the server is not listening: use `async with kvwire.serve(...) as server`")

    def _arrived(self, request_id: str | None = None) -> Transfer | None:
        """The oldest arrived transfer nobody claimed (of ``request_id``), now claimed: one
        that failed since it arrived too."""
        for key in self.core.unclaimed(request_id):
            if (t := self._transfers.get(key)) is not None:
                self._hand_out(t)
                return t
        return None

    def _hand_out(self, transfer: Transfer) -> None:
        """``transfer`` goes to the application: claimed, and from now on held only weakly
        (see ``_handed``)."""
        key = transfer._key
        self.core.claim(key, self.now())
        if transfer._error is not None:  # failed before it was claimed: nothing to let go of
            self._transfers.pop(key, None)
            return
        if self._transfers.pop(key, None) is not None:
            self._handed[key] = transfer
            f = self._finalizers[key] = weakref.finalize(
                transfer, _let_go, weakref.ref(self), asyncio.get_running_loop(), key, transfer.request_id)
            # Not at interpreter exit: the application still holds the transfer then (an
            # atexit hook of its own may be taking it), it did not let go of it.
            f.atexit = False

    def _taking(self, transfer: Transfer) -> None:
        """The application began taking ``transfer``'s layers: held strongly again (a task
        waiting on its layers is then kept by the server, as asyncio needs; leaving the
        iteration early aborts the transfer, so no finalizer is needed any more)."""
        if self._handed.pop(transfer._key, None) is not None:
            self._transfers[transfer._key] = transfer
        if (f := self._finalizers.pop(transfer._key, None)) is not None:
            f.detach()

    def _transfer(self, key: Key) -> Transfer | None:
        return self._transfers.get(key) or self._handed.get(key)

    def _let_go(self, key: Key) -> None:
        """The application let go of a transfer it was handed (garbage collected): one
        not fully taken is aborted, so its layers do not stay buffered until the session
        ends (nothing happens to one that ended)."""
        self._letting_go.pop(key, None)
        self._finalizers.pop(key, None)
        if not self.closed:
            self.core.abort(key, "the application let go of the transfer without taking every layer", self.now())
            self.pump()

    @staticmethod
    async def _wait(fut: asyncio.Future[Transfer], timeout: float | None, what: str) -> Transfer:
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for returns the result when
        # the cancel and the result land in one loop iteration, losing the cancel (the
        # caller, cancelled, would be handed the transfer and go on running).
        try:
            async with asyncio.timeout(timeout):
                return await fut
        except KvwireError:
            raise
        except TimeoutError:
            raise TransferTimeoutError(f"{what} timed out after {timeout} s") from None

    def statistics(self) -> dict[str, Any]:
        """A snapshot: sessions, connections, transfers, bytes held, and event counts, each
        present from the start (0 until it happens): ``transfers_accepted``,
        ``transfers_refused``, ``transfers_aborted`` (by this side: the application, or
        ``claim_timeout``), ``transfers_aborted_by_peer``, ``transfers_unclaimed``
        (transfers that had not failed and nobody claimed within ``claim_timeout``:
        aborted then), ``failed_arrivals_expired`` (arrivals
        that failed before anyone claimed them, counted when they failed, and dropped at
        ``claim_timeout`` unclaimed), ``buffer_budget_refusals``, ``credit_waits``
        (times a transfer was granted less than its window of layers because the layers
        held and granted filled ``max_buffer_bytes``: its sender waits for credit until
        the application takes layers or other transfers end), ``admission_waits``
        (transfers whose ACCEPT waited for room for their first layer in
        ``max_buffer_bytes``: their senders wait to start until layers are taken or other
        transfers end), ``authentication_failures``,
        ``tls_handshake_failures`` (TLS handshakes that did not complete: failed, timed
        out, or the client closed the connection),
        ``resumes``, ``goaways_received`` and ``connections_dropped`` (closed other than
        cleanly, for a reason none of the others counts: a protocol error, a corrupted
        frame, ``idle_timeout``, a refusal, the peer closing without a GOAWAY).
        ``pending_arrivals`` counts the arrived transfers :meth:`accept` or :meth:`expect`
        would hand out, ``failed_arrivals`` those of them that failed before anyone
        claimed them.  ``reserved_bytes`` counts the bytes of layers granted and not yet
        received (within ``max_buffer_bytes`` with ``buffered_bytes``' layers), and
        ``transfers_waiting_for_room`` the transfers waiting for credit for want of room,
        ``transfers_waiting_to_start`` those admitted whose ACCEPT waits for room.
        ``sessions_by_version`` counts the open sessions by the wire protocol version they
        agreed (``{2: 3}``: three sessions, all of version 2; a
        client of an earlier kvwire speaks an earlier one, docs/protocol.md 5.4).
        ``held_transfers`` counts the transfers the server holds for its sessions (in
        progress, or complete and not claimed, those of sessions that ended included):
        at ``max_sessions`` x ``max_transfers`` every BEGIN is refused (LIMIT_EXCEEDED, and
        a WARNING in the log at most once a minute).  ``registry_calls`` counts the
        registry calls running (``check_many``, ``publish``), those of transfers that
        failed meanwhile included."""
        return {
            "sessions": self.core.sessions,
            "sessions_by_version": self.core.sessions_by_version,
            "connections": len(self._by_cid),
            "pending_arrivals": len(self.core.unclaimed()),
            "failed_arrivals": self.core.failed_unclaimed,
            "buffered_bytes": self.core.buffered_bytes,
            "reserved_bytes": self.core.reserved_bytes,
            "transfers_waiting_for_room": self.core.waiting_for_room,
            "transfers_waiting_to_start": self.core.waiting_to_start,
            "held_transfers": self.core.held_transfers,
            "registry_calls": self.core.registry_calls,
            **self.core.counters,
            "tls_handshake_failures": self._tls_failures,
        }

    async def close(self) -> None:
        """Stop listening, close every connection and end every task and timer this server
        started (the one teardown path: after it returns nothing of it is pending).
        Transfers that arrived and were never claimed are dropped with their memory;
        those handed out and not taken whole fail (:class:`~kvwire.ConnectionLostError`),
        and so do those admitted and still waiting to start (none is accepted once the
        close began).  Their senders are told first, each by a ``RESET(SESSION_LOST)`` that says the
        server is shutting down (their ``send()`` fails with
        :class:`~kvwire.ConnectionLostError` saying so: a transfer to send again, to this
        server once it is back or to another), then every stream closes with
        ``GOAWAY(NO_ERROR, "the server is shutting down")`` (a sender whose transfer
        the server did not have yet, its BEGIN still on the way, fails with that); a
        connection whose client does not read its GOAWAY is dropped after a second.
        :meth:`accept` and :meth:`expect` raise :class:`~kvwire.ConnectionLostError`
        from now on.  Idempotent: a close() while another is under way waits for that one
        to end; a close() that is cancelled still closes the server (a later close() waits
        for it)."""
        task = self._close_task
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            streams = self._begin_close()
            task = self._close_task = asyncio.get_running_loop().create_task(self._finish_close(streams))
        await asyncio.shield(task)

    def _begin_close(self) -> list[Stream]:
        """What :meth:`close` does at once: listen no more, fail every transfer and wait,
        tell the senders; the streams open now, for :meth:`_finish_close` to close."""
        self._closing = True
        for server in self._servers:
            server.close()
        for accepted in list(self._handshaking):  # their tasks end with the others below
            accepted.abort()
        streams = list(self._by_cid.values())
        if not self.closed:
            # Every transfer fails, complete ones too (nobody can take them now), and those
            # admitted and waiting to start: each sender hears why (RESET(SESSION_LOST))
            # before its streams close, a GOAWAY alone saying only that a stream closed; the
            # core starts none of those waiting with the room the others free.
            self.core.close(self.now())
            self.pump()
        waiters = [*self._accept_waiters, *(f for q in self._expect_waiters.values() for f in q)]
        for fut in waiters:
            if not fut.done():
                fut.set_exception(ConnectionLostError("server closed"))
        return streams

    async def _finish_close(self, streams: list[Stream]) -> None:
        """The rest of :meth:`close`, in a task of its own (shielded: a close() cancelled
        does not stop it): every task and timer ended, every stream closed."""
        await self.teardown(streams)
        if self._servers:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(2.0):
                    await asyncio.gather(*(server.wait_closed() for server in self._servers))

    async def __aenter__(self) -> Server:
        await self.start()
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    # -- the pump ---------------------------------------------------------------------------

    @property
    def _streams(self) -> list[Stream]:
        return list(self._by_cid.values())

    def pump(self) -> None:
        """Handle the core's events, write what it queued, re-arm the one timer.

        A transfer that arrived is handed to a waiting :meth:`accept` / :meth:`expect`
        only once every event the core queued is handled: one read can carry its BEGIN
        and what fails it (its sender's RESET, a chunk that breaks the rules), and the
        waiter must be handed it failed, as one that asks after this pump is, not a
        transfer that never learns of its failure."""
        core = self.core
        if not self.closed:
            self._costs.tick(self.now())
        while True:
            while (ev := core.next_event()) is not None:
                try:
                    self._on_event(ev)
                except Exception:
                    _log.exception("internal error handling %s", type(ev).__name__)
            if not self._arriving:
                break
            key = self._arriving.popleft()
            try:
                self._deliver(key)
            except Exception:
                _log.exception("internal error handing out a transfer")
        for cid in core.take_dirty():
            stream = self._by_cid.get(cid)
            if stream is not None:
                stream.flush()
        if core.waiting_to_start:
            self._log_waiting_to_start()
        if core.held_refusals != self._held_refusals_seen:
            self._log_held_full()
        self.arm_timer()

    def _log_waiting_to_start(self) -> None:
        """Say (at most once per :data:`ROOM_LOG_INTERVAL`) that transfers wait to start
        for room in ``max_buffer_bytes``: their senders only see their sends slow down."""
        now = self.now()
        if now - self._room_logged_at < ROOM_LOG_INTERVAL:
            return
        self._room_logged_at = now
        core = self.core
        _log.info(
            "%d transfer(s) wait to start: max_buffer_bytes (%s) has no room for another first "
            "layer (%s held in layers not yet taken by the application, %s granted and not yet "
            "received); they start as the application takes layers (to have more going at "
            "once: raise max_buffer_bytes, lower transfer_buffer_bytes, or receive into a "
            "destination with into=)", core.waiting_to_start, format_size(self.options.max_buffer_bytes),
            format_size(core.buffered_bytes - core.kept_bytes), format_size(core.reserved_bytes))

    def _log_held_full(self) -> None:
        """Say (at most once per :data:`HELD_LOG_INTERVAL`) that BEGINs were refused because
        the server holds ``max_sessions`` x ``max_transfers`` transfers, what holds that
        room, and what to change: only their clients learn it otherwise (LIMIT_EXCEEDED),
        and the sessions open never get there alone, complete transfers of sessions that
        ended (a producer that restarted or reconnected), which nobody claimed, do.
        Called by the pump that follows the refusals (the one after the bytes that carried
        their BEGINs), with the numbers the core had at the last of them; refusals within
        the interval after a line are counted, and the next line says how many."""
        core = self.core
        refused, self._held_refusals_seen = core.held_refusals - self._held_refusals_seen, core.held_refusals
        now = self.now()
        if now - self._held_logged_at < HELD_LOG_INTERVAL:
            self._held_refusals_unlogged += refused
            return
        self._held_logged_at = now
        more, self._held_refusals_unlogged = self._held_refusals_unlogged, 0
        held, held_gone = core.held_at_refusal
        claim_timeout = self.options.claim_timeout
        _log.warning(
            "%d transfer(s) refused%s: the server holds %d transfers (max_sessions x max_transfers = %d), "
            "%d of them complete transfers of sessions that ended, which the application has not "
            "claimed; to make room: claim them (accept()/expect()), %s, or raise max_sessions",
            refused, f" ({more} more since the last such line)" if more else "", held, core.held_limit, held_gone,
            "set claim_timeout (None: only claiming frees them)" if claim_timeout is None
            else f"lower claim_timeout ({claim_timeout:g} s)")

    # -- what a stream asks of its pump -----------------------------------------------------

    def _new_stream(self) -> Stream:
        """A stream for a connection accepted: what it queues unsent is the server's
        replies, control frames only, held to the small ``REPLY_QUEUE_HIGH`` (it stops
        reading above it, :meth:`set_writable`), not the client's 4 MiB for chunks."""
        return Stream(self, next(self._cids), high=REPLY_QUEUE_HIGH, low=REPLY_QUEUE_LOW)

    def stream_made(self, stream: Stream) -> bool:
        if self.closed:  # accepted while the server was closing
            return False
        self.core.connection_made(stream.key, self.now(), started=stream.started)
        self._by_cid[stream.key] = stream
        return True

    def stream_lost(self, stream: Stream) -> None:
        self.core.forget(stream.key)
        self._by_cid.pop(stream.key, None)

    def set_writable(self, stream: Stream, writable: bool) -> None:
        stream.pause_reading(not writable)  # an answering side stops reading instead

    def _on_event(self, ev: ReceiverEvent) -> None:
        if isinstance(ev, TransferFailed) and (check := self._checks.get(ev.key)) is not None:
            # Its registry check still runs: its verdict no longer matters, so it is
            # cancelled (check_many only reads: nothing in the registry needs undoing, and
            # RedisRegistry closes a connection whose reply did not come).  The core counts
            # the transfer among the session's failed ones awaiting the registry (an
            # allowance beside max_transfers: the client may begin another at once) until
            # the call has ended and answered it (_registry_answered): a client beginning
            # and resetting transfers has at most 2 x max_transfers calls running, even
            # against a registry that goes on when cancelled.  A publish is never
            # cancelled: it runs only for a transfer whose every chunk arrived, and what a
            # registry does on publish is its own (it confirms what was received); it
            # counts until answered.
            check.cancel()
        if isinstance(ev, LayerReady):
            t = self._transfer(ev.key)
            if t is not None:
                t._layer_ready(ev.layer, ev.wire_bytes)
        elif isinstance(ev, TransferArrived):
            self._transfers[ev.key] = Transfer(self, ev)
            self._arriving.append(ev.key)  # (handed out at the end of the pump)
        elif isinstance(ev, TransferFailed) and ev.claimable and (t := self._transfers.get(ev.key)) is not None:
            # Nobody claimed it yet: accept() / expect() hand it out failed, in its place.
            t._fail(ev.error)
        elif isinstance(ev, TransferDropped):
            self._transfers.pop(ev.key, None)
        elif isinstance(ev, TransferFailed):
            # (Also one the core kept to be claimed that was claimed meanwhile: the
            # application holds it, and learns it failed.)
            t = self._transfers.pop(ev.key, None) or self._handed.pop(ev.key, None)
            if (f := self._finalizers.pop(ev.key, None)) is not None:
                f.detach()
            if t is not None:
                t._fail(ev.error)
            elif ev.refused or (not ev.claimable and isinstance(ev.error, StaleVersionError | RegistryUnavailableError)):
                # Refused by the registry before it arrived, or at BEGIN for its KV layout:
                # blocks refused as stale do not become fresh, nor is a layout refused
                # accepted when sent again, so the expect() it would have gone to (the
                # oldest waiting, with into= or without) learns now rather than at its timeout.
                if ev.refused:
                    self._log_refused(ev)
                waiters = self._expect_waiters.get(ev.request_id, deque())
                while waiters:
                    if not (fut := waiters.popleft()).done():
                        self._expect_into.pop(fut, None)
                        fut.set_exception(ev.error)
                        break
        elif isinstance(ev, RegistryCheck | RegistryPublish):
            self._start_registry_call(ev)
        elif isinstance(ev, AuthenticationFailed):
            _log.warning("authentication failed for %s: %s", self._peer(ev.cid), printable(str(ev.error)))
        elif isinstance(ev, GoawayReceived):
            _log.info("GOAWAY from %s: %s %s", self._peer(ev.cid), code_name(ev.code),
                      printable(ev.message or "no reason given"))
        elif isinstance(ev, ConnectionDropped):
            level = logging.INFO if ev.by_peer or ev.code in _QUIET_CODES else logging.WARNING
            who = "closed by the client" if ev.by_peer else f"closed: {code_name(ev.code)}"
            _log.log(level, "connection from %s %s: %s", self._peer(ev.cid), who, printable(ev.reason))
        elif isinstance(ev, StreamResumed):
            _log.info("%s resumed stream %d of session %s", self._peer(ev.cid), ev.stream_index,
                      ev.session_id.hex()[:8])
        elif isinstance(ev, InternalError):
            _log.error("internal error on a connection from %s", self._peer(ev.cid), exc_info=ev.error)
        elif isinstance(ev, TransferAborted) and _log.isEnabledFor(logging.DEBUG):
            # One a transfer: a peer could begin and reset transfers by the thousand (the
            # counters in statistics() count them), so not even formatted unless wanted.
            _log.debug("transfer '%s' from %s %s: %s", printable(ev.request_id), self._peer(ev.cid),
                       "reset by the client" if ev.by_peer else "aborted",
                       printable(ev.reason) if ev.reason else "no reason given")

    def _log_refused(self, ev: TransferFailed) -> None:
        """Say that a BEGIN was refused for its KV layout, with the text its sender got:
        otherwise only the producer learns it.  Each sender's layout gives a text of its
        own, so the lines are bounded by the interval (:data:`REFUSED_LOG_INTERVAL`), not
        by the text: one a reason at most, and :data:`REFUSED_LINES_PER_INTERVAL` reasons
        at most.  The others are counted, and the first refusal after an interval in which
        some were not said is preceded by a line saying how many, for how many reasons."""
        reason = str(ev.error)
        now = self.now()
        if now - self._refused_interval_at >= REFUSED_LOG_INTERVAL:
            if self._refused_unsaid:
                n = len(self._refused_unsaid_reasons)
                _log.warning(
                    "%d more BEGIN(s) refused (%s) for a KV layout this server does not accept, for %s%d "
                    "reason(s), not logged one by one (at most %d reasons, each once, per %g s)",
                    self._refused_unsaid, code_name(ev.error.code), "at least " if n >= REFUSED_REASONS_KEPT else "",
                    n, REFUSED_LINES_PER_INTERVAL, REFUSED_LOG_INTERVAL)
            self._refused_interval_at = now
            self._refused_lines = 0
            self._refused_unsaid = 0
            self._refused_unsaid_reasons.clear()
        said = self._refused_logged.get(reason)
        if (said is not None and now - said < REFUSED_LOG_INTERVAL) or self._refused_lines >= REFUSED_LINES_PER_INTERVAL:
            self._refused_unsaid += 1
            if len(self._refused_unsaid_reasons) < REFUSED_REASONS_KEPT:
                self._refused_unsaid_reasons.add(reason)
            return
        self._refused_lines += 1
        self._refused_logged[reason] = now
        self._refused_logged.move_to_end(reason)
        while len(self._refused_logged) > REFUSED_REASONS_KEPT:
            self._refused_logged.popitem(last=False)
        _log.warning("transfer %s from %s refused (%s): %s", quoted_id(ev.request_id), self._peer(ev.cid),
                     code_name(ev.error.code), printable(reason))

    def _peer(self, cid: int | None) -> str:
        stream = self._by_cid.get(cid) if cid is not None else None
        return address(stream.peer) if stream is not None else "a client"

    def _start_registry_call(self, ev: RegistryCheck | RegistryPublish) -> None:
        """Ask the registry what the core asked, in a task (ended by :meth:`teardown`)
        whose end, however it ends (cancelled before it began included), answers the core
        (:meth:`_registry_answered`)."""
        task = self.spawn(self._registry_call(ev))
        task.add_done_callback(lambda done: self._registry_answered(ev, done))
        if isinstance(ev, RegistryCheck):
            self._checks[ev.key] = task

    async def _registry_call(self, ev: RegistryCheck | RegistryPublish) -> KvwireError | None:
        """Ask the registry what the core asked (docs/consistency.md: ``check_many`` at
        BEGIN, ``publish`` before the last acknowledgement); returns None, or the error the
        transfer fails with."""
        what = "check" if isinstance(ev, RegistryCheck) else "publish"
        error: KvwireError | None
        try:
            blocks = [(block_from_key(b.decode("utf-8")), v) for b, v in ev.blocks]
            ask = self.registry.check_many if isinstance(ev, RegistryCheck) else self.registry.publish
            bad = await ask(blocks)
            error = stale_error(bad) if bad else None
        except KvwireError as exc:
            error = RegistryUnavailableError(f"registry {what} failed: {exc}")
        except Exception as exc:  # a registry of the caller's that raises its own errors: fail closed
            error = RegistryUnavailableError(f"registry {what} failed: {exc!r}")
        return error

    def _registry_answered(self, ev: RegistryCheck | RegistryPublish,
                           task: asyncio.Task[KvwireError | None]) -> None:
        """A registry call ended: the core hears its outcome (one cancelled because its
        transfer failed, whose outcome no longer matters, too: that frees its place).  So
        does a call that :meth:`close` ended (its transfer failed with the close, the
        answer frees its place and block list: ``statistics()`` after close count none),
        only without a pump: nothing is sent once the server closed."""
        if isinstance(ev, RegistryCheck) and self._checks.get(ev.key) is task:
            del self._checks[ev.key]
        what = "check" if isinstance(ev, RegistryCheck) else "publish"
        error: KvwireError | None
        if task.cancelled():
            error = RegistryUnavailableError(f"registry {what} cancelled")
        elif (exc := task.exception()) is not None:  # (not an Exception: _registry_call takes those)
            error = RegistryUnavailableError(f"registry {what} failed: {exc!r}")
        else:
            error = task.result()
        try:
            if isinstance(ev, RegistryCheck):
                self.core.registry_checked(ev.key, None, error, self.now())
            else:
                self.core.registry_published(ev.key, error, self.now())
            if not self.closed:
                self.pump()
        except Exception:
            _log.exception("internal error answering a registry %s", what)

    def _deliver(self, key: Key) -> None:
        """Hand transfer ``key``, which arrived in this pump, to the oldest ``expect()`` of
        its request id waiting, else to the oldest ``accept()``: failed if it failed in
        the same pump (as :meth:`_arrived` hands it out); nothing if it is gone or was
        claimed meanwhile."""
        transfer = self._transfers.get(key)
        if transfer is None or not self.core.is_unclaimed(key):
            return
        waiters = self._expect_waiters.get(transfer.request_id)
        while waiters:
            fut = waiters.popleft()
            if not fut.done():
                into = self._expect_into.pop(fut, None)
                if into is not None:
                    try:
                        self._attach_claimed(transfer, into)
                    except Exception as exc:  # the transfer failed with it: nobody else takes it
                        self.core.claim(key, self.now())
                        self._transfers.pop(key, None)
                        fut.set_exception(exc)
                        return
                self._hand_out(transfer)
                fut.set_result(transfer)
                return
        while self._accept_waiters:
            fut = self._accept_waiters.popleft()
            if not fut.done():
                self._hand_out(transfer)
                fut.set_result(transfer)
                return

    # -- what a Transfer asks of the core ---------------------------------------------------------

    def _take(self, transfer: Transfer, layer: int) -> Any:
        buf = self.core.pop_layer(transfer._key, layer, self.now())
        if transfer._yielded + 1 >= transfer.spec.num_layers:
            self._transfers.pop(transfer._key, None)
        self.pump()
        return buf

    def _abort(self, transfer: Transfer, reason: str) -> None:
        self.core.abort(transfer._key, reason, self.now())
        self.pump()

    def _attach_claimed(self, transfer: Transfer, into: Any) -> None:
        """``transfer.attach(into)`` for a transfer that ``expect()`` hands out: if it
        raises, the transfer is failed (nobody will take it) and the error re-raised.  One
        that failed before it was claimed is only given ``into``, as if it had been
        attached and then failed: its destination is not called."""
        if transfer._error is not None:
            transfer._into = into
            return
        try:
            transfer.attach(into)
        except KvwireError as exc:  # a destination refusing it failed it already (_attach)
            self._destination_failed(transfer, exc)
            raise

    def _attach(self, transfer: Transfer, into: Any) -> None:
        """Give ``transfer`` its destination: a destination whose ``check()`` raises fails
        the transfer, on both sides, with :func:`~kvwire.aio._receive.destination_error`."""
        key = transfer._key
        self._store.attachable(key)  # (UsageError: the transfer goes on as it was)
        try:
            self._store.attach(key, into, quoted_id(transfer.request_id))
        except KvwireError as exc:
            self._destination_failed(transfer, exc)
            raise
        self.core.attach(key, self.now())
        self.pump()

    def _destination_failed(self, transfer: Transfer, error: KvwireError) -> None:
        """Fail ``transfer`` with its destination's ``error`` (the sender is told, if it is
        still sending); nothing if it already failed."""
        if transfer._error is None:
            self.core.fail(transfer._key, error, self.now())
            self.pump()
            transfer._fail(error)  # even where the core is done with it (every layer taken)

__all__ = ["Server", "ServerOptions", "Transfer", "make_server_options"]
