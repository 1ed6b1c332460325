"""What both pumps share about TCP streams: the one connection protocol (bytes straight
into the session core's frame decoder, the core's bytes out), socket tuning and the
teardown helpers."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import platform
import socket
import ssl
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, cast

from kvwire._extensions import load_extension
from kvwire.session.options import NOTSENT_LOWAT
from kvwire.wire.frames import ByteRanges, CheckedPayload

#: The compiled send queue (``kvwire/aio/_sendq.c``), or None: then every stream writes
#: through its transport (:func:`write_parts`).
_sendq = load_extension("kvwire.aio._sendq")
#: A client's stream stops taking frames above this many queued bytes (a server's uses
#: ``REPLY_QUEUE_HIGH``) and takes them again at or below ``QUEUE_LOW`` (the transport's
#: write limits where it writes).
QUEUE_HIGH = 4 << 20
QUEUE_LOW = 1 << 20
#: The marks of a server's streams, which send only control frames (ACK, CREDIT, RESET,
#: REPORT, PONG, GOAWAY, ACCEPT; at most about 1.3 KiB each): a stream over the mark stops
#: reading (Server.set_writable) until its replies drain to the low mark.  What is queued
#: unsent is what the peer's receive window and this side's socket buffer (at least
#: ``NOTSENT_LOWAT`` unsent bytes) could not take: a client that reads its ACKs never gets
#: near it (a 10 Gbit/s transfer in 4 MiB chunks is acknowledged in about 10 KiB of ACKs
#: a second), one that floods frames the server answers and reads nothing gets its
#: connection's replies held to this mark plus the replies to one read (docs/protocol.md 16).
REPLY_QUEUE_HIGH = 256 * 1024
REPLY_QUEUE_LOW = 64 * 1024
#: Most bytes of a large payload the queue hands to the kernel per write, checksummed
#: right after the write before (so the kernel copies them from the cache): large enough for few
#: writes per chunk on a shaped link, small enough that a piece and its copy stay in a
#: core's L2 cache (docs/benchmarks.md compares 256 KiB, 512 KiB and whole payloads).
SEND_PIECE = 512 * 1024
#: Seconds a stream the core closed may take to write what it has left (its GOAWAY) and,
#: half-closed, to see the peer close in turn, before its socket is dropped: a peer that
#: reads nothing, or never closes, does not keep it open, nor what it holds.
CLOSE_LINGER = 5.0

TCP_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", 25)
#: Most bytes a stream whose write failed reads of what the kernel still holds from its peer
#: before it drops the connection (see Stream._read_left; after a reset that is finite).
READ_LEFT_MAX = 64 << 20

#: Largest SO_RCVLOWAT a stream sets while a large payload is arriving (see Stream.lowat).
RCVLOWAT_MAX = 1 << 20
#: Payload left below which a stream reads whatever arrives (SO_RCVLOWAT back at 1).
RCVLOWAT_MIN = 64 * 1024


def _kernel_sizes_rcvlowat() -> bool:
    """Linux 4.18+ grows a TCP socket's receive buffer to fit its SO_RCVLOWAT and wakes a
    reader whose window is closing; older kernels could leave a reader waiting."""
    if sys.platform != "linux" or not hasattr(socket, "SO_RCVLOWAT"):
        return False
    try:
        major, minor = (int(x) for x in platform.release().split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (4, 18)


USE_RCVLOWAT = _kernel_sizes_rcvlowat()


def tune_socket(sock: Any, notsent_lowat: int | None = NOTSENT_LOWAT) -> None:
    """TCP_NODELAY and TCP_NOTSENT_LOWAT; buffer sizes are left to kernel autotuning."""
    if sock is None:
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if notsent_lowat:
            sock.setsockopt(socket.IPPROTO_TCP, TCP_NOTSENT_LOWAT, notsent_lowat)
    except OSError:
        pass  # not a TCP socket (e.g. a test transport), or an older kernel


def on_this_host(transport: Any) -> bool:
    """The connection's other end is on this host: its peer address is a loopback address
    or the connection's own (IP addresses only; anything else, or no transport: False)."""
    if transport is None:
        return False
    peer, own = transport.get_extra_info("peername"), transport.get_extra_info("sockname")
    if not isinstance(peer, tuple) or not isinstance(own, tuple) or not peer or not own:
        return False
    try:
        address = ipaddress.ip_address(peer[0])
    except ValueError:
        return False
    return address.is_loopback or peer[0] == own[0]


