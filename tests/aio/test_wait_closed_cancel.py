"""``wait_closed()`` cancelled leaves none of its waiters behind (they stayed pending
for good), and aborts what did not close in time otherwise."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from kvwire.aio._stream import wait_closed

pytestmark = pytest.mark.timeout(60)


class _Unclosed:
    """What wait_closed() reads of a stream: one whose peer never closes it."""

    def __init__(self) -> None:
        self.transport = object()
        self.closed = asyncio.Event()
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True
        self.closed.set()


async def test_wait_closed_cancelled_leaves_no_waiter() -> None:
    streams = [_Unclosed(), _Unclosed()]
    before = asyncio.all_tasks()
    waiting = asyncio.create_task(wait_closed(streams, 30.0))  # type: ignore[arg-type]
    for _ in range(5):
        await asyncio.sleep(0)
    assert len(asyncio.all_tasks() - before) > 1  # its waiters run
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(waiting, 10)
    assert asyncio.all_tasks() - before == set()  # none left behind, pending for good
    assert not any(s.aborted for s in streams)  # (cancelled: it gave up, aborts nothing)


async def test_wait_closed_aborts_what_did_not_close_in_time() -> None:
    late, gone = _Unclosed(), SimpleNamespace(transport=None, closed=asyncio.Event())
    before = asyncio.all_tasks()
    await asyncio.wait_for(wait_closed([late, gone], 0.05), 10)  # type: ignore[list-item]
    assert late.aborted
    assert asyncio.all_tasks() - before == set()
