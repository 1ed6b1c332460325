"""How much to keep in flight and how fast to release it, from the bandwidth estimate.

Application-level flow sits above TCP: keeping one or two bandwidth-delay products of
chunks outstanding fills the path without building a queue that delays acks (and with
them the estimator) for seconds. The pacer spaces chunk releases when the caller wants
a rate ceiling rather than a window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvwire.control.estimator import DeliveryRateEstimator

__all__ = ["InflightTarget", "Pacer"]

_MIB = 1 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class InflightTarget:
    """Target bytes in flight = ``gain`` x bandwidth x min RTT, clamped to a range."""

    gain: float = 2.0
    """Multiple of the bandwidth-delay product to keep outstanding; 1 to 2."""
    min_bytes: int = 4 * _MIB
    """Floor, so a few chunks are always outstanding before the first estimate and on
    paths whose RTT is below the ack granularity."""
    max_bytes: int = 256 * _MIB
    """Ceiling on buffered-but-unacknowledged data."""
    initial_bytes: int = 16 * _MIB
    """Used until the estimator has both a bandwidth and an RTT."""

    def __post_init__(self) -> None:
        if not 1.0 <= self.gain <= 2.0:
            raise ValueError("gain must be within [1, 2] bandwidth-delay products")
        if not 0 < self.min_bytes <= self.max_bytes:
            raise ValueError("need 0 < min_bytes <= max_bytes")

    def bytes_for(self, bandwidth_bps: float | None, min_rtt: float | None) -> int:
        """Target in-flight bytes for a bandwidth (bits/s) and a minimum RTT (seconds)."""
        if bandwidth_bps is None or min_rtt is None or bandwidth_bps <= 0:
            target = self.initial_bytes
        else:
            target = math.ceil(self.gain * bandwidth_bps / 8.0 * max(min_rtt, 0.0))
        return max(self.min_bytes, min(self.max_bytes, target))

    def for_estimator(self, estimator: DeliveryRateEstimator) -> int:
        return self.bytes_for(estimator.bandwidth_bps, estimator.min_rtt)

    def may_send(self, estimator: DeliveryRateEstimator, nbytes: int) -> bool:
        """Whether sending ``nbytes`` more keeps the flight within the target.

        An empty flight may always send, so a chunk larger than the target is not stuck.
        """
        in_flight = estimator.bytes_in_flight
        return in_flight == 0 or in_flight + nbytes <= self.for_estimator(estimator)


class Pacer:
    """A token bucket releasing bytes at ``rate_bps`` with bursts up to ``burst_bytes``.

    ``rate_bps=None`` means unpaced: everything may go at once.
    """

    def __init__(self, rate_bps: float | None = None, *, burst_bytes: int = 2 * _MIB) -> None:
        if burst_bytes <= 0:
            raise ValueError("burst_bytes must be positive")
        if rate_bps is not None and rate_bps <= 0:
            raise ValueError("rate_bps must be positive or None")
        self._rate_bps = rate_bps
        self._burst = float(burst_bytes)
        self._tokens = float(burst_bytes)
        self._stamp: float | None = None
        self._waiting_for = 0

    @property
    def rate_bps(self) -> float | None:
        return self._rate_bps

    def set_rate(self, rate_bps: float | None, now: float) -> None:
        if rate_bps is not None and rate_bps <= 0:
            raise ValueError("rate_bps must be positive or None")
        self._refill(now)
        self._rate_bps = rate_bps

    def _refill(self, now: float) -> None:
        if self._stamp is not None and self._rate_bps is not None and now > self._stamp:
            self._tokens = min(self._burst, self._tokens + (now - self._stamp) * self._rate_bps / 8)
        if self._stamp is None or now > self._stamp:
            self._stamp = now

    def next_send_time(self, nbytes: int, now: float) -> float:
        """Earliest time ``nbytes`` may be released (``now`` if they may go now)."""
        if self._rate_bps is None:
            return now
        self._refill(now)
        # A chunk larger than the burst waits for a full bucket and then overdraws it.
        need = min(float(nbytes), self._burst)
        if self._tokens >= need:
            return now
        return now + (need - self._tokens) * 8.0 / self._rate_bps

    def on_send(self, nbytes: int, now: float) -> None:
        """Account released bytes; the bucket may go negative (the debt delays the next)."""
        self._refill(now)
        if self._rate_bps is not None:
            self._tokens -= nbytes
        self._waiting_for = 0

    def want(self, nbytes: int) -> None:
        """Declare the size of the next release, so ``get_timer`` can say when it may go."""
        self._waiting_for = nbytes

    def get_timer(self) -> float | None:
        """When the declared release may go; ``None`` if nothing is waiting or it may go now."""
        if not self._waiting_for or self._rate_bps is None or self._stamp is None:
            return None
        need = min(float(self._waiting_for), self._burst)
        if self._tokens >= need:
            return None
        return self._stamp + (need - self._tokens) * 8.0 / self._rate_bps

    def handle_timer(self, now: float) -> bool:
        """Refill at ``now``; returns whether the declared release may go."""
        self._refill(now)
        need = min(float(self._waiting_for), self._burst)
        return self._rate_bps is None or self._tokens >= need
