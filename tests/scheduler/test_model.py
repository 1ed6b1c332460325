from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.scheduler.model import Bound, Capacity, ClusterConfig, capacity, optimize
from kvwire.scheduler.profile import ModelProfile, builtin_profile
from kvwire.scheduler.workload import LengthDistribution

# T_remote(l) = l / 1000 s, S_kv(l) = 1000 * l bytes, T_local(l) = l / 100 s: every term of
# the model is a round number for lengths {500, 500, 2000, 2000} and t = 1000
# (p = 0.5, l_long = 2000, l_short = 500).
REMOTE = ModelProfile(name="r", tokens=(1000, 2000), kv_bytes=(1e6, 2e6), prefill_s=(1.0, 2.0))
LOCAL = ModelProfile(name="l", tokens=(1000, 2000), kv_bytes=(1e6, 2e6), prefill_s=(10.0, 20.0))
DIST = LengthDistribution([500, 500, 2000, 2000])


def cfg(*, local: int, egress_bps: float = 160e6) -> ClusterConfig:
    # Decode: BS 10 / (0.1 s x 100 tokens) = 1 request/s per decode instance.
    return ClusterConfig(
        remote_profile=REMOTE,
        local_profile=LOCAL,
        remote_instances=2,
        local_instances=local,
        egress_bps=egress_bps,
        decode_step_s=0.1,
        decode_batch_max=10,
        mean_output_tokens=100,
    )


@pytest.mark.parametrize(
    ("local", "n_p", "egress", "lam", "binding"),
    [
        # local path 4/5/0.5 = 1.6 < remote 2/2/0.5 = 2 < decode 4
        (8, 4, 160e6, 1.6, Bound.LOCAL_PREFILL),
        # local 6/5/0.5 = 2.4, decode 4: remote compute 2 binds
        (10, 6, 160e6, 2.0, Bound.REMOTE_COMPUTE),
        # egress 8e6 / 16e6 bits = 0.5/s, over p = 0.5: 1.0 binds
        (10, 6, 8e6, 1.0, Bound.EGRESS_BANDWIDTH),
        # one decode instance: 1/s
        (7, 6, 160e6, 1.0, Bound.DECODE),
    ],
)
def test_hand_computed_bounds(
    local: int, n_p: int, egress: float, lam: float, binding: Bound
) -> None:
    c = capacity(
        DIST, cfg(local=local, egress_bps=egress), threshold_tokens=1000, prefill_instances=n_p
    )
    assert c.offload_fraction == 0.5
    assert c.mean_long_tokens == 2000 and c.mean_short_tokens == 500
    assert c.remote_compute_rps == pytest.approx(1.0)
    assert c.local_prefill_rps == pytest.approx(n_p / 5)
    assert c.egress_rps == pytest.approx(egress / 16e6)
    assert c.decode_rps == pytest.approx(local - n_p)
    assert c.lambda_max_rps == pytest.approx(lam)
    assert c.binding is binding


def test_all_local_and_all_remote_edges() -> None:
    c = capacity(DIST, cfg(local=8), threshold_tokens=5000, prefill_instances=4)
    assert c.offload_fraction == 0 and math.isinf(c.remote_path_rps)
    assert c.lambda_max_rps == pytest.approx(4 / (1250 / 100))  # N_p / T_local(mean 1250)
    c = capacity(DIST, cfg(local=8), threshold_tokens=-1, prefill_instances=0)
    assert c.offload_fraction == 1 and math.isinf(c.local_path_rps)
    assert c.lambda_max_rps == pytest.approx(2 / 1.25)


@pytest.mark.parametrize(
    ("profile", "egress"), [("hybrid-1t", 100e9), ("hybrid-1t", 10e9), ("llama-3-70b", 100e9)]
)
def test_optimizer_balances_the_prefill_paths(profile: str, egress: float) -> None:
    config = ClusterConfig(
        remote_profile=builtin_profile(profile), egress_bps=egress, decode_batch_max=10**6
    )
    dist = LengthDistribution.lognormal(points=4000)
    step = 512.0
    res = optimize(dist, config, step_tokens=step, prefill_instances=5)
    t = res.threshold_tokens
    below = capacity(dist, config, threshold_tokens=t - step, prefill_instances=5)
    above = capacity(dist, config, threshold_tokens=t + step, prefill_instances=5)
    # Remote path rises with t, local path falls: the optimum sits where they cross.
    assert below.remote_path_rps <= below.local_path_rps
    assert above.remote_path_rps >= above.local_path_rps
    assert res.best.binding in (Bound.LOCAL_PREFILL, Bound.REMOTE_COMPUTE, Bound.EGRESS_BANDWIDTH)
    assert res.best.lambda_max_rps == max(res.lambda_at_best_split)


