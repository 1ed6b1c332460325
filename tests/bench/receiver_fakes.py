"""Fakes of what ``kvwire serve``'s receiver (``BenchReceiver``) reads of a server and its
transfers, a tiny bench's transfers made of them, and a wait for a condition on the loop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from kvwire.bench.models import MODELS, bench_cache
from kvwire.spec import KVSpec

TINY = MODELS["tiny"]


class _Layer:
    def __init__(self, index: int, k: Any, v: Any) -> None:
        self.index, self.k, self.v = index, k, v


class FakeTransfer:
    """A transfer as ``BenchReceiver.handle`` reads it; ``hold`` (an asyncio.Event)
    keeps it waiting after its first layer until set."""

    def __init__(self, request_id: str, meta: Any, spec: KVSpec, layers: list[tuple[Any, Any]],
                 hold: asyncio.Event | None = None) -> None:
        self.request_id, self.meta, self.spec, self._layers, self._hold = request_id, meta, spec, layers, hold
        self.wire_bytes, self.started, self.finished = 0, 0.0, 1.0
        self.aborted: str | None = None
        self.begun = self.closed = False  # its layers' iteration begun, ended

    def abort(self, reason: str = "") -> None:
        self.aborted = reason

    async def __aiter__(self) -> AsyncIterator[_Layer]:
        self.begun = True
        try:
            for index, (k, v) in enumerate(self._layers):
                yield _Layer(index, k, v)
                if self._hold is not None:
                    await self._hold.wait()
        finally:
            self.closed = True


def bench_transfer(bench: str, n: int, *, tokens: int = 16, end: bool = False,
                   hold: asyncio.Event | None = None) -> FakeTransfer:
    """Transfer ``n`` of bench ``bench`` (its end when ``end``) of the tiny model."""
    meta = {"kvwire_bench": {"id": bench, "seed": 0, **({"end": True} if end else {})}}
    return FakeTransfer(f"{bench}-{n}", meta, TINY.spec(), bench_cache(TINY, 1 if end else tokens, 0), hold)


class FakeServer:
    sessions = 1

    def statistics(self) -> dict[str, int]:
        return {"sessions": self.sessions}


async def until(condition: Any, what: str, timeout: float = 30.0) -> None:
    """Wait (polling on the running loop) until ``condition()`` holds; fail naming ``what``."""
    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.01)

    try:
        await asyncio.wait_for(poll(), timeout)
    except TimeoutError:
        raise AssertionError(f"not within {timeout:.0f} s: {what}") from None
