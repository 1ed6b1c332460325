"""A split with no local prefill instance: refused where a policy needs one, and the
optimizer the policies run at searches only splits that leave one, so the table, the
summary and the JSON give one split, and adaptive on a constant link is selective."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from kvwire.cli import main
from kvwire.errors import UsageError
from kvwire.scheduler.model import ClusterConfig, best_split, capacity
from kvwire.scheduler.profile import builtin_profile
from kvwire.scheduler.simulator import (
    SimulationConfig,
    model_cluster,
    policy_capacity,
    simulate,
    simulate_policies,
)
from kvwire.scheduler.workload import LengthDistribution, synthetic_trace

TRACE = synthetic_trace(np.random.default_rng(0), requests=50, rate_rps=2.0)


@pytest.mark.parametrize("policy", ["local", "selective", "adaptive"])
def test_no_local_prefill_instance_is_refused(policy: str) -> None:
    config = SimulationConfig(cluster=ClusterConfig(remote_profile=builtin_profile("hybrid-1t")),
                              prefill_instances=0)
    with pytest.raises(UsageError, match="bad split"):
        simulate(TRACE, config, policy)
    with pytest.raises(UsageError, match="bad split"):
        simulate_policies(TRACE, config, ["offload-all", policy])


def test_simulate_refuses_prefill_instances_0(capsys: pytest.CaptureFixture[str]) -> None:
    # It ran selective and adaptive at 1/7 while the summary and the JSON said 0/8.
    assert main(["simulate", "--requests", "50", "--prefill-instances", "0", "--json", "-"]) == 2
    captured = capsys.readouterr()
    assert "kvwire simulate: bad split" in captured.err and captured.out == ""


def test_offload_all_alone_runs_without_a_local_prefill_instance(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--requests", "50", "--prefill-instances", "0", "--policy", "offload-all", "--json", "-"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["model"]["prefill_instances"], doc["model"]["decode_instances"]) == (0, 8)
    r = doc["policies"]["offload-all"]
    assert (r["prefill_instances"], r["decode_instances"]) == (0, 8)


def test_split_and_threshold_agree_where_the_bare_model_offloads_everything(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # On 2 local instances the bare model's best is N_p = 0, t = 0 (everything remote).
    # Selective ran at 1/1 with t = 0, adaptive at 1/1 with the optimizer's t for 1/1
    # (8448), while the summary said 0/2.
    assert main(["simulate", "--requests", "50", "--local-instances", "2", "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    model, sel, ada = doc["model"], doc["policies"]["selective"], doc["policies"]["adaptive"]
    assert model["prefill_instances"] == sel["prefill_instances"] == ada["prefill_instances"] == 1
    assert model["threshold_tokens"] == sel["threshold_tokens"] == ada["threshold_tokens"] > 0
    assert {k: v for k, v in sel.items() if k != "retunes"} == {k: v for k, v in ada.items() if k != "retunes"}
    assert doc["policies"]["offload-all"]["prefill_instances"] == 0  # its own split, as documented


def test_local_runs_at_the_models_best_split_for_the_traces_output_lengths(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Short prompts, 128 output tokens: decode is cheap, so the best split with every
    # prefill local gives prefill all but one instance. local ran at the split that is
    # best for ClusterConfig's default of 1,024 output tokens (4/4), where the model gives
    # it 43% less, while selective and the capacities took the trace's mean output.
    reqs = synthetic_trace(np.random.default_rng(0), requests=50, rate_rps=2.0, mu=7.0, output_tokens=128)
    config = SimulationConfig(cluster=ClusterConfig(remote_profile=builtin_profile("hybrid-1t")))
    dist = LengthDistribution.from_trace(reqs)
    model = model_cluster(reqs, config)
    assert model.mean_output_tokens == 128 and config.cluster.mean_output_tokens == 1024
    best = best_split(dist, model, threshold_tokens=math.inf)
    every = [
        capacity(dist, model, threshold_tokens=math.inf, prefill_instances=n).lambda_max_rps
        for n in range(1, config.cluster.local_instances)
    ]
    assert best.lambda_max_rps == max(every)
    cap = policy_capacity("local", reqs, config)
    assert cap.prefill_instances == best.prefill_instances
    assert cap.lambda_max_rps == pytest.approx(best.lambda_max_rps)
    run = simulate(reqs, config, "local")
    assert (run.prefill_instances, run.decode_instances) == (best.prefill_instances, best.decode_instances)
    assert run.capacity_rps == pytest.approx(best.lambda_max_rps)
    # The command too, and --load-baseline local scales to that capacity.
    argv = ["simulate", "--requests", "50", "--mu", "7", "--output-tokens", "128", "--policy", "local",
            "--load", "0.5", "--load-baseline", "local", "--json", "-"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)["policies"]["local"]
    assert doc["prefill_instances"] == best.prefill_instances
    assert doc["utilization"] == pytest.approx(0.5, rel=2e-3)
    assert doc["capacity_rps"] == pytest.approx(best.lambda_max_rps)
