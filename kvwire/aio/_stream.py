"""What both pumps share about TCP streams: the one connection protocol (bytes straight
into the session core's frame decoder, the core's bytes out), socket tuning and the
teardown helpers."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Sequence
from typing import Any, Protocol

from kvwire.session.options import NOTSENT_LOWAT

TCP_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", 25)


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


class Core(Protocol):
    """What a stream asks of its side's session core (``SenderCore``, ``ReceiverCore``)."""

    def get_buffer(self, key: int, /) -> memoryview: ...
    def buffer_updated(self, key: int, nbytes: int, now: float, /) -> bool:
        """False when only bytes of an unfinished frame arrived: nothing to pump."""
    def receive_data(self, key: int, data: bytes, now: float, /) -> None: ...
    def buffers_to_send(self, key: int, /) -> list[Any]: ...
    def is_closed(self, key: int, /) -> bool: ...
    def connection(self, key: int, /) -> Any: ...


class Owner(Protocol):
    """The pump a stream belongs to: its core, its clock, and the side-specific parts."""

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
        """The transport's write buffer went over (False) or back under (True) its limit."""


class Stream(asyncio.BufferedProtocol):
    """One TCP connection, ``key`` in its core (a client's stream slot, a server's
    connection id): bytes read go straight into the core's frame buffer, what the core
    has to send is written by :meth:`flush`."""

    def __init__(self, owner: Owner, key: int) -> None:
        self.owner, self.key = owner, key
        self.transport: asyncio.Transport | None = None
        self.peer: Any = None  # the remote address
        self.reading_paused = False
        self.made = False
        self.closed = asyncio.Event()
        self._scratch = bytearray(0)

    @property
    def conn(self) -> Any:
        """The core's connection for this stream (None once it has none)."""
        return self.owner.core.connection(self.key)

    def _current(self) -> bool:
        return self.made and self.owner.is_current(self)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.set_write_buffer_limits(high=4 << 20, low=1 << 20)  # type: ignore[attr-defined]
        tune_socket(transport.get_extra_info("socket"), self.owner.notsent_lowat)
        self.peer = transport.get_extra_info("peername")
        self.made = self.owner.stream_made(self)
        if not self.made:
            transport.abort()  # type: ignore[attr-defined]
            return
        self.owner.pump()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._current():
            return self.owner.core.get_buffer(self.key)
        if not self._scratch:
            self._scratch = bytearray(65536)  # a replaced connection's last bytes are dropped
        return memoryview(self._scratch)

    def buffer_updated(self, nbytes: int) -> None:
        if self._current() and self.owner.core.buffer_updated(self.key, nbytes, self.owner.now()):
            self.owner.pump()

    def eof_received(self) -> bool | None:
        self._eof()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
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
        if tr is not None and not tr.is_closing() and paused != self.reading_paused:
            tr.pause_reading() if paused else tr.resume_reading()
        self.reading_paused = paused

    def flush(self) -> None:
        """Write what the core has to send on this stream; close it once the core did."""
        tr = self.transport
        if tr is None or tr.is_closing():
            return
        data = self.owner.core.buffers_to_send(self.key)
        if data:
            write_parts(tr, data)
        if self.owner.core.is_closed(self.key):
            tr.close()


#: Parts at least this large are written on their own; smaller neighbours are joined.
LARGE_PART = 64 * 1024


def write_parts(tr: asyncio.WriteTransport, parts: Sequence[Any]) -> None:
    """Write frame parts without joining a large payload into a new bytes object.

    ``writelines`` of a plain asyncio transport joins every part into one bytes object
    before sending: a copy of every payload byte.  Small parts (headers, CRCs, acks) are
    joined; each large one goes to ``write()``, which hands it to the socket directly when
    nothing is queued and copies only what the kernel did not take.
    """
    small: list[Any] = []
    for part in parts:
        view = memoryview(part)
        if view.nbytes < LARGE_PART:
            small.append(view)
            continue
        if small:
            tr.write(b"".join(small))
            small = []
        tr.write(view if view.format == "B" and view.ndim == 1 else view.cast("B"))
    if small:
        tr.write(b"".join(small))


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
    did not (their peer is not reading), and leave no waiter behind."""
    waits = [
        asyncio.ensure_future(s.closed.wait()) for s in streams
        if s.transport is not None and not s.closed.is_set()
    ]
    if waits:
        _, pending = await asyncio.wait(waits, timeout=timeout)
        for w in pending:
            w.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
    for s in streams:
        tr = s.transport
        if tr is not None and not s.closed.is_set():
            tr.abort()


class Pump:
    """What both sides' pumps share: the clock, the one timer kept at the core's
    ``get_timer()``, the tasks they start, and the one teardown path."""

    core: Any
    closed = False

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
        """Keep the one timer at the core's ``get_timer()``."""
        when = None if self.closed else self.core.get_timer()
        if when != self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer_at = when
            self._timer = None if when is None else asyncio.get_running_loop().call_at(when, self._fire)

    def _fire(self) -> None:
        self._timer = self._timer_at = None
        self.core.handle_timer(self.now())
        self.pump()

    def spawn(self, coro: Any) -> None:
        """Start ``coro`` as a task that :meth:`teardown` ends."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def teardown(self, streams: Sequence[Stream]) -> None:
        """After the core closed: no timer, every task ended, every stream closed (its
        transport aborted after a second if its peer does not read)."""
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._timer_at = None
        await finish_tasks(self._tasks)
        await wait_closed(streams, 1.0)
