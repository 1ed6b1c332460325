"""The synchronous bridge behind :mod:`kvwire.sync`, which documents it (the code is here
because only ``kvwire.aio`` runs an event loop)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import inspect
import os
import threading
import warnings
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine
from types import TracebackType
from typing import Any, SupportsIndex, TypeVar

import kvwire
from kvwire.aio._arrays import is_device_array
from kvwire.aio._logtext import address
from kvwire.aio._receive import check_destination
from kvwire.aio._send import SendProgress
from kvwire.aio._stream import Stream
from kvwire.consistency.blocks import block_pairs
from kvwire.errors import (
    ConnectionLostError,
    KvwireError,
    TransferAbortedError,
    TransferTimeoutError,
    UsageError,
    detached,
)
from kvwire.session.options import check_index, check_seconds, check_value
from kvwire.session.quoting import local_id
from kvwire.session.sender import check_request_id
from kvwire.spec import KVSpec, Layer

T = TypeVar("T")


def check_wait(timeout: object) -> None:
    """:class:`~kvwire.UsageError` unless ``timeout`` is a wait's limit: a finite number of
    seconds >= 0, or None (no limit)."""
    check_value("timeout", timeout, none_ok=True, zero_ok=True)


#: The longest a thread here waits at a time: half of ``threading.TIMEOUT_MAX`` (146
#: years on Linux), with room for ``Condition.wait_for()``'s own arithmetic.  Past
#: ``TIMEOUT_MAX`` a thread's wait raised OverflowError; a longer limit is no limit in practice.
LONGEST_WAIT = threading.TIMEOUT_MAX / 2


def thread_wait(timeout: float | None) -> float | None:
    """``timeout`` (seconds >= 0, or None: no limit) as a thread's wait (a lock's, an
    event's, a future's) may take it: at most :data:`LONGEST_WAIT`."""
    return None if timeout is None else min(timeout, LONGEST_WAIT)


def check_bridge(bridge: object) -> None:
    """:class:`~kvwire.UsageError` unless ``bridge`` is None or a :class:`Bridge`."""
    if bridge is not None and not isinstance(bridge, Bridge):
        raise UsageError(f"bridge must be a kvwire.sync.Bridge, got {bridge!r:.80}")


def check_marks(marks: object) -> list[tuple[Stream, int]]:
    """``marks`` (a copy) if it is what :meth:`SyncPeer.write_marks` returns, a list of
    ``(stream, position)`` pairs; :class:`~kvwire.UsageError` otherwise."""
    if isinstance(marks, list | tuple) and all(
            isinstance(m, tuple) and len(m) == 2 and isinstance(m[0], Stream)
            and isinstance(m[1], int) and not isinstance(m[1], bool) for m in marks):
        return list(marks)
    raise UsageError(f"marks must be what write_marks() returned, got {marks!r:.80}")


def wait_done(fut: concurrent.futures.Future[Any], timeout: float | None) -> bool:
    """Wait at most ``timeout`` s (``None``: until it ends) for ``fut`` to end; whether it did."""
    check_wait(timeout)
    # On the future's own condition, which cancel() wakes too (Bridge.close() on a stuck
    # loop); not concurrent.futures.wait(), whose waiters a plain cancel() does not wake.
    # exception() returns the future's error, so a TimeoutError here is this wait's.
    with contextlib.suppress(concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
        fut.exception(thread_wait(timeout))
    return fut.done()


def wait_result(fut: concurrent.futures.Future[T], timeout: float | None, *,
                not_done: Callable[[], KvwireError], cancelled: Callable[[], KvwireError],
                kept: bool = False) -> T:
    """``fut``'s result once it ended (waiting at most ``timeout`` s), or the error it
    raised; ``not_done()`` is raised when it has not ended by then, and ``cancelled()``
    when it was cancelled (not a kvwire error: the caller says what ended it).  ``kept``:
    the future is kept and read again (a handle's), so its kvwire error, raised at every
    read, is raised detached, keeping none of the callers' frames."""
    # Not fut.result(timeout): its TimeoutError is TimeoutError itself, so a
    # TransferTimeoutError the coroutine raised would read as this wait's timeout.
    if not wait_done(fut, timeout):
        raise not_done()
    try:
        return fut.result()
    except concurrent.futures.CancelledError:
        raise cancelled() from None
    except KvwireError as exc:
        if not kept:
            raise
        raise detached(exc) from None


class BridgeLoop:
    """What a :class:`Bridge`'s loop thread runs on and ends with: the loop, the servers
    and peers it owns and the state of its close.  The Bridge owns it and its thread holds
    it; nothing here refers to the Bridge, so that a Bridge dropped unclosed is collected
    (its finalizer then closes this, :func:`close_dropped_bridge`), not kept by its thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        # The process whose thread runs the loop: a child made by fork() has no such thread.
        self.pid = os.getpid()
        self.closed = False
        # The loop's stop was queued, by close_soon() (its stop, which sets closed, may not
        # have run yet) or by Bridge.close(): one stop only, as a second one, run once the
        # loop thread left run_forever(), would stop what run() runs then (run_to_end()
        # runs on through it all the same).  Set without a lock, by a finalizer perhaps.
        self.close_begun = False
        self.lock = threading.Lock()
        # Handles whose waiters wait on a condition of their own: woken when this closes,
        # even if what ran on the loop never got to tell them (a loop too busy to cancel).
        self.watched: weakref.WeakSet[ReceiveHandle] = weakref.WeakSet()
        # The servers and peers running on the loop (SyncServer, SyncPeer): close() closes
        # them before it cancels the rest, so that no socket outlives the bridge.  One
        # leaves it once its close() completed: what close() could not close in time is
        # closed when the loop ends.
        self.owned: dict[int, Any] = {}
        # (on the loop) The closes under way, by id(thing) (a failed start's clean-up by
        # id(its task)): never cancelled, as a server's or peer's close() cancelled midway
        # does not close it when called again (a peer's failed open closes it lingering 0 s,
        # and its close() begun again lingers 1 s); close() waits for them first.
        self.closing: dict[int, asyncio.Task[None]] = {}
        # Set once the loop thread's run ended (the loop closed): nothing runs on it any
        # more.  Events given to when_ended() are set then.
        self.ended = False
        self.end_events: weakref.WeakSet[threading.Event] = weakref.WeakSet()

    def run(self) -> None:
        """The loop thread's run."""
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self.ready.set)
        try:
            self.loop.run_forever()
        finally:
            try:  # what close() could not close or cancel in time (a loop that was stuck) ends here
                with self.lock:
                    owned = list(self.owned.values())
                if owned:
                    self.run_to_end(asyncio.gather(*(self.close_owned(thing) for thing in owned),
                                                   return_exceptions=True))
                pending = asyncio.all_tasks(self.loop)
                for task in pending:
                    task.cancel()
                if pending:
                    self.run_to_end(asyncio.gather(*pending, return_exceptions=True))
                self.run_to_end(self.loop.shutdown_asyncgens())
            finally:
                self.loop.close()
                with self.lock:
                    self.ended = True
                    events = list(self.end_events)
                    watched = list(self.watched)
                for event in events:
                    event.set()
                for handle in watched:  # (a close that did not wait for this: close_soon())
                    handle._wake()

    def run_to_end(self, aw: Any) -> None:
        """Run the (stopped) loop until ``aw`` ended: a stop queued meanwhile (a close
        begun while this one ran) does not end it midway, as it would end
        ``run_until_complete()`` ("Event loop stopped before Future completed"), leaving
        what it closes unclosed."""
        fut = asyncio.ensure_future(aw, loop=self.loop)
        fut.add_done_callback(lambda _: self.loop.stop())
        while not fut.done():
            self.loop.run_forever()
        fut.result()

    def disown(self, thing: Any) -> None:
        with self.lock:
            self.owned.pop(id(thing), None)

    async def close_owned(self, thing: Any) -> None:
        await asyncio.shield(self.close_task(thing))

    def close_task(self, thing: Any) -> asyncio.Task[None]:
        task = self.closing.get(id(thing))
        if task is None:
            async def close() -> None:
                try:
                    await thing.close()
                    self.disown(thing)  # (only once closed: one whose close failed is closed again)
                finally:
                    del self.closing[id(thing)]

            task = self.closing[id(thing)] = asyncio.ensure_future(close())
        return task

    def close_soon(self) -> None:
        """:meth:`Bridge.close_soon`: the loop's stop, queued once (nothing more when a
        close was begun already, by this or by :meth:`Bridge.close`)."""
        if os.getpid() != self.pid or self.close_begun:
            return
        self.close_begun = True

        def stop() -> None:  # (on the loop, where no lock is held between callbacks)
            with self.lock:
                self.closed = True
            self.loop.stop()

        with contextlib.suppress(RuntimeError):  # (the loop is closed: closed already)
            self.loop.call_soon_threadsafe(stop)

    def stop_soon(self) -> None:
        """:meth:`Bridge.close`'s stop of the loop, once what runs on it was closed:
        nothing when a stop was queued already (:meth:`close_soon`, or a close before)."""
        if self.close_begun:
            return
        self.close_begun = True
        with contextlib.suppress(RuntimeError):  # (the loop is closed: closed already)
            self.loop.call_soon_threadsafe(self.loop.stop)


