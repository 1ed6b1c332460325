"""Per-request placement: prefill locally, or offload to a remote prefill cluster.

``decide(request, state)`` is a pure function. The state carries what a serving stack knows
at decision time: the current length threshold and, optionally, the egress that threshold
was planned to use, the live egress bandwidth estimate, the egress demand on the link, and,
per cluster, the longest complete prefix it holds for this request, as the consistency
registry's ``lookup`` returns it (a sequence of ``(block, version)`` pairs,
``block_tokens`` tokens each).

Rules, in order:

1. No usable bandwidth (estimate <= 0, or no remote cluster): local. (A NaN threshold, and
   a bandwidth or demand that is NaN or infinite, are refused by :class:`SchedulerState`.)
2. Egress utilization ``u`` (:attr:`SchedulerState.utilization`) raises the threshold above
   the soft level and refuses offload at the hard level: only the longest prefills, which
   carry the most compute per byte shipped, still go remote when the link fills up.
   Without a plan ``u = demand / bandwidth`` and the levels are ``soft_utilization`` and
   ``hard_utilization``. With a plan (``planned_egress_bps``, the egress the threshold was
   chosen to use, e.g. :attr:`Capacity.egress_demand_bps <kvwire.scheduler.model.Capacity>`)
   the rules guard the plan instead of fighting it: demand above the planned egress is
   load beyond what the plan can serve on any path (moving prefills to a local cluster
   that is overloaded too does not help), so ``u = min(demand, planned) / bandwidth``, and
   the levels start at the plan's own utilization of the bandwidth it was made for. On
   the link the plan expected, ``u`` never exceeds the soft level, whatever the load; it
   does when the link carries less than the plan needs at the current load (a step down,
   a link shared with more traffic than planned).
3. The incremental length is the input minus the prefix hit *where the prefill would run*.
   If it is short locally, run it locally (short prefills cost little and ship nothing).
4. Long locally: offload to the remote cluster with the best prefix hit, if the request's
   incremental length there is still above the threshold. If it is below (that cluster
   holds most of the prefix), offload anyway while bandwidth is plentiful (``u`` at most
   the soft level): the remote cache saves a long local prefill at the price of shipping
   the KV, egress no plan counted on.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

from kvwire.errors import UsageError
from kvwire.scheduler._checks import check_whole

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
    """Prompt tokens: a whole number >= 0 (UsageError otherwise)."""
    output_length: int = 0
    """A whole number >= 0."""

    def __post_init__(self) -> None:
        for name in ("input_length", "output_length"):
            check_whole(name, getattr(self, name), at_least=0)


def _real(value: object) -> bool:
    """A real number (a numpy one too), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_hit(name: str, hit: object) -> None:
    """A prefix hit is a sequence of pairs (what ``decide`` counts): anything else, a
    registry's lookup not awaited (a coroutine), is a UsageError here, not a TypeError
    from ``decide``."""
    if not isinstance(hit, Sequence) or isinstance(hit, (str, bytes)):
        raise UsageError(f"{name} must be a sequence of (block, version) pairs (got {hit!r})")


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterView:
    """A remote prefill cluster as the policy sees it for one request."""

    name: str
    prefix_hit: PrefixHit = ()

    def __post_init__(self) -> None:
        _check_hit("prefix_hit", self.prefix_hit)


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerState:
    """Everything ``decide`` reads besides the request. Rates are bits per second."""

    threshold_tokens: float
    """Incremental lengths above this go remote (the optimizer's or the controller's ``t``;
    ``inf``: none, below 0: every one). NaN is refused (:class:`~kvwire.UsageError`): no
    length compares above it, and every request went remote as ``"remote-prefix"``."""
    bandwidth_bps: float
    """Live estimate of the egress bandwidth the offloads can use: the link's rate now, or
    on a link shared with other traffic the share left to them (what a throughput
    estimator of these transfers measures). 0 or below: none, every request stays local
    (``"no-bandwidth"``). Must be a finite number: NaN or infinity is refused."""
    egress_demand_bps: float = 0.0
    """Egress the offloads ask of the link: the KV of recent offloads per second (e.g. the
    bytes offloaded over the last minute x 8 / 60). Without a plan, other traffic may be
    counted here instead, with ``bandwidth_bps`` the whole link. 0 (the default, and any
    value below 0): unknown, and the utilization rules never fire. Must be a finite
    number: NaN or infinity is refused."""
    local_prefix_hit: PrefixHit = ()
    """The local cluster's longest cached prefix for this request."""
    remotes: tuple[ClusterView, ...] = ()
    block_tokens: int = 512
    soft_utilization: float = 0.7
    """Above this egress utilization the threshold starts to rise (and a request short only
    on a remote cluster stays local); with a plan, above the plan's utilization if higher."""
    hard_utilization: float = 0.97
    """At or above this utilization nothing more is offloaded; with a plan whose
    utilization is above ``soft_utilization``, that utilization plus
    ``hard_utilization - soft_utilization``."""
    threshold_gain: float = 4.0
    """Threshold multiplier at the hard level is ``1 + threshold_gain``."""
    planned_egress_bps: float | None = None
    """Egress the threshold was chosen to use at the load it plans for, e.g. the
    optimizer's :attr:`Capacity.egress_demand_bps <kvwire.scheduler.model.Capacity>` (the
    offloaded share's KV at ``Lambda_max``; for an egress-bound optimum, the whole link).
    ``None`` (the default; also NaN, inf or < 0): no plan, the rules compare the demand
    with the bandwidth alone. Demand above the plan counts as load beyond what the plan can
    serve on any path and is not held against the link (see :attr:`utilization`; 0: a plan
    that ships nothing, the rules never fire), so pass it only when ``threshold_tokens``
    comes from a plan that budgets the link, and count other traffic in ``bandwidth_bps``
    (the share left to the offloads), not in the demand."""
    planned_bandwidth_bps: float | None = None
    """Bandwidth the plan was made for (the optimizer's ``egress_bps``), required with a
    plan: a live estimate below it is the link carrying less than planned. ``None`` (or not
    a finite number > 0): no plan (were the plan taken as made for the live estimate, the
    link could never fall short of it and the rules would never fire)."""

    def __post_init__(self) -> None:
        _check_hit("local_prefix_hit", self.local_prefix_hit)
        if not isinstance(self.remotes, Sequence) or not all(isinstance(c, ClusterView) for c in self.remotes):
            raise UsageError(f"remotes must be a sequence of ClusterView (got {self.remotes!r})")
        if not _real(self.threshold_tokens) or math.isnan(self.threshold_tokens):  # inf and -inf: rules of their own
            raise UsageError(f"threshold_tokens must be a number (got {self.threshold_tokens!r})")
        for name in ("bandwidth_bps", "egress_demand_bps", "soft_utilization", "hard_utilization",
                     "threshold_gain"):
            value = getattr(self, name)
            if not _real(value) or not math.isfinite(value):
                raise UsageError(f"{name} must be a finite number (got {value!r})")
        for name in ("planned_egress_bps", "planned_bandwidth_bps"):
            value = getattr(self, name)
            if value is not None and not _real(value):
                raise UsageError(f"{name} must be a number or None (got {value!r})")
        # The rules read a band: the threshold rises from the soft level to the hard one.
        if not 0 <= self.soft_utilization < self.hard_utilization:
            raise UsageError(
                f"need 0 <= soft_utilization < hard_utilization (got {self.soft_utilization!r} "
                f"and {self.hard_utilization!r})"
            )
        if self.threshold_gain < 0:
            raise UsageError(f"threshold_gain must be >= 0 (got {self.threshold_gain!r})")
        check_whole("block_tokens", self.block_tokens, at_least=1)

    @property
    def has_plan(self) -> bool:
        """A usable plan: ``planned_egress_bps`` finite and >= 0, ``planned_bandwidth_bps``
        finite and > 0."""
        p, bw = self.planned_egress_bps, self.planned_bandwidth_bps
        return (p is not None and math.isfinite(p) and p >= 0
                and bw is not None and math.isfinite(bw) and bw > 0)

    @property
    def planned_utilization(self) -> float:
        """The plan's utilization of the bandwidth it was made for (0 without a plan, or
        with no bandwidth to plan on)."""
        if not self.has_plan:
            return 0.0
        assert self.planned_egress_bps is not None and self.planned_bandwidth_bps is not None
        return self.planned_egress_bps / self.planned_bandwidth_bps

    @property
    def utilization(self) -> float:
        """The egress utilization the rules read: ``demand / bandwidth``, with the demand
        counted up to ``planned_egress_bps`` when there is a plan (``inf``: no bandwidth)."""
        if self.bandwidth_bps <= 0:
            return math.inf
        demand = max(0.0, self.egress_demand_bps)
        if self.has_plan:
            assert self.planned_egress_bps is not None
            demand = min(demand, self.planned_egress_bps)
        return demand / self.bandwidth_bps

    @property
    def levels(self) -> tuple[float, float]:
        """``(soft, hard)``: where the threshold starts to rise and where offload stops.
        ``soft_utilization`` and ``hard_utilization``, moved up to start at the plan's
        utilization when that is higher (the band keeps its width)."""
        soft, hard = self.soft_utilization, self.hard_utilization
        planned = self.planned_utilization
        if planned <= soft:
            return soft, hard
        return planned, planned + (hard - soft)


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
    soft, hard = state.levels
    if u <= soft:
        return state.threshold_tokens
    if u >= hard:
        return math.inf
    return state.threshold_tokens * (1.0 + state.threshold_gain * (u - soft) / (hard - soft))