class Core(Protocol):
    """What a stream asks of its side's session core (``SenderCore``, ``ReceiverCore``)."""

    def get_buffer(self, key: int, /) -> memoryview: ...
    def buffer_updated(self, key: int, nbytes: int, now: float, /) -> bool:
        """False when only bytes of an unfinished frame arrived: nothing to pump."""
    def receive_data(self, key: int, data: bytes, now: float, /) -> None: ...
    def payload_remaining(self, key: int, /) -> int:
        """Bytes of the frame being read that are sure to arrive before it completes."""
    def scatter_buffers(self, key: int, /) -> list[memoryview]:
        """Where a payload received into several places goes next, for one scatter read."""
    def buffers_to_send(self, key: int, /) -> list[Any]: ...
    def is_closed(self, key: int, /) -> bool: ...
    def connection(self, key: int, /) -> Any: ...


class Owner(Protocol):
    """The pump a stream belongs to: its core, its clock, and the side-specific parts.

    Two class attributes, read once per stream, say how it treats its streams (both
    False on :class:`Pump`): ``fixed_connections``, true (a server's), says it never gives a
    stream's key another connection: the stream then reads into its core connection
    straight; ``replaces_streams``, true (a client's :class:`~kvwire.aio.client.PeerLink`),
    says a stream may stop feeding the core before it closes (a replaced one): every read
    then asks :meth:`is_current`, which an owner that says False is never asked."""

    fixed_connections: bool
    replaces_streams: bool

    @property
    def core(self) -> Core: ...
    @property
    def notsent_lowat(self) -> int | None: ...
    def now(self) -> float: ...
    def pump(self) -> None: ...
    def stream_made(self, stream: Stream) -> bool:
        """Register a connected stream and tell the core; False: it is not wanted (closed)."""
    def is_current(self, stream: Stream) -> bool:
        """Whether the stream still feeds the core (a replaced one's last bytes do not)."""
    def stream_lost(self, stream: Stream) -> None: ...
    def set_writable(self, stream: Stream, writable: bool) -> None:
        """The stream's unsent bytes went over its high mark (False) or back to its low mark (True)."""


