"""Work handed to the loop's default thread pool, and done on the loop when it refuses."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def in_worker(loop: asyncio.AbstractEventLoop, fn: Callable[[], T]) -> asyncio.Future[T]:
    """``fn()`` on one of the loop's default worker threads; its future.

    While the interpreter exits (a send waited for by an atexit hook, as a serving
    engine's shutdown is) the pool refuses work and no thread starts any more: ``fn`` is
    then called here, on the loop, and the future returned already holds its outcome (a
    CancelledError it raises cancels the future)."""
    try:
        return loop.run_in_executor(None, fn)
    except RuntimeError:
        fut: asyncio.Future[T] = loop.create_future()
        try:
            fut.set_result(fn())
        except asyncio.CancelledError:
            fut.cancel()
        except Exception as exc:
            fut.set_exception(exc)
        return fut
