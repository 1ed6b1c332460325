"""The link emulator's pump on Linux: bytes move socket -> pipe -> socket with splice(2)
and wait out the emulated link in kernel pipes, never in Python memory.

The emulator shares the host with the sender and the receiver it stands between, so its
CPU is taken from the transfer it measures. Read into Python and written out again, each
byte costs two kernel copies, a user-space copy and an allocation; spliced, the pages the
sender's kernel filled are passed on by reference. Measured on 2 cores at 10 Gbit/s
(docs/benchmarks.md): the emulator's share of a core fell from 0.6 to 0.35, the
receiver's copy out of spliced pages costs more (part of the saving comes back there), and
the unshaped ceiling is lower (about 12 Gbit/s against 15).

Each direction keeps a FIFO of segments: a pipe, a byte count, and the time those bytes
may leave (the policy's: through the shared bottleneck, plus the delay). A read splices
what the socket has into the newest pipe, up to :data:`PIPE_BYTES` per pipe, then takes a
new one from a pool shared by every connection; the writer splices due bytes out of the
oldest pipe and hands it back to the pool once it is empty. Memory is bounded as in the
copying pump: past the high-water mark reading stops until the queue is half drained, and
a destination that cannot take more stops the writer (the pipe keeps the bytes).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import math
import os
import socket
import sys
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from kvwire.bench._proxy import PipeStatistics, ProxyBase, gate_of, reset_on_close

__all__ = ["AVAILABLE", "SpliceConnection", "SpliceDirection", "SpliceProxy", "TimedPolicy"]

AVAILABLE = sys.platform.startswith("linux") and hasattr(os, "splice")
"""splice(2) exists here (Linux, Python 3.10+)."""

PIPE_BYTES = 1 << 20
"""Bytes spliced into one pipe before the next is taken (its requested capacity too)."""
READ_BUDGET = 4 << 20
"""Most bytes one readiness event reads, so that one busy connection cannot starve the
others or the writer."""

if sys.platform != "win32":  # importable everywhere; used only where AVAILABLE
    import fcntl

    _F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_FLAGS = getattr(os, "SPLICE_F_NONBLOCK", 2) | getattr(os, "SPLICE_F_MOVE", 1)


class TimedPolicy(Protocol):
    """When bytes read now may be written on (the link emulator's per-direction policy)."""

    def pieces(self, now: float, nbytes: int) -> list[tuple[int, float]]:
        """``nbytes`` read at ``now`` as pieces in order: (bytes, when they may leave)."""
        ...

    def eof_at(self, now: float) -> float: ...


class _KernelPipe:
    __slots__ = ("filled", "r", "unread", "w")

    def __init__(self) -> None:
        self.r, self.w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        # A pipe's capacity is counted in slots (pages), each holding up to a page of the
        # sender's data; a larger pipe means fewer pipes for the same bytes. Over the
        # user's pipe quota the kernel refuses, and the default (64 KiB) still works.
        with contextlib.suppress(OSError):
            fcntl.fcntl(self.w, _F_SETPIPE_SZ, PIPE_BYTES)
        self.filled = 0  # bytes spliced in since it was last empty
        self.unread = 0  # bytes in it now

    def close(self) -> None:
        for fd in (self.r, self.w):
            with contextlib.suppress(OSError):
                os.close(fd)


class _PipePool:
    """Empty pipes to reuse; creating one costs three system calls."""

    def __init__(self) -> None:
        self._free: list[_KernelPipe] = []
        self.created = 0

    def get(self) -> _KernelPipe:
        if self._free:
            return self._free.pop()
        self.created += 1
        return _KernelPipe()

    def put(self, pipe: _KernelPipe) -> None:
        pipe.filled = 0
        self._free.append(pipe)

    def close(self) -> None:
        for pipe in self._free:
            pipe.close()
        self._free.clear()


@dataclass(slots=True)
class _Segment:
    pipe: _KernelPipe | None
    """``None``: the source's EOF, passed on at ``due``."""
    nbytes: int
    due: float


class SpliceDirection:
    """One direction of a spliced connection (the copying pump's ``Pipe``)."""

    def __init__(
        self,
        conn: SpliceConnection,
        src: socket.socket,
        dst: socket.socket,
        policy: TimedPolicy,
        *,
        high_water: int,
        pool: _PipePool,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._conn = conn
        self._src, self._dst = src.fileno(), dst.fileno()
        self._policy = policy
        self._gate = gate_of(policy)
        self._pool = pool
        self._segments: deque[_Segment] = deque()
        self._tail: _KernelPipe | None = None
        self._queued = 0
        self._high = max(high_water, 1)
        self._low = self._high // 2
        self._reading = False
        self._eof_read = False
        self._starved = False  # no pipe could be made: reading waits for one of ours
        self._waiting_writable = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._last_due = -math.inf
        self._closed = False
        self.bytes_in = 0
        self.bytes_out = 0
        self.eof_sent = False

    def statistics(self) -> PipeStatistics:
        return PipeStatistics(
            bytes_in=self.bytes_in,
            bytes_out=self.bytes_out,
            queued_bytes=self._queued,
            reading_paused=not self._reading and not self._eof_read and not self._closed,
            writing_paused=self._waiting_writable,
        )

    def start(self) -> None:
        self._resume_reading()

    # -- reading ------------------------------------------------------------------------

    def _resume_reading(self) -> None:
        if not (self._reading or self._closed or self._eof_read):
            self._loop.add_reader(self._src, self._on_readable)
            self._reading = True

    def _pause_reading(self) -> None:
        if self._reading:
            self._loop.remove_reader(self._src)
            self._reading = False

    def _on_readable(self) -> None:
        budget = READ_BUDGET if self._gate is None else self._gate.read_size
        rotated = False
        while budget > 0 and not self._closed:
            tail = self._tail
            if tail is None or tail.filled >= PIPE_BYTES:
                try:
                    tail = self._tail = self._pool.get()
                except OSError:  # out of descriptors, or of the user's pipe quota
                    if not self._segments:
                        self._conn._fail()  # nothing in flight will free a pipe
                        return
                    # Read on once this direction hands a pipe back.
                    self._starved = True
                    self._pause_reading()
                    break
            want = min(PIPE_BYTES - tail.filled, budget)
            gate = self._gate
            if gate is not None:
                # A queue shared with other connections (the link's): no more than it
                # has room for, none while it is full, and one turn (the queue's
                # read_size, the budget) per readiness event: the connections whose
                # sockets are ready read in turn.
                now = self._loop.time()
                room = gate.room(now)
                if room <= 0:
                    self._pause_reading()
                    gate.wait(now, self._pump)
                    break
                want = min(want, room)
            try:
                n = os.splice(self._src, tail.w, want, flags=_FLAGS)
            except BlockingIOError:
                # Nothing to read, or the pipe's slots are full (the sender's pages can
                # be partly filled): a readiness event says there is data, so once a
                # new pipe is tried.
                if tail.filled and not rotated:
                    self._tail, rotated = None, True
                    continue
                break
            except OSError:
                self._conn._fail()
                return
            if n == 0:
                self._on_eof()
                return
            tail.filled += n
            tail.unread += n
            segments = self._segments
            for size, when in self._policy.pieces(self._loop.time(), n):
                due = max(when, self._last_due)
                self._last_due = due
                last = segments[-1] if segments else None
                if last is not None and last.pipe is tail and last.due == due:
                    last.nbytes += size
                else:
                    segments.append(_Segment(tail, size, due))
            self._queued += n
            self.bytes_in += n
            budget -= n
            if self._queued > self._high:
                self._pause_reading()
                break
            if n < want:
                break
        self._pump()

    def _on_eof(self) -> None:
        self._eof_read = True
        self._pause_reading()
        due = max(self._policy.eof_at(self._loop.time()), self._last_due)
        self._last_due = due
        self._segments.append(_Segment(None, 0, due))
        self._pump()

    # -- writing ------------------------------------------------------------------------

    def _pump(self) -> None:
        if self._closed or self._waiting_writable:
            return
        now = self._loop.time()
        segments = self._segments
        while segments and not self._closed:
            pipe, due = segments[0].pipe, segments[0].due
            if due > now:
                self._arm(due)
                break
            if pipe is None:
                segments.popleft()
                self.eof_sent = True
                self._conn._shutdown(self._dst)
                self._conn._eof_sent()
                return
            total = 0
            for segment in segments:  # every due byte of this pipe in one call
                if segment.pipe is not pipe or segment.due > now:
                    break
                total += segment.nbytes
            try:
                written = os.splice(pipe.r, self._dst, total, flags=_FLAGS)
            except BlockingIOError:
                written = 0
            except OSError:
                self._conn._fail()
                return
            if written == 0:
                self._waiting_writable = True
                self._loop.add_writer(self._dst, self._on_writable)
                break
            self.bytes_out += written
            self._queued -= written
            pipe.unread -= written
            while written:
                head = segments[0]
                take = min(written, head.nbytes)
                head.nbytes -= take
                written -= take
                if head.nbytes == 0:
                    segments.popleft()
            if pipe.unread == 0:
                if pipe is self._tail:
                    pipe.filled = 0
                else:
                    self._pool.put(pipe)
                self._starved = False
        if self._queued <= self._low and not (self._starved or self._reading or self._eof_read):
            gate = self._gate
            if gate is not None and not gate.drained(now):
                gate.wait(now, self._pump)
            else:
                self._resume_reading()

    def _on_writable(self) -> None:
        self._loop.remove_writer(self._dst)
        self._waiting_writable = False
        self._pump()

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = math.inf
        self._pump()

    def _arm(self, due: float) -> None:
        if due >= self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = due
        self._timer = self._loop.call_at(due, self._on_timer)

    def close(self) -> None:
        """Stop both ends' callbacks and free the pipes (bytes still queued are dropped)."""
        if self._closed:
            return
        self._closed = True
        self._pause_reading()
        if self._waiting_writable:
            self._loop.remove_writer(self._dst)
            self._waiting_writable = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        pipes = {id(s.pipe): s.pipe for s in self._segments if s.pipe is not None}
        if self._tail is not None:
            pipes[id(self._tail)] = self._tail
        for pipe in pipes.values():
            if pipe.unread:
                pipe.close()
            else:
                self._pool.put(pipe)
        self._segments.clear()
        self._tail = None
        self._queued = 0


class SpliceConnection:
    """One accepted connection and its companion connection to the target."""

    def __init__(self, proxy: SpliceProxy, index: int, client: socket.socket) -> None:
        self.proxy = proxy
        self.index = index
        self.client = client
        self.upstream: socket.socket | None = None
        self.forward: SpliceDirection | None = None
        """Client to target."""
        self.backward: SpliceDirection | None = None
        """Target to client."""
        self.closed = asyncio.get_running_loop().create_future()
        self._eofs = 0

    async def _open(self) -> None:
        loop = asyncio.get_running_loop()
        proxy = self.proxy
        try:
            infos = await loop.getaddrinfo(proxy.target_host, proxy.target_port, type=socket.SOCK_STREAM)
            family, kind, proto, _, address = infos[0]
            upstream = socket.socket(family, kind, proto)
        except OSError:
            self._terminate(reset=True)
            return
        self.upstream = upstream
        upstream.setblocking(False)
        try:
            await loop.sock_connect(upstream, address)
        except OSError:
            self._terminate(reset=True)
            return
        if self.closed.done():  # the proxy closed meanwhile
            return
        for sock in (self.client, upstream):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        forward, backward = proxy._policies(self)
        high, pool = proxy.high_water, proxy._pool
        assert pool is not None  # connections come only after start()
        self.forward = SpliceDirection(self, self.client, upstream, forward, high_water=high, pool=pool)
        self.backward = SpliceDirection(self, upstream, self.client, backward, high_water=high, pool=pool)
        self.forward.start()
        self.backward.start()

    def _shutdown(self, fd: int) -> None:
        for sock in (self.client, self.upstream):
            if sock is not None and sock.fileno() == fd:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_WR)

    def _eof_sent(self) -> None:
        self._eofs += 1
        if self._eofs == 2:
            self._terminate(reset=False)

    def _fail(self) -> None:
        """A socket error on either side (reset, broken pipe): reset both."""
        self._terminate(reset=True)

    def _terminate(self, *, reset: bool) -> None:
        for direction in (self.forward, self.backward):
            if direction is not None:
                direction.close()
        for sock in (self.client, self.upstream):
            if sock is None or sock.fileno() < 0:
                continue
            if reset:
                reset_on_close(sock)
            sock.close()
        if not self.closed.done():
            self.closed.set_result(None)
            self.proxy._connection_done(self)

    def abort(self) -> None:
        """Reset both sides now, discarding anything queued."""
        self._terminate(reset=True)


class SpliceProxy(ProxyBase[SpliceConnection, TimedPolicy]):
    """Listens on ``listen_host:listen_port`` and splices every connection to the target
    (the same surface as the copying ``TcpProxy``, for the link emulator)."""

    _listening: socket.socket | None = None
    _pool: _PipePool | None = None  # from start() on
    _closing = False
    _retry: asyncio.TimerHandle | None = None  # accepting again after running out of fds

    @property
    def port(self) -> int:
        if self._listening is None:
            raise RuntimeError("the proxy is not started")
        port: int = self._listening.getsockname()[1]
        return port

    @property
    def pipes_created(self) -> int:
        """Pipes made so far (the pool reuses them)."""
        return 0 if self._pool is None else self._pool.created

    async def start(self) -> None:
        if not AVAILABLE:
            raise OSError(errno.ENOSYS, "splice(2) is not available here")
        self._pool = _PipePool()
        listener = self._listener()
        self._listening = listener
        self._closing = False
        self._accepting(listener)

    def _accepting(self, listener: socket.socket) -> None:
        self._retry = None
        if not self._closing:
            asyncio.get_running_loop().add_reader(listener.fileno(), self._accept, listener)

    def _accept(self, listener: socket.socket) -> None:
        """The listener's reader callback: takes what its backlog holds.

        Not a task awaiting ``loop.sock_accept()``: cancelled by close(), that can still
        have its callback queued in the same loop iteration, which then accepts a
        connection it cannot hand over (the socket leaks). close() removes this callback
        (a queued run of it is then skipped) and closes the listener before anything else.
        """
        loop = asyncio.get_running_loop()
        for _ in range(128):  # the backlog at most; the rest at the next readiness
            if self._closing:
                return
            try:
                client, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue  # reset while in the backlog: the next one may be there
            except OSError as exc:
                loop.remove_reader(listener.fileno())
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # out of descriptors: later, not never
                    self._retry = loop.call_later(0.05, self._accepting, listener)
                else:
                    loop.call_exception_handler(
                        {"message": "the link emulator stopped accepting connections", "exception": exc}
                    )
                return
            client.setblocking(False)
            conn = SpliceConnection(self, len(self.connections), client)
            self.connections.append(conn)
            self.active.add(conn)
            self._spawn(conn._open())

    async def close(self) -> None:
        self._closing = True
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        if self._listening is not None:
            if self._listening.fileno() >= 0:
                asyncio.get_running_loop().remove_reader(self._listening.fileno())
            self._listening.close()
            self._listening = None
        for conn in list(self.active):
            conn.abort()
        await self._cancel_tasks()
        if self._pool is not None:
            self._pool.close()
