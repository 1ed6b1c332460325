"""A transfer its sender aborts (its layer producer failed, its send() was cancelled) after
it arrived and before the application claimed it: ``expect()`` / ``accept()`` hand it out
failed, whenever they are called, in its place among the arrivals, until its
``claim_timeout`` passes.  What the application sees does not depend on timing."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import kvwire
from kvwire.errors import TransferAbortedError
from tests.aio.arrival_helpers import Destination
from tests.conftest import SECRET, make_layers
from tests.rawpeer import wait_until

pytestmark = pytest.mark.timeout(60)

SPEC = kvwire.KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16")


def failing() -> Iterator[tuple[np.ndarray, np.ndarray]]:
    yield make_layers(1, 4, 2, 8)[0]
    raise RuntimeError("producer failed")


async def send_failing(peer: Any, request_id: str) -> None:
    with pytest.raises(TransferAbortedError):
        await asyncio.wait_for(peer.send(request_id, SPEC, failing()), 10)


async def aborted(server: Any, n: int) -> bool:
    return await wait_until(lambda: server.statistics()["transfers_aborted_by_peer"] >= n, 10)


async def outcome(t: kvwire.Transfer, how: str) -> BaseException:
    with pytest.raises(TransferAbortedError) as info:
        if how == "collect":
            await t.collect(timeout=5)
        else:
            async for _ in t:
                pass
    return info.value


@pytest.mark.parametrize("how", ["iterate", "collect"])
async def test_expect_before_or_after_the_sender_aborted_sees_the_same_failure(how: str) -> None:
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            early = asyncio.create_task(server.expect("early", timeout=10))
            await asyncio.sleep(0)
            await send_failing(peer, "early")
            await send_failing(peer, "late")
            assert await aborted(server, 2)
            late = await server.expect("late", timeout=5)  # waited for ever (its timeout) before
            assert server.statistics()["failed_arrivals"] == 0  # ("early" was claimed as it arrived)
            seen = [await outcome(await early, how), await outcome(late, how)]
            assert [str(e) for e in seen] == ["sender aborted: RuntimeError('producer failed')"] * 2
            assert late.request_id == "late" and not late.complete


async def test_a_failed_arrival_keeps_its_place_among_its_request_ids_and_accepts_arrivals() -> None:
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            await send_failing(peer, "same")
            await asyncio.wait_for(peer.send("same", SPEC, make_layers(2, 4, 2, 8)), 10)
            await send_failing(peer, "other")
            await asyncio.wait_for(peer.send("other", SPEC, make_layers(2, 4, 2, 8)), 10)
            assert await aborted(server, 2)
            assert server.statistics()["pending_arrivals"] == 4
            first, second = await server.expect("same", timeout=5), await server.expect("same", timeout=5)
            await outcome(first, "iterate")
            assert len((await second.collect(timeout=5)).layers) == 2
            third, fourth = await server.accept(timeout=5), await server.accept(timeout=5)
            assert (third.request_id, fourth.request_id) == ("other", "other")
            await outcome(third, "collect")
            assert fourth.complete
            assert server.statistics()["pending_arrivals"] == 0


async def test_expect_into_a_destination_hands_out_a_failed_arrival_without_calling_it() -> None:
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            await send_failing(peer, "r")
            assert await aborted(server, 1)
            dest = Destination()
            t = await server.expect("r", into=dest, timeout=5)
            await outcome(t, "iterate")
            with pytest.raises(kvwire.UsageError):  # as for any transfer received into a destination
                await t.collect(timeout=5)
            assert dest.calls == []


async def test_a_failed_arrival_nobody_claims_is_dropped_at_claim_timeout() -> None:
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, claim_timeout=0.5) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            await send_failing(peer, "r")
            assert await aborted(server, 1)
            assert await wait_until(lambda: server.statistics()["failed_arrivals_expired"] == 1, 10)
            stats = server.statistics()
            assert stats["transfers_unclaimed"] == 0 and stats["transfers_aborted_by_peer"] == 1
            assert stats["failed_arrivals"] == 0 and stats["pending_arrivals"] == 0
            assert not server._transfers  # the server let go of its view of it
            with pytest.raises(kvwire.TransferTimeoutError):
                await server.expect("r", timeout=0.2)
