"""The asyncio pump around one sans-IO :class:`~kvwire.wire.Connection`.

One protocol object per TCP connection: bytes in -> ``conn.receive_data`` -> events to
the owner -> ``conn.data_to_send`` written -> timer re-armed.  Write backpressure is an
``asyncio.Event`` that senders await.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Sequence
from typing import Any

from kvwire.errors import ConnectionLostError, ErrorCode, KvwireError
from kvwire.wire import Connection, ConnectionClosed, Event, State

#: Unsent bytes the kernel may hold before the socket stops polling writable; keeps small
#: frames (acks, credits) from queueing behind a full send buffer.
NOTSENT_LOWAT = 1 << 20
TCP_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", 25)
_log = logging.getLogger("kvwire")


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


class StreamProtocol(asyncio.BufferedProtocol):
    """Feeds one TCP connection to its sans-IO core and hands events to ``on_event``."""

    def __init__(
        self,
        conn: Connection,
        on_event: Callable[[StreamProtocol, Event], None],
        *,
        write_high: int = 4 << 20,
        notsent_lowat: int | None = NOTSENT_LOWAT,
        pause_reading_when_blocked: bool = False,
    ) -> None:
        self.conn = conn
        # A side that only answers (the server) stops reading from a peer that does not
        # read what it is sent: its answers (ACK, RESET, PONG) then stay bounded by the
        # write buffer limit instead of growing with what the peer sends.
        self._pause_reading = pause_reading_when_blocked
        self.reading_paused = False
        self._on_event = on_event
        self._write_high = write_high
        self._notsent_lowat = notsent_lowat
        self.transport: asyncio.Transport | None = None
        self.loop = asyncio.get_event_loop()
        self.writable = asyncio.Event()
        self.writable.set()
        self.closed = asyncio.Event()
        self.close_error: KvwireError | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self.owner: Any = None  # the session this stream belongs to
        self.index = 0
        self.acked_bytes = 0  # CHUNK bytes acknowledged on this stream (sender side)
        #: called once the transport exists (a TLS handshake that fails never gets here)
        self.on_made: Callable[[StreamProtocol], None] | None = None

    # -- asyncio callbacks ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.set_write_buffer_limits(high=self._write_high, low=self._write_high // 4)  # type: ignore[attr-defined]
        tune_socket(transport.get_extra_info("socket"), self._notsent_lowat)
        if self.on_made is not None:
            self.on_made(self)
        self.flush()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.conn.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        self.conn.buffer_updated(nbytes, self.loop.time())
        self.process()

    def eof_received(self) -> bool | None:
        self.conn.receive_data(b"")
        self.process()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self.conn.closed_event is None:
            self.conn.receive_data(b"")
            self.process(flush=False)
        self._cancel_timer()
        self.writable.set()
        self.closed.set()
        self.transport = None

    def pause_writing(self) -> None:
        self.writable.clear()
        tr = self.transport
        if self._pause_reading and tr is not None and not tr.is_closing():
            tr.pause_reading()
            self.reading_paused = True

    def resume_writing(self) -> None:
        self.writable.set()
        tr = self.transport
        if self.reading_paused and tr is not None and not tr.is_closing():
            tr.resume_reading()
        self.reading_paused = False
        if self.owner is not None:
            self.owner.on_writable(self)

    # -- pump -----------------------------------------------------------------------------

    def process(self, *, flush: bool = True) -> None:
        """Hand every pending event to the owner, then write and re-arm the timer."""
        conn = self.conn
        while True:
            ev = conn.next_event()
            if ev is None:
                break
            if isinstance(ev, ConnectionClosed):
                self.close_error = ev.error
            try:
                self._on_event(self, ev)
            except KvwireError as exc:
                conn.close(exc.code, str(exc))
            except Exception as exc:  # a bug or an allocation failure: never a silent hang
                _log.exception("kvwire: internal error handling %s", type(ev).__name__)
                conn.close(ErrorCode.INTERNAL_ERROR, f"internal error ({type(exc).__name__})")
        if flush:
            self.flush()

    def flush(self) -> None:
        data = self.conn.data_to_send()
        tr = self.transport
        if tr is not None and not tr.is_closing():
            if data:
                tr.writelines(data)
            if self.conn.closed_event is not None:
                tr.close()
        self._arm_timer()

    def _arm_timer(self) -> None:
        when = self.conn.get_timer()
        if when == self._timer_at:
            return
        self._cancel_timer()
        if when is not None:
            self._timer_at = when
            self._timer = self.loop.call_at(when, self._fire_timer)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None
        self._timer_at = None

    def _fire_timer(self) -> None:
        self._timer = None
        self._timer_at = None
        self.conn.handle_timer(self.loop.time())
        self.process()

    def abort(self, code: ErrorCode = ErrorCode.NO_ERROR, message: str = "") -> None:
        """Close with GOAWAY; the transport is closed after the frame is written."""
        self.conn.close(code, message)
        self.process()
        tr = self.transport
        if tr is not None and not tr.is_closing():
            tr.close()

    @property
    def is_open(self) -> bool:
        """Connected, authenticated both ways and not closed: frames may be sent."""
        return self.transport is not None and self.conn.state is State.OPEN

    def lost_error(self) -> KvwireError:
        """The error waiters on this stream should see now that it is gone."""
        if self.close_error is not None:
            return self.close_error
        return ConnectionLostError("connection closed")


async def finish_tasks(tasks: set[asyncio.Task[None]]) -> None:
    """Cancel ``tasks`` (except the caller's own) and wait until each has ended."""
    current = asyncio.current_task()
    pending = [t for t in tasks if t is not current]
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)


async def wait_closed(streams: Sequence[StreamProtocol], timeout: float) -> None:
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
        if s.transport is not None and not s.closed.is_set():
            s.transport.abort()
