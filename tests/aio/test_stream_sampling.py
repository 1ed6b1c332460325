"""streams="auto" on loopback: what the stream controller is given each period is each
stream's acknowledged bytes since the previous period over the time that passed."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass

import pytest

import kvwire
import kvwire.control.streams as streams_mod
from kvwire.control import StreamController, StreamDecision, StreamSample, StreamVerdict
from tests.conftest import SECRET, make_layers


@dataclass
class Evaluation:
    now: float
    in_use: list[int]
    acked: dict[int, int]
    rates: list[float]
    verdict: StreamVerdict


async def test_each_sample_is_the_bytes_since_the_last_period_over_the_time_since(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every stream reads window-limited, so the controller grows.  The stream a grow put
    in use read 0 bit/s in its first sample (its baseline was taken then), so the grow
    was reverted however much it carried; and a rate was the bytes over 0.25 s however
    long the period was (here the application holds the loop 0.3 s now and then; two
    sends are always under way).  Each
    sample is now the stream's acknowledged bytes since the previous evaluation over the
    time between the two, the new stream's first one included."""
    monkeypatch.setattr(streams_mod, "window_limited_from_counters", lambda **counters: True)
    peers: list[kvwire.Peer] = []
    log: list[Evaluation] = []
    evaluate = StreamController.evaluate

    def recording(self: StreamController, samples: Sequence[StreamSample], now: float, *,
                  app_limited: bool = False) -> StreamDecision:
        core = peers[0].core
        open_keys = [s.key for s in peers[0].streams if core.is_open(s.key)]
        entry = Evaluation(now, open_keys[: self.streams], {k: core.acked_bytes(k) for k in open_keys},
                           [s.delivery_rate_bps for s in samples], StreamVerdict.HOLD)
        decision = evaluate(self, samples, now, app_limited=app_limited)
        entry.verdict = decision.verdict
        log.append(entry)
        return decision

    monkeypatch.setattr(StreamController, "evaluate", recording)

    def grow_judged() -> bool:
        """A grow was followed by an evaluation in which the stream it added carried data."""
        return any(
            before.verdict is StreamVerdict.GROW and len(after.in_use) > len(before.in_use)
            and after.acked[after.in_use[-1]] > before.acked[after.in_use[-1]]
            for before, after in itertools.pairwise(log)
        )

    spec = kvwire.KVSpec(num_layers=8, num_kv_heads=8, head_dim=128)
    layers = make_layers(8, 2048, 8, 128)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async def drain() -> None:
            while True:
                await (await server.accept()).collect(timeout=30)

        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, streams="auto", max_streams=2) as peer:
            peers.append(peer)
            draining = asyncio.create_task(drain())

            async def send() -> None:
                while True:
                    await peer.send("x", spec, layers, timeout=30)

            async def hold_the_loop() -> None:
                while True:
                    await asyncio.sleep(0.4)
                    time.sleep(0.3)  # the application holds the loop now and then

            async def until_a_grow_is_judged() -> None:
                while not (grow_judged() and len(log) >= 4):
                    await asyncio.sleep(0.05)

            tasks = [asyncio.create_task(send()), asyncio.create_task(send()), asyncio.create_task(hold_the_loop())]
            try:
                await asyncio.wait_for(until_a_grow_is_judged(), 60)
            finally:
                for task in [*tasks, draining]:
                    task.cancel()
                await asyncio.gather(*tasks, draining, return_exceptions=True)

    checked = 0
    for before, after in itertools.pairwise(log):
        assert len(after.rates) == len(after.in_use)
        for key, rate in zip(after.in_use, after.rates, strict=True):
            assert rate == pytest.approx((after.acked[key] - before.acked[key]) * 8 / (after.now - before.now))
            checked += 1
    assert checked >= 4
