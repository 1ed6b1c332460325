"""A trace's clock does not matter: arrival times below 0 (``load_trace`` takes timestamps
either side of 0) give the same results as the same trace shifted above it."""

from __future__ import annotations

import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvwire.scheduler.link import LinkSchedule
from kvwire.scheduler.model import ClusterConfig
from kvwire.scheduler.profile import ModelProfile
from kvwire.scheduler.simulator import (
    PolicyName,
    PolicyResult,
    SimulationConfig,
    ThresholdTable,
    model_cluster,
    simulate,
)
from kvwire.scheduler.workload import TraceRequest

# 1 s of remote and 10 s of local prefill per 1000 tokens; 1000 bytes of KV per token,
# over a 1 MB/s link: the link matters to the threshold.
REMOTE = ModelProfile(name="r", tokens=(1000, 2000), kv_bytes=(1e6, 2e6), prefill_s=(1.0, 2.0))
LOCAL = ModelProfile(name="l", tokens=(1000, 2000), kv_bytes=(1e6, 2e6), prefill_s=(10.0, 20.0))


def config(noise: float = 0.0) -> SimulationConfig:
    return SimulationConfig(
        cluster=ClusterConfig(
            remote_profile=REMOTE,
            local_profile=LOCAL,
            remote_instances=1,
            local_instances=3,
            decode_step_s=0.01,
            decode_batch_max=8,
        ),
        link=LinkSchedule.constant(8e6),
        rtt_s=0.0,
        prefill_instances=1,
        bandwidth_noise=noise,
        control_interval_s=1.0,
        bandwidth_time_constant_s=2.0,
    )


def test_the_first_rate_holds_before_0() -> None:
    link = LinkSchedule.from_pairs(((0.0, 8e9), (10.0, 1e9)))
    assert link.rate_at(-5.0) == 8e9
    assert link.bytes_between(-5.0, 0.0) == 5e9
    assert link.bytes_between(-5.0, 15.0) == 15e9 + 5 * 1e9 / 8
    assert link.mean_rate_between(-10.0, -5.0) == 8e9
    assert link.finish_time(-5.0, 10e9) == 5.0  # 5 s before 0 and 5 s after, at 8 Gbit/s
    assert link.bytes_between(3.0, 3.0) == 0.0


def test_a_constant_link_is_modelled_at_its_rate_whatever_the_clock() -> None:
    # Arrivals ending at 0 saw a 100 Gbit/s link as 0 bit/s: no bytes were counted before 0.
    reqs = [TraceRequest(arrival_s=t, input_length=1000, output_length=1, hash_ids=(i,))
            for i, t in enumerate((-100.0, -50.0, 0.0))]
    cfg = SimulationConfig(cluster=config().cluster, link=LinkSchedule.constant(100e9))
    assert model_cluster(reqs, cfg).egress_bps == 100e9


def _same(a: PolicyResult, b: PolicyResult) -> None:
    assert a.offload_fraction == b.offload_fraction
    assert a.decisions == b.decisions
    assert a.retunes == b.retunes
    assert a.prefill_instances == b.prefill_instances
    for name in ("threshold_tokens", "capacity_rps", "capacity_realized_rps", "throughput_rps",
                 "ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "egress_gbps_peak",
                 "offered_rps", "makespan_s"):
        x, y = getattr(a, name), getattr(b, name)
        if x is None or y is None or (math.isnan(x) and math.isnan(y)):
            assert (x is None) == (y is None), name
            continue
        assert y == pytest.approx(x, rel=1e-6, abs=1e-6), name


@settings(max_examples=60, deadline=None)
@given(
    gaps=st.lists(st.integers(min_value=0, max_value=40), min_size=2, max_size=25),
    lengths=st.lists(st.integers(min_value=100, max_value=4000), min_size=25, max_size=25),
    shift=st.integers(min_value=-10**6, max_value=10**6),
    noise=st.sampled_from([0.0, 0.6]),
)
@example(gaps=[4, 4, 4, 4, 4, 4], lengths=[3000, 200, 3500, 300, 2500, 400] + [100] * 19,
         shift=-20, noise=0.0)
@example(gaps=[4] * 25, lengths=[2000, 1000] * 12 + [2000], shift=-1000, noise=0.6)
def test_results_do_not_depend_on_the_clock(
    gaps: list[int], lengths: list[int], shift: int, noise: float
) -> None:
    # Arrivals in quarter seconds and a whole shift: the arrival times are exact on both
    # clocks, so any difference is the clock's, not rounding's.
    t, base = 0.0, []
    for i, gap in enumerate(gaps):
        t += gap / 4
        base.append(TraceRequest(arrival_s=t, input_length=lengths[i], output_length=10,
                                 hash_ids=(i,)))
    moved = [TraceRequest(arrival_s=r.arrival_s + shift, input_length=r.input_length,
                          output_length=r.output_length, hash_ids=r.hash_ids) for r in base]
    cfg = config(noise)
    assert model_cluster(moved, cfg).egress_bps == model_cluster(base, cfg).egress_bps == 8e6
    for policy in (PolicyName.SELECTIVE, PolicyName.ADAPTIVE, PolicyName.OFFLOAD_ALL):
        _same(simulate(base, cfg, policy), simulate(moved, cfg, policy))
    # adaptive with a table whose threshold follows the (noisy) estimate: its controller
    # steps from the first arrival on, wherever the clock puts it.
    table = ThresholdTable(bandwidths_bps=(4e6, 6e6, 8e6, 10e6, 12e6),
                           thresholds=(3000.0, 2400.0, 1500.0, 1000.0, 600.0))
    _same(simulate(base, cfg, PolicyName.ADAPTIVE, table=table),
          simulate(moved, cfg, PolicyName.ADAPTIVE, table=table))
