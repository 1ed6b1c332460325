from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvwire.scheduler.policy import (
    ClusterView,
    Local,
    Offload,
    PolicyRequest,
    SchedulerState,
    decide,
    effective_threshold,
)


def hit(blocks: int) -> tuple[tuple[int, int], ...]:
    return tuple((b, 1) for b in range(blocks))


def req(n: int) -> PolicyRequest:
    return PolicyRequest(request_id="r", input_length=n)


def state(**kw: object) -> SchedulerState:
    base: dict[str, object] = {
        "threshold_tokens": 8192.0,
        "bandwidth_bps": 100e9,
        "remotes": (ClusterView(name="east"),),
    }
    base.update(kw)
    return SchedulerState(**base)  # type: ignore[arg-type]


def test_short_local_long_offloaded() -> None:
    assert isinstance(decide(req(4000), state()), Local)
    d = decide(req(20000), state())
    assert d == Offload(cluster="east", incremental_tokens=20000, reason="long")


def test_no_bandwidth_or_no_remote_means_local() -> None:
    assert decide(req(100_000), state(bandwidth_bps=0.0)).reason == "no-bandwidth"
    assert isinstance(decide(req(100_000), state(remotes=())), Local)


def test_local_prefix_hit_shortens_the_request() -> None:
    # 20000 tokens, 30 blocks (15360 tokens) cached locally: 4640 left, below t.
    d = decide(req(20000), state(local_prefix_hit=hit(30)))
    assert d == Local(incremental_tokens=4640, reason="short")


def test_threshold_rises_with_egress_utilization() -> None:
    s = state(egress_demand_bps=85e9)  # u = 0.85, halfway between soft 0.7 and hard 0.97
    assert effective_threshold(s) > 8192 * 2
    assert isinstance(decide(req(12000), state()), Offload)
    assert isinstance(decide(req(12000), s), Local)
    assert isinstance(decide(req(100_000), s), Offload)
    sat = state(egress_demand_bps=99e9)
    assert math.isinf(effective_threshold(sat))
    assert decide(req(100_000), sat).reason == "link-saturated"


def test_remote_prefix_used_only_when_bandwidth_is_plentiful() -> None:
    remotes = (ClusterView(name="east", prefix_hit=hit(35)),)  # 17920 of 20000 cached there
    d = decide(req(20000), state(remotes=remotes))
    assert d == Offload(cluster="east", incremental_tokens=2080, reason="remote-prefix")
    tight = decide(req(20000), state(remotes=remotes, egress_demand_bps=72e9))
    assert tight == Local(incremental_tokens=20000, reason="bandwidth-tight")


def test_best_cache_hit_chooses_the_cluster() -> None:
    remotes = (ClusterView(name="a", prefix_hit=hit(2)), ClusterView(name="b", prefix_hit=hit(10)))
    d = decide(req(50_000), state(remotes=remotes))
    assert isinstance(d, Offload) and d.cluster == "b"
    assert d.incremental_tokens == 50_000 - 10 * 512


def test_values_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        state().threshold_tokens = 1.0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        Local(incremental_tokens=1, reason="x").reason = "y"  # type: ignore[misc]


@given(
    n=st.integers(0, 200_000),
    t=st.floats(0, 150_000),
    bw=st.floats(0, 1e12),
    demand=st.floats(0, 1e12),
    lh=st.integers(0, 400),
    rh=st.integers(0, 400),
)
def test_decide_is_total_and_consistent(
    n: int, t: float, bw: float, demand: float, lh: int, rh: int
) -> None:
    s = state(
        threshold_tokens=t,
        bandwidth_bps=bw,
        egress_demand_bps=demand,
        local_prefix_hit=hit(lh),
        remotes=(ClusterView(name="east", prefix_hit=hit(rh)),),
    )
    d = decide(req(n), s)
    assert 0 <= d.incremental_tokens <= n
    if bw == 0:
        assert isinstance(d, Local)
    if isinstance(d, Offload):
        # Something offloaded is long locally; the link has room for it.
        assert n - min(lh * 512, n) > effective_threshold(s)
        assert s.utilization < s.hard_utilization
