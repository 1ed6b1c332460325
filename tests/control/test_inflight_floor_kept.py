"""The in-flight window keeps its floor between updates (recomputed only when the max
filter, the minimum RTT or the stream count changed): every update's floor and target are
those a fresh controller computes from the same estimate, and a bandwidth or RTT that is
not a finite number is refused on every update, not only the first."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.control import InflightController

MIB = 1 << 20


@dataclass
class Estimate:
    """What InflightController.update reads of an estimator, set by the test."""

    max_filter_bps: float | None = 10e9
    min_rtt: float | None = 0.001
    recent_min_rtt: float | None = 0.001
    extra_acked_bytes: int = 0
    bytes_in_flight: int = 0

    def min_rtt_outlook(self) -> tuple[float, float | None] | None:
        return (1e9, None)  # sampled "now": no drain to refresh it

    def min_rtt_since(self, since: float) -> float | None:
        return self.min_rtt

    def mark_app_limited(self) -> None:
        pass


def fresh_floor(streams: int, bandwidth: float, min_rtt: float) -> int:
    return InflightController(streams=streams, chunk_bytes=4 * MIB).floor_for(bandwidth, min_rtt)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([1e8, 1e9, 10e9, 25e9]), st.sampled_from([1e-4, 1e-3, 0.02]),
                          st.integers(1, 8)), min_size=1, max_size=12))
def test_each_update_floors_the_window_as_a_fresh_controller_would(steps: list[tuple[float, float, int]]) -> None:
    ctl = InflightController(streams=1, chunk_bytes=4 * MIB)
    est = Estimate()
    now = 1.0
    for bandwidth, min_rtt, streams in steps:
        est.max_filter_bps, est.min_rtt, est.recent_min_rtt = bandwidth, min_rtt, min_rtt
        ctl.set_streams(streams)
        now += 0.001
        target = ctl.update(est, now)  # type: ignore[arg-type]
        floor = fresh_floor(streams, bandwidth, min_rtt)
        assert ctl.floor_bytes == InflightController(streams=streams, chunk_bytes=4 * MIB).floor_bytes
        assert ctl._floor == floor  # the floor the target was clamped to
        assert floor <= target <= 256 * MIB


@pytest.mark.parametrize("bad", [{"max_filter_bps": math.nan}, {"min_rtt": math.nan}, {"max_filter_bps": math.inf},
                                 {"min_rtt": math.inf}])
def test_a_number_that_is_not_finite_is_refused_on_every_update(bad: dict[str, float]) -> None:
    ctl = InflightController(streams=2, chunk_bytes=4 * MIB)
    est = Estimate()
    ctl.update(est, 1.0)  # type: ignore[arg-type]
    for name, value in bad.items():
        setattr(est, name, value)
    for now in (1.001, 1.002, 1.003):
        with pytest.raises(ValueError, match="finite"):
            ctl.update(est, now)  # type: ignore[arg-type]
    est.max_filter_bps, est.min_rtt = 1e9, 0.02
    assert ctl.update(est, 1.004) >= fresh_floor(2, 1e9, 0.02)  # type: ignore[arg-type]