def close_dropped_bridge(core: BridgeLoop, name: str) -> None:
    """A :class:`Bridge`'s finalizer: garbage-collected unclosed (nothing made on it is
    alive, as each holds it), it is closed as :meth:`Bridge.close` would close it (the
    servers and peers made on it too) without waiting for it (:meth:`Bridge.close_soon`:
    its loop thread closes them, then ends), and a ResourceWarning says so.  It waits for
    nothing, as it runs on whatever thread the garbage collector ran on (another event
    loop's, one holding a lock the loop thread's close needs).  Nothing more when its close
    was begun already (closed by hand, or by the finalizer of the SyncServer or SyncPeer it
    belonged to); nothing in a child made by ``fork()``."""
    if os.getpid() != core.pid:
        return
    begun = core.closed or core.close_begun
    core.close_soon()  # (a close() interrupted before its stop: the loop ends all the same)
    if begun:
        return
    warnings.warn(f"unclosed kvwire.sync.Bridge {name!r}: it is closed now, with the servers and peers made on "
                  "it, as it is garbage-collected; close() it", ResourceWarning, stacklevel=1)


class Bridge:
    """An asyncio event loop running on its own daemon thread.

    One garbage-collected unclosed (nothing made on it is alive: a SyncServer or SyncPeer
    holds its bridge) is closed then, with what was made on it, and a ResourceWarning says
    so (as an unclosed socket's): :meth:`close` it."""

    def __init__(self, name: str = "kvwire-sync") -> None:
        # What the loop thread holds: not this (or this would never be collected).
        core = self._core = BridgeLoop()
        self.loop = core.loop
        self._thread = threading.Thread(target=core.run, name=name, daemon=True)
        self._pid = core.pid
        self._lock = core.lock
        self._watched = core.watched
        self._owned = core.owned
        self._closing = core.closing
        # What submit() scheduled: close() fails the waiters of what the loop never ended
        # (a loop stuck for longer than close() waits for it).
        self._futures: weakref.WeakSet[concurrent.futures.Future[Any]] = weakref.WeakSet()
        # Held by the close() under way: another thread's close() waits for it to end.
        self._close_lock = threading.Lock()
        self._close_finished = False
        self._thread.start()
        core.ready.wait()
        # Closes it once garbage-collected unclosed; not at the interpreter's exit (its
        # daemon thread ends with the process).
        self._finalizer = weakref.finalize(self, close_dropped_bridge, core, name)
        self._finalizer.atexit = False

    @property
    def closed(self) -> bool:
        return self._core.closed

    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def check_process(self) -> None:
        """:class:`~kvwire.UsageError` in a child made by ``fork()``: the loop thread runs in
        the parent only, so a call waiting on it there would never return."""
        if os.getpid() != self._pid:
            raise UsageError(
                f"a kvwire.sync bridge made in process {self._pid} was used in process {os.getpid()}, a child "
                "made by fork(): its loop thread does not run in the child (make a new SyncServer or SyncPeer there)")

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; a future any thread can wait on."""
        try:
            self.check_process()
        except UsageError:
            coro.close()
            raise
        with self._lock:
            if self._core.closed:
                coro.close()
                raise ConnectionLostError("the kvwire bridge is closed")
            fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
            self._futures.add(fut)
            return fut

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None, *,
            track: Callable[[concurrent.futures.Future[Any]], None] | None = None,
            gone: Callable[[], KvwireError | None] | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (at most ``timeout`` seconds).
        A wait that ends without it (its timeout, or anything raised into the waiting
        thread, a KeyboardInterrupt) cancels it.  ``track`` is given its future (whose
        owner may cancel it, a peer closing), and ``gone()`` says why when it was
        cancelled so (None: not by that owner)."""
        try:
            check_wait(timeout)  # before it runs: it is not left running
            self.check_process()
        except UsageError:
            coro.close()
            raise
        if self.in_loop_thread():
            coro.close()
            raise UsageError("a blocking kvwire.sync call was made from the bridge's own loop thread")
        fut = self.submit(coro)
        if track is not None:
            track(fut)

        def not_done() -> KvwireError:
            fut.cancel()  # nobody waits for it any more
            return TransferTimeoutError(f"not done in {timeout} s")

        def cancelled() -> KvwireError:
            error = gone() if gone is not None else None
            if error is not None:
                return error
            if self._core.closed:
                return ConnectionLostError("the kvwire bridge was closed while the call ran")
            return TransferAbortedError("the call was cancelled on the bridge's loop")

        try:
            return wait_result(fut, timeout, not_done=not_done, cancelled=cancelled)
        except BaseException:
            # The caller gave up (KeyboardInterrupt, or any error raised into its wait):
            # what it started does not go on behind its back (a send holding the arrays
            # the caller now takes back).  Nothing to cancel when that was its own error.
            fut.cancel()
            raise

    def call_soon(self, fn: Any, *args: Any) -> None:
        self.check_process()
        with self._lock:
            if self._core.closed:
                raise ConnectionLostError("the kvwire bridge is closed")
            self.loop.call_soon_threadsafe(fn, *args)

    def when_ended(self, event: threading.Event) -> None:
        """Set ``event`` once the loop thread's run ended (at once if it has): nothing
        runs on the loop after that.  The bridge keeps ``event`` weakly."""
        with self._lock:
            if not self._core.ended:
                self._core.end_events.add(event)
                return
        event.set()

    def call_soon_while_running(self, fn: Any) -> None:
        """Schedule ``fn`` on the loop even when this is closed, as long as the loop is not:
        what a close under way (or one that gave up on a held-up loop) has not ended yet
        still runs it before the loop ends."""
        with contextlib.suppress(RuntimeError):  # (the loop is closed: nothing runs any more)
            self.loop.call_soon_threadsafe(fn)

    def watch(self, handle: ReceiveHandle) -> None:
        with self._lock:
            self._watched.add(handle)

    async def own(self, thing: Any) -> None:
        """On the loop: ``thing`` (a running Server or Peer) is closed by :meth:`close`
        (closed at once if the bridge is closing already)."""
        with self._lock:
            closing = self._core.closed
            if not closing:
                self._owned[id(thing)] = thing
        if closing:
            await thing.close()
            raise ConnectionLostError("the kvwire bridge is closed")

    async def close_owned(self, thing: Any) -> None:
        """On the loop: close ``thing`` (a Server or Peer it owns) and disown it once
        closed.  Its close is not cancelled with the caller: it goes on (one close at a
        time), and one that did not complete leaves it owned."""
        await self._core.close_owned(thing)

    def _close_task(self, thing: Any) -> asyncio.Task[None]:
        return self._core.close_task(thing)

    def close_soon(self) -> None:
        """Begin closing without waiting for anything, from any thread, the loop's own too
        (a garbage collector's finalizer may run on either): the loop stops, and its
        thread's end closes the servers and peers it owns, cancels the rest and closes the
        loop, its thread ending then.  Takes no lock a thread may hold meanwhile; nothing
        in a child made by ``fork()`` (the loop thread runs in the parent only)."""
        self._core.close_soon()

    def submit_close(self, coro: Coroutine[Any, Any, None]) -> concurrent.futures.Future[None]:
        """Schedule ``coro``, which closes what a failed start opened, on the loop: a close
        under way, which :meth:`close` waits for (as for the closes of what it owns) before
        it cancels what still runs."""
        async def close() -> None:
            task = asyncio.current_task()
            assert task is not None
            self._closing[id(task)] = task
            try:
                await coro
            finally:
                del self._closing[id(task)]

        wrapper = close()
        try:
            return self.submit(wrapper)
        except BaseException:
            coro.close()  # (submit() closed the wrapper before it began)
            raise

    def close(self, timeout: float = 5.0) -> None:
        """Close the servers and peers that run on the loop (their sockets, the listening
        one too) and let the closes under way end (what a start given up on opened), then
        cancel what still runs on it, stop it and join the thread (idempotent;
        each step waits at most ``timeout`` seconds, a finite number >= 0).  What it
        could not close in time (a loop held up elsewhere) is closed when the loop ends.
        A close() while another thread's is under way waits for that one to end (at most
        as long as its own steps would wait); one that failed (interrupted) may be
        called again."""
        check_value("timeout", timeout, zero_ok=True)  # (before anything changes)
        self.check_process()
        if self.in_loop_thread():
            raise UsageError("Bridge.close() from the loop thread")
        with self._lock:
            self._core.closed = True  # nothing new is submitted from now on
        if not self._close_lock.acquire(timeout=min(3 * timeout, LONGEST_WAIT)):
            return  # another thread's close is still under way
        try:
            if not self._close_finished:
                self._close(timeout)
                self._close_finished = True
        finally:
            self._close_lock.release()

    def _close(self, timeout: float) -> None:
        async def close_all() -> None:
            with self._lock:
                owned = list(self._owned.values())
            for thing in owned:  # their close() fails their transfers and waiters with their own errors
                self._close_task(thing)
            closes = list(self._closing.values())  # those and the closes already under way
            if closes:
                _, late = await asyncio.wait(closes, timeout=timeout)
                if late:  # they go on (the tasks they wait for too): the loop's end finishes them, then the rest
                    return
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        coro = close_all()
        try:
            fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        except RuntimeError:  # the loop is closed already (a close called again)
            coro.close()
        else:
            with contextlib.suppress(concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
                fut.result(thread_wait(2 * timeout))
        self._core.stop_soon()
        self._thread.join(thread_wait(timeout))
        if self._thread.is_alive():  # a stuck loop: its waiters are not left waiting on it
            with self._lock:
                futures = list(self._futures)
            for f in futures:
                with contextlib.suppress(RuntimeError):  # (the loop closed meanwhile)
                    f.cancel()
        with self._lock:
            watched = list(self._watched)
        for handle in watched:
            handle._wake()


def start_on(bridge: Bridge, start: Coroutine[Any, Any, T], timeout: float | None) -> T:
    """Run ``start`` (it opens a server or peer the bridge owns) on ``bridge``'s loop and
    wait at most ``timeout`` s for it.  One that completes after the caller gave up (a loop
    busy with other work) is closed then, not left open until the bridge closes."""
    try:
        bridge.check_process()  # (a forked child: nothing runs, nothing is left unawaited)
    except UsageError:
        start.close()
        raise
    started: list[asyncio.Task[T]] = []

    async def run() -> T:
        task = asyncio.current_task()
        assert task is not None
        started.append(task)
        return await start

    try:
        return bridge.run(run(), timeout)
    except BaseException:
        async def discard() -> None:  # (on the loop: after run() began, or was cancelled first)
            if not started:  # never began: nothing was opened
                start.close()
                return
            task = started[0]
            await asyncio.wait([task])
            if not task.cancelled() and task.exception() is None:
                await bridge.close_owned(task.result())

        try:
            # A close under way: the bridge's close (the caller's own bridge, closed next)
            # lets it end before it cancels the rest.  Cancelled, a peer's failed open
            # (closed at once, lingering 0 s) was closed again by its close(), lingering 1 s.
            bridge.submit_close(discard())
        except ConnectionLostError:  # (a closed bridge closed what it owned)
            if inspect.getcoroutinestate(start) == inspect.CORO_CREATED:
                start.close()
        raise


def close_dropped(bridge: Bridge, what: str) -> None:
    """A SyncServer's or SyncPeer's finalizer (``what`` names it): garbage-collected
    unclosed, its own ``bridge`` is closed without waiting (:meth:`Bridge.close_soon`), and
    a ResourceWarning says so, as an unclosed socket's does.  Nothing when its bridge is
    closed already, or its close begun (its close() ended, or the bridge was closed by
    hand, or close_soon() was called)."""
    if bridge.closed or bridge._core.close_begun or os.getpid() != bridge._pid:  # (a forked child: its copy holds no thread)
        return
    bridge.close_soon()  # first: a warning raised (an "error" filter) closes it all the same
    warnings.warn(f"unclosed {what}: it is closed now, as it is garbage-collected; close() it",
                  ResourceWarning, stacklevel=1)  # (run by a collector: no caller to name)


def watch_dropped(owner: SyncServer | SyncPeer, what: str) -> weakref.finalize[Any, Any]:
    """:func:`close_dropped` for ``owner`` (a SyncServer or SyncPeer with its own bridge)
    once it is garbage-collected; not at the interpreter's exit (its daemon thread ends with
    the process).  Nothing the loop runs refers to ``owner``, or it would never be collected."""
    finalizer = weakref.finalize(owner, close_dropped, owner.bridge, what)
    finalizer.atexit = False
    return finalizer


# -- GPU stream order across the bridge ---------------------------------------------------
# CuPy's current stream is per thread (and per device): the send on the loop orders its
# transfer stream after the loop thread's current stream, and the caller's arrays were
# written on the caller's.  A blocking call records where the caller's current stream is,
# on each device of its GPU arrays; the loop thread's current stream there waits for it
# before the send (or a write into the caller's memory) touches them, and a GPU layer
# handed to the caller is ordered before its current stream's next work.  That current
# stream is the loop thread's own non-blocking stream on the device, made current there
# the first time it waits for a caller (and again for any later mark if another stream is
# current then: CuPy 13 forgets a use()d stream when a `with` block of another ends, so
# kvwire makes streams current for a while with kvwire.codec.gpu.on_stream, not `with`):
# never the legacy null stream (every blocking stream's and other threads' default-stream
# work would wait for the caller's work then).
# A GPU server's layers are still allocated on the stream that was current before it
# (normally the null stream): they are the caller's once handed over, and a layer it drops
# goes back to CuPy's pool in that stream's order, not the loop's own stream's, whose next
# allocation would reuse it unordered with reads still queued on the caller's stream.
# CPU-only use never imports CuPy.


def _device_of(x: Any) -> int:
    dev = getattr(x, "device", None)
    if type(x).__module__.startswith("cupy") and dev is not None:
        return int(dev.id)
    return int(x.__dlpack_device__()[1])


def caller_marks(arrays: Any) -> list[tuple[int, Any]]:
    """(in the caller's thread) ``(device, event)``: an event recorded on the calling
    thread's current CUDA stream of each device that holds one of ``arrays`` (an iterable
    of anything: what is not a GPU array is passed over).  Empty without a GPU array
    (and CuPy is not imported then)."""
    devices: set[int] = set()
    for x in arrays:
        if is_device_array(x):
            with contextlib.suppress(Exception):  # (one it cannot read fails in the send)
                devices.add(_device_of(x))
    if not devices:
        return []
    try:
        import cupy
    except ImportError:
        return []  # (the send says that a GPU array needs CuPy)
    marks = []
    for device in sorted(devices):
        with cupy.cuda.Device(device):
            marks.append((device, cupy.cuda.get_current_stream().record()))
    return marks


def layer_arrays(layers: Any) -> list[Any]:
    """The arrays of a list or tuple of ``(k, v)`` layers, or the caches of a
    :class:`~kvwire.paged.PagedSource` (gathered on the loop thread, from caches the
    caller wrote); none of an iterator's: it yields them on the loop thread."""
    from kvwire.paged import PagedSource  # (imported with kvwire: no CuPy)

    if isinstance(layers, PagedSource):
        return list(layers.caches)
    if not isinstance(layers, (list, tuple)):
        return []
    return [x for item in layers if isinstance(item, (list, tuple)) for x in item]


_loop_streams = threading.local()  # the loop thread's own current streams: (cupy, {device: stream})


def loop_stream(cupy: Any, device: int) -> None:
    """(on the loop thread, ``device`` current) Its own non-blocking stream on
    ``device`` made its current stream there, once: the caller's marks are waited for on
    it, not on the legacy null stream, which every blocking stream (and other threads'
    default-stream work) would then wait behind.  The DLPack imports, copies and gathers
    the loop queues there run on it, and the transfer stream, which waits for the loop
    thread's current stream, follows it.  A GPU server's layers, handed to the caller,
    stay allocated on the stream current before (:func:`kvwire.aio._gpu.allocate_layers_on`).
    Called again, it makes that stream current again if another is current now (after
    what was queued on that one: CuPy 13 drops a ``use()``d stream when a ``with`` block
    of another ends), so each mark is waited for on it."""
    from kvwire.aio._gpu import allocate_layers_on, thread_streams

    streams = thread_streams(_loop_streams, cupy)
    stream = streams.get(device)
    if stream is None:

        previous = cupy.cuda.get_current_stream()
        stream = cupy.cuda.Stream(non_blocking=True)
        # after what the loop had queued on its current stream until now (memory it
        # allocated there may be used on the new one)
        stream.wait_event(previous.record())
        allocate_layers_on(cupy, device, previous)
        stream.use()
        streams[device] = stream
        return
    current = cupy.cuda.get_current_stream()
    if int(current.ptr) != int(stream.ptr):
        # made current again: CuPy 13 forgets a use()d stream when any `with other:` block
        # on this thread and device ends (cupy/cupy#8377), and the stream current then (the
        # null stream) never waited for the caller's marks.  (A stream made current for a
        # while in kvwire is so with kvwire.codec.gpu.on_stream, which restores it.)  After
        # what was queued on that one: memory allocated there may be used on this one.
        stream.wait_event(current.record())
        stream.use()


def order_after(marks: list[tuple[int, Any]]) -> None:
    """(on the loop thread) Its current stream on each device (its own,
    :func:`loop_stream`) waits for the caller's mark there: work queued on it next (a
    send's transfer stream orders after it) comes after what the caller had queued on its
    own stream."""
    if not marks:
        return
    import cupy

    for device, event in marks:
        with cupy.cuda.Device(device):
            loop_stream(cupy, device)
            cupy.cuda.get_current_stream().wait_event(event)


async def after_marks(marks: list[tuple[int, Any]], start: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """``start()`` run once the loop thread's streams wait for ``marks`` (made only then:
    this closed before it ran leaves no coroutine unawaited)."""
    order_after(marks)
    return await start()


def hand_over(layer: Layer) -> Layer:
    """(in the caller's thread) A GPU layer's device work (its allocation on the loop
    thread's layer stream, the one current before its own, which the transfer stream waits
    for, and its decode, on the transfer stream) ordered before the caller's current
    stream's next work."""
    k = layer.k
    if not type(k).__module__.startswith("cupy"):
        return layer
    import cupy

    from kvwire.aio._gpu import stream_for

    device = int(k.device.id)
    with cupy.cuda.Device(device):
        cupy.cuda.get_current_stream().wait_event(stream_for(device).record())
    return layer


class ReceiveState:
    """What a :class:`ReceiveHandle`'s receive on the loop fills and its waiters wait on.
    It refers to no bridge (nor to the handle, which holds the bridge): the receive on the
    loop holds this, so that a bridge dropped with its server while an ``expect()`` without
    timeout is pending is collected (and closes that server, which fails the receive), not
    kept alive by its own loop."""

    def __init__(self, request_id: str, num_layers: int | None) -> None:
        self.request_id = request_id
        self.cond = threading.Condition()
        self.layers: dict[int, Layer] = {}
        self.num_layers = num_layers
        self.error: KvwireError | None = None
        self.done = False
        self.transfer: Any = None
        self.task: asyncio.Task[None] | None = None

    def fail(self, error: KvwireError) -> None:
        with self.cond:
            if self.error is None and not self.done:
                self.error = error
            self.cond.notify_all()

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()


async def receive(state: ReceiveState, server: Any, into: Any, timeout: float | None,
                  marks: list[tuple[int, Any]] | None = None) -> None:
    """(on the loop) :meth:`SyncServer.expect`'s receive into ``state``: what it waits
    for, and every layer as it arrives (``into``: a destination, or None; written after
    ``marks``, the caller's streams when it expected it, :func:`caller_marks`)."""
    state.task = asyncio.current_task()
    request_id = state.request_id
    if state.error is not None:  # aborted before this began: what arrived already is given up
        _abort_arrived(server, request_id)
        return
    try:
        order_after(marks or [])
        transfer = await server.expect(request_id, into=into, timeout=timeout) if into is not None \
            else await server.expect(request_id, timeout=timeout)
        with state.cond:
            aborted = state.error is not None  # abort() came while the transfer was handed over
            if not aborted:
                state.transfer = transfer
                state.num_layers = transfer.spec.num_layers
                state.cond.notify_all()
        if aborted:
            transfer.abort(f"receive of {local_id(request_id)} aborted")
            return
        async for layer in transfer:
            with state.cond:
                state.layers[layer.index] = layer
                state.cond.notify_all()
        with state.cond:
            state.done = True
            state.cond.notify_all()
    except asyncio.CancelledError:
        state.fail(TransferAbortedError(f"receive of {local_id(request_id)} aborted"))
        raise
    except KvwireError as exc:
        state.fail(exc)
    except Exception as exc:  # never leave a waiter hanging on an unexpected error
        state.fail(KvwireError(f"receive of {local_id(request_id)} failed: {exc!r}"))


def _abort_arrived(server: Any, request_id: str) -> None:
    """A receive aborted before it began on the loop: the transfer it would have taken, if
    one of ``request_id`` has arrived already, is aborted (the sender is told), not left
    for nobody to claim until its ``claim_timeout`` (or for ever without one)."""
    transfer = server._arrived(request_id)  # (the package's own Server: claimed if there)
    if transfer is not None:
        transfer.abort(f"receive of {local_id(request_id)} aborted")


class ReceiveHandle:
    """An expected incoming transfer, waited on from any thread."""

    def __init__(self, bridge: Bridge, request_id: str, num_layers: int | None) -> None:
        # The bridge, for the caller's side only: the receive on the loop holds the state.
        self._bridge = bridge
        self.request_id = request_id
        self._state = ReceiveState(request_id, num_layers)
        bridge.watch(self)

    def _receive(self, server: Any, into: Any, timeout: float | None,
                 marks: list[tuple[int, Any]] | None = None) -> Coroutine[Any, Any, None]:
        """The receive to run on the loop: it refers to the state, not to this handle (nor,
        through it, to the bridge, which its own loop would then keep alive)."""
        return receive(self._state, server, into, timeout, marks)

    def _fail(self, error: KvwireError) -> None:
        self._state.fail(error)

    def _wake(self) -> None:
        """The bridge closed: waiters look again (and see it closed)."""
        self._state.wake()

    # -- caller side ----------------------------------------------------------------------

    @property
    def transfer(self) -> Any:
        """The :class:`~kvwire.Transfer` once it arrived (None before)."""
        return self._state.transfer

    @property
    def done(self) -> bool:
        """Every layer arrived."""
        return self._state.done

    @property
    def error(self) -> KvwireError | None:
        return self._state.error

    def layers_done(self) -> int:
        with self._state.cond:
            return len(self._state.layers)

    def _wait_for(self, ready: Any, timeout: float | None, what: str) -> None:
        check_wait(timeout)
        self._bridge.check_process()
        if self._bridge.in_loop_thread():
            raise UsageError("a blocking kvwire.sync call was made from the bridge's own loop thread")
        state = self._state
        with state.cond:
            ok = state.cond.wait_for(lambda: ready() or state.error is not None or self._bridge.closed,
                                     thread_wait(timeout))
            if ready():
                return
            if state.error is not None:
                raise detached(state.error)
            if self._bridge.closed:
                raise ConnectionLostError("the kvwire bridge is closed")
            assert not ok
            raise TransferTimeoutError(f"{what} of {local_id(self.request_id)} not ready after {timeout} s")

    def wait_layer(self, index: SupportsIndex, timeout: float | None = None) -> Layer:
        """Block until layer ``index`` (an int) has arrived; return it (raises the transfer's error).

        A GPU layer is ordered before the calling thread's current CUDA stream: work queued
        there afterwards runs after its decode."""
        i = check_index("layer index", index, 0)
        state = self._state
        if state.num_layers is not None and i >= state.num_layers:
            raise UsageError(f"layer {i} out of range: the transfer has {state.num_layers} layers")
        # Once the transfer arrived (or ended) its layer count is known: an index past it
        # is an error then, not a wait without end.
        self._wait_for(lambda: i in state.layers or state.done or (
            state.num_layers is not None and i >= state.num_layers), timeout, f"layer {i}")
        if i not in state.layers:
            raise UsageError(f"layer {i} out of range: the transfer has {state.num_layers} layers")
        return hand_over(state.layers[i])

    def wait(self, timeout: float | None = None) -> None:
        """Block until every layer has arrived."""
        self._wait_for(lambda: self._state.done, timeout, "transfer")

    def abort(self, reason: str = "", timeout: float = 5.0) -> bool:
        """Stop receiving: the sender is told (when the transfer began, or had arrived
        already: one this receive would have taken is aborted) and waiters fail.

        From another thread it returns once the loop has stopped the transfer, or has
        ended (at most ``timeout`` seconds), so the caller may reuse the destination's
        memory then: no chunk is written into it afterwards.  A closed bridge is no
        exception: its loop runs until its close ended.  Returns whether that is so: False
        when the loop did not get to it within ``timeout`` (a loop held up elsewhere, a
        close under way on it), and a chunk may still be written into the destination.
        ``timeout``: a finite number >= 0."""
        check_value("timeout", timeout, zero_ok=True)  # (before anything changes)
        self._bridge.check_process()
        self._fail(TransferAbortedError(f"receive of {local_id(self.request_id)} aborted{': ' + reason if reason else ''}"))

        state = self._state

        def cancel() -> None:
            t = state.transfer
            if t is not None and not t.complete:
                abort = getattr(t, "abort", None)
                if abort is not None:
                    abort(reason)
                else:  # a server without Transfer.abort(): fail it and tell the sender
                    err = TransferAbortedError(f"receiver aborted {local_id(state.request_id)}")
                    t.fail(err)
                    sess = t._session
                    sess.bury(t, err)
                    stream = sess.any_stream()
                    if stream is not None:
                        stream.conn.send_reset(t.transfer_id, err.code, str(err))
                        stream.flush()
            if state.task is not None:
                state.task.cancel()

        if self._bridge.in_loop_thread():
            cancel()
            return True
        # Done once the loop stopped the transfer, or once the loop thread ended (nothing
        # writes into the destination then).  A closed bridge's loop may still run: its
        # close under way, or one that gave up on a loop held up elsewhere, has not ended
        # it yet, and what is still on it may write a chunk until it ends.
        done = threading.Event()
        self._bridge.when_ended(done)

        def cancel_and_tell() -> None:
            try:
                cancel()
            finally:
                done.set()

        try:
            self._bridge.call_soon(cancel_and_tell)
        except ConnectionLostError:  # closed: stopped by the loop if it still runs, else by its end
            self._bridge.call_soon_while_running(cancel_and_tell)
        return done.wait(thread_wait(timeout))


class SyncServer:
    """``kvwire.serve()`` on a background loop; :meth:`expect` from any thread.

    One with its own bridge garbage-collected unclosed is closed then, without waiting,
    with a ResourceWarning (as an unclosed socket): :meth:`close` it."""

    #: Closes it (with its own bridge) once garbage-collected unclosed; None: nothing to do.
    _finalizer: weakref.finalize[Any, Any] | None = None

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, secret: bytes,
                 bridge: Bridge | None = None, start_timeout: float = 30.0, **options: Any) -> None:
        check_bridge(bridge)
        self._own_bridge = bridge is None
        self.bridge = bridge or Bridge("kvwire-server")
        self._server: Any = None
        # The handles to fail if the server closes first: weak, so that one its caller let
        # go of (and the layers it holds) is freed, not kept for the server's lifetime.
        # expect() may add to it on any thread while close() lists it: under the lock (a
        # WeakSet is listed by Python code, which another thread's add() can interrupt).
        self._handles: weakref.WeakSet[ReceiveHandle] = weakref.WeakSet()
        self._handles_lock = threading.Lock()

        async def start() -> Any:
            server = kvwire.serve(host, port, secret=secret, **options)
            await server.start()
            await self.bridge.own(server)
            return server

        try:
            self._server = start_on(self.bridge, start(), start_timeout)
        except BaseException:
            if self._own_bridge:
                self.bridge.close()
            raise
        self.port: int = self._server.port
        if self._own_bridge:  # (a shared bridge's close closes it)
            self._finalizer = watch_dropped(self, f"kvwire.sync.SyncServer on {address((host, self.port))}")

    @property
    def server(self) -> Any:
        """The underlying :class:`~kvwire.Server` (use only on the bridge's loop)."""
        return self._server

    def expect(self, request_id: str, *, into: Any = None, timeout: float | None = None,
               num_layers: SupportsIndex | None = None) -> ReceiveHandle:
        """Start waiting for ``request_id``'s transfer; returns at once.  ``num_layers``
        (an int in [1, 65535]), when known, bounds :meth:`ReceiveHandle.wait_layer`'s
        index before the transfer arrived.  ``into`` (a destination, as
        :meth:`kvwire.Server.expect` takes) without a destination's methods is refused.

        Without ``into``, every layer is taken as it arrives (as ``collect()`` does) and
        the handle holds it: taken layers are outside the server's ``max_buffer_bytes``,
        so the sender is not held back by a slow reader; ``into`` bounds the memory."""
        check_request_id(request_id)  # at once, not from the wait
        check_seconds("timeout", timeout)
        check_destination(into)
        layers = check_index("num_layers", num_layers, 1, 0xFFFF) if num_layers is not None else None  # (KVSpec's range)
        self.bridge.check_process()
        # a GPU cache is written after what this thread's streams had queued on it by now
        # (first: a failure here leaves no handle behind)
        marks = caller_marks(getattr(into, "caches", ())) if into is not None else []
        handle = ReceiveHandle(self.bridge, request_id, layers)
        with self._handles_lock:
            self._handles.add(handle)
        self.bridge.submit(handle._receive(self._server, into, timeout, marks))
        return handle

    def unclaimed_request_ids(self, timeout: float = 5.0) -> list[str]:
        """:meth:`kvwire.Server.unclaimed_request_ids` from any thread: the request ids of
        the arrived transfers :meth:`expect` would hand out now, oldest first, failed ones
        included, read on the bridge's loop within ``timeout`` seconds
        (:class:`~kvwire.TransferTimeoutError` past it; a closed bridge raises
        :class:`~kvwire.ConnectionLostError`)."""
        server = self._server

        async def ids() -> list[str]:
            return list(server.unclaimed_request_ids())

        return self.bridge.run(ids(), timeout)

    def statistics(self, timeout: float = 5.0) -> dict[str, Any]:
        """:meth:`kvwire.Server.statistics` from any thread: the snapshot, read on the
        bridge's loop within ``timeout`` seconds (:class:`~kvwire.TransferTimeoutError`
        past it; a closed bridge raises :class:`~kvwire.ConnectionLostError`)."""
        server = self._server

        async def snapshot() -> dict[str, Any]:
            return dict(server.statistics())

        return self.bridge.run(snapshot(), timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Close the server (and its own bridge); each step waits at most ``timeout``
        seconds (a finite number >= 0).  A server whose close did not complete in time is
        closed with its bridge.  On a bridge another thread is closing it waits for that
        close to end (as :meth:`Bridge.close` does)."""
        check_value("timeout", timeout, zero_ok=True)  # (before anything changes)
        self.bridge.check_process()
        if self.bridge.closed:  # (closed by another thread, its close perhaps under way)
            if not self.bridge.in_loop_thread():
                # waits for the bridge's close under way (which closes this), at once once
                # it ended, and ends a close that failed
                self.bridge.close(timeout)
            return
        if self.bridge.in_loop_thread():  # (it would wait on itself; nothing is closed)
            raise UsageError("SyncServer.close() from the bridge's own loop: await the server's close() there")
        with contextlib.suppress(KvwireError):
            # not disowned unless closed: the bridge's close then closes it
            self.bridge.run(self.bridge.close_owned(self._server), timeout)
        with self._handles_lock:
            handles = list(self._handles)
        for h in handles:
            h._fail(ConnectionLostError("server closed"))
        if self._own_bridge:
            self.bridge.close(timeout)
            if self._finalizer is not None:
                self._finalizer.detach()  # (closed: nothing for it to do)

    def __enter__(self) -> SyncServer:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


async def queued_layers(queue: asyncio.Queue[Any], num_layers: int) -> AsyncIterator[tuple[Any, Any]]:
    """:meth:`SendHandle.send_layer`'s layers as they are queued (``num_layers`` of them),
    each once the loop thread's streams wait for the caller's when it was queued."""
    for _ in range(num_layers):
        layer, marks = await queue.get()
        order_after(marks)
        yield layer


class SendHandle:
    """One outgoing transfer fed layer by layer from any thread."""

    def __init__(self, bridge: Bridge, request_id: str, num_layers: int, owner: Any = None) -> None:
        self._bridge = bridge
        # The SyncPeer that began it, kept alive while the handle is held (garbage-collected
        # unclosed, the peer is closed); not by the send on the loop, which holds the queue only.
        self._owner = owner
        self.request_id = request_id
        self.num_layers = num_layers
        self._lock = threading.Lock()
        self._queued = 0
        # Bound to the bridge's loop on first use there (put_nowait runs on the loop thread).
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._future: concurrent.futures.Future[Any] | None = None
        self._aborted = False
        self._lost = False  # its peer closed: waiters fail with ConnectionLostError
        # Kept up to date on the loop (accepted, layers granted, waiting for credit): the
        # send on the loop holds it, not this handle (see _layers()).
        self._progress = SendProgress()

    def _layers(self) -> AsyncIterator[tuple[Any, Any]]:
        """The layers queued, for the send on the loop: it refers to the queue, not to this
        handle (nor, through it, to its SyncPeer, which could then never be collected)."""
        return queued_layers(self._queue, self.num_layers)

    def send_layer(self, k: Any, v: Any) -> None:
        """Queue the next layer (in layer order); returns at once.  The arrays must not be
        modified until :meth:`wait` returns (pass copies, e.g. from :func:`kvwire.paged.gather_layer`).
        GPU arrays are read after what the calling thread's current CUDA stream had queued."""
        marks = caller_marks((k, v))
        with self._lock:
            if self._queued >= self.num_layers:
                raise UsageError(f"all {self.num_layers} layers of {local_id(self.request_id)} were already queued")
            self._bridge.call_soon(self._queue.put_nowait, ((k, v), marks))
            self._queued += 1  # only once queued: a closed bridge's refusal counts no layer

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the receiver acknowledged everything; the :class:`~kvwire.Receipt`.

        Raises the send's error; :class:`~kvwire.TransferAbortedError` after :meth:`abort`,
        :class:`~kvwire.ConnectionLostError` when its peer or the bridge closed under it."""
        check_wait(timeout)
        self._bridge.check_process()
        if self._bridge.in_loop_thread():
            raise UsageError("a blocking kvwire.sync call was made from the bridge's own loop thread")
        assert self._future is not None

        def cancelled() -> KvwireError:
            if self._aborted:
                return TransferAbortedError(f"send of {local_id(self.request_id)} aborted")
            if self._lost:
                return ConnectionLostError(f"the peer was closed while sending {local_id(self.request_id)}")
            if self._bridge.closed:
                return ConnectionLostError(f"the kvwire bridge was closed while sending {local_id(self.request_id)}")
            return TransferAbortedError(f"send of {local_id(self.request_id)} aborted")

        def not_done() -> KvwireError:
            text = f"send of {local_id(self.request_id)} not done after {timeout:g} s"
            if not self.accepted:
                text += (": it has not started, the server has not accepted it yet (a server holds its ACCEPT "
                         "while its buffer budget has no room for the transfer's first layer)")
            elif self.waiting_for_credit:
                text += (f": the server has granted {self.layers_granted} of its {self.num_layers} layers and "
                         "holds the rest while its buffer budget has no room (until its application takes layers)")
            return TransferTimeoutError(text)

        # (not cancelled when not done in time: the send goes on, and may be waited for again)
        return wait_result(self._future, timeout, not_done=not_done, cancelled=cancelled, kept=True)

    @property
    def done(self) -> bool:
        return self._future is not None and self._future.done()

    @property
    def accepted(self) -> bool:
        """Whether the server accepted the transfer (answered its BEGIN), from any thread,
        without the loop: False until then, while a server holds its ACCEPT because its
        buffer budget has no room for the transfer's first layer (its application has
        not taken what it holds), and for a send that failed before it.  Once True it
        stays so."""
        return self._progress.accepted.is_set()

    @property
    def layers_granted(self) -> int:
        """The layers the server has granted so far (layers ``0 .. layers_granted - 1`` may
        be sent; all of them once the send is done), from any thread without the loop."""
        return self._progress.layers_granted

    @property
    def waiting_for_credit(self) -> bool:
        """Whether the send is waiting, now, for the server to grant its next layer: a
        server grants layers only within its buffer budget's room, so one whose
        application does not take layers holds its senders here (docs/protocol.md 8.2)."""
        return self._progress.waiting_for_credit

    def abort(self) -> None:
        """Give up on this transfer (the send is cancelled; waiters fail with
        :class:`~kvwire.TransferAbortedError`)."""
        self._bridge.check_process()
        if self._future is not None:
            self._aborted = True
            self._future.cancel()

    def _lose(self) -> None:
        """Its peer closed: a send not ended yet is cancelled, and its waiters fail with
        :class:`~kvwire.ConnectionLostError` (at once, a loop held up elsewhere too)."""
        if self._future is not None and not self._future.done():
            self._lost = True
            self._future.cancel()


async def open_peer(bridge: Bridge, host: str, port: int, *, secret: bytes, **options: Any) -> Any:
    """``kvwire.connect()`` on ``bridge``'s loop (run it there), owned by the bridge: closed
    with it.  A connect that fails or is cancelled mid-handshake leaves no socket open."""
    peer = kvwire.connect(host, port, secret=secret, **options)
    try:
        await peer.__aenter__()
    except BaseException:
        await peer.close()
        raise
    await bridge.own(peer)
    return peer


def check_send_options(peer: Any, options: dict[str, Any]) -> dict[str, Any]:
    """What :meth:`kvwire.Peer.send` checks of its options before anything is sent
    (``Peer._send_arguments()``), checked in the caller's thread
    (:meth:`SyncPeer.begin` returns before the send starts on the loop): a
    :class:`~kvwire.UsageError` before anything changes.  The options to send (``blocks``
    read here once: an iterator is not read again)."""
    params = inspect.signature(peer.send).parameters
    for name in options:
        param = params.get(name)
        if param is None or param.kind is not inspect.Parameter.KEYWORD_ONLY:
            raise UsageError(f"unknown send option {name!r}")
    options = dict(options)
    if options.get("blocks") is not None:
        options["blocks"] = block_pairs(options["blocks"], "blocks")
    peer._send_arguments(**options)
    return options


class SyncPeer:
    """``kvwire.connect()`` on a background loop; :meth:`begin` / :meth:`send` from any thread.

    One with its own bridge garbage-collected unclosed is closed then, without waiting,
    with a ResourceWarning (as an unclosed socket): :meth:`close` it.  Its
    :class:`SendHandle` objects keep it alive while they are held."""

    #: Closes it (with its own bridge) once garbage-collected unclosed; None: nothing to do.
    _finalizer: weakref.finalize[Any, Any] | None = None

    def __init__(self, host: str, port: int, *, secret: bytes, bridge: Bridge | None = None,
                 start_timeout: float = 30.0, **options: Any) -> None:
        check_bridge(bridge)
        self._own_bridge = bridge is None
        self.bridge = bridge or Bridge("kvwire-peer")
        self._init_waiters()

        try:
            self._peer: Any = start_on(self.bridge, open_peer(self.bridge, host, port, secret=secret, **options),
                                       start_timeout)
        except BaseException:
            if self._own_bridge:
                self.bridge.close()
            raise
        if self._own_bridge:  # (a shared bridge's close closes it)
            self._finalizer = watch_dropped(self, f"kvwire.sync.SyncPeer to {address((self._peer.host, port))}")

    def _init_waiters(self) -> None:
        # What threads wait on (SendHandles, the futures of send() and the other blocking
        # calls), failed by close() even when the loop is held up elsewhere and the peer's
        # own close cannot run: weak, as SyncServer's handles.  Under the lock: close()
        # lists them while other threads add to them.
        self._handles: weakref.WeakSet[SendHandle] = weakref.WeakSet()
        self._calls: weakref.WeakSet[concurrent.futures.Future[Any]] = weakref.WeakSet()
        self._waiters_lock = threading.Lock()
        self._lost = False

    def _track(self, fut: concurrent.futures.Future[Any]) -> None:
        with self._waiters_lock:
            self._calls.add(fut)

    def _gone(self) -> KvwireError | None:
        return ConnectionLostError("the peer was closed while the call ran") if self._lost else None

    @property
    def peer(self) -> Any:
        return self._peer

    def begin(self, request_id: str, spec: KVSpec, **send_options: Any) -> SendHandle:
        """Start a transfer whose layers come later through :meth:`SendHandle.send_layer`.
        ``send_options`` are :meth:`kvwire.Peer.send`'s (``timeout``, ``codec``, ...),
        checked here: one it refuses is a :class:`~kvwire.UsageError` before anything starts."""
        if not isinstance(spec, KVSpec):
            raise UsageError("spec must be a kvwire.KVSpec")
        check_request_id(request_id)  # at once, not from wait() after every layer was queued
        send_options = check_send_options(self._peer, send_options)  # (so are they)
        self.bridge.check_process()
        handle = SendHandle(self.bridge, request_id, spec.num_layers, self)
        handle._future = self.bridge.submit(self._peer._send_noting(
            request_id, spec, handle._layers(), progress=handle._progress, **send_options))
        with self._waiters_lock:
            self._handles.add(handle)
        return handle

    def write_marks(self, timeout: float = 5.0) -> Any:
        """:meth:`kvwire.Peer.write_marks` from any thread; pass it to :meth:`written_past`."""
        async def marks() -> Any:
            return self._peer.write_marks()

        return self.bridge.run(marks(), timeout, track=self._track, gone=self._gone)

    def written_past(self, marks: Any, timeout: float = 5.0) -> bool:
        """Whether the streams wrote (or dropped) everything they held at ``marks`` (what
        :meth:`write_marks` returned; anything else is a :class:`~kvwire.UsageError`)."""
        checked = check_marks(marks)  # (in the caller's thread, before anything runs)

        async def past() -> bool:
            return bool(self._peer.written_past(checked))

        return bool(self.bridge.run(past(), timeout, track=self._track, gone=self._gone))

    @property
    def broken(self) -> KvwireError | None:
        """:attr:`kvwire.Peer.broken` from any thread, without the loop (a reference the
        loop sets once): the error that ended the session, or None.  A SyncPeer whose
        session ended cannot send again: close it and make a new one."""
        err: KvwireError | None = self._peer.broken
        return err

    @property
    def protocol_version(self) -> int | None:
        """:attr:`kvwire.Peer.protocol_version` from any thread: the wire protocol version
        the session agreed with the server, read on the bridge's loop within 5 s
        (:class:`~kvwire.TransferTimeoutError` past it; a closed bridge raises
        :class:`~kvwire.ConnectionLostError`)."""
        peer = self._peer

        async def agreed() -> int | None:
            version: int | None = peer.protocol_version
            return version

        return self.bridge.run(agreed(), 5.0, track=self._track, gone=self._gone)

    def statistics(self, timeout: float = 5.0) -> dict[str, Any]:
        """:meth:`kvwire.Peer.statistics` from any thread: the snapshot, read on the
        bridge's loop within ``timeout`` seconds (:class:`~kvwire.TransferTimeoutError`
        past it; a closed bridge raises :class:`~kvwire.ConnectionLostError`)."""
        peer = self._peer

        async def snapshot() -> dict[str, Any]:
            return dict(peer.statistics())

        return self.bridge.run(snapshot(), timeout, track=self._track, gone=self._gone)

    def send(self, request_id: str, spec: KVSpec, layers: Any, *, timeout: float | None = None,
             **send_options: Any) -> Any:
        """Send a whole cache and wait for its receipt.  ``timeout`` bounds the whole send
        as :meth:`kvwire.Peer.send`'s does (TransferTimeoutError; the receiver is told).
        GPU layers of a list or tuple, and the GPU caches of a
        :class:`~kvwire.paged.PagedSource`, are read after what the calling thread's
        current CUDA stream had queued on their devices (an iterator's layers are taken on
        the loop thread: see docs/integrations.md)."""
        # Peer.send ends on its own timeout: waiting here for less would cancel it, and its
        # receiver would be told of a cancelled sender instead of a timeout.
        send_options = check_send_options(self._peer, {**send_options, "timeout": timeout})
        marks = caller_marks(layer_arrays(layers))
        send = functools.partial(self._peer.send, request_id, spec, layers, **send_options)
        return self.bridge.run(after_marks(marks, send) if marks else send(), track=self._track, gone=self._gone)

    def close(self, timeout: float = 5.0) -> None:
        """Close the peer (and its own bridge); each step waits at most ``timeout``
        seconds (a finite number >= 0).  A peer whose close did not complete in time is
        closed with its bridge.  On a bridge another thread is closing it waits for that
        close to end (as :meth:`Bridge.close` does)."""
        check_value("timeout", timeout, zero_ok=True)  # (before anything changes)
        self.bridge.check_process()
        if self.bridge.closed:  # (closed by another thread, its close perhaps under way)
            if not self.bridge.in_loop_thread():
                # waits for the bridge's close under way (which closes this), at once once
                # it ended, and ends a close that failed
                self.bridge.close(timeout)
            return
        if self.bridge.in_loop_thread():  # (it would wait on itself; nothing is closed)
            raise UsageError("SyncPeer.close() from the bridge's own loop: await the peer's close() there")
        with contextlib.suppress(KvwireError):
            # not disowned unless closed: the bridge's close then closes it
            self.bridge.run(self.bridge.close_owned(self._peer), timeout)
        # Its close failed what it was sending: these are what it did not get to (a loop
        # held up elsewhere), failed now as SyncServer's waiters are.
        self._lost = True
        with self._waiters_lock:
            handles, calls = list(self._handles), list(self._calls)
        for h in handles:
            h._lose()
        for fut in calls:
            fut.cancel()
        if self._own_bridge:
            self.bridge.close(timeout)
            if self._finalizer is not None:
                self._finalizer.detach()  # (closed: nothing for it to do)

    def __enter__(self) -> SyncPeer:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


__all__ = ["Bridge", "ReceiveHandle", "SendHandle", "SyncPeer", "SyncServer"]
