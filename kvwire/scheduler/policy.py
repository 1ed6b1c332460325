"""Per-request placement: prefill locally, or offload to a remote prefill cluster.

``decide(request, state)`` is a pure function. The state carries what a serving stack knows
at decision time: the current length threshold, the live egress bandwidth estimate, the
egress the already-offloaded load needs, and, per cluster, the longest complete prefix it
holds for this request, as the consistency registry's ``lookup`` returns it (a sequence of
``(block, version)`` pairs, ``block_tokens`` tokens each).

Rules, in order:

1. No usable bandwidth (estimate <= 0, or no remote cluster): local.
2. Egress utilization ``u = demand / bandwidth`` raises the threshold above ``soft`` and
   refuses offload at ``u >= hard``: only the longest prefills, which carry the most
   compute per byte shipped, still go remote when the link fills up.
3. The incremental length is the input minus the prefix hit *where the prefill would run*.
   If it is short locally, run it locally (short prefills cost little and ship nothing).
4. Long locally: offload to the remote cluster with the best prefix hit, if the request's
   incremental length there is still above the threshold. If it is below (that cluster
   holds most of the prefix), offload anyway while bandwidth is plentiful (``u < soft``):
   the remote cache saves a long local prefill at the price of shipping the KV.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "ClusterView",
    "Decision",
    "Local",
    "Offload",
    "PolicyRequest",
    "SchedulerState",
    "decide",
    "effective_threshold",
]

PrefixHit = tuple[tuple[int, int], ...]
"""``(block, version)`` pairs of the longest complete cached prefix, in order."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyRequest:
    """What the policy needs to know about a request."""

    request_id: str
    input_length: int
    """Prompt tokens."""
    output_length: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterView:
    """A remote prefill cluster as the policy sees it for one request."""

    name: str
    prefix_hit: PrefixHit = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerState:
    """Everything ``decide`` reads besides the request."""

    threshold_tokens: float
    """Incremental lengths above this go remote (the optimizer's or the controller's ``t``)."""
    bandwidth_bps: float
    """Live estimate of the egress bandwidth available, bits per second."""
    egress_demand_bps: float = 0.0
    """Egress the load already offloaded needs, bits per second."""
    local_prefix_hit: PrefixHit = ()
    """The local cluster's longest cached prefix for this request."""
    remotes: tuple[ClusterView, ...] = ()
    block_tokens: int = 512
    soft_utilization: float = 0.7
    """Above this egress utilization the threshold starts to rise."""
    hard_utilization: float = 0.97
    """At or above this utilization nothing more is offloaded."""
    threshold_gain: float = 4.0
    """Threshold multiplier at ``hard_utilization`` is ``1 + threshold_gain``."""

    @property
    def utilization(self) -> float:
        if self.bandwidth_bps <= 0:
            return math.inf
        return max(0.0, self.egress_demand_bps) / self.bandwidth_bps


@dataclass(frozen=True, slots=True, kw_only=True)
class Local:
    """Prefill on the local cluster."""

    incremental_tokens: int
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Offload:
    """Prefill on the remote cluster ``cluster`` and ship the KV back."""

    cluster: str
    incremental_tokens: int
    reason: str


Decision = Local | Offload


def hit_tokens(hit: Sequence[tuple[int, int]], input_length: int, block_tokens: int) -> int:
    """Tokens of the prompt a prefix hit covers (never more than the prompt)."""
    return min(len(hit) * block_tokens, input_length)


def effective_threshold(state: SchedulerState) -> float:
    """The threshold after the egress-utilization raise (``inf``: offload nothing)."""
    u = state.utilization
    soft, hard = state.soft_utilization, state.hard_utilization
    if u >= hard:
        return math.inf
    if u <= soft:
        return state.threshold_tokens
    return state.threshold_tokens * (1.0 + state.threshold_gain * (u - soft) / (hard - soft))


def decide(request: PolicyRequest, state: SchedulerState) -> Decision:
    """Place one request. Pure: same inputs, same answer."""
    n, bt = request.input_length, state.block_tokens
    local_incr = n - hit_tokens(state.local_prefix_hit, n, bt)
    if state.bandwidth_bps <= 0 or not state.remotes:
        return Local(incremental_tokens=local_incr, reason="no-bandwidth")
    t_eff = effective_threshold(state)
    if math.isinf(t_eff):
        return Local(incremental_tokens=local_incr, reason="link-saturated")
    if local_incr <= t_eff:
        return Local(incremental_tokens=local_incr, reason="short")
    # Ties go to the first cluster listed, so callers control preference by order.
    best = min(state.remotes, key=lambda c: n - hit_tokens(c.prefix_hit, n, bt))
    remote_incr = n - hit_tokens(best.prefix_hit, n, bt)
    if remote_incr > t_eff:
        return Offload(cluster=best.name, incremental_tokens=remote_incr, reason="long")
    if state.utilization < state.soft_utilization:
        return Offload(cluster=best.name, incremental_tokens=remote_incr, reason="remote-prefix")
    return Local(incremental_tokens=local_incr, reason="bandwidth-tight")