def test_optimizer_names_egress_for_dense_model_on_slow_link() -> None:
    config = ClusterConfig(remote_profile=builtin_profile("llama-3-70b"), egress_bps=10e9)
    dist = LengthDistribution.lognormal(points=4000)
    res = optimize(dist, config, step_tokens=1024)
    # A dense model over 10 Gbit/s offloads only the very longest prompts.
    assert res.best.offload_fraction < 0.1
    assert res.best.egress_demand_bps == pytest.approx(10e9, rel=0.05)


SMALL = LengthDistribution.lognormal(points=500)
HYBRID = builtin_profile("hybrid-1t")


@settings(max_examples=40, deadline=None)
@given(
    bw1=st.floats(1e8, 2e11),
    factor=st.floats(1.0, 100.0),
    t=st.floats(0, 140_000),
    n_p=st.integers(0, 6),
)
def test_more_bandwidth_never_lowers_lambda(bw1: float, factor: float, t: float, n_p: int) -> None:
    lo = ClusterConfig(remote_profile=HYBRID, egress_bps=bw1)
    hi = lo.with_egress(bw1 * factor)
    a = capacity(SMALL, lo, threshold_tokens=t, prefill_instances=n_p).lambda_max_rps
    b = capacity(SMALL, hi, threshold_tokens=t, prefill_instances=n_p).lambda_max_rps
    assert b >= a


@settings(max_examples=15, deadline=None)
@given(bw1=st.floats(1e8, 2e11), factor=st.floats(1.0, 100.0))
def test_more_bandwidth_never_lowers_optimum(bw1: float, factor: float) -> None:
    lo = ClusterConfig(remote_profile=HYBRID, egress_bps=bw1)
    a = optimize(SMALL, lo, step_tokens=4096).best.lambda_max_rps
    b = optimize(SMALL, lo.with_egress(bw1 * factor), step_tokens=4096).best.lambda_max_rps
    assert b >= a


@settings(max_examples=30, deadline=None)
@given(t=st.floats(0, 140_000), n_r=st.integers(0, 8))
def test_more_remote_instances_never_lower_lambda(t: float, n_r: int) -> None:
    base = ClusterConfig(remote_profile=HYBRID, remote_instances=n_r)
    more = ClusterConfig(remote_profile=HYBRID, remote_instances=n_r + 1)
    a = capacity(SMALL, base, threshold_tokens=t, prefill_instances=4).lambda_max_rps
    b = capacity(SMALL, more, threshold_tokens=t, prefill_instances=4).lambda_max_rps
    assert b >= a


def test_optimizer_work_is_bounded_by_the_distinct_lengths(monkeypatch: pytest.MonkeyPatch) -> None:
    # One 10M-token prompt made the grid 39K thresholds x every split (a 1e8-token one
    # took 21 s). The model is constant between consecutive distinct lengths: it is
    # evaluated once per such run, and the step widens past MAX_GRID_POINTS points.
    from kvwire.scheduler import model

    config = ClusterConfig(remote_profile=HYBRID)
    huge = LengthDistribution([2000, 1e12])
    res = optimize(huge, config)
    assert len(res.thresholds) <= model.MAX_GRID_POINTS
    assert res.step_tokens % 256 == 0 and res.thresholds[-2] < 1e12 <= res.thresholds[-1]
    calls = 0
    real = model._assemble

    def counting(*args: object) -> Capacity:
        nonlocal calls
        calls += 1
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(model, "_assemble", counting)
    res = optimize(LengthDistribution([2000, 1e7]), config)
    assert calls <= 3 * len(config.splits())  # t below 2000, in [2000, 1e7), at 1e7
    assert res.threshold_tokens == 2048 and res.step_tokens == 256


@pytest.mark.parametrize("step", [100.0, 256.0, 700.0])
def test_optimizer_curves_match_the_model_at_every_grid_point(step: float) -> None:
    dist = LengthDistribution([0, 300, 300, 1000, 1900, 2000, 2000, 5000])
    config = cfg(local=8)
    res = optimize(dist, config, step_tokens=step)
    n_p = res.best.prefill_instances
    for t, lam, env in zip(res.thresholds, res.lambda_at_best_split, res.lambda_best_over_splits, strict=True):
        assert lam == capacity(dist, config, threshold_tokens=t, prefill_instances=n_p).lambda_max_rps
        assert env == max(
            capacity(dist, config, threshold_tokens=t, prefill_instances=s).lambda_max_rps
            for s in config.splits()
        )
    # The best is the first grid point of the best (t, N_p), as a full grid search finds.
    ranks = [
        (capacity(dist, config, threshold_tokens=t, prefill_instances=s), s, t)
        for s in config.splits() for t in res.thresholds
    ]
    first = max(ranks, key=lambda x: (x[0].lambda_max_rps, min(x[0].remote_path_rps, x[0].local_path_rps)))
    assert (res.best.prefill_instances, res.threshold_tokens) == (first[1], first[2])
