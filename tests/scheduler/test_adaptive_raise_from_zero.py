"""adaptive: a threshold of 0 ("offload everything", the nominal optimum on a fast link)
rises to the table's smallest non-zero threshold on its first raise, not x1.25 from 1
token (which took 45 steps to reach 20,000 tokens)."""

from __future__ import annotations

import math

import numpy as np

from kvwire.scheduler.link import LinkSchedule
from kvwire.scheduler.model import ClusterConfig
from kvwire.scheduler.profile import builtin_profile
from kvwire.scheduler.simulator import (
    AdaptiveState,
    PolicyName,
    SimulationConfig,
    ThresholdTable,
    new_state,
    retune_threshold,
    run_events,
)
from kvwire.scheduler.workload import LengthDistribution, synthetic_trace

TABLE = ThresholdTable((1e9, 1e10, 1e11), (20000.0, 5000.0, 0.0))


def _state(t: float, nominal_bps: float) -> AdaptiveState:
    return AdaptiveState(
        threshold_tokens=t, nominal_bps=nominal_bps, tuned_bps=nominal_bps, estimate_bps=nominal_bps
    )


def _raise(s: AdaptiveState) -> AdaptiveState:
    return retune_threshold(s, 1e9, TABLE, local_backlog_s=0.0, remote_backlog_s=100.0,
                            smoothing=1.0)


def test_first_raise_from_zero_lands_on_the_smallest_nonzero_threshold() -> None:
    s = _raise(_state(0.0, 1e11))
    assert s.bounds(TABLE) == (0.0, 20000.0)
    assert s.threshold_tokens == 5000.0
    assert s.retunes == 1
    seen = [s.threshold_tokens]
    while s.threshold_tokens < 20000.0:
        s = _raise(s)
        seen.append(s.threshold_tokens)
    # 5000 then x1.25 steps, as from a nominal threshold of 5000: 1 + 7 raises.
    assert seen[1:] == [min(5000.0 * 1.25**k, 20000.0) for k in range(1, 8)]
    assert s.retunes == 8


def test_raise_from_a_small_threshold_lands_on_the_floor_and_above_it_multiplies() -> None:
    assert _raise(_state(3.0, 1e11)).threshold_tokens == 5000.0
    assert _raise(_state(4500.0, 1e11)).threshold_tokens == 5625.0
    assert _raise(_state(6000.0, 1e11)).threshold_tokens == 7500.0


def test_lowering_is_unchanged() -> None:
    s = AdaptiveState(threshold_tokens=5000.0, nominal_bps=1e11, tuned_bps=1e10,
                      estimate_bps=1e10)
    for want in (4000.0, 3200.0, 2560.0):
        s = retune_threshold(s, 1e10, TABLE, local_backlog_s=100.0, remote_backlog_s=0.0,
                             smoothing=1.0)
        assert s.bounds(TABLE) == (0.0, 5000.0)
        assert s.threshold_tokens == want


def test_table_of_zeros_stays_at_zero() -> None:
    zeros = ThresholdTable((1e9, 1e11), (0.0, 0.0))
    s = retune_threshold(_state(0.0, 1e11), 1e9, zeros, local_backlog_s=0.0,
                         remote_backlog_s=100.0, smoothing=1.0)
    assert s.threshold_tokens == 0.0
    assert s.retunes == 0


def test_simulated_link_drop_from_nominal_zero_raises_in_one_step() -> None:
    reqs = synthetic_trace(np.random.default_rng(0), requests=400, rate_rps=1.0)
    cluster = ClusterConfig(remote_profile=builtin_profile("hybrid-1t"), egress_bps=1e12)
    cfg = SimulationConfig(
        cluster=cluster,
        link=LinkSchedule.from_pairs(((0.0, 1e12), (60.0, 1e9))),
        bandwidth_time_constant_s=0.0,
    )
    table = ThresholdTable((1e9, 1e12), (20000.0, 0.0))
    st = new_state(reqs, cfg, PolicyName.ADAPTIVE, prefill_instances=5.0,
                   threshold_tokens=math.inf, table=table, seed=0,
                   plan_lengths=LengthDistribution.from_trace(reqs))
    run_events(st)
    assert st.adaptive is not None
    arrivals = [r.arrival_s for r in reqs]
    drop = next(k for k, a in enumerate(arrivals) if a >= 60.0)
    assert all(t == 0.0 for t in st.thresholds_seen[:drop])
    # The old x1.25-from-1-token raise took 45 retunes (about 94 s past the drop); now
    # the first one after the drop lands on 20,000.
    assert st.adaptive.retunes == 1
    assert max(st.thresholds_seen) == 20000.0
    first = next(k for k, t in enumerate(st.thresholds_seen) if t > 0)
    assert arrivals[first] < 70.0
