"""What ``kvwire serve`` (``BenchReceiver``, meant to run for months) keeps: a finished
bench's report is logged and dropped unless the receiver runs ``once``, and a bench that
never ends holds running totals, not one entry per transfer it received."""

from __future__ import annotations

import asyncio
import gc
import weakref
from typing import Any

import pytest

from kvwire.bench import runner
from tests.bench.receiver_fakes import TINY, FakeServer, FakeTransfer, bench_transfer, until

pytestmark = pytest.mark.timeout(120)


class _Report(dict[str, Any]):
    """A report that can be watched with a weak reference."""


def _watch_reports(monkeypatch: pytest.MonkeyPatch) -> list[weakref.ref[_Report]]:
    real = runner.BenchReceiver._finish
    made: list[weakref.ref[_Report]] = []

    def finish(self: runner.BenchReceiver, state: Any) -> dict[str, Any]:
        report = _Report(real(self, state))
        made.append(weakref.ref(report))
        return report

    monkeypatch.setattr(runner.BenchReceiver, "_finish", finish)
    return made


def _benches(count: int, per: int) -> list[FakeTransfer]:
    return [t for b in range(count)
            for t in (*(bench_transfer(f"b{b}", i) for i in range(per)), bench_transfer(f"b{b}", per, end=True))]


class _Feeding(FakeServer):
    """Hands out ``transfers`` in order, then waits (a quiet server)."""

    def __init__(self, transfers: list[FakeTransfer]) -> None:
        self.transfers = transfers

    async def accept(self) -> FakeTransfer:
        if self.transfers:
            return self.transfers.pop(0)
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


async def test_a_server_running_forever_logs_each_report_and_keeps_none(monkeypatch: pytest.MonkeyPatch) -> None:
    made = _watch_reports(monkeypatch)
    lines: list[str] = []
    recv = runner.BenchReceiver(_Feeding(_benches(12, 2)), lines.append)
    receiving = asyncio.create_task(recv.run())
    try:
        await until(lambda: sum(x.startswith("bench b") for x in lines) == 12, "every bench's report logged")
        assert all(f"bench b{b}: 2 transfers" in "\n".join(lines) for b in range(12)), lines
        assert len(made) == 12

        def all_dropped() -> bool:  # (the last one, once its task has ended)
            gc.collect()
            return all(r() is None for r in made)

        await until(all_dropped, "every finished bench's report dropped", timeout=10)
        assert not receiving.done()
    finally:
        receiving.cancel()
        await asyncio.gather(receiving, return_exceptions=True)


async def test_a_server_running_once_returns_the_report(monkeypatch: pytest.MonkeyPatch) -> None:
    made = _watch_reports(monkeypatch)
    recv = runner.BenchReceiver(_Feeding(_benches(1, 3)))
    reports = await asyncio.wait_for(recv.run(once=True), 60)
    assert [r["bench_id"] for r in reports] == ["b0"] and reports[0]["transfers"] == 3
    assert made[0]() is reports[0]


def _held(obj: object) -> int:
    """Objects reachable from ``obj`` (what it keeps alive)."""
    seen: set[int] = set()
    todo = [obj]
    while todo:
        o = todo.pop()
        if id(o) in seen or isinstance(o, type):
            continue
        seen.add(id(o))
        todo.extend(gc.get_referents(o))
    return len(seen)


async def test_a_bench_that_never_ends_keeps_totals_not_a_list_of_its_transfers() -> None:
    recv = runner.BenchReceiver(FakeServer())
    layer_bytes = sum(int(k.nbytes) + int(v.nbytes) for k, v in bench_transfer("x", 0)._layers)
    for i in range(TINY.num_layers):  # a pass over the layers: each checked once
        await recv.handle(bench_transfer("n", i))
    state = recv._benches["n"]
    before = _held(state)
    for i in range(TINY.num_layers, 20 * TINY.num_layers):
        assert await recv.handle(bench_transfer("n", i)) is None
    # Nothing held per transfer received since (a few more objects at most: counts past
    # the small ints Python keeps, a float of a time).
    assert _held(state) < before + 10, (before, _held(state))
    report = await recv.handle(bench_transfer("n", 0, end=True))
    assert report is not None
    n = 20 * TINY.num_layers
    assert report["transfers"] == n and report["kv_bytes"] == n * layer_bytes
    assert report["failed"] == 0 and report["checked_layers"] == n and report["max_rel_error"] == 0
