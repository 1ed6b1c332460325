"""SimulationConfig and ClusterConfig take only finite numbers in range, and whole numbers
where the field counts something: NaN passed their checks written ``x < 0`` (a NaN noise
kept every request local, a NaN threshold step or split crashed the optimizer with a
ValueError or a bare StopIteration, a NaN RTT read as an overflowed time)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from kvwire.cli import main
from kvwire.errors import UsageError
from kvwire.scheduler.link import LinkSchedule
from kvwire.scheduler.model import ClusterConfig, optimize
from kvwire.scheduler.profile import ModelProfile
from kvwire.scheduler.simulator import PolicyName, SimulationConfig, simulate
from kvwire.scheduler.workload import LengthDistribution, TraceRequest

REMOTE = ModelProfile(name="r", tokens=(1000, 2000), kv_bytes=(1e6, 2e6), prefill_s=(1.0, 2.0))
CLUSTER = ClusterConfig(remote_profile=REMOTE, remote_instances=1, local_instances=4)
CONFIG = SimulationConfig(cluster=CLUSTER, link=LinkSchedule.constant(8e9))
BAD = [math.nan, math.inf, -math.inf]


@pytest.mark.parametrize("value", BAD)
@pytest.mark.parametrize("name", ["rtt_s", "control_interval_s", "bandwidth_time_constant_s",
                                  "hysteresis", "bandwidth_noise", "threshold_step_tokens",
                                  "egress_window_s", "prefill_instances", "remote_cache_blocks",
                                  "local_cache_blocks"])
def test_simulation_config_refuses_what_is_not_finite(name: str, value: float) -> None:
    with pytest.raises(UsageError, match=name):
        replace(CONFIG, **{name: value})


@pytest.mark.parametrize("value", BAD)
@pytest.mark.parametrize("name", ["egress_bps", "relative_compute", "decode_step_s",
                                  "mean_output_tokens", "remote_instances", "local_instances",
                                  "decode_batch_max", "gpus_per_instance"])
def test_cluster_config_refuses_what_is_not_finite(name: str, value: float) -> None:
    with pytest.raises(UsageError, match=name):
        replace(CLUSTER, **{name: value})


@pytest.mark.parametrize(("name", "value"), [
    ("rtt_s", -0.001), ("control_interval_s", 0.0), ("hysteresis", -1.0),
    ("threshold_step_tokens", 0.0), ("egress_window_s", -1.0), ("bandwidth_time_constant_s", -1.0),
    ("remote_cache_blocks", 1.5), ("local_cache_blocks", -1), ("local_cache_blocks", True),
    ("prefill_instances", -1.0), ("prefill_instances", 1.5), ("prefill_instances", "2"),
])
def test_simulation_config_refuses_what_is_out_of_range(name: str, value: object) -> None:
    with pytest.raises(UsageError, match=name):
        replace(CONFIG, **{name: value})


@pytest.mark.parametrize(("name", "value"), [
    ("remote_instances", 1.5), ("remote_instances", -1), ("local_instances", 0),
    ("local_instances", 2.5), ("decode_batch_max", 0.5), ("gpus_per_instance", 0),
    ("gpus_per_instance", True), ("relative_compute", 0.0), ("decode_step_s", -0.05),
    ("mean_output_tokens", 0.0), ("egress_bps", -1.0), ("decode_step_s", "0.05"),
])
def test_cluster_config_refuses_what_is_out_of_range(name: str, value: object) -> None:
    with pytest.raises(UsageError, match=name):
        replace(CLUSTER, **{name: value})


def test_whole_numbers_written_as_floats_are_taken_as_ints() -> None:
    cl = replace(CLUSTER, remote_instances=2.0, local_instances=4.0)
    assert cl.remote_instances == 2 and isinstance(cl.local_instances, int)
    assert cl.splits() == [0.0, 1.0, 2.0, 3.0]
    cfg = replace(CONFIG, cluster=cl, local_cache_blocks=10.0, prefill_instances=2.0)
    assert cfg.cache_blocks("local") == 10 and isinstance(cfg.cache_blocks("local"), int)


def test_a_split_at_gpu_granularity_is_whole_gpus() -> None:
    gpu = replace(CLUSTER, split_granularity="gpu", gpus_per_instance=8)
    assert replace(CONFIG, cluster=gpu, prefill_instances=2.125).prefill_instances == 2.125
    with pytest.raises(UsageError, match=r"prefill_instances must be a whole number of GPUs"):
        replace(CONFIG, cluster=gpu, prefill_instances=2.1)


def test_a_valid_config_still_runs() -> None:
    trace = [TraceRequest(arrival_s=float(k), input_length=500 + 1000 * (k % 2), output_length=1)
             for k in range(6)]
    r = simulate(trace, replace(CONFIG, prefill_instances=2), PolicyName.SELECTIVE)
    assert r.completed == 6


@pytest.mark.parametrize(("kw", "field"), [
    ({"step_tokens": math.nan}, "step_tokens"),  # ValueError from arange
    ({"prefill_instances": math.nan}, "prefill_instances"),  # a bare StopIteration
])
def test_optimize_refuses_nan(kw: dict[str, float], field: str) -> None:
    with pytest.raises(UsageError, match=field):
        optimize(LengthDistribution([500.0, 1500.0]), CLUSTER, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(("argv", "message"), [
    (["--prefill-instances", "2.5"], "--prefill-instances must be a whole number at split granularity"),
    (["--prefill-instances", "2.3", "--split-granularity", "gpu"],
     "--prefill-instances must be a whole number of GPUs at split granularity 'gpu' (a multiple of 1/8)"),
])
def test_the_command_refuses_a_split_between_steps(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # --prefill-instances 2.5 at instance granularity ran a half-speed third server.
    assert main(["simulate", "--requests", "20", "--policy", "selective", *argv]) == 2
    err = capsys.readouterr().err
    assert "kvwire simulate: " in err and message in err
    assert "Traceback" not in err