class Stream(asyncio.BufferedProtocol):
    """One TCP connection, ``key`` in its core (a client's stream slot, a server's
    connection id): bytes read go straight into the core's frame buffer, what the core
    has to send is written by :meth:`flush`.  The loop holds it (through its transport)
    as long as the connection is open, and so whatever its ``owner`` holds: a client's
    owner is a stand-in that holds its Peer weakly (``kvwire.aio.client.PeerLink``), so
    a Peer dropped unclosed is collected."""

    def __init__(self, owner: Owner, key: int, *, high: int = QUEUE_HIGH, low: int = QUEUE_LOW) -> None:
        self.owner, self.key = owner, key
        # Bytes queued unsent above which the owner is told the stream is not writable, and
        # at or below which it is told it is again (QUEUE_HIGH / QUEUE_LOW; a server's
        # streams REPLY_QUEUE_HIGH / REPLY_QUEUE_LOW): the send queue's marks, and the
        # transport's write limits where it writes.
        self.high, self.low = high, low
        # When the connection began: the protocol is made as the TCP connection is accepted
        # (server) or before it is opened (client), before any TLS handshake, and the
        # handshake deadline counts from here (docs/protocol.md 5.8, 5.9).
        self.started = owner.now()
        self.transport: asyncio.Transport | None = None
        self.peer: Any = None  # the remote address
        self.reading_paused = False
        self.made = False
        # An owner that never replaces streams need not be asked per read.
        self._always_current = not owner.replaces_streams
        self.closed = asyncio.Event()
        self._scratch = bytearray(0)
        self._asked = 0  # the size of the buffer the last get_buffer() handed out
        # The owner's clock, for every read: Pump's (the running loop's) is its loop's own
        # once the connection is made, that loop not looked up on every read.
        self._clock: Callable[[], float] = owner.now
        # The core's connection for this stream once it is made, where the owner's core never
        # gives a stream's key another connection (``fixed_connections``: a server's): reads
        # then go to it straight, not looked up in the core each time.  None: through the core.
        self._fixed: Any = None
        # The plain TCP socket whose SO_RCVLOWAT follows the payload being read (None: TLS,
        # not a socket, or not supported), and the value it has now.
        self._lowat_sock: Any = None
        self._lowat = 1
        self._gather = False  # whether the transport's writelines() is one writev
        # The stream's own send queue on a duplicate of the socket's descriptor (plain TCP
        # with the compiled queue), or None: writes go through the transport.
        self._queue: Any = None
        # The stream's own socket object on a duplicate of the descriptor (plain TCP): the
        # queue writes it, scatter reads and SO_RCVLOWAT go through it.
        self._own: socket.socket | None = None
        # Under TLS (asyncio's own TLS layer): a socket object on a duplicate of the
        # descriptor, the TLS object and its incoming buffer, to read and decrypt what the
        # peer sent before a write failed (see _read_tls_left); None otherwise.
        self._tls_left: tuple[socket.socket, ssl.SSLObject, ssl.MemoryBIO] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the one its descriptor waits in
        self._waiting = False  # the queue's descriptor is registered for writability
        self._paused = False  # the owner was told the stream is not writable
        self._close_queued = False  # close once the queue is written
        # Everything is written, the GOAWAY last, and the sending side is shut (where the
        # transport can): what still arrives is read and dropped until the peer closes.
        self._draining = False
        self._eof_seen = False  # the peer closed its sending side
        self._said_goaway = False  # the peer's GOAWAY closed the connection: it sends no more
        self._linger: asyncio.TimerHandle | None = None  # drops the socket if closing takes too long
        self._broken = False  # a write failed: nothing more is written, what is left is read
        self.pushed = 0  # bytes ever put in the send queue (see written())

    @property
    def conn(self) -> Any:
        """The core's connection for this stream (None once it has none)."""
        return self.owner.core.connection(self.key)

    def _current(self) -> bool:
        return self.made and not self._draining and (self._always_current or self.owner.is_current(self))

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.set_write_buffer_limits(high=self.high, low=self.low)  # type: ignore[attr-defined]
        sock = transport.get_extra_info("socket")
        tune_socket(sock, self.owner.notsent_lowat)
        plain = sock is not None and transport.get_extra_info("sslcontext") is None  # TCP, no TLS
        self.peer = transport.get_extra_info("peername")
        self._gather = gathers(transport)
        self.made = self.owner.stream_made(self)
        if not self.made:
            transport.abort()  # type: ignore[attr-defined]
            return
        if getattr(type(self.owner), "now", None) is Pump.now:
            self._clock = asyncio.get_running_loop().time
        if self.owner.fixed_connections:
            self._fixed = self.owner.core.connection(self.key)
        if plain:
            self._open_own(sock)
        elif sock is not None:
            self._open_tls_left(transport, sock)
        if plain and USE_RCVLOWAT:
            # Through the stream's own socket object where there is one: a loop's stand-in for
            # its socket (uvloop's) may build a socket object, and ask the kernel what it
            # is, for every option set.
            self._lowat_sock = self._own or sock
        self.owner.pump()

    def _open_own(self, sock: Any) -> None:
        """A socket object of the stream's own on a duplicate of the socket's descriptor
        (the loop refuses a writer on a descriptor its transport holds), for scatter reads
        and, with the compiled queue, to write through a send queue of the stream's own
        instead of the transport: everything this stream sends goes through it, so the
        transport's write buffer stays empty and nothing interleaves.
        """
        try:
            fd = os.dup(sock.fileno())
        except (AttributeError, OSError, ValueError):
            return  # not a real socket (a test transport): the transport writes
        try:
            own = socket.socket(fileno=fd)
        except OSError:
            os.close(fd)
            return
        self._own = own  # owns the duplicate; closed by _close_own()
        if _sendq is not None:
            self._queue = _sendq.SendQueue(own.fileno(), piece=SEND_PIECE)
            self._loop = asyncio.get_running_loop()

    def _open_tls_left(self, transport: asyncio.BaseTransport, sock: Any) -> None:
        """Under TLS, what :meth:`_read_tls_left` needs: the TLS layer's transport closes its
        socket before this stream hears that the connection broke, so a socket object of
        the stream's own on a duplicate of the descriptor keeps what the kernel still holds
        readable until then, and the TLS layer's object and incoming buffer decrypt it.
        Nothing where the TLS layer is not asyncio's (uvloop's keeps them to itself)."""
        proto = getattr(transport, "_ssl_protocol", None)
        sslobj, incoming = getattr(proto, "_sslobj", None), getattr(proto, "_incoming", None)
        if not isinstance(sslobj, ssl.SSLObject) or not isinstance(incoming, ssl.MemoryBIO):
            return
        try:
            fd = os.dup(sock.fileno())
        except (AttributeError, OSError, ValueError):
            return
        try:
            own = socket.socket(fileno=fd)
        except OSError:
            os.close(fd)
            return
        self._tls_left = (own, sslobj, incoming)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._current():
            fixed = self._fixed
            buf = fixed.get_buffer() if fixed is not None else self.owner.core.get_buffer(self.key)
            self._asked = buf.nbytes
            return buf
        if not self._scratch:
            self._scratch = bytearray(65536)  # a replaced connection's last bytes are dropped
        return memoryview(self._scratch)

    def buffer_updated(self, nbytes: int) -> None:
        if not self._current():
            return
        core = self.owner.core
        conn = self._fixed if self._fixed is not None else core.connection(self.key)
        if core.buffer_updated(self.key, nbytes, self._clock()):
            ev = getattr(conn, "closed_event", None)
            if ev is not None and ev.goaway and ev.by_peer:
                self._said_goaway = True
            self.owner.pump()
        if self._own is None and self._lowat_sock is None:
            return
        fixed = self._fixed
        remaining = fixed.payload_remaining if fixed is not None else core.payload_remaining(self.key)
        # A scatter read only goes on with a payload being read into its places (remaining),
        # and not after a read that did not fill its buffer: that took all the kernel had.
        if self._own is not None and remaining and nbytes >= self._asked and self._scatter_read(core):
            remaining = fixed.payload_remaining if fixed is not None else core.payload_remaining(self.key)
        if self._lowat_sock is not None:
            self.lowat(remaining)

    def _scatter_read(self, core: Core) -> bool:
        """Read what has arrived of a payload that goes to several places (the blocks of a
        paged cache) with one ``recvmsg_into`` per batch of places, instead of a read per
        place through the transport.  Reads until the kernel has no more (the transport's
        next read wakes the stream as ever) or the payload is in.  True if it read any."""
        read = False
        while (own := self._own) is not None and not self.reading_paused and self._current():
            fixed = self._fixed
            bufs = fixed.scatter_buffers() if fixed is not None else core.scatter_buffers(self.key)
            if not bufs:
                return read
            try:
                n = own.recvmsg_into(bufs, 0, socket.MSG_DONTWAIT)[0]
            except (BlockingIOError, InterruptedError):
                return read
            except OSError:
                self.abort()  # the connection is broken: its loss reaches the core from the transport
                return read
            if not n:
                return read  # EOF: the transport reads it too, and tells the core
            read = True
            if core.buffer_updated(self.key, n, self._clock()):
                self.owner.pump()
        return read

    def lowat(self, remaining: int) -> None:
        """Wake up for reading only once ``remaining`` bytes (capped) have arrived.

        While a large payload arrives, nothing can happen on the connection before all of
        it is in: SO_RCVLOWAT makes the kernel hand it over in a few large reads instead
        of many small ones (each a callback into Python).  Never more than the peer has
        committed to send, so the wait always ends (the kernel also wakes a reader whose
        receive window is closing, and on EOF or error).  Plain TCP only: under TLS the
        transport may hold part of a record, so the socket could see fewer bytes.
        """
        want = min(remaining, RCVLOWAT_MAX) if remaining >= RCVLOWAT_MIN else 1
        if want != self._lowat:
            try:
                self._lowat_sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
                self._lowat = want
            except OSError:
                self._lowat_sock = None  # not a TCP socket after all: read as it comes

    def eof_received(self) -> bool | None:
        self._eof_seen = True
        self._eof()
        # A close still being written (the GOAWAY in the queue) keeps the transport open
        # until it is, or until the linger passes; anything else closes now.
        return self._close_queued and self._queue is not None and self.transport is not None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        if exc is not None:
            # The transport broke (a write through it failed): what the peer sent before
            # is still to be read, its GOAWAY perhaps (over plain TCP the socket is open
            # until this returns; under TLS it is read through the duplicate descriptor
            # _open_tls_left opened).
            self._broken = True
            self._read_left()
            self._read_tls_left()
        self._close_own()
        self._eof()
        self.transport = None
        if self.made:
            self.owner.stream_lost(self)
        self.closed.set()

    def _eof(self) -> None:
        if self._current():
            self.owner.core.receive_data(self.key, b"", self.owner.now())  # a no-op once closed
            self.owner.pump()

    def pause_writing(self) -> None:
        if self._current():
            self.owner.set_writable(self, False)

    def resume_writing(self) -> None:
        if self._current():
            self.owner.set_writable(self, True)

    def pause_reading(self, paused: bool) -> None:
        """Stop (or resume) reading: a side that only answers stops reading from a peer
        that does not read what it is sent, so its answers stay within the write limit."""
        tr = self.transport
        if self._draining:
            paused = False  # a closing stream reads on, so that it closes with nothing unread
        if tr is not None and not tr.is_closing() and paused != self.reading_paused:
            tr.pause_reading() if paused else tr.resume_reading()
        self.reading_paused = paused

    def flush(self) -> None:
        """Write what the core has to send on this stream; close it once the core did."""
        tr = self.transport
        if tr is None or tr.is_closing() or self._close_queued or self._draining or self._broken:
            return
        fixed = self._fixed
        data = fixed.data_to_send() if fixed is not None else self.owner.core.buffers_to_send(self.key)
        q = self._queue
        if q is None:
            if data:
                write_parts(tr, data, self._gather)
            if self.owner.core.is_closed(self.key):
                self._arm_linger()
                self._finish()
            return
        if data:
            before = q.pending
            q.push(_queue_parts(data))
            self.pushed += q.pending - before
        if self.owner.core.is_closed(self.key):
            self._close_queued = True
            self._arm_linger()
        self._write_queue()

    @property
    def queued(self) -> int:
        """Bytes this stream holds that the kernel has not taken yet: in its send queue, or
        in its transport's write buffer where the transport writes."""
        q, tr = self._queue, self.transport
        if q is not None:
            return int(q.pending)
        return tr.get_write_buffer_size() if tr is not None else 0

    def written(self) -> int:
        """Of the bytes ever put in the send queue (:attr:`pushed`), those no longer in it:
        taken by the kernel (which copied them), or dropped with the queue.  The queue
        holds the caller's buffers themselves until then; a transport copies what the
        kernel does not take, so without a queue nothing is held (both stay 0)."""
        q = self._queue
        return self.pushed - (q.pending if q is not None else 0)

    def _arm_linger(self) -> None:
        if self._linger is None:
            self._linger = asyncio.get_running_loop().call_later(CLOSE_LINGER, self.abort)

    def _write_queue(self) -> None:
        """Write what the queue holds until the kernel takes no more; wait for
        writability while bytes are left; tell the owner when the stream crosses its
        marks (:attr:`high` / :attr:`low`)."""
        q, tr, loop = self._queue, self.transport, self._loop
        if q is None or tr is None or loop is None:
            return
        try:
            left = q.flush()
        except OSError:
            self._write_failed()
            return
        if left and not self._waiting:
            loop.add_writer(q.fd, self._write_queue)
            self._waiting = True
        elif not left and self._waiting:
            loop.remove_writer(q.fd)
            self._waiting = False
        if not left and self._close_queued:
            self._finish()
            return
        if left > self.high and not self._paused:
            self._paused = True
            if self._current():  # a replaced stream's key is its successor's
                self.owner.set_writable(self, False)
        elif left <= self.low and self._paused:
            self._paused = False
            if self._current():
                self.owner.set_writable(self, True)  # last: it may pump, and flush again

    def _finish(self) -> None:
        """The core closed the stream and everything it had to send is written (or in the
        transport's buffer): close without losing it.

        Closing a TCP socket with bytes of the peer unread makes the kernel send a reset,
        dropping what it had still to send, and the peer's kernel may drop what it had not
        yet read (Linux keeps it): the GOAWAY, and the RESETs and ACKs before it.  So the
        stream shuts its sending side instead (the transport sends EOF once its buffer is
        written; a TLS transport cannot, and relies on the peer closing on GOAWAY), reads
        and drops whatever still arrives, and closes once the peer closes too, or when the
        linger armed with the close passes (docs/protocol.md 10).  A stream whose peer closed first, or said GOAWAY (it sends
        nothing after it), has nothing to wait for and closes at once."""
        tr = self.transport
        if self._lowat_sock is not None:
            self.lowat(0)  # read whatever arrives from now on
        self._close_own()
        if tr is None or tr.is_closing():
            return
        try:
            half = tr.can_write_eof()
        except NotImplementedError:  # a transport that does not say: closed at once
            half = None
        if self._eof_seen or self._said_goaway or half is None:
            tr.close()
            return
        self._draining = True
        if self.reading_paused:
            self.pause_reading(False)
        if half:
            try:
                tr.write_eof()
            except (OSError, RuntimeError):
                tr.close()

    def _write_failed(self) -> None:
        """A write through the send queue failed: the connection is broken, mostly because
        the peer reset it (a peer whose process ended, or that closed with bytes of ours
        unread, resets it when more arrive).  What the peer sent before the reset is
        still in the kernel's receive queue, unread where this side wrote first (a
        process resumed after a stop is woken for both at once): its GOAWAY, and the
        RESETs and ACKs before it.  Dropping the connection now would lose them, and a
        peer that closed on purpose would be taken for a break (resumed against a server
        that is gone).  So nothing more is written, and on the loop's next turn (not from
        within the pump that wrote) the stream reads what is left, then drops the
        connection; its loss reaches the core from the transport."""
        self._broken = True
        self._drop_queue()
        asyncio.get_running_loop().call_soon(self._read_left_and_abort)

    def _read_left_and_abort(self) -> None:
        self._read_left()
        self.abort()

    def _read_left(self) -> None:
        """Feed the core what the kernel still holds of the peer's bytes on a connection
        that broke while writing (plain TCP, through the stream's own socket object; a TLS
        stream reads in :meth:`_read_tls_left`), up to ``READ_LEFT_MAX`` bytes: after a
        reset nothing more arrives, so the reads end where the queue does."""
        got = 0
        while (own := self._own) is not None and self._current() and got < READ_LEFT_MAX:
            try:
                n = own.recv_into(self.owner.core.get_buffer(self.key), 0, socket.MSG_DONTWAIT)
            except OSError:  # nothing more (EAGAIN), or the reset itself
                return
            if not n:
                return
            got += n
            self.buffer_updated(n)

    def _read_tls_left(self) -> None:
        """:meth:`_read_left` under TLS: what the peer sent before the connection broke (its
        GOAWAY, and the RESETs and ACKs before it), in the kernel still or in the TLS
        layer's incoming buffer not yet decrypted (this stream was not reading), is read
        through the duplicate descriptor, decrypted and fed to the core, up to
        ``READ_LEFT_MAX`` bytes; a record not whole, the peer's close_notify or a TLS error
        ends it."""
        left = self._tls_left
        if left is None:
            return
        own, sslobj, incoming = left
        got = 0
        while self._current():
            while self._current():  # every whole record held
                buf = self.owner.core.get_buffer(self.key)
                try:
                    n = cast(int, sslobj.read(len(buf), buf))  # (a count, given a buffer)
                except ssl.SSLWantReadError:
                    break  # a record not whole: more bytes from the kernel, if any
                except (ssl.SSLError, ValueError):
                    return  # close_notify (SSLZeroReturnError), or the TLS layer broke
                if not n:
                    return
                self.buffer_updated(n)
            if got >= READ_LEFT_MAX:
                return
            try:
                data = own.recv(min(READ_LEFT_MAX - got, 1 << 16), socket.MSG_DONTWAIT)
            except OSError:  # nothing more (EAGAIN), or the reset itself
                return
            if not data:
                return
            got += len(data)
            incoming.write(data)

    def _drop_queue(self) -> None:
        """Stop writing through the queue; what it holds is dropped."""
        q, self._queue = self._queue, None
        if q is not None:
            if self._waiting and self._loop is not None:
                self._loop.remove_writer(q.fd)
            self._waiting = False
            q.clear()

    def _close_own(self) -> None:
        """Stop writing through the queue (what it holds is dropped) and reading through
        the stream's own socket object (a TLS stream's duplicate descriptor too); its
        descriptor is closed."""
        self._drop_queue()
        if self._own is not None:
            if self._lowat_sock is self._own:
                self._lowat_sock = None
            self._own.close()
            self._own = None
        if self._tls_left is not None:
            self._tls_left[0].close()
            self._tls_left = None

    def abort(self) -> None:
        """Close the connection at once, dropping whatever is not yet written."""
        self._close_own()
        tr = self.transport
        if tr is not None:
            tr.abort()

    def abort_unlooped(self) -> None:
        """:meth:`abort` once the stream's loop is closed (and runs nothing any more):
        every descriptor the stream holds is closed here and now.  An asyncio transport
        cannot abort on a closed loop: it marks itself closing, then fails to schedule
        what closes its socket (its ``_call_connection_lost``, which tells this stream
        too), so that is run here instead, as its loop would have; left to its own
        collection, its socket would stay open, and warn.  (uvloop's transports are
        closed with their loop.)"""
        self._waiting = False  # (the closed loop's selector holds nothing any more)
        self._close_own()
        tr = self.transport
        if tr is None:
            return
        with contextlib.suppress(RuntimeError):  # "Event loop is closed": asyncio's
            tr.abort()
        # Under TLS the socket is the SSL wrapper's inner transport's, whose loss would
        # then tell this stream through the closed loop (RuntimeError, its socket closed).
        inner = getattr(getattr(tr, "_ssl_protocol", None), "_transport", None)
        for t in (tr, inner):
            lost = getattr(t, "_call_connection_lost", None)
            if t is not None and t.is_closing() and getattr(t, "_sock", None) is not None and callable(lost):
                with contextlib.suppress(RuntimeError):
                    lost(None)


