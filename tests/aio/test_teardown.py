"""One teardown path: after ``close()`` no task of the peer or the server is pending and
nothing is reported as "Future exception was never retrieved" or "Task was destroyed"."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest

import kvwire
from kvwire.testing.fault_proxy import FaultPlan, FaultProxy, Faults
from tests.conftest import SECRET, make_layers

pytestmark = pytest.mark.timeout(60)

SPEC = kvwire.KVSpec(num_layers=4, num_kv_heads=2, head_dim=16)


def other_tasks() -> set[asyncio.Task[Any]]:
    return {t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()}


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)
    gc.collect()  # unretrieved exceptions are reported when their futures are collected
    await asyncio.sleep(0)


async def stalled() -> AsyncIterator[Any]:
    yield make_layers(1, 64, 2, 16)[0]
    await asyncio.Event().wait()  # never produces the second layer


SCENARIOS = ["complete", "mid-send", "reconnecting", "auto-streams", "server-first"]


@pytest.mark.parametrize("scenario", SCENARIOS)
async def test_close_leaves_no_task_and_no_unretrieved_exception(
    scenario: str, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="asyncio")
    loop = asyncio.get_running_loop()
    seen: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, ctx: seen.append(ctx))
    before = other_tasks()
    try:
        server = kvwire.serve("127.0.0.1", 0, secret=SECRET)
        await server.start()
        plan = FaultPlan(forward=Faults(drop_at=2000)) if scenario == "reconnecting" else FaultPlan()
        # Both first streams drop, so the cache (128 KiB) cannot complete before the
        # reconnect's backoff ends, however the host's load orders the sends (with only
        # the first dropped, a loaded host at times finished the transfer before close()).
        proxy = FaultProxy("127.0.0.1", server.port, plan=lambda i: plan if i < 2 else FaultPlan())
        await proxy.start()
        peer = kvwire.connect(
            "127.0.0.1", proxy.port, secret=SECRET, reconnect_backoff=0.5, chunk_bytes=2048,
            streams="auto" if scenario == "auto-streams" else 2,
        )
        await peer.__aenter__()
        send: asyncio.Task[Any] | None = None
        if scenario == "complete":
            await peer.send("done", SPEC, make_layers(4, 64, 2, 16), timeout=10)
        else:
            producer = stalled() if scenario != "reconnecting" else None
            layers: Any = producer or make_layers(4, 256, 2, 16)
            send = asyncio.create_task(peer.send("open", SPEC, layers, timeout=30))
            await asyncio.sleep(0.2)  # reconnecting: both streams dropped, backoff running
        started = set(peer._tasks) | set(server._tasks)
        if scenario == "server-first":
            await server.close()
            await peer.close()
        else:
            await peer.close()
            await server.close()
        # right after close(), not a loop iteration later: nothing it started still runs
        assert all(t.done() for t in started)
        assert not peer._tasks and not server._tasks
        assert server._timer is None  # the pump's one timer is cancelled too
        await proxy.close()
        if send is not None:
            with pytest.raises(kvwire.KvwireError):
                await send
        await settle()
        assert other_tasks() - before == set()
    finally:
        loop.set_exception_handler(None)
    assert seen == []
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage() or "destroyed" in r.getMessage()]
