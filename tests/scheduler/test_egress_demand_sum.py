"""The egress demand is kept as a running sum of the window's offloads (whole bytes, so it
cannot drift), and gives the results the plain sum over the window gave."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

import kvwire.scheduler.simulator as sim
from kvwire.scheduler.link import LinkSchedule
from kvwire.scheduler.model import ClusterConfig
from kvwire.scheduler.profile import builtin_profile
from kvwire.scheduler.simulator import (
    PolicyName,
    SimState,
    SimulationConfig,
    egress_demand,
    new_state,
    optimizer_for,
    run_events,
    simulate,
)
from kvwire.scheduler.workload import synthetic_trace

HYBRID = ClusterConfig(remote_profile=builtin_profile("hybrid-1t"))


def _plain_demand(state: SimState, placed: list[tuple[float, float]]) -> float:
    """The straightforward computation: every offload of the window summed again, on the
    unrounded estimates."""
    window = state.config.egress_window_s
    if window <= 0:
        return 0.0
    since = state.now - window
    return 8.0 * sum(b for t, b in placed if t > since) / window


@pytest.mark.parametrize(("seed", "window"), [(1, 30.0), (2, 60.0), (3, 7.5)])
def test_running_sum_gives_the_plain_sums_results(
    seed: int, window: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 10 Gbit/s, then 1 Gbit/s for good: the link rules fire, so the demand decides.
    rng = np.random.default_rng(seed)
    trace = synthetic_trace(rng, requests=250, rate_rps=float(rng.uniform(0.8, 2.0)))
    link = LinkSchedule(starts_s=(0.0, float(rng.uniform(20.0, 80.0))), rates_bps=(10e9, 1e9))
    config = SimulationConfig(cluster=HYBRID, link=link, egress_window_s=window,
                              bandwidth_noise=0.2)
    opt = optimizer_for(trace, config)
    policies = (PolicyName.SELECTIVE, PolicyName.ADAPTIVE)
    fast = {p: simulate(trace, config, p, optimizer=opt) for p in policies}
    assert sum(Counter(dict(fast[p].decisions))["link-saturated"] for p in policies) > 0

    # The same runs with the demand recomputed at every arrival from every offload of the
    # window, on the unrounded estimates, as before.
    placed: list[tuple[float, float]] = []
    record = sim._record_offload

    def record_too(state: SimState, nbytes: float) -> None:
        placed.append((state.now, nbytes))
        record(state, nbytes)

    def checked(state: SimState) -> float:
        plain = _plain_demand(state, placed)
        running = egress_demand(state)
        # The running sum is exact: it equals the plain sum of what the window holds.
        held = sum(b for _, b in state.offloaded)
        assert state.offloaded_bytes == held
        assert running == 8.0 * held / window
        assert running == pytest.approx(plain, rel=1e-9, abs=1e-3)
        return plain

    monkeypatch.setattr(sim, "_record_offload", record_too)
    monkeypatch.setattr(sim, "egress_demand", checked)
    for p in policies:
        placed.clear()
        assert simulate(trace, config, p, optimizer=opt) == fast[p]


def test_the_window_keeps_only_its_offloads() -> None:
    trace = synthetic_trace(np.random.default_rng(4), requests=200, rate_rps=2.0)
    config = SimulationConfig(cluster=HYBRID, link=LinkSchedule.constant(10e9), egress_window_s=20.0)
    opt = optimizer_for(trace, config)
    state = run_events(new_state(trace, config, PolicyName.SELECTIVE,
                                 prefill_instances=opt.best.prefill_instances,
                                 threshold_tokens=opt.threshold_tokens))
    assert state.offloaded
    assert state.offloaded_bytes == sum(b for _, b in state.offloaded)
    assert all(isinstance(b, int) for _, b in state.offloaded)
    state.now = max(t for t, _ in state.offloaded) + 20.0
    assert egress_demand(state) == 0.0
    assert not state.offloaded and state.offloaded_bytes == 0