def _queue_parts(data: Sequence[Any]) -> list[Any]:
    """What the core has to send as the send queue's parts: checked payloads as
    :func:`_checked_parts`, large buffers as they are, and each run of small parts (frame
    heads, CRCs, control frames) joined into one bytes object: the queue keeps an entry of
    about 150 bytes per part, so 20-byte frames queued one by one (a peer's flood of PINGs
    answered while it does not read) would cost many times the bytes counted."""
    parts: list[Any] = []
    small: list[Any] = []
    for p in data:
        if not isinstance(p, CheckedPayload) and memoryview(p).nbytes < LARGE_PART:
            small.append(p)
            continue
        if small:
            parts.append(small[0] if len(small) == 1 else b"".join(small))
            small = []
        parts.extend(_checked_parts(p) if isinstance(p, CheckedPayload) else (p,))
    if small:
        parts.append(small[0] if len(small) == 1 else b"".join(small))
    return parts


def _checked_parts(p: CheckedPayload) -> tuple[tuple[Any, ...], ...]:
    """A CheckedPayload as the send queue's checked parts: ``(payload, crc)``, or for a
    payload in several buffers a chain in which each but the last hands its CRC on; byte
    ranges of one buffer as one ``(buffer, crc, more, spans)`` part."""
    views = p.views
    if len(views) == 1 and not isinstance(p.payload, ByteRanges):
        return ((p.payload, p.crc),)
    last = len(views) - 1
    return tuple(
        (v.base, 0 if i else p.crc, i < last, v.spans) if isinstance(v, ByteRanges)
        else (v, 0 if i else p.crc, True) if i < last else (v, 0 if i else p.crc)
        for i, v in enumerate(views)
    )


