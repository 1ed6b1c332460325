"""Work handed to the loop's default thread pool, and done on the loop when it refuses."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def in_worker(loop: asyncio.AbstractEventLoop, fn: Callable[[], T]) -> asyncio.Future[T]:
    """``fn()`` on one of the loop's default worker threads; its future.

    While the interpreter exits (a send waited for by an atexit hook, as a serving
    engine's shutdown is) the pool refuses work and no thread starts any more: ``fn`` is
    then called here, on the loop, and the future returned already holds its outcome (a
    CancelledError it raises cancels the future).  ``fn`` runs once whatever happens: a
    pool that queued the work and then failed to start a thread for it (an OS thread
    limit) has a worker run the queued copy later, which then only returns the outcome
    of the call made here (or this call waits for that worker's and takes its outcome)."""
    lock = threading.Lock()
    outcome: list[tuple[bool, object]] = []  # (returned, value or exception), once run

    def once() -> T:
        with lock:
            if not outcome:
                try:
                    outcome.append((True, fn()))
                except BaseException as exc:
                    outcome.append((False, exc))
        returned, value = outcome[0]
        if not returned:
            assert isinstance(value, BaseException)
            raise value
        return value  # type: ignore[return-value]

    try:
        return loop.run_in_executor(None, once)
    except RuntimeError:
        fut: asyncio.Future[T] = loop.create_future()
        try:
            fut.set_result(once())
        except asyncio.CancelledError:
            fut.cancel()
        except Exception as exc:
            fut.set_exception(exc)
        return fut
