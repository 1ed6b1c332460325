"""Inputs far out of range are usage errors, and the per-second egress statistics stay
small whatever span of simulated time a run covers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from kvwire.cli import main
from kvwire.errors import UsageError
from kvwire.scheduler.link import LinkSchedule
from kvwire.scheduler.model import ClusterConfig
from kvwire.scheduler.profile import ModelProfile
from kvwire.scheduler.simulator import (
    PolicyName,
    SimulationConfig,
    _window_stats,
    egress_runs,
    simulate,
)
from kvwire.scheduler.workload import MAX_TOKENS, TraceRequest, load_trace

# 1 s of remote prefill and 1 MB of KV per 1000 tokens.
PROFILE = ModelProfile(name="r", tokens=(1000, 2000), kv_bytes=(1e6, 2e6), prefill_s=(1.0, 2.0))


def _config(rate_bps: float, **cluster: object) -> SimulationConfig:
    kw: dict[str, object] = {"remote_profile": PROFILE, "remote_instances": 1, "local_instances": 2}
    kw.update(cluster)
    return SimulationConfig(
        cluster=ClusterConfig(**kw),  # type: ignore[arg-type]
        link=LinkSchedule.constant(rate_bps),
        prefill_instances=1,
        remote_cache_blocks=10,
        local_cache_blocks=10,
    )


def _dense(transfers: list[tuple[float, float, float]], t0: float, nbins: int) -> np.ndarray:
    """The per-second bins the simple way, as the statistics were computed before."""
    bins = np.zeros(nbins)
    for s, e, b in transfers:
        if b <= 0:
            continue
        a, z = s - t0, e - t0
        if z - a <= 0:
            bins[math.floor(a)] += b
            continue
        k = math.floor(a)
        while k < z:
            bins[k] += b / (z - a) * (min(z, k + 1) - max(a, k))
            k += 1
    return bins


def test_egress_runs_equal_the_per_second_bins() -> None:
    rng = np.random.default_rng(0)
    for _ in range(300):
        t0 = float(rng.uniform(0, 3))
        t, transfers = t0, []
        for _ in range(int(rng.integers(0, 7))):
            t += float(rng.choice([0.0, 0.5, 1.0, rng.exponential(2.0)]))
            d = float(rng.choice([0.0, 0.25, 1.0, 2.0, rng.exponential(3.0)]))
            transfers.append((t, t + d, float(rng.choice([0.0, rng.uniform(1, 1e6)]))))
            t += d
        nbins = math.ceil(t - t0) + 2
        dense = _dense(transfers, t0, nbins)
        sparse = np.zeros(nbins)
        for first, stop, value in egress_runs(transfers, t0):
            assert 0 <= first < stop <= nbins
            sparse[first:stop] += value
        np.testing.assert_allclose(sparse, dense, rtol=1e-9, atol=1e-6)
        window = int(rng.integers(1, nbins + 1))
        mean, p99 = _window_stats(egress_runs(transfers, t0), window)
        assert mean == pytest.approx(dense[:window].mean(), rel=1e-9, abs=1e-6)
        assert p99 == pytest.approx(np.percentile(dense[:window], 99), rel=1e-9, abs=1e-6)


def test_egress_runs_of_a_transfer_lasting_centuries() -> None:
    # 10^10 s at 1 byte/s: one run of whole seconds, not 10^10 bins.
    runs = egress_runs([(0.5, 0.5 + 1e10, 1e10)], 0.0)
    assert runs == [(0, 1, 0.5), (1, 10**10, 1.0), (10**10, 10**10 + 1, 0.5)]
    mean, p99 = _window_stats(runs, 10**9)
    assert mean == pytest.approx(1.0) and p99 == 1.0


@pytest.mark.timeout(60)
def test_a_run_spanning_decades_of_simulated_time() -> None:
    # Offload-all over 10 kbit/s: a prompt of 100M tokens takes 10^5 s to prefill and ships
    # 100 GB, 8e7 s (2.5 years) each. The statistics held one float a simulated second (the
    # whole run's worth: 10^9 of them, or a crash) and looped over every second in Python.
    reqs = [TraceRequest(arrival_s=float(i), input_length=100_000_000, output_length=1, hash_ids=(i,))
            for i in range(10)]
    r = simulate(reqs, _config(10e3), PolicyName.OFFLOAD_ALL)
    assert r.completed == 10 and r.makespan_s > 8e8
    assert r.egress_gbps_peak == pytest.approx(10e3 / 1e9)
    assert r.egress_gbps_mean == 0.0 and r.egress_gbps_p99 == 0.0  # the arrivals' 9 s: prefills


@pytest.mark.parametrize("rate", [100.0, 9e3, 2e15])
def test_link_rates_out_of_range_are_refused(rate: float) -> None:
    with pytest.raises(UsageError, match="out of range"):
        LinkSchedule.constant(rate)
    with pytest.raises(UsageError, match="out of range"):
        LinkSchedule(starts_s=(0.0, 1.0), rates_bps=(rate, 1e9))


def test_an_outage_and_the_limits_themselves_are_accepted() -> None:
    LinkSchedule(starts_s=(0.0, 1.0, 2.0), rates_bps=(10e3, 0.0, 1e15))


def test_a_time_that_overflows_is_a_usage_error() -> None:
    reqs = [TraceRequest(arrival_s=0.0, input_length=1000, output_length=1000, hash_ids=(1,))]
    with pytest.raises(UsageError, match="overflowed"):
        simulate(reqs, _config(1e9, decode_step_s=1e306), PolicyName.LOCAL)


def _trace(tmp_path: Path, **bad: object) -> Path:
    path = tmp_path / "t.jsonl"
    good = {"timestamp": 0, "input_length": 4000, "output_length": 50, "hash_ids": [0]}
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "hash_ids": [1], **bad}) + "\n")
    return path


@pytest.mark.parametrize(
    "bad",
    [
        {"input_length": 10**20},
        {"input_length": 1e300},
        {"output_length": 10**20},
        {"input_length": MAX_TOKENS + 1},
        {"timestamp": 1e300},
        {"timestamp": -1e300},
        {"timestamp": 1e16},
    ],
)
def test_trace_values_out_of_range_are_refused(tmp_path: Path, bad: dict[str, object]) -> None:
    path = _trace(tmp_path, **bad)
    with pytest.raises(UsageError, match=rf"{path}:2:"):
        load_trace(path)


def test_trace_values_at_the_limits_are_accepted(tmp_path: Path) -> None:
    # Epoch milliseconds, and the longest prompt there is.
    path = _trace(tmp_path, timestamp=1.7e12, input_length=MAX_TOKENS)
    assert load_trace(path)[-1].input_length == MAX_TOKENS


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--link", "100bps"], "out of range"),
        (["--link-schedule", "0s:1gbps,10s:1bps"], "out of range"),
        (["--speedup", "1e-300"], "arrivals span"),
        (["--load", "1e-300"], "arrivals span"),
        (["--max-tokens", "1000000000000"], "--max-tokens must be at most"),
        (["--output-tokens", "1000000000000"], "--output-tokens must be at most"),
    ],
)
def test_simulate_refuses_inputs_out_of_range(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", "--requests", "2", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvwire simulate: ") and message in err and "Traceback" not in err


def test_simulate_refuses_a_trace_out_of_range(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _trace(tmp_path, input_length=10**20)
    assert main(["simulate", "--trace", str(path)]) == 2
    assert f"kvwire simulate: {path}:2: input_length" in capsys.readouterr().err


@pytest.mark.parametrize("rate", [1e-308, 5e-324])
def test_a_rate_so_low_the_arrival_times_overflow_is_refused_without_a_warning(rate: float) -> None:
    """numpy's RuntimeWarning (overflow in accumulate) came first; under
    filterwarnings=error it is an exception."""
    from kvwire.scheduler.workload import synthetic_trace

    with pytest.raises(UsageError, match="arrival times overflow"):
        synthetic_trace(np.random.default_rng(0), requests=10, rate_rps=rate)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--local-instances", "100000000"], "--local-instances must be at most 10,000"),
        (["--remote-instances", "10001"], "--remote-instances must be at most 10,000"),
        (["--split-granularity", "gpu", "--gpus-per-instance", "100000"], "--gpus-per-instance must be at most 64"),
        (["--split-granularity", "gpu", "--local-instances", "2000"], "at most 10,000 local GPUs"),
        (["--rate", "1e-308", "--requests", "10"], "arrival times overflow"),
        (["--decode-step", "0"], "--decode-step must be > 0"),  # not ClusterConfig's field names
    ],
)
def test_instance_and_gpu_counts_are_capped(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    """They ran for hours: the optimizer tries every split at every distinct length."""
    assert main(["simulate", "--requests", "2", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvwire simulate: ") and message in err and "Traceback" not in err


def test_cluster_config_caps_its_counts() -> None:
    from kvwire.scheduler.model import MAX_GPUS_PER_INSTANCE, MAX_INSTANCES, MAX_SPLITS

    ok = ClusterConfig(remote_profile=PROFILE, remote_instances=MAX_INSTANCES, local_instances=MAX_INSTANCES)
    assert len(ok.splits()) == MAX_SPLITS
    gpu = ClusterConfig(remote_profile=PROFILE, local_instances=MAX_SPLITS // MAX_GPUS_PER_INSTANCE,
                        gpus_per_instance=MAX_GPUS_PER_INSTANCE, split_granularity="gpu")
    assert len(gpu.splits()) <= MAX_SPLITS
    for bad in ({"remote_instances": MAX_INSTANCES + 1}, {"local_instances": MAX_INSTANCES + 1},
                {"gpus_per_instance": MAX_GPUS_PER_INSTANCE + 1},
                {"local_instances": MAX_SPLITS // 8 + 1, "split_granularity": "gpu"}):
        with pytest.raises(UsageError, match="at most"):
            ClusterConfig(remote_profile=PROFILE, **bad)  # type: ignore[arg-type]