#: Parts at least this large are written on their own; smaller neighbours are joined.
LARGE_PART = 64 * 1024


def gathers(tr: asyncio.BaseTransport) -> bool:
    """Whether ``tr.writelines()`` hands its buffers to one scatter-gather write instead of
    joining them into a new bytes object: uvloop's plain TCP transports (asyncio's own join
    before Python 3.12; under TLS every byte is copied into the TLS object anyway)."""
    return tr.get_extra_info("sslcontext") is None and type(tr).__module__.startswith("uvloop")


def write_parts(tr: asyncio.WriteTransport, parts: Sequence[Any], gather: bool = False) -> None:
    """Write frame parts without joining a large payload into a new bytes object.

    ``writelines`` of asyncio's transports (before Python 3.12) joins every part into one
    bytes object before sending: a copy of every payload byte.  Small parts (headers, CRCs,
    acks) are joined; each large one goes to ``write()``, which hands it to the socket
    directly when nothing is queued and copies only what the kernel did not take, or with
    ``gather`` (see :func:`gathers`) to ``writelines()`` together with the small parts
    before it: one writev, no packet for a frame's header alone.  A
    :class:`CheckedPayload` is written piece by piece, each checksummed just before.
    """
    small: list[Any] = []
    for part in _pieces(parts):
        view = memoryview(part)
        if view.nbytes < LARGE_PART:
            small.append(view)
            continue
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        if small:
            head, small = b"".join(small), []
            if gather:
                tr.writelines((head, view))
                continue
            tr.write(head)
        tr.write(view)
    if small:
        tr.write(b"".join(small))


