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


def test_without_a_plan_the_levels_are_the_fixed_ones() -> None:
    s = state(egress_demand_bps=85e9)
    assert not s.has_plan and s.planned_utilization == 0.0
    assert s.levels == (0.7, 0.97) and s.utilization == pytest.approx(0.85)


def test_a_plan_that_fills_the_link_is_not_fought() -> None:
    # The optimizer's threshold for an egress-bound link plans to fill it: 100 Gbit/s of
    # KV on the 100 Gbit/s link. Demand above the plan (here twice it: offered load beyond
    # Lambda_max) is load the plan cannot serve on any path, not a link short of the plan,
    # so the rules see at most the plan: u = 1.0, the soft level; nothing rises.
    planned = {"planned_egress_bps": 100e9, "planned_bandwidth_bps": 100e9}
    remotes = (ClusterView(name="east", prefix_hit=hit(35)),)
    for demand in (50e9, 100e9, 200e9):
        s = state(egress_demand_bps=demand, remotes=remotes, **planned)
        assert s.levels == pytest.approx((1.0, 1.27))
        assert s.utilization == pytest.approx(min(demand, 100e9) / 100e9)
        assert effective_threshold(s) == 8192
        assert decide(req(12000), s).reason == "remote-prefix"
        assert decide(req(50000), s).reason == "long"
    # Without the plan the same demands raise the threshold and then refuse everything.
    assert effective_threshold(state(egress_demand_bps=85e9)) > 8192
    assert decide(req(50000), state(egress_demand_bps=200e9)).reason == "link-saturated"


def test_a_link_short_of_the_plan_raises_the_threshold_then_refuses() -> None:
    # Planned: 10 Gbit/s of KV on a 10 Gbit/s link. The link steps down to 8 Gbit/s:
    # at full load (demand >= plan) u = 10/8 = 1.25, inside the band [1.0, 1.27]: the
    # threshold rises 4 x 0.25 / 0.27 = 3.7-fold more, and a request short only on the
    # remote cluster stays local. At 5 Gbit/s (u = 2) nothing more goes remote. At half
    # the planned load the 8 Gbit/s link still carries the plan (u = 0.625): no change.
    planned = {"planned_egress_bps": 10e9, "planned_bandwidth_bps": 10e9}
    remotes = (ClusterView(name="east", prefix_hit=hit(35)),)
    short = state(bandwidth_bps=8e9, egress_demand_bps=30e9, remotes=remotes, **planned)
    assert short.utilization == pytest.approx(1.25)
    assert effective_threshold(short) == pytest.approx(8192 * (1 + 4 * 0.25 / 0.27))  # 38.5K
    assert decide(req(20000), short).reason == "short"
    assert decide(req(100_000), short).reason == "long"
    # 60000 tokens, 100 blocks (51200) cached remotely: long locally, short there.
    near = (ClusterView(name="east", prefix_hit=hit(100)),)
    tight = state(bandwidth_bps=8e9, egress_demand_bps=30e9, remotes=near, **planned)
    assert decide(req(60000), tight) == Local(incremental_tokens=60000, reason="bandwidth-tight")
    down = state(bandwidth_bps=5e9, egress_demand_bps=10e9, **planned)
    assert decide(req(100_000), down).reason == "link-saturated"
    half = state(bandwidth_bps=8e9, egress_demand_bps=5e9, remotes=remotes, **planned)
    assert effective_threshold(half) == 8192
    assert decide(req(20000), half).reason == "remote-prefix"


def test_a_plan_below_the_soft_level_keeps_the_fixed_levels() -> None:
    # A remote-compute-bound plan uses 30% of the link: the levels stay at 0.7 and 0.97.
    s = state(egress_demand_bps=90e9, planned_egress_bps=30e9, planned_bandwidth_bps=100e9)
    assert s.planned_utilization == pytest.approx(0.3) and s.levels == (0.7, 0.97)
    assert s.utilization == pytest.approx(0.3)
    assert effective_threshold(s) == 8192
    # The live estimate at a third of the planned bandwidth: u = 0.9.
    low = state(bandwidth_bps=100e9 / 3, egress_demand_bps=90e9, planned_egress_bps=30e9,
                planned_bandwidth_bps=100e9)
    assert low.utilization == pytest.approx(0.9)
    assert effective_threshold(low) > 8192


