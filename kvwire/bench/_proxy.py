"""The TCP proxy pump shared by the link emulator and the fault-injecting proxy.

Each accepted connection is paired with a fresh connection to the target. Each
direction is a :class:`Pipe`: bytes read from one side go through a policy that returns
timed actions (write these bytes at time t, half-close, close, reset); the pipe performs
them in order when their time comes. Memory is bounded: a pipe holding more than its
high-water mark pauses reading from its source, and stops writing while its destination
is paused, so a slow side pushes back on the fast one through TCP instead of piling up
here. A connection that has ended lets go of its read buffers and its policies; what it
keeps (its pipes' byte counts) is small.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket
import struct
from collections import deque
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any, Generic, Protocol, TypeVar, cast

__all__ = [
    "Action",
    "ActionKind",
    "DirectionPolicy",
    "PassThrough",
    "Pipe",
    "PipeStatistics",
    "ProxyBase",
    "ProxyConnection",
    "QueueGate",
    "TcpProxy",
    "gate_of",
    "reset_on_close",
]

_READ_SIZE = 1024 * 1024
_MIN_READ = 16 * 1024
_NO_BUFFER = bytearray()  # an ended connection's sides' (never resized)
_NO_VIEW = memoryview(_NO_BUFFER)
C = TypeVar("C")  # a proxy's connection type
P = TypeVar("P")  # its per-direction policy type


class ActionKind(Enum):
    DATA = "data"
    EOF = "eof"
    """Half-close towards the destination once everything before it was written."""
    CLOSE = "close"
    """Flush to the destination, then close the whole connection (FIN both ways)."""
    RESET = "reset"
    """Flush to the destination, then close the whole connection with a TCP reset."""


@dataclass(slots=True)
class Action:
    at: float
    kind: ActionKind
    data: bytes = b""


class DirectionPolicy(Protocol):
    """Turns bytes read from a source into timed actions towards the destination."""

    def feed(self, data: bytes, now: float) -> Iterable[Action]: ...

    def feed_eof(self, now: float) -> Iterable[Action]: ...


class QueueGate(Protocol):
    """A queue shared by several pipes (a link's bottleneck): each pipe stops reading its
    source while the queue is full, and reads again once it has drained to its low mark."""

    read_size: int
    """Most bytes one connection reads at once (its turn)."""

    def room(self, now: float) -> int:
        """Bytes the queue may still take at ``now`` (0 or less: full)."""
        ...

    def drained(self, now: float) -> bool:
        """Whether the queue is at or below its low mark, where paused readers resume."""
        ...

    def wait(self, now: float, wake: Callable[[], None]) -> None:
        """Call ``wake`` once, when the queue has drained to its low mark."""
        ...


def gate_of(policy: object) -> QueueGate | None:
    """The shared queue a direction's policy feeds (its ``gate``), if any."""
    gate: QueueGate | None = getattr(policy, "gate", None)
    return gate


class PassThrough:
    """Forward everything at once."""

    def feed(self, data: bytes, now: float) -> Iterable[Action]:
        return (Action(now, ActionKind.DATA, data),)

    def feed_eof(self, now: float) -> Iterable[Action]:
        return (Action(now, ActionKind.EOF),)


@dataclass(frozen=True, slots=True, kw_only=True)
class PipeStatistics:
    bytes_in: int
    bytes_out: int
    queued_bytes: int
    reading_paused: bool
    writing_paused: bool


class _Side(asyncio.BufferedProtocol):
    """One socket of a proxied connection; reads feed the pipe leaving this side.

    Its read buffer (:data:`_READ_SIZE` bytes) lives as long as the connection: once the
    connection has ended, :meth:`release` lets go of it and of the pipes.
    """

    def __init__(self, conn: ProxyConnection, name: str) -> None:
        self.conn = conn
        self.name = name
        self.transport: asyncio.Transport | None = None
        self.outgoing: Pipe | None = None
        self.incoming: Pipe | None = None
        self._buffer = bytearray(_READ_SIZE)
        self._view = memoryview(self._buffer)
        # Bytes (and an EOF) read before the pipes exist: some event loops (uvloop) deliver
        # data even though reading was paused in connection_made.
        self._early: list[bytes] = []
        self._early_eof = False
        self._released = False

    def release(self) -> None:
        """The connection has ended (both sockets closing, so nothing is read any more):
        let go of the read buffer, anything read early, the pipes and the transport."""
        self._released = True
        self._buffer = _NO_BUFFER
        self._view = _NO_VIEW
        self._early.clear()
        self._early_eof = False
        self.outgoing = self.incoming = None
        self.transport = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement the interface without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.conn._side_made(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._released:
            # (Not expected: a closing transport reads no more.) Somewhere to put what
            # is then discarded.
            return memoryview(bytearray(_MIN_READ))
        pipe = self.outgoing
        if pipe is not None and pipe.gate is not None:
            # Read a turn's worth, no more than a shared queue has room for (and not a
            # tiny piece).
            gate = pipe.gate
            room = gate.room(pipe.loop.time())
            return self._view[: max(_MIN_READ, min(room, gate.read_size, _READ_SIZE))]
        return self._view

    def buffer_updated(self, nbytes: int) -> None:
        if self._released:
            return
        if self.outgoing is not None:
            self.outgoing.feed(bytes(self._view[:nbytes]))
        else:
            self._early.append(bytes(self._view[:nbytes]))

    def eof_received(self) -> bool:
        if self.outgoing is not None:
            self.outgoing.feed_eof()
        elif not self._released:
            self._early_eof = True
        return True

    def flush_early(self) -> None:
        """Hand what arrived before the pipes existed to the pipe leaving this side."""
        assert self.outgoing is not None
        early, self._early = self._early, []
        for data in early:
            self.outgoing.feed(data)
        if self._early_eof:
            self._early_eof = False
            self.outgoing.feed_eof()

    def pause_writing(self) -> None:
        if self.incoming is not None:
            self.incoming.set_writing_paused(True)

    def resume_writing(self) -> None:
        if self.incoming is not None:
            self.incoming.set_writing_paused(False)

    def connection_lost(self, exc: Exception | None) -> None:
        self.conn._side_lost(self, exc)


_CLOSED_POLICY = PassThrough()
"""What a closed pipe holds instead of its policy (a closed pipe consults none)."""


class Pipe:
    """One direction of a proxied connection.

    Once closed it keeps its counts (:attr:`bytes_in`, :attr:`bytes_out`, :attr:`eof_sent`)
    and lets go of its queue and its policy: :attr:`policy` is then a stand-in and
    :attr:`gate` ``None``.
    """

    def __init__(
        self,
        conn: ProxyConnection,
        src: _Side,
        dst: _Side,
        policy: DirectionPolicy,
        *,
        high_water: int,
    ) -> None:
        self._conn = conn
        self._src = src
        self._dst = dst
        self.policy = policy
        self.gate = gate_of(policy)
        self.loop = self._loop = asyncio.get_running_loop()
        self._queue: deque[Action] = deque()
        self._queued_bytes = 0
        self._high = max(high_water, 1)
        self._low = self._high // 2
        self._reading_paused = False
        self._writing_paused = False
        self._eof_read = False
        self._last_at = -math.inf
        self._hold_until = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._closed = False
        self.bytes_in = 0
        self.bytes_out = 0
        self.eof_sent = False

    def statistics(self) -> PipeStatistics:
        return PipeStatistics(
            bytes_in=self.bytes_in,
            bytes_out=self.bytes_out,
            queued_bytes=self._queued_bytes,
            reading_paused=self._reading_paused,
            writing_paused=self._writing_paused,
        )

    # -- inputs -----------------------------------------------------------------------

    def feed(self, data: bytes) -> None:
        if self._closed:
            return
        self.bytes_in += len(data)
        self._push(self.policy.feed(data, self._loop.time()))

    def feed_eof(self) -> None:
        if self._closed or self._eof_read:
            # Some event loops (uvloop) report the EOF again when reading resumes after it.
            return
        self._eof_read = True
        self._push(self.policy.feed_eof(self._loop.time()))

    def push(self, actions: Iterable[Action]) -> None:
        """Queue actions that did not come from the source (runtime faults)."""
        if not self._closed:
            self._push(actions)

    def _push(self, actions: Iterable[Action]) -> None:
        for action in actions:
            # A byte stream cannot be reordered: nothing overtakes what was queued first.
            action.at = max(action.at, self._last_at)
            self._last_at = action.at
            self._queue.append(action)
            self._queued_bytes += len(action.data)
        if not self._reading_paused:
            gate = self.gate
            if self._queued_bytes > self._high:
                self._reading_paused = True
                self._pause_source(True)
            elif gate is not None and gate.room(now := self._loop.time()) <= 0:
                self._reading_paused = True
                self._pause_source(True)
                gate.wait(now, self._kick)
        self._kick()

    def set_writing_paused(self, paused: bool) -> None:
        self._writing_paused = paused
        if not paused:
            self._kick()

    def hold(self, until: float) -> None:
        """Stop writing until ``until`` (``math.inf``: until :meth:`release`)."""
        self._hold_until = until
        self._kick()

    def release(self) -> None:
        """End a hold and release anything a policy held back indefinitely."""
        now = self._loop.time()
        self._hold_until = 0.0
        for action in self._queue:
            if math.isinf(action.at):
                action.at = now
        if math.isinf(self._last_at):
            self._last_at = now
        self._kick()

    def close(self) -> None:
        self._closed = True
        self._queue.clear()
        self._queued_bytes = 0
        self.policy = _CLOSED_POLICY
        self.gate = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # -- the pump ---------------------------------------------------------------------

    def _pause_source(self, paused: bool) -> None:
        transport = self._src.transport
        if transport is None or transport.is_closing():
            return
        if paused:
            transport.pause_reading()
        else:
            transport.resume_reading()

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = math.inf
        self._kick()

    def _kick(self) -> None:
        if self._closed or self._writing_paused:
            return
        dst = self._dst.transport
        if dst is None:
            return
        now = self._loop.time()
        queue = self._queue
        while queue and not self._writing_paused and not self._closed:
            head = queue[0]
            due = max(head.at, self._hold_until)
            if due > now:
                self._arm(due)
                break
            queue.popleft()
            if head.kind is ActionKind.DATA:
                self._queued_bytes -= len(head.data)
                self.bytes_out += len(head.data)
                dst.write(head.data)
            elif head.kind is ActionKind.EOF:
                self.eof_sent = True
                if dst.can_write_eof() and not dst.is_closing():
                    with contextlib.suppress(OSError):  # reset meanwhile: its loss comes on its own
                        dst.write_eof()
                self._conn._eof_sent()
            else:
                self._conn._terminate(self._dst, reset=head.kind is ActionKind.RESET)
                return
        if self._reading_paused and self._queued_bytes <= self._low and not (self._closed or self._eof_read):
            gate = self.gate
            if gate is not None and not gate.drained(now):
                gate.wait(now, self._kick)
            else:
                self._reading_paused = False
                self._pause_source(False)

    def _arm(self, due: float) -> None:
        if math.isinf(due) or due >= self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = due
        self._timer = self._loop.call_at(due, self._on_timer)


class ProxyConnection:
    """One accepted connection and its companion connection to the target.

    Once it has ended (:attr:`closed` done) it keeps its pipes and their counts, and lets
    go of its sides' read buffers and of its policies.
    """

    def __init__(self, proxy: TcpProxy, index: int) -> None:
        self.proxy = proxy
        self.index = index
        self.client = _Side(self, "client")
        self.upstream = _Side(self, "upstream")
        self.forward: Pipe | None = None
        """Client to target."""
        self.backward: Pipe | None = None
        """Target to client."""
        self.closed = asyncio.get_running_loop().create_future()
        self._eofs = 0

    # -- lifecycle, called by the sides and pipes --------------------------------------

    def _side_made(self, side: _Side) -> None:
        if self.proxy._closing or self.closed.done():
            # Accepted (or connected) as the proxy closed, or after this connection was
            # ended: closed now, not left open past the proxy's close().
            self._terminate(None, reset=True)
            side.release()
            return
        if side is self.client:
            assert side.transport is not None
            # Nothing may be read before the target is connected and the pipes exist.
            side.transport.pause_reading()
            self.proxy._spawn(self._connect_upstream())
        else:
            self._wire()

    async def _connect_upstream(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            await loop.create_connection(
                lambda: self.upstream, self.proxy.target_host, self.proxy.target_port
            )
        except OSError:
            self._terminate(None, reset=True)

    def _wire(self) -> None:
        fwd_policy, back_policy = self.proxy._policies(self)
        high = self.proxy.high_water
        self.forward = Pipe(self, self.client, self.upstream, fwd_policy, high_water=high)
        self.backward = Pipe(self, self.upstream, self.client, back_policy, high_water=high)
        self.client.outgoing = self.forward
        self.client.incoming = self.backward
        self.upstream.outgoing = self.backward
        self.upstream.incoming = self.forward
        self.client.flush_early()
        self.upstream.flush_early()
        assert self.client.transport is not None
        if not (self.client.transport.is_closing() or self.forward.statistics().reading_paused):
            # (What arrived early may have filled the queue: the pipe resumes it then.)
            self.client.transport.resume_reading()

    def _eof_sent(self) -> None:
        self._eofs += 1
        if self._eofs == 2:
            self._terminate(None, reset=False)

    def _side_lost(self, side: _Side, exc: Exception | None) -> None:
        other = self.upstream if side is self.client else self.client
        if exc is not None:
            self._terminate(None, reset=True)
        elif other.transport is not None and not other.transport.is_closing():
            # The side went away without a half-close first: pass the close on, after
            # what is already queued towards the other side.
            pipe = side.outgoing
            if pipe is not None and not pipe.eof_sent:
                pipe.push((Action(-math.inf, ActionKind.CLOSE),))
            else:
                self._terminate(None, reset=False)
        else:
            self._finish()

    def _terminate(self, flushed: _Side | None, *, reset: bool) -> None:
        """Close both sockets; ``flushed`` gets its written bytes delivered first."""
        for pipe in (self.forward, self.backward):
            if pipe is not None:
                pipe.close()
        for side in (self.client, self.upstream):
            transport = side.transport
            if transport is None or transport.is_closing():
                continue
            if reset:
                sock = transport.get_extra_info("socket")
                if sock is not None:
                    reset_on_close(sock)
            if side is flushed or not reset:
                transport.close()
            else:
                transport.abort()
        self._finish()

    def _finish(self) -> None:
        client_done = self.client.transport is None or self.client.transport.is_closing()
        upstream_done = self.upstream.transport is None or self.upstream.transport.is_closing()
        if client_done and upstream_done and not self.closed.done():
            # Ended: only the counts are kept (the proxy keeps every connection).
            for pipe in (self.forward, self.backward):
                if pipe is not None:
                    pipe.close()
            self.client.release()
            self.upstream.release()
            self.closed.set_result(None)
            self.proxy._connection_done(self)

    # -- runtime control ---------------------------------------------------------------

    def abort(self) -> None:
        """Reset both sides now, discarding anything queued."""
        self._terminate(None, reset=True)

    def close(self) -> None:
        """Close both sides now (FIN), discarding anything queued."""
        self._terminate(None, reset=False)


def reset_on_close(sock: socket.socket) -> None:
    """Make closing ``sock`` send a TCP reset (SO_LINGER with a zero timeout)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


class ProxyBase(Generic[C, P]):
    """What a proxy keeps, whichever pump it runs: the target, the policies, where it
    listens, its connections and the tasks it started."""

    def __init__(
        self,
        target_host: str,
        target_port: int,
        policies: Callable[[C], tuple[P, P]],
        *,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        high_water: int = 4 * 1024 * 1024,
        client_rcvbuf: int | None = None,
    ) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self._policy_factory = policies
        self.listen_host = listen_host
        self.listen_port = listen_port
        self.high_water = high_water
        # SO_RCVBUF of accepted connections (None: the kernel's autotuning): what a client
        # may have sent that the proxy has not read yet stays within it, so a slow link's
        # queue is not the kernel's megabytes on top of ``high_water``.
        self.client_rcvbuf = client_rcvbuf
        self.connections: list[C] = []
        """Every connection accepted so far, in order (index = position). One that has
        ended keeps its counts, not its buffers or policies."""
        self.active: set[C] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    def _policies(self, conn: C) -> tuple[P, P]:
        return self._policy_factory(conn)

    def _listener(self) -> socket.socket:
        """The listening socket, with :attr:`client_rcvbuf` set before any connection
        arrives (accepted sockets inherit it, and their window scale is chosen from it)."""
        family = socket.AF_INET6 if ":" in self.listen_host else socket.AF_INET
        listener = socket.create_server((self.listen_host, self.listen_port), family=family, backlog=128)
        if self.client_rcvbuf is not None:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.client_rcvbuf)
        listener.setblocking(False)
        return listener

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _connection_done(self, conn: C) -> None:
        self.active.discard(conn)

    async def _cancel_tasks(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


class TcpProxy(ProxyBase[ProxyConnection, DirectionPolicy]):
    """Listens on ``listen_host:listen_port`` and pipes every connection to the target."""

    _server: asyncio.Server | None = None
    _closing = False

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the proxy is not started")
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    def _accept(self) -> _Side:
        conn = ProxyConnection(self, len(self.connections))
        self.connections.append(conn)
        self.active.add(conn)
        return conn.client

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._accept, sock=self._listener(), backlog=128)

    async def close(self) -> None:
        self._closing = True  # a connection whose transport is made from now on is closed at once
        if self._server is not None:
            # Accept no more, and let the accepts under way make their transports first:
            # asyncio's Server (3.11) fails to make one after its close(), leaving the
            # accepted socket open until the garbage collector finds it.
            loop = asyncio.get_running_loop()
            for sock in self._server.sockets:
                loop.remove_reader(sock.fileno())
            await asyncio.sleep(0)
            self._server.close()
        for conn in list(self.active):
            conn.abort()
        await self._cancel_tasks()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
