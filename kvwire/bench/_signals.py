"""Signals that end the program, while an event loop runs: kept for after the loop.

A Python signal handler that raises (Ctrl-C's KeyboardInterrupt, ``kvwire``'s own for
SIGTERM and SIGHUP, the namespace cleanup of ``--kernel``) raises at whatever line the
main thread runs. Inside an event loop's callback (a uvloop protocol's ``get_buffer``,
say) the loop takes it for that callback's failure: it logs "Fatal error on transport",
closes one connection and goes on, and the signal is lost.

:func:`run` runs a coroutine as :class:`asyncio.Runner` runs one under Ctrl-C, for
every signal whose handler ends the program: the first such signal cancels the main
task, and once the loop has stopped the signal is raised again with the handler it
had, which then runs at one well-defined point (the ``with`` blocks around the run
clean up after it). A second one while the loop still runs goes to that handler at
once.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Callable, Coroutine
from types import FrameType
from typing import Any, TypeVar

__all__ = ["defers", "ends_the_program", "run"]

T = TypeVar("T")
Handler = Callable[[int, FrameType | None], Any]

#: The signals whose handler may end the program.
_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))
_ending: set[Any] = {signal.default_int_handler}
_deferring: set[Any] = set()


def ends_the_program(handler: Handler) -> Handler:
    """Mark a signal handler as one that ends the program (it raises, or ends the
    process): :func:`run` keeps its signal until the loop has stopped."""
    _ending.add(handler)
    return handler


def defers(handler: Any) -> bool:
    """Whether ``handler`` is a :func:`run`'s, which keeps the signal for after its loop
    (a handler installed meanwhile that would clean up, then hand the signal on, should
    leave the cleanup to the ``with`` blocks that the cancelled run leaves)."""
    return handler in _deferring


class _Kept:
    def __init__(self) -> None:
        self.signum: int | None = None
        self.task: asyncio.Task[Any] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.saved: dict[int, Handler] = {}


def run(main: Coroutine[Any, Any, T]) -> T:
    """``kvwire.aio.run(main)``, with the signals whose handler ends the program
    (SIGINT's default handler and those marked with :func:`ends_the_program`) kept
    for after the loop: the first cancels ``main``'s task; once the loop has stopped,
    it is raised again with its handler. In the main thread only (elsewhere, signals
    are not delivered to the loop's thread anyway)."""
    from kvwire.aio import run as run_loop

    if threading.current_thread() is not threading.main_thread():
        result: T = run_loop(main)
        return result
    kept = _Kept()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if kept.signum is not None:  # a second one: no more waiting
            kept.saved[signum](signum, frame)
            return
        kept.signum = signum
        task, loop = kept.task, kept.loop
        if task is not None and loop is not None and not task.done():
            # A callback of the loop's own, not here: this may run inside one of them.
            with contextlib.suppress(RuntimeError):  # the loop has closed meanwhile
                loop.call_soon_threadsafe(task.cancel)

    for signum in _SIGNALS:
        handler = signal.getsignal(signum)
        if handler in _ending:
            kept.saved[signum] = handler  # type: ignore[assignment]
    if not kept.saved:
        result = run_loop(main)
        return result

    async def guarded() -> T:
        kept.task, kept.loop = asyncio.current_task(), asyncio.get_running_loop()
        if kept.signum is not None:  # it came before the loop ran
            main.close()
            raise asyncio.CancelledError
        return await main

    _deferring.add(on_signal)
    try:
        for signum in kept.saved:
            signal.signal(signum, on_signal)
        result = run_loop(guarded())
    finally:
        for signum, handler in kept.saved.items():
            signal.signal(signum, handler)
        _deferring.discard(on_signal)
        if kept.signum is not None:
            signal.raise_signal(kept.signum)  # its handler raises, or ends the process
    return result
