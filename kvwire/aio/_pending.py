"""``kvwire.connect()`` started on a bridge's loop from any thread, without waiting for it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from typing import Any

from kvwire.aio._sync import Bridge, SyncPeer, check_wait, open_peer, wait_done, wait_result
from kvwire.errors import ConnectionLostError, KvwireError, UsageError
from kvwire.session.options import check_value


class _OpenedPeer(SyncPeer):
    """A :class:`SyncPeer` over a peer already open on ``bridge``'s loop (the bridge is the
    caller's: not closed with it)."""

    def __init__(self, bridge: Bridge, peer: Any) -> None:  # (not SyncPeer's: that one connects)
        self._own_bridge = False
        self.bridge = bridge
        self._init_waiters()
        self._peer = peer


class PendingPeer:
    """A connect under way on ``bridge``'s loop: :meth:`done` never waits, :meth:`wait`
    waits at most a given time, :meth:`result`
    gives the :class:`SyncPeer` (or raises what the connect raised) once done, and
    :meth:`cancel` stops a connect still under way, returning once its sockets are closed.

    For a caller whose thread must not wait for a handshake (a serving engine's step):
    start the connect, poll it, use the peer once it is up.  The peer is closed with the
    bridge, or by its :meth:`SyncPeer.close`."""

    def __init__(self, bridge: Bridge, host: str, port: int, *, secret: bytes, **options: Any) -> None:
        if not isinstance(bridge, Bridge):
            raise UsageError(f"bridge must be a kvwire.sync.Bridge, got {bridge!r:.80}")
        self._bridge = bridge
        self._task: asyncio.Task[Any] | None = None

        async def connect() -> Any:
            self._task = asyncio.current_task()
            return await open_peer(bridge, host, port, secret=secret, **options)

        self._future: concurrent.futures.Future[Any] = bridge.submit(connect())

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait at most ``timeout`` s (``None``: until it ends) for the connect to end;
        whether it did.  Never raises the connect's error: :meth:`result` does."""
        check_wait(timeout)
        self._bridge.check_process()
        return wait_done(self._future, timeout)

    def result(self) -> SyncPeer:
        """The connected peer; raises the connect's error, :class:`~kvwire.ConnectionLostError`
        after :meth:`cancel` or when the bridge closed first, and
        :class:`~kvwire.UsageError` while not done (poll :meth:`done` first)."""
        self._bridge.check_process()
        def cancelled() -> KvwireError:
            why = "the kvwire bridge was closed" if self._bridge.closed else "the connect was cancelled"
            return ConnectionLostError(f"{why} before it completed")

        peer = wait_result(  # (a timeout of 0: result() never waits)
            self._future, 0,
            not_done=lambda: UsageError("the connect is still under way: result() once done() says so"),
            cancelled=cancelled, kept=True)
        return _OpenedPeer(self._bridge, peer)

    def cancel(self, timeout: float = 10.0) -> None:
        """Stop a connect still under way and wait (at most ``timeout`` s, a finite number
        >= 0) until its sockets are closed; nothing happens once it is done.  A blocking
        call: from the bridge's own loop thread it is refused (:class:`~kvwire.UsageError`)."""
        check_value("timeout", timeout, zero_ok=True)
        self._bridge.check_process()
        if self._bridge.in_loop_thread():  # (it did nothing there: its wait refused, silently)
            raise UsageError("PendingPeer.cancel() from the bridge's own loop thread: it waits for that loop")
        if self._future.done() or self._bridge.closed:
            return

        async def stop() -> None:
            task = self._task  # read on the loop: the connect's task started before this one
            if task is not None and not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

        with contextlib.suppress(KvwireError):
            self._bridge.run(stop(), timeout)


__all__ = ["PendingPeer"]
