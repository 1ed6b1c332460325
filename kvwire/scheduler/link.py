"""The link between the clusters: a piecewise-constant rate over time."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from kvwire.errors import UsageError
from kvwire.units import format_rate

__all__ = ["MAX_RATE_BPS", "MIN_RATE_BPS", "LinkSchedule"]

MIN_RATE_BPS = 10e3
"""Slowest link rate the simulator takes (10 kbit/s; 0 is an outage), and ``kvwire bench``
(:data:`kvwire.bench.runner.MIN_LINK_BPS`)."""
MAX_RATE_BPS = 1e15
"""Fastest link rate the simulator takes (1 Pbit/s)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkSchedule:
    """Rate ``rates_bps[i]`` from ``starts_s[i]`` until the next start (the last one holds
    forever, and the first one, from 0, holds before 0 too: a trace whose arrival times
    lie below 0 sees the first rate there, in :meth:`rate_at`, :meth:`bytes_between`,
    :meth:`mean_rate_between` and :meth:`finish_time` alike). A zero rate models an outage; the last rate must be positive so every queued
    transfer eventually finishes. A rate other than 0 lies between :data:`MIN_RATE_BPS`
    and :data:`MAX_RATE_BPS`."""

    starts_s: tuple[float, ...] = (0.0,)
    rates_bps: tuple[float, ...] = (100e9,)

    def __post_init__(self) -> None:
        if not self.starts_s or len(self.starts_s) != len(self.rates_bps):
            raise UsageError("a link schedule needs one rate per start time")
        if not all(math.isfinite(s) for s in self.starts_s):
            raise UsageError("schedule starts must be finite")
        if self.starts_s[0] != 0.0 or any(
            b <= a for a, b in zip(self.starts_s, self.starts_s[1:], strict=False)
        ):
            raise UsageError("schedule starts must begin at 0 and increase")
        if any(r < 0 or not math.isfinite(r) for r in self.rates_bps) or self.rates_bps[-1] <= 0:
            raise UsageError("rates must be finite and >= 0, and the last one > 0")
        for r in self.rates_bps:
            if r and not MIN_RATE_BPS <= r <= MAX_RATE_BPS:
                raise UsageError(
                    f"link rate {format_rate(r)} is out of range: 0 (an outage), or "
                    f"{format_rate(MIN_RATE_BPS)} to {format_rate(MAX_RATE_BPS)}"
                )

    @classmethod
    def constant(cls, rate_bps: float) -> LinkSchedule:
        return cls(starts_s=(0.0,), rates_bps=(rate_bps,))

    @classmethod
    def from_pairs(cls, pairs: tuple[tuple[float, float], ...]) -> LinkSchedule:
        return cls(starts_s=tuple(s for s, _ in pairs), rates_bps=tuple(r for _, r in pairs))

    def rate_at(self, now: float) -> float:
        i = max(0, bisect.bisect_right(self.starts_s, now) - 1)
        return self.rates_bps[i]

    def mean_rate(self, horizon_s: float) -> float:
        """Time-averaged rate over ``[0, horizon_s]``."""
        return self.mean_rate_between(0.0, horizon_s)

    def mean_rate_between(self, t0: float, t1: float) -> float:
        """Time-averaged rate over ``[t0, t1]`` (``t1 <= t0``: the rate at ``t0``)."""
        if t1 <= t0:
            return self.rate_at(t0)
        return 8.0 * self.bytes_between(t0, t1) / (t1 - t0)

    def bytes_between(self, t0: float, t1: float) -> float:
        """Bytes the link carries at full rate over ``[t0, t1]`` (0 when ``t1 <= t0``)."""
        total = 0.0
        for i, (s, r) in enumerate(zip(self.starts_s, self.rates_bps, strict=True)):
            if i == 0:
                s = -math.inf  # the first rate holds before 0 too, as in rate_at
            e = self.starts_s[i + 1] if i + 1 < len(self.starts_s) else math.inf
            lo, hi = max(s, t0), min(e, t1)
            if hi > lo:
                total += (hi - lo) * r / 8.0
        return total

    def finish_time(self, start_s: float, nbytes: float) -> float:
        """When ``nbytes`` sent at full rate from ``start_s`` have all left."""
        remaining = nbytes * 8.0
        t = start_s
        i = max(0, bisect.bisect_right(self.starts_s, t) - 1)
        while True:
            rate = self.rates_bps[i]
            end = self.starts_s[i + 1] if i + 1 < len(self.starts_s) else math.inf
            if rate > 0:
                need = remaining / rate
                if t + need <= end:
                    return t + need
                remaining -= (end - t) * rate
            t = end
            i += 1
