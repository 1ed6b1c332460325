"""A fake-time bottleneck link with a receiver that may ack late, for window controllers.

The sender keeps chunks in flight as its window allows; the link serialises them at
``capacity(t)`` bytes/s; each arrives ``delay`` seconds later; the receiver acknowledges
``ack_delay(t)`` seconds after arrival (a receiver whose loop runs late) and at its next
scheduling tick (``ack_period(t)`` seconds apart, ``0``: at once), as a receiver starved
of CPU does in bursts; the ack takes ``delay`` back. Everything is exact
arithmetic over the event times: no clock, no sockets.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from kvwire.control import DeliveryRateEstimator

MIB = 1 << 20

MaySend = Callable[[DeliveryRateEstimator, int, float], bool]


@dataclass
class SimResult:
    acked: list[tuple[float, int]] = field(default_factory=list)
    targets: list[tuple[float, int]] = field(default_factory=list)

    def rate(self, start: float, end: float) -> float:
        """Acked bytes per second over ``[start, end)``."""
        return sum(n for t, n in self.acked if start <= t < end) / (end - start)


def simulate(
    may_send: MaySend,
    *,
    capacity: Callable[[float], float],
    ack_period: Callable[[float], float] = lambda t: 0.0,
    ack_delay: Callable[[float], float] = lambda t: 0.0,
    delay: float = 50e-6,
    chunk: int = MIB,
    duration: float = 2.0,
    target_of: Callable[[DeliveryRateEstimator, float], int] | None = None,
    estimator: DeliveryRateEstimator | None = None,
) -> SimResult:
    est = estimator or DeliveryRateEstimator()
    out = SimResult()
    events: list[tuple[float, int]] = []
    keys = itertools.count()
    link_free = 0.0

    def send_what_fits(now: float) -> None:
        nonlocal link_free
        while may_send(est, chunk, now):
            key = next(keys)
            est.on_send(key, chunk, now, app_limited=False)
            start = max(now, link_free)
            link_free = start + chunk / capacity(start)
            arrival = link_free + delay + ack_delay(link_free)
            period = ack_period(arrival)
            acked_at = math.ceil(arrival / period) * period if period > 0 else arrival
            heapq.heappush(events, (acked_at + delay, key))

    send_what_fits(0.0)
    while events:
        now, key = heapq.heappop(events)
        if now >= duration:
            break
        est.on_ack(key, now)
        out.acked.append((now, chunk))
        if target_of is not None:
            out.targets.append((now, target_of(est, now)))
        send_what_fits(now)
    return out
