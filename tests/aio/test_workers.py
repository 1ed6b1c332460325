"""``in_worker``: work on the loop's default pool, on the loop when the pool refuses it,
and run once either way."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvwire.aio._workers import in_worker


async def test_work_runs_on_a_worker_thread() -> None:
    loop = asyncio.get_running_loop()
    assert await in_worker(loop, lambda: threading.current_thread() is threading.main_thread()) is False


async def test_a_pool_that_refuses_work_has_it_done_on_the_loop() -> None:
    loop = asyncio.get_running_loop()
    await loop.shutdown_default_executor()  # as at interpreter exit: submit() raises
    fut = in_worker(loop, lambda: threading.current_thread() is threading.main_thread())
    assert fut.done() and fut.result() is True

    def fail() -> None:
        raise ValueError("bad")

    with pytest.raises(ValueError, match="bad"):
        await in_worker(loop, fail)

    def stopped() -> None:
        raise asyncio.CancelledError

    assert in_worker(loop, stopped).cancelled()


async def test_work_queued_by_a_pool_that_then_fails_to_start_a_thread_runs_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``submit`` queues the work, then fails to start a thread for it (an OS thread
    limit): the call falls back to the loop, and the worker that later takes the queued
    copy must not run it again."""
    loop = asyncio.get_running_loop()
    gate = threading.Event()
    busy = loop.run_in_executor(None, gate.wait)  # the pool's one thread, held
    await asyncio.sleep(0.05)
    calls: list[str] = []

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    with monkeypatch.context() as m:
        m.setattr(threading.Thread, "start", refuse)
        fut = in_worker(loop, lambda: calls.append(threading.current_thread().name) or len(calls))
    assert await fut == 1
    gate.set()
    await busy
    # the worker has taken the queued copy by now: one more job after it has run
    await loop.run_in_executor(None, lambda: None)
    assert len(calls) == 1, calls