def decide(request: PolicyRequest, state: SchedulerState) -> Decision:
    """Place one request. Pure: same inputs, same answer."""
    n, bt = request.input_length, state.block_tokens
    local_incr = n - hit_tokens(state.local_prefix_hit, n, bt)
    if state.bandwidth_bps <= 0 or not state.remotes:
        return Local(incremental_tokens=local_incr, reason="no-bandwidth")
    t_eff = effective_threshold(state)
    if math.isinf(t_eff) and t_eff > state.threshold_tokens:  # raised by the utilization, not set so
        return Local(incremental_tokens=local_incr, reason="link-saturated")
    if local_incr <= t_eff:
        return Local(incremental_tokens=local_incr, reason="short")
    # Ties go to the first cluster listed, so callers control preference by order.
    best = min(state.remotes, key=lambda c: n - hit_tokens(c.prefix_hit, n, bt))
    remote_incr = n - hit_tokens(best.prefix_hit, n, bt)
    if remote_incr > t_eff:
        return Offload(cluster=best.name, incremental_tokens=remote_incr, reason="long")
    if state.utilization <= state.levels[0]:
        return Offload(cluster=best.name, incremental_tokens=remote_incr, reason="remote-prefix")
    return Local(incremental_tokens=local_incr, reason="bandwidth-tight")
