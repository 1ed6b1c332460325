"""What both pumps share about TCP streams: socket tuning and the teardown helpers."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Sequence
from typing import Any, Protocol

#: Unsent bytes the kernel may hold before the socket stops polling writable; keeps small
#: frames (acks, credits) from queueing behind a full send buffer.
NOTSENT_LOWAT = 1 << 20
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


class Closable(Protocol):
    """A connection's protocol object as :func:`wait_closed` sees it."""

    @property
    def transport(self) -> asyncio.Transport | None: ...

    @property
    def closed(self) -> asyncio.Event: ...


async def finish_tasks(tasks: set[asyncio.Task[None]]) -> None:
    """Cancel ``tasks`` (except the caller's own) and wait until each has ended."""
    current = asyncio.current_task()
    pending = [t for t in tasks if t is not current]
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)


async def wait_closed(streams: Sequence[Closable], timeout: float) -> None:
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
