"""``saturated`` says whether a policy keeps up with the arrivals: judged on first tokens,
not on completions, whose decode tail says nothing about queueing."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.scheduler.simulator import (
    SATURATION_MARGIN,
    PolicyName,
    simulate,
)
from kvwire.scheduler.workload import TraceRequest
from tests.scheduler.worked_cluster import config


def trace(gap_s: float, inputs: int, outputs: list[int]) -> list[TraceRequest]:
    return [
        TraceRequest(arrival_s=i * gap_s, input_length=inputs, output_length=out, hash_ids=(i,))
        for i, out in enumerate(outputs)
    ]


def test_one_long_answer_mid_trace_is_not_saturation() -> None:
    # 100 requests 1 s apart, each prefilled in 0.5 s on an idle local server; request 50
    # answers 2000 tokens (100 s of decode), the rest 10. Nothing ever queues, but the
    # last completion is that long answer's, 50 s after the last arrival: completions per
    # second (throughput_rps) are 0.66 of the offered rate, which was flagged saturated.
    outputs = [2000 if i == 50 else 10 for i in range(100)]
    r = simulate(trace(1.0, 50, outputs), config(), PolicyName.LOCAL)
    assert r.offered_rps == pytest.approx(1.0)
    assert max(r.ttft_p99_s, r.ttft_p50_s) < 1.0  # no queueing
    # throughput_rps keeps its definition: completions between the first and the last one.
    assert r.throughput_rps == pytest.approx(99 / (50.5 + 100.0 - 0.5 - 0.5))
    assert r.saturated is False
    assert r.as_json()["saturated"] is False
    assert r.keep_up == pytest.approx(1.0)
    assert r.as_json()["keep_up"] == pytest.approx(1.0)


def test_queues_that_grow_are_saturation() -> None:
    # 10 s of local prefill per request, one arriving every 2 s: first tokens come at a
    # fifth of the arrival rate.
    r = simulate(trace(2.0, 1000, [1] * 40), config(), PolicyName.LOCAL)
    assert r.keep_up == pytest.approx(0.2, rel=0.01)
    assert r.saturated is True


@settings(max_examples=25, deadline=None)
@given(outputs=st.lists(st.integers(min_value=0, max_value=4000), min_size=2, max_size=30))
def test_an_idle_system_is_never_saturated_whatever_its_output_lengths(outputs: list[int]) -> None:
    # Arrivals 5 s apart, 1 s of prefill each, decode slots to spare: whatever the output
    # lengths (up to 200 s of decode), nothing waits, so nothing is saturated.
    r = simulate(trace(5.0, 100, outputs), config(), PolicyName.LOCAL)
    assert r.ttft_p99_s == pytest.approx(1.0)
    assert r.saturated is False
    assert r.keep_up == pytest.approx(1.0)


def test_keep_up_ratio() -> None:
    from kvwire.scheduler.simulator import keep_up_ratio

    arrivals = [float(i) for i in range(10)]
    assert keep_up_ratio(arrivals, [3.0] * 10) == pytest.approx(1.0)
    # One late first token of 100 changes the fit a little, not the verdict.
    assert keep_up_ratio([float(i) for i in range(100)], [0.1] * 99 + [5.0]) > 0.99
    # A single server of 2 s per request: the k-th first token at 2 (k + 1).
    assert keep_up_ratio(arrivals, [2.0 * (k + 1) - k for k in range(10)]) == pytest.approx(0.5)
    # On the clock of epoch seconds the same.
    assert keep_up_ratio([1.7e9 + t for t in arrivals], [3.0] * 10) == pytest.approx(1.0)
    assert keep_up_ratio(arrivals, [0.0] * 9 + [math.nan]) == 0.0  # one never got a token
    assert math.isnan(keep_up_ratio([1.0], [0.0]))
    assert math.isnan(keep_up_ratio([1.0, 1.0], [0.0, 0.0]))


def varied(gap_s: float, inputs: list[int]) -> list[TraceRequest]:
    return [
        TraceRequest(arrival_s=i * gap_s, input_length=n, output_length=1, hash_ids=(i,))
        for i, n in enumerate(inputs)
    ]


def test_later_longer_prompts_with_nothing_queued_are_not_saturation() -> None:
    # One local prefill server, 10 ms a token; arrivals 30 s apart: five 1 s prefills, then
    # five 20 s ones. Nothing waits, but fitted on raw first-token times (30 k + 1, then
    # 30 k + 20) the slope was 32.9 s a request against 30: keep_up 0.91, saturated.
    r = simulate(varied(30.0, [100] * 5 + [2000] * 5), config(), PolicyName.LOCAL)
    assert r.ttft_mean_s == pytest.approx((5 * 1.0 + 5 * 20.0) / 10)
    assert r.keep_up == pytest.approx(1.0)
    assert r.saturated is False


def test_an_offload_waits_only_in_queues_not_on_its_transfer_or_the_rtt() -> None:
    # offload-all over the 1 MB/s link with a 4 s RTT: a prompt of n tokens takes n ms of
    # remote prefill, n ms of transfer and 2 s to land, growing along the trace; arrivals
    # 30 s apart, so none waits.
    cfg = replace(config(), rtt_s=4.0)
    inputs = [200 * (k + 1) for k in range(10)]
    r = simulate(varied(30.0, inputs), cfg, PolicyName.OFFLOAD_ALL)
    assert r.ttft_p99_s <= 2 * 2.0 + 2.0 + 1e-9
    assert r.keep_up == pytest.approx(1.0)
    assert r.saturated is False


@settings(max_examples=25, deadline=None)
@given(inputs=st.lists(st.integers(min_value=1, max_value=2000), min_size=2, max_size=30),
       policy=st.sampled_from([PolicyName.LOCAL, PolicyName.OFFLOAD_ALL]))
def test_an_idle_system_is_never_saturated_whatever_its_input_lengths(
    inputs: list[int], policy: PolicyName
) -> None:
    # At most 20 s of local prefill or 4 s of remote prefill and transfer; arrivals 25 s
    # apart: nothing waits whatever the order of the lengths.
    r = simulate(varied(25.0, inputs), config(), policy)
    assert r.keep_up == pytest.approx(1.0)
    assert r.saturated is False


def test_keep_up_ratio_subtracts_each_requests_own_service() -> None:
    from kvwire.scheduler.simulator import keep_up_ratio

    arrivals = [10.0 * k for k in range(10)]
    service = [float(k) for k in range(10)]  # later ones longer, none waits
    assert keep_up_ratio(arrivals, service) < SATURATION_MARGIN
    assert keep_up_ratio(arrivals, service, service) == pytest.approx(1.0)
    # A single server of 20 s per request: the k-th leaves the queue at 20 k, its wait
    # 10 k on top of its own service, whatever that is.
    waits = [10.0 * k for k in range(10)]
    ttft = [w + s for w, s in zip(waits, service, strict=True)]
    assert keep_up_ratio(arrivals, ttft, service) == pytest.approx(0.5)