@pytest.mark.parametrize(("planned", "planned_bw"), [
    (None, 100e9), (math.nan, 100e9), (math.inf, 100e9), (-1.0, 100e9),
    (30e9, None), (30e9, 0.0), (30e9, math.nan), (30e9, math.inf),
])
def test_no_usable_plan_is_no_plan(planned: float | None, planned_bw: float | None) -> None:
    # A plan without the bandwidth it was made for is none: taken as made for the live
    # estimate, the link could never fall short of it and no rule would ever fire.
    s = state(egress_demand_bps=85e9, planned_egress_bps=planned, planned_bandwidth_bps=planned_bw)
    assert not s.has_plan and s.levels == (0.7, 0.97)
    assert effective_threshold(s) == effective_threshold(state(egress_demand_bps=85e9))


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
    planned=st.none() | st.floats(0, 1e12),
    planned_bw=st.none() | st.floats(0, 1e12),
)
def test_decide_is_total_and_consistent(
    n: int,
    t: float,
    bw: float,
    demand: float,
    lh: int,
    rh: int,
    planned: float | None,
    planned_bw: float | None,
) -> None:
    s = state(
        threshold_tokens=t,
        bandwidth_bps=bw,
        egress_demand_bps=demand,
        local_prefix_hit=hit(lh),
        remotes=(ClusterView(name="east", prefix_hit=hit(rh)),),
        planned_egress_bps=planned,
        planned_bandwidth_bps=planned_bw,
    )
    d = decide(req(n), s)
    assert 0 <= d.incremental_tokens <= n
    soft, hard = s.levels
    assert s.soft_utilization <= soft <= hard
    if bw == 0:
        assert isinstance(d, Local) and math.isinf(effective_threshold(s))
    if isinstance(d, Offload):
        # Something offloaded is long locally; the link has room for it.
        assert n - min(lh * 512, n) > effective_threshold(s)
        assert s.utilization <= soft or s.utilization < hard  # (a plan's huge level: soft == hard in floats)
    if s.has_plan and bw > 0 and planned_bw == bw:
        # On the link the plan was made for, the plan is never fought, whatever the load.
        assert effective_threshold(s) == t
        assert d.reason not in ("link-saturated", "bandwidth-tight")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("threshold_tokens", math.nan),  # offloaded every request as "remote-prefix"
        ("bandwidth_bps", math.nan),  # "bandwidth-tight" instead of "no-bandwidth"
        ("bandwidth_bps", math.inf),
        ("bandwidth_bps", -math.inf),
        ("egress_demand_bps", math.nan),  # the utilization rules silently off
        ("egress_demand_bps", math.inf),
        ("soft_utilization", math.nan),
        ("hard_utilization", math.inf),
        ("threshold_gain", math.nan),
    ],
)
def test_state_refuses_values_no_rule_can_compare(field: str, value: float) -> None:
    from kvwire.errors import UsageError

    with pytest.raises(UsageError, match=field):
        state(**{field: value})


@pytest.mark.parametrize("field", ["threshold_tokens", "bandwidth_bps", "egress_demand_bps", "soft_utilization",
                                   "hard_utilization", "threshold_gain", "planned_egress_bps",
                                   "planned_bandwidth_bps"])
@pytest.mark.parametrize("value", ["1e9", True, [1.0]])
def test_state_refuses_what_is_not_a_number(field: str, value: object) -> None:
    # math.isfinite raised TypeError ('must be real number, not str') from __post_init__.
    from kvwire.errors import UsageError

    with pytest.raises(UsageError, match=field):
        state(**{field: value})


