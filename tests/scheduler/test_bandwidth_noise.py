"""``bandwidth_noise`` is noise on ``adaptive``'s estimate of the link: log-normal around the
link's rate (mean preserved, never 0 on a link that carries anything); ``selective``'s
decisions see the link's rate."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.errors import UsageError
from kvwire.scheduler.link import LinkSchedule
from kvwire.scheduler.model import ClusterConfig
from kvwire.scheduler.profile import ModelProfile
from kvwire.scheduler.simulator import (
    MAX_BANDWIDTH_NOISE,
    PolicyName,
    SimulationConfig,
    _bandwidth_sample,
    new_state,
    simulate,
)
from kvwire.scheduler.workload import TraceRequest

# 1 s of remote and 10 s of local prefill per 1000 tokens; 1000 bytes of KV per token.
REMOTE = ModelProfile(name="r", tokens=(1000, 2000), kv_bytes=(1e6, 2e6), prefill_s=(1.0, 2.0))
LOCAL = ModelProfile(name="l", tokens=(1000, 2000), kv_bytes=(1e6, 2e6), prefill_s=(10.0, 20.0))


def config(noise: float, rate_bps: float = 8e9) -> SimulationConfig:
    return SimulationConfig(
        cluster=ClusterConfig(
            remote_profile=REMOTE,
            local_profile=LOCAL,
            remote_instances=2,
            local_instances=4,
            decode_step_s=0.01,
            decode_batch_max=64,
        ),
        link=LinkSchedule.constant(rate_bps),
        rtt_s=0.0,
        prefill_instances=2,
        bandwidth_noise=noise,
    )


# Long and short prompts alternating, 5 s apart: the long ones are offloaded.
TRACE = tuple(
    TraceRequest(arrival_s=5.0 * k, input_length=2000 if k % 2 else 200, output_length=1)
    for k in range(60)
)


def test_selective_decisions_see_the_links_rate_whatever_the_noise() -> None:
    # Gaussian noise clamped at 0 sent a share Phi(-1) (16%) of them local as "no-bandwidth".
    quiet = simulate(TRACE, config(0.0), PolicyName.SELECTIVE)
    assert dict(quiet.decisions) == {"long": 30, "short": 30}
    for noise in (0.5, 1.0, 3.0):
        assert simulate(TRACE, config(noise), PolicyName.SELECTIVE, seed=1) == quiet


@pytest.mark.parametrize("noise", [1.0, 3.0])
def test_adaptive_never_reads_a_carrying_link_as_down(noise: float) -> None:
    result = simulate(TRACE, config(noise), PolicyName.ADAPTIVE, seed=2)
    assert "no-bandwidth" not in dict(result.decisions)
    assert result.offload_fraction > 0


@settings(max_examples=200, deadline=None)
@given(
    noise=st.floats(min_value=0.0, max_value=MAX_BANDWIDTH_NOISE),
    rate=st.floats(min_value=1e4, max_value=1e15),
    seed=st.integers(min_value=0, max_value=2**32),
)
def test_the_estimate_of_a_carrying_link_is_positive_and_finite(
    noise: float, rate: float, seed: int
) -> None:
    state = new_state(TRACE[:1], config(noise, rate), PolicyName.ADAPTIVE, prefill_instances=2,
                      seed=seed)
    for _ in range(20):
        sample = _bandwidth_sample(state)
        assert 0.0 < sample < math.inf


@pytest.mark.parametrize("noise", [0.25, 1.0])
def test_the_estimate_has_the_links_rate_as_mean_and_the_noise_as_relative_deviation(
    noise: float,
) -> None:
    state = new_state(TRACE[:1], config(noise, 1e9), PolicyName.ADAPTIVE, prefill_instances=2,
                      seed=5)
    samples = np.asarray([_bandwidth_sample(state) for _ in range(200_000)]) / 1e9
    assert samples.mean() == pytest.approx(1.0, rel=0.02)
    assert samples.std() == pytest.approx(noise, rel=0.05)


def test_an_outage_reads_as_no_bandwidth_with_noise_too() -> None:
    link = LinkSchedule(starts_s=(0.0, 100.0, 200.0), rates_bps=(8e9, 0.0, 8e9))
    cfg = replace(config(1.0), link=link)
    state = new_state(TRACE[:1], cfg, PolicyName.ADAPTIVE, prefill_instances=2)
    state.link_rate_bps = 0.0
    assert _bandwidth_sample(state) == 0.0


@pytest.mark.parametrize("noise", [100.5, 1e300, math.inf, math.nan, -0.1])
def test_a_noise_out_of_range_is_refused(noise: float) -> None:
    with pytest.raises(UsageError, match="bandwidth_noise"):
        config(noise)