def _pieces(parts: Sequence[Any]) -> Iterator[Any]:
    """``parts`` with each :class:`CheckedPayload` as its pieces, each checksummed only
    when it is asked for, that is just before it is written."""
    for part in parts:
        if isinstance(part, CheckedPayload):
            yield from part.pieces()
        else:
            yield part


async def finish_tasks(tasks: set[asyncio.Task[None]]) -> None:
    """Cancel ``tasks`` (except the caller's own) and wait until each has ended."""
    current = asyncio.current_task()
    pending = [t for t in tasks if t is not current]
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)


async def wait_closed(streams: Sequence[Stream], timeout: float) -> None:
    """Wait up to ``timeout`` for ``streams`` to close; abort the transports of any that
    did not (their peer is not reading), and leave no waiter behind: cancelled, it aborts
    nothing and ends its waiters before it raises CancelledError."""
    waits = [
        asyncio.ensure_future(s.closed.wait()) for s in streams
        if s.transport is not None and not s.closed.is_set()
    ]
    if waits:
        try:
            await asyncio.wait(waits, timeout=timeout)
        finally:
            for w in waits:
                w.cancel()
            # (a cancelled Event.wait() ends at its next step; cancelled again meanwhile,
            # the waiters are cancelled all the same and end without this)
            await asyncio.gather(*waits, return_exceptions=True)
    for s in streams:
        if s.transport is not None and not s.closed.is_set():
            s.abort()