def test_state_takes_numbers_of_every_kind() -> None:
    import numpy as np

    assert state(threshold_tokens=np.float32(100.0), bandwidth_bps=np.int64(10**9), egress_demand_bps=0).has_plan is False


def test_a_prefix_hit_that_is_not_a_sequence_of_pairs_is_refused() -> None:
    # A registry lookup not awaited (a coroutine) failed in decide() with a TypeError.
    from kvwire.errors import UsageError

    async def lookup() -> tuple[tuple[int, int], ...]:
        return ()

    coro = lookup()
    try:
        with pytest.raises(UsageError, match="local_prefix_hit"):
            state(local_prefix_hit=coro)  # type: ignore[arg-type]
        with pytest.raises(UsageError, match="prefix_hit"):
            ClusterView(name="east", prefix_hit=coro)  # type: ignore[arg-type]
    finally:
        coro.close()
    with pytest.raises(UsageError, match="remotes"):
        state(remotes=("east",))  # type: ignore[arg-type]


def test_state_keeps_the_documented_edges() -> None:
    # inf: offload nothing; below 0: every request long; bandwidth <= 0: none; demand < 0: 0.
    # An infinite threshold is short for every prompt ('link-saturated' said the link was full).
    assert decide(req(10**6), state(threshold_tokens=math.inf)) == Local(incremental_tokens=10**6, reason="short")
    assert decide(req(10**6), state(threshold_tokens=1e4, egress_demand_bps=1e12)).reason == "link-saturated"
    assert decide(req(1), state(threshold_tokens=-1.0)).reason == "long"
    assert decide(req(100_000), state(bandwidth_bps=-5.0)).reason == "no-bandwidth"
    assert state(egress_demand_bps=-1e9).utilization == 0.0


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        # Levels the wrong way round or equal: the band the threshold rises across is empty
        # (a demand between them was neither raised nor refused).
        ({"soft_utilization": 0.8, "hard_utilization": 0.8}, "soft_utilization"),
        ({"soft_utilization": 0.9, "hard_utilization": 0.8}, "soft_utilization"),
        ({"soft_utilization": -0.1}, "soft_utilization"),
        ({"threshold_gain": -2.0}, "threshold_gain"),  # lowered the threshold as the link filled
        ({"block_tokens": 0}, "block_tokens"),  # a prefix hit covered no tokens
        ({"block_tokens": -512}, "block_tokens"),
        ({"block_tokens": 511.5}, "block_tokens"),
        ({"block_tokens": True}, "block_tokens"),
    ],
)
def test_state_refuses_levels_gains_and_blocks_out_of_range(kw: dict[str, object], field: str) -> None:
    from kvwire.errors import UsageError

    with pytest.raises(UsageError, match=field):
        state(egress_demand_bps=85e9, **kw)


@pytest.mark.parametrize(("kw", "field"), [
    ({"input_length": -5}, "input_length"),  # stayed local as "short", 0 incremental tokens
    ({"input_length": 4000.5}, "input_length"),
    ({"input_length": math.nan}, "input_length"),
    ({"input_length": "4000"}, "input_length"),
    ({"input_length": 4000, "output_length": -1}, "output_length"),
])
def test_request_refuses_lengths_that_are_not_whole_and_non_negative(
    kw: dict[str, object], field: str
) -> None:
    from kvwire.errors import UsageError

    with pytest.raises(UsageError, match=field):
        PolicyRequest(request_id="r", **kw)  # type: ignore[arg-type]


def test_whole_lengths_of_any_integral_type_are_taken() -> None:
    import numpy as np

    assert isinstance(decide(PolicyRequest(request_id="r", input_length=np.int64(20000)), state()), Offload)
    assert isinstance(decide(PolicyRequest(request_id="r", input_length=4000.0), state()), Local)  # type: ignore[arg-type]
    assert isinstance(decide(req(20000), state(block_tokens=np.int64(256))), Offload)
