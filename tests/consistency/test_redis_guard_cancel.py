"""A registry call cancelled in the loop iteration its reply arrives raises CancelledError:
``asyncio.wait_for`` on Python 3.11 returned the reply there and the cancel was lost (the
caller went on as if never cancelled).  The bound on a call's wait stays a
RegistryUnavailableError."""

from __future__ import annotations

import asyncio

import pytest

from kvwire.aio.registry_redis import _guard
from kvwire.errors import RegistryUnavailableError


async def test_guarded_call_cancelled_as_its_reply_arrives_raises() -> None:
    reply: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    after: list[int] = []

    async def caller() -> None:
        after.append(await _guard("GET", reply, 10.0))

    task = asyncio.create_task(caller())
    await asyncio.sleep(0)  # the caller waits for the reply
    reply.set_result(7)
    task.cancel()  # in the same iteration (a TaskGroup's sibling failing)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()
    assert after == []


async def test_guarded_call_without_a_reply_is_unavailable() -> None:
    silent: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    with pytest.raises(RegistryUnavailableError, match=r"GET: no reply within 0\.05 s"):
        await _guard("GET", silent, 0.05)
    assert silent.cancelled()