class Pump:
    """What both sides' pumps share: the clock, the one timer kept at the core's
    ``get_timer()``, the tasks they start, and the one teardown path."""

    core: Any
    closed = False
    #: Whether the core never gives a stream's key another connection (see ``Owner``):
    #: a server's pump says True.
    fixed_connections: bool = False
    #: Whether a stream may stop feeding the core before it closes (see ``Owner``): a pump
    #: that says True overrides :meth:`is_current`, asked then on every read.
    replaces_streams: bool = False

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None

    @staticmethod
    def now() -> float:
        return asyncio.get_running_loop().time()

    def pump(self) -> None:
        raise NotImplementedError

    def is_current(self, stream: Stream) -> bool:
        return True

    def stream_lost(self, stream: Stream) -> None:
        """``stream``'s connection is gone (after the core saw its EOF)."""

    def arm_timer(self) -> None:
        """Keep the one timer at or before the core's ``get_timer()``.

        A timer armed earlier than the core now asks for stays: when it fires, the core
        finds nothing due yet (its ``handle_timer`` acts only on what is due) and the
        timer is armed again then.  Every frame received moves the connection's idle
        deadline later, so re-arming at once would cancel and make a loop timer per read.
        """
        when = None if self.closed else self.core.get_timer()
        armed = self._timer_at
        if when != armed and not (self._timer is not None and armed is not None and (when is None or armed < when)):
            if self._timer is not None:
                self._timer.cancel()
            self._timer_at = when
            self._timer = None if when is None else asyncio.get_running_loop().call_at(when, self.timer_callback())

    def timer_callback(self) -> Callable[[], None]:
        """What the loop's timer calls (:meth:`_fire`): a pump the loop must not keep
        alive through its timer returns something that holds it weakly."""
        return self._fire

    def _fire(self) -> None:
        self._timer = self._timer_at = None
        self.core.handle_timer(self.now())
        self.pump()

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        """Start ``coro`` as a task that :meth:`teardown` ends; returns it."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def teardown(self, streams: Sequence[Stream], linger: float = 1.0) -> None:
        """After the core closed: no timer, every task ended, every stream closed (its
        transport aborted after ``linger`` seconds if its peer does not read; at once
        with 0)."""
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._timer_at = None
        await finish_tasks(self._tasks)
        await wait_closed(streams, linger)
