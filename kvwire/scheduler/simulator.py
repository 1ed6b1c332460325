"""Trace-driven discrete-event simulation of local vs offloaded prefill.

Resources: a remote prefill cluster (``N_remote`` instances, one request each, FIFO), a
local PD cluster (``N_p`` prefill instances, FIFO; ``N_d`` decode instances of ``BS_max``
slots each, FIFO for a slot), one link from remote to local (FIFO, full rate per transfer,
rate from a :class:`LinkSchedule`, plus half the RTT of latency), and a prefix cache per
cluster (LRU over 512-token blocks, finite). Decode holds a slot for ``output_length``
steps of ``T_decode``. At GPU split granularity a fractional prefill instance is a server
of proportionally lower speed, and decode slots scale with the decode GPUs.

The simulation is a set of event handlers over one explicit :class:`SimState`. Each
handler takes the state and a request (or schedule) index, changes the state, and returns
the events it causes; :func:`run_events` pops events in time order and calls them. Events
at equal times run completions first (so freed capacity and newly cached prefixes are
visible), then arrivals, then starts:

========================  ==================================================================
``on_link_change``        the link's rate (and the estimate the policy sees) changes
``on_arrival``            the policy places the request; it joins a prefill queue
``on_prefill_start``      the prefix cache *where it runs* is looked up now (a request
                          queued behind the one computing its prefix gets the hit)
``on_prefill_end``        the prefix enters that cluster's cache; local: to decode;
                          remote: to the link queue
``on_transfer_start``     the KV not already held at the decode side goes on the link
``on_transfer_end``       the link is free; the KV lands RTT/2 later
``on_decode_start``       the KV is at the decode side: take a slot (TTFT) or wait
``on_decode_end``         the slot frees; the longest-waiting request takes it
========================  ==================================================================

TTFT is measured from arrival to the moment the request's KV is in a decode slot, which
counts prefill queueing, prefill, transfer and any wait for a decode slot.

Policies: ``local`` (homogeneous PD, nothing offloaded), ``offload-all`` (every prefill
remote), ``selective`` (:func:`decide` with the optimizer's threshold for the trace and the
mean link rate, held fixed), ``adaptive`` (the threshold the optimizer gives for the live
bandwidth estimate, looked up in a :class:`ThresholdTable` and retuned with hysteresis,
see :func:`retune_threshold`). Both pass :func:`decide` the egress their threshold was
planned for (:func:`planned_egress`) and, when ``egress_window_s`` > 0 (off by default),
the egress demand of their recent offloads (:func:`egress_demand`), so its link rules act
on top of either threshold when the link carries less than that plan needs.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from enum import IntEnum, StrEnum
from typing import Any

import numpy as np

from kvwire.errors import UsageError
from kvwire.scheduler._checks import check_number, check_whole
from kvwire.scheduler.cache import PrefixCache
from kvwire.scheduler.link import LinkSchedule
from kvwire.scheduler.model import (
    Capacity,
    ClusterConfig,
    OptimizerResult,
    best_split,
    capacity,
    optimize,
)
from kvwire.scheduler.policy import (
    ClusterView,
    Offload,
    PolicyRequest,
    SchedulerState,
    decide,
)
from kvwire.scheduler.workload import BLOCK_TOKENS, MAX_TOKENS, LengthDistribution, TraceRequest

__all__ = [
    "DEFAULT_CACHE_BLOCKS_PER_INSTANCE",
    "MAX_BANDWIDTH_NOISE",
    "AdaptiveState",
    "EventKind",
    "PolicyName",
    "PolicyResult",
    "SimState",
    "SimulationConfig",
    "ThresholdTable",
    "check_workload",
    "egress_demand",
    "egress_runs",
    "keep_up_ratio",
    "model_cluster",
    "new_state",
    "offered_rate",
    "on_arrival",
    "on_decode_end",
    "on_decode_start",
    "on_link_change",
    "on_prefill_end",
    "on_prefill_start",
    "on_transfer_end",
    "on_transfer_start",
    "optimizer_for",
    "planned_egress",
    "policy_capacity",
    "retune_threshold",
    "run_events",
    "scale_to_load",
    "simulate",
    "simulate_policies",
    "threshold_table",
]

REMOTE = "remote"
DEFAULT_CACHE_BLOCKS_PER_INSTANCE = 8192
"""Prefix-cache blocks per instance when neither the profile nor the config says."""
SATURATION_MARGIN = 0.95
"""A policy is *saturated* when its first tokens come at fewer than this share of the rate
the requests arrive (:attr:`PolicyResult.keep_up`)."""
MAX_ARRIVAL_SPAN_S = 1e9
"""Longest arrival window the simulator takes (last arrival minus first): 10^9 s, about 31.7
years of simulated time."""
MAX_BANDWIDTH_NOISE = 100.0
"""Largest ``bandwidth_noise`` (relative standard deviation of ``adaptive``'s estimate):
far beyond any real estimator, and small enough that the log-normal estimate of a
10 kbit/s link never underflows to 0 (at a noise of 10^300 its median would be 10^-300
of the rate)."""
MIN_ARRIVAL_WINDOW_S = 1.0
"""Egress is reported in 1-second averages over the arrival window; a window shorter than
one of them is too short to say: its egress mean and P99, ``saturated`` and
``throughput_rps`` are n/a."""


class PolicyName(StrEnum):
    LOCAL = "local"
    OFFLOAD_ALL = "offload-all"
    SELECTIVE = "selective"
    ADAPTIVE = "adaptive"


@dataclass(frozen=True, slots=True, kw_only=True)
class SimulationConfig:
    """The simulated system. The model parts (profiles, instance counts, decode, split
    granularity) come from ``cluster``; its ``egress_bps`` is ignored in favour of ``link``."""

    cluster: ClusterConfig
    link: LinkSchedule = field(default_factory=LinkSchedule)
    rtt_s: float = 0.01
    """Round-trip time between the clusters; a transfer lands half of it after it leaves."""
    prefill_instances: float | None = None
    """``N_p``; ``None``: each policy uses the model's best split for its own threshold."""
    remote_cache_blocks: int | None = None
    """Remote prefix cache, blocks; ``None``: the profile's ``cache_blocks`` per instance
    (or :data:`DEFAULT_CACHE_BLOCKS_PER_INSTANCE`) times the remote instances."""
    local_cache_blocks: int | None = None
    """Local prefix cache, blocks; ``None``: as for the remote, times the local instances."""
    control_interval_s: float = 1.0
    """How often ``adaptive`` samples the bandwidth estimate."""
    bandwidth_time_constant_s: float = 60.0
    """Time constant of ``adaptive``'s moving average of the bandwidth estimate: it
    retunes for changes that last about this long, and leaves shorter dips to the link's
    queue, which drains once the rate is back (0: no smoothing)."""
    hysteresis: float = 0.25
    """``adaptive`` retunes only when its smoothed estimate leaves ``[B / (1 + h), B (1 + h)]``
    around the bandwidth ``B`` its threshold was chosen for."""
    bandwidth_noise: float = 0.0
    """Relative standard deviation of ``adaptive``'s bandwidth estimate (seeded; log-normal
    with mean the link's rate, never 0 on a link that carries anything). ``selective``
    sees the link's rate."""
    threshold_step_tokens: float = 256.0
    """Grid step of the optimizer that sets the thresholds."""
    egress_window_s: float = 0.0
    """Window of the egress demand ``selective`` and ``adaptive`` pass to :func:`decide`
    (:func:`egress_demand`, the KV offloaded per second over it). 0 (the default): no
    demand, decide's utilization rules never fire and the thresholds act alone. > 0 (60 s
    is a sensible value): when the link carries less than the threshold's plan needs at
    the current load (:func:`planned_egress`), decide raises the threshold, then refuses to
    offload. Off by default because a dip the link's queue can absorb is not told apart
    from a lasting step down (docs/scheduler.md, "When the link changes")."""

    def __post_init__(self) -> None:
        # Every number finite and in range, naming the field.
        for name in ("rtt_s", "hysteresis", "bandwidth_time_constant_s", "egress_window_s",
                     "bandwidth_noise"):
            check_number(name, getattr(self, name), at_least=0.0)
        for name in ("control_interval_s", "threshold_step_tokens"):
            check_number(name, getattr(self, name), above=0.0)
        if self.bandwidth_noise > MAX_BANDWIDTH_NOISE:
            raise UsageError(
                f"bandwidth_noise must be at most {MAX_BANDWIDTH_NOISE:g} (got {self.bandwidth_noise!r})"
            )
        for name in ("remote_cache_blocks", "local_cache_blocks"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, check_whole(name, getattr(self, name), at_least=0))
        if self.prefill_instances is not None:
            n_p = check_number("prefill_instances", self.prefill_instances, at_least=0.0)
            step = self.cluster.split_step
            if abs(n_p / step - round(n_p / step)) > 1e-9:
                unit = (
                    f"of GPUs at split granularity 'gpu' (a multiple of 1/{self.cluster.gpus_per_instance})"
                    if self.cluster.split_granularity == "gpu"
                    else "at split granularity 'instance'"
                )
                raise UsageError(
                    f"prefill_instances must be a whole number {unit} (got {self.prefill_instances!r})"
                )

    def cache_blocks(self, where: str) -> int:
        """Prefix-cache capacity of the ``"remote"`` or ``"local"`` cluster, blocks."""
        cl = self.cluster
        if where == REMOTE:
            given, prof, n = self.remote_cache_blocks, cl.remote_profile, cl.remote_instances
        else:
            given, prof, n = self.local_cache_blocks, cl.local_prefill_profile, cl.local_instances
        if given is not None:
            return given
        per = prof.cache_blocks if prof.cache_blocks is not None else DEFAULT_CACHE_BLOCKS_PER_INSTANCE
        return per * n


# -- the adaptive controller ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ThresholdTable:
    """The optimizer's threshold as a function of egress bandwidth (at a fixed split),
    made monotone non-increasing: less bandwidth never lowers the threshold, because only
    the longest prefills, which carry the most compute per byte shipped, should still go
    remote when bandwidth falls."""

    bandwidths_bps: tuple[float, ...]
    """Ascending."""
    thresholds: tuple[float, ...]
    """Non-increasing, one per bandwidth."""

    def threshold_at(self, bandwidth_bps: float) -> float:
        """The threshold for the largest tabulated bandwidth not above ``bandwidth_bps``
        (below the table: its first, highest threshold)."""
        i = bisect.bisect_right(self.bandwidths_bps, bandwidth_bps) - 1
        return self.thresholds[max(i, 0)]

    def smallest_positive(self) -> float:
        """The lowest threshold above 0 the table holds (the optimizer's threshold at the
        fastest tabulated bandwidth that does not offload everything), or 1 token when
        every threshold is 0."""
        return min((t for t in self.thresholds if t > 0), default=1.0)


def threshold_table(
    dist: LengthDistribution,
    cluster: ClusterConfig,
    *,
    prefill_instances: float,
    step_tokens: float = 256.0,
    bandwidths_bps: Sequence[float] | None = None,
    include_bps: Sequence[float] = (),
) -> ThresholdTable:
    """Tabulate :func:`optimize`'s threshold over bandwidth (default 0.1 Gbit/s to
    1 Tbit/s, 8 points a decade) at split ``prefill_instances``. ``include_bps``: more
    bandwidths to tabulate exactly (``adaptive`` adds the link's nominal rate, so its
    threshold there is the optimizer's, not the one of the grid point below it)."""
    base = bandwidths_bps if bandwidths_bps is not None else (10 ** (8 + i / 8) for i in range(33))
    grid = sorted({float(b) for b in (*base, *include_bps)})
    if not grid or grid[0] <= 0:
        raise UsageError("threshold table bandwidths must be > 0")
    raw = [
        optimize(
            dist,
            cluster.with_egress(b),
            step_tokens=step_tokens,
            prefill_instances=prefill_instances,
        ).threshold_tokens
        for b in grid
    ]
    mono = list(raw)
    for i in range(len(mono) - 2, -1, -1):
        mono[i] = max(mono[i], mono[i + 1])
    return ThresholdTable(tuple(float(b) for b in grid), tuple(mono))


@dataclass(frozen=True, slots=True, kw_only=True)
class AdaptiveState:
    """``adaptive``'s controller: its threshold and the bandwidths that bound it."""

    threshold_tokens: float
    nominal_bps: float
    """The link's provisioned rate (the first rate of the schedule)."""
    tuned_bps: float
    """Bandwidth the current bounds were chosen for (moves only past the hysteresis band)."""
    estimate_bps: float
    """Smoothed bandwidth estimate."""
    retunes: int = 0
    """How often the threshold moved."""

    def bounds(self, table: ThresholdTable) -> tuple[float, float]:
        """The optimizer's thresholds at the nominal and the tuned bandwidth, low first."""
        a, b = table.threshold_at(self.nominal_bps), table.threshold_at(self.tuned_bps)
        return min(a, b), max(a, b)


def retune_threshold(
    state: AdaptiveState,
    sample_bps: float,
    table: ThresholdTable,
    *,
    local_backlog_s: float = 0.0,
    remote_backlog_s: float = 0.0,
    smoothing: float = 0.5,
    hysteresis: float = 0.25,
    factor: float = 1.25,
    slack_s: float = 1.0,
) -> AdaptiveState:
    """One control step of ``adaptive``.

    1. Fold the bandwidth sample into a moving average; if it has left the band
       ``[B / (1 + hysteresis), B (1 + hysteresis)]`` around the bandwidth ``B`` the bounds
       were chosen for, re-choose them. Inside the band nothing moves, so estimator noise
       cannot make offloading flap.
    2. The bounds are the optimizer's thresholds at the nominal and at the estimated
       bandwidth: when bandwidth falls the upper bound rises (only the longest prefills,
       which carry the most compute per byte shipped, keep going remote), never below the
       nominal one.
    3. Within the bounds the threshold moves by ``factor`` per step toward the path with
       the smaller backlog (seconds of queued work per instance; the remote path counts
       the link's queue at the estimated rate), and stays put while they are within
       ``slack_s`` and 25% of each other. A link dip that the link's queue can absorb and
       drain later does not push work onto a busy local cluster; a link that stays slow
       does, up to the optimizer's threshold for it. When the bounds move, the threshold
       is clamped into them. A raise from below the table's smallest non-zero threshold
       (from 0, "offload everything") goes straight to that threshold: x1.25 steps from
       0 (or from 1 token) would take dozens of steps to matter.
    """
    est = sample_bps if state.estimate_bps <= 0 else (
        (1.0 - smoothing) * state.estimate_bps + smoothing * sample_bps
    )
    tuned = state.tuned_bps
    if not tuned / (1.0 + hysteresis) <= est <= tuned * (1.0 + hysteresis):
        tuned = est
    moved = replace(state, estimate_bps=est, tuned_bps=tuned)
    lo, hi = moved.bounds(table)
    t = state.threshold_tokens
    if remote_backlog_s > 1.25 * local_backlog_s + slack_s:
        # Multiplying cannot leave 0, and from 1 token it took 45 steps (45 s of control
        # at a step a second) to reach 20,000 tokens. Between 0 and the table's smallest
        # non-zero threshold lies no threshold the optimizer picks at any bandwidth (it is
        # one of its grid points, a grid step or more), so a raise from below it lands on
        # it (at most hi whenever hi > 0; the clamp below keeps t in [lo, hi]), and steps
        # of ``factor`` go on from there. From it or above, this is the plain t * factor.
        t = max(t * factor, table.smallest_positive())
    elif local_backlog_s > 1.25 * remote_backlog_s + slack_s:
        t = t / factor
    t = min(max(t, lo), hi)
    if t != state.threshold_tokens:
        return replace(moved, threshold_tokens=t, retunes=state.retunes + 1)
    return moved


# -- state and events ------------------------------------------------------------------------


class EventKind(IntEnum):
    """Order of events at equal times: completions, then arrivals, then starts."""

    LINK_CHANGE = 0
    DECODE_END = 1
    TRANSFER_END = 2
    PREFILL_END = 3
    DECODE_START = 4
    ARRIVAL = 5
    PREFILL_START = 6
    TRANSFER_START = 7


Event = tuple[float, EventKind, int]
"""``(time, kind, index)``: a request index, or a link-schedule index for LINK_CHANGE."""


@dataclass(slots=True, kw_only=True)
class SimState:
    """Everything the simulation knows at ``now``. Per-request lists are indexed like
    ``requests``."""

    requests: Sequence[TraceRequest]
    config: SimulationConfig
    policy: PolicyName
    now: float = 0.0
    # the model's parts
    threshold_tokens: float = math.inf
    """``selective``'s fixed threshold (``adaptive``: its controller's)."""
    table: ThresholdTable | None = None
    adaptive: AdaptiveState | None = None
    next_control_s: float = 0.0
    """When ``adaptive``'s next control step is due (the first: at the first arrival)."""
    last_control_s: float = 0.0
    """When ``adaptive``'s estimate was last updated (its starting value: at the first
    arrival, whatever the trace's clock)."""
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))
    # resources
    prefill_instances: float = 0.0
    """``N_p`` (the local prefill servers' speeds add up to it)."""
    local_free: list[float] = field(default_factory=list)
    """Speeds of the idle local prefill servers (1.0 a whole instance)."""
    remote_free: int = 0
    slots_free: int = 0
    link_busy: bool = False
    link_busy_until: float = -math.inf
    """When the transfer on the link ends (-infinity: none yet, whatever the clock)."""
    link_rate_bps: float = 0.0
    local_queued_s: float = 0.0
    """Estimated prefill seconds waiting in the local queue (for ``adaptive``)."""
    remote_queued_s: float = 0.0
    link_queued_bytes: float = 0.0
    """Estimated bytes waiting for the link."""
    offloaded: deque[tuple[float, int]] = field(default_factory=deque)
    """``(time, estimated KV bytes)`` of the offloads of the last ``egress_window_s``
    (whole bytes, so that their running sum is exact)."""
    offloaded_bytes: int = 0
    """The bytes of ``offloaded``, kept as offloads join and leave it: the egress demand
    costs the same whatever the window holds."""
    local_pending: dict[int, int] = field(default_factory=dict)
    """Blocks of the prefills queued or running locally (block -> count)."""
    remote_pending: dict[int, int] = field(default_factory=dict)
    local_cache: PrefixCache = field(default_factory=lambda: PrefixCache(0))
    remote_cache: PrefixCache = field(default_factory=lambda: PrefixCache(0))
    local_queue: deque[int] = field(default_factory=deque)
    remote_queue: deque[int] = field(default_factory=deque)
    link_queue: deque[int] = field(default_factory=deque)
    decode_queue: deque[int] = field(default_factory=deque)
    # per request
    remote: list[bool] = field(default_factory=list)
    speed: list[float] = field(default_factory=list)
    hit_tokens: list[int] = field(default_factory=list)
    service_s: list[float] = field(default_factory=list)
    ship_bytes: list[float] = field(default_factory=list)
    transfer_s: list[float] = field(default_factory=list)
    """How long each request's KV took on the link (0: none shipped)."""
    queued_est: list[float] = field(default_factory=list)
    """Estimated prefill seconds (while queued) or bytes to ship (while waiting for the link)."""
    ttft_s: list[float] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    """:func:`decide`'s reason for each request (``""``: the policy does not ask it)."""
    # records
    transfers: list[tuple[float, float, float]] = field(default_factory=list)
    """``(start, end, bytes)`` of every transfer."""
    thresholds_seen: list[float] = field(default_factory=list)
    finish_order: list[int] = field(default_factory=list)
    first_finish_s: float = math.nan
    last_finish_s: float = math.nan
    # the plan the thresholds come from
    plan_lengths: LengthDistribution | None = None
    """Incremental lengths the optimizer planned with (``None``: no plan is passed)."""
    plan_cluster: ClusterConfig | None = None
    """The model's cluster, its ``egress_bps`` the link's mean rate (:func:`model_cluster`)."""
    plans: dict[tuple[float, float], float] = field(default_factory=dict)
    """Planned egress by ``(threshold, bandwidth)``, computed once each."""


def new_state(
    requests: Sequence[TraceRequest],
    config: SimulationConfig,
    policy: PolicyName,
    *,
    prefill_instances: float,
    threshold_tokens: float = math.inf,
    table: ThresholdTable | None = None,
    seed: int = 0,
    plan_lengths: LengthDistribution | None = None,
) -> SimState:
    """An idle system (empty queues and caches, every server free) at the first arrival,
    whatever the trace's clock: arrival times may lie below 0. The plan
    :func:`planned_egress` reads is the model's for these requests (``plan_lengths``: their
    incremental lengths when already computed)."""
    cl = config.cluster
    n_p = prefill_instances
    n_d = cl.local_instances - n_p
    whole = math.floor(n_p + 1e-9)
    frac = n_p - whole
    n = len(requests)
    state = SimState(
        requests=requests,
        config=config,
        policy=policy,
        threshold_tokens=threshold_tokens,
        table=table,
        rng=np.random.default_rng(seed),
        prefill_instances=n_p,
        local_free=[1.0] * whole + ([frac] if frac > 1e-9 else []),
        remote_free=cl.remote_instances,
        slots_free=max(1, math.floor(n_d * cl.decode_batch_max + 1e-9)),
        link_rate_bps=config.link.rate_at(0.0),
        local_cache=PrefixCache(config.cache_blocks("local")),
        remote_cache=PrefixCache(config.cache_blocks(REMOTE)),
        remote=[False] * n,
        speed=[1.0] * n,
        hit_tokens=[0] * n,
        service_s=[0.0] * n,
        ship_bytes=[0.0] * n,
        transfer_s=[0.0] * n,
        queued_est=[0.0] * n,
        ttft_s=[math.nan] * n,
        reasons=[""] * n,
    )
    if requests:
        # The controller starts with the arrivals, not at time 0: arrival times may lie
        # below 0, and a controller waiting for 0 would not step before then.
        state.now = state.next_control_s = state.last_control_s = min(
            r.arrival_s for r in requests
        )
        state.plan_lengths = (
            plan_lengths if plan_lengths is not None else LengthDistribution.from_trace(requests)
        )
        state.plan_cluster = model_cluster(requests, config)
    if policy is PolicyName.ADAPTIVE:
        bw = config.link.rate_at(0.0)
        start = threshold_tokens
        if table is not None:
            start = table.threshold_at(bw)
        state.adaptive = AdaptiveState(
            threshold_tokens=start, nominal_bps=bw, tuned_bps=bw, estimate_bps=bw
        )
    return state


def _est_prefill_s(state: SimState, i: int, remote: bool) -> float:
    r = state.requests[i]
    cl = state.config.cluster
    cache, prof = (
        (state.remote_cache, cl.remote_profile) if remote else (state.local_cache, cl.local_prefill_profile)
    )
    hit = min(cache.peek(r.hash_ids) * BLOCK_TOKENS, r.input_length)
    return prof.prefill_seconds(max(r.input_length - hit, 1))


def _ship_bytes(state: SimState, i: int) -> float:
    r = state.requests[i]
    prof = state.config.cluster.remote_profile
    held = min(state.local_cache.peek(r.hash_ids) * BLOCK_TOKENS, r.input_length)
    per_token_held = prof.kv_size_bytes(held) - prof.kv_size_bytes(0) if held else 0.0
    return max(0.0, prof.kv_size_bytes(r.input_length) - per_token_held)


def backlogs(state: SimState, bandwidth_bps: float) -> tuple[float, float]:
    """``(local, remote)`` seconds of queued work per instance; the remote path adds the
    link's queue and the rest of the transfer in flight at ``bandwidth_bps``."""
    cl = state.config.cluster
    local = state.local_queued_s / max(state.prefill_instances, 1e-9)
    link = max(0.0, state.link_busy_until - state.now)
    if bandwidth_bps > 0:
        link += 8.0 * state.link_queued_bytes / bandwidth_bps
    else:
        link = math.inf
    remote = state.remote_queued_s / max(cl.remote_instances, 1) + link
    return local, remote


def egress_demand(state: SimState) -> float:
    """The egress the load already offloaded needs, bits per second, as :func:`decide`
    reads it (``egress_demand_bps``): the KV bytes of the offloads placed in the last
    ``egress_window_s`` seconds of simulated time (each estimated when it was placed),
    over that window. Deterministic. A window much longer than one transfer keeps a
    single large KV from reading as a full link. It forgets (drops from
    ``state.offloaded``) the offloads older than the window as of ``state.now``: it reads
    ``now`` moving forward only, as the simulator's clock does."""
    window = state.config.egress_window_s
    if window <= 0:
        return 0.0
    _expire_offloads(state)
    return 8.0 * state.offloaded_bytes / window


def _expire_offloads(state: SimState) -> None:
    """Drop the offloads placed ``egress_window_s`` or more before ``now``."""
    since = state.now - state.config.egress_window_s
    while state.offloaded and state.offloaded[0][0] <= since:
        state.offloaded_bytes -= state.offloaded.popleft()[1]


def _record_offload(state: SimState, nbytes: float) -> None:
    """An offload placed now, of ``nbytes`` estimated KV (rounded to whole bytes); not
    kept without an egress window (nothing reads it)."""
    if state.config.egress_window_s <= 0:
        return
    b = round(nbytes)
    state.offloaded.append((state.now, b))
    state.offloaded_bytes += b


def planned_egress(state: SimState, threshold_tokens: float) -> tuple[float, float] | None:
    """``(egress, bandwidth)`` the policy's threshold was planned for, as :func:`decide`
    reads them (``planned_egress_bps``, ``planned_bandwidth_bps``): the model's egress
    demand at ``Lambda_max`` (:attr:`Capacity.egress_demand_bps`) for this threshold and
    split, at the bandwidth the threshold was chosen for: ``selective``'s the link's mean
    rate over the arrivals (its threshold is the optimizer's for it), ``adaptive``'s the
    estimate its controller last tuned its bounds for. ``None``: no plan (no model, or an
    unbounded egress demand)."""
    if state.plan_lengths is None or state.plan_cluster is None:
        return None
    bw = state.adaptive.tuned_bps if state.adaptive is not None else state.plan_cluster.egress_bps
    key = (threshold_tokens, bw)
    if key not in state.plans:
        state.plans[key] = capacity(
            state.plan_lengths,
            state.plan_cluster.with_egress(bw),
            threshold_tokens=threshold_tokens,
            prefill_instances=state.prefill_instances,
        ).egress_demand_bps
    planned = state.plans[key]
    return (planned, bw) if math.isfinite(planned) else None


def _dispatch_prefills(state: SimState) -> list[Event]:
    """Give queued prefills to idle servers (FIFO); the fastest idle local server first."""
    out: list[Event] = []
    while state.local_free and state.local_queue:
        i = state.local_queue.popleft()
        state.local_free.sort()
        state.speed[i] = state.local_free.pop()
        out.append((state.now, EventKind.PREFILL_START, i))
    while state.remote_free and state.remote_queue:
        i = state.remote_queue.popleft()
        state.remote_free -= 1
        out.append((state.now, EventKind.PREFILL_START, i))
    return out


def _dispatch_link(state: SimState) -> list[Event]:
    if state.link_busy or not state.link_queue:
        return []
    state.link_busy = True
    return [(state.now, EventKind.TRANSFER_START, state.link_queue.popleft())]


def _bandwidth_sample(state: SimState) -> float:
    """``adaptive``'s live bandwidth estimate: the link's rate times log-normal noise of
    mean 1 and relative standard deviation ``bandwidth_noise`` (log-space variance
    ``log(1 + noise^2)``), so the estimate is right on average and never 0 on a link that
    carries anything. (Gaussian noise clamped at 0 read an unchanged link as down for a
    share ``Phi(-1 / noise)`` of the samples, 16% at noise 1.)"""
    bw = state.link_rate_bps
    noise = state.config.bandwidth_noise
    if noise:
        var = math.log1p(noise * noise)
        bw *= math.exp(math.sqrt(var) * float(state.rng.standard_normal()) - var / 2.0)
    return bw


def _planned_hit(cache: PrefixCache, pending: dict[int, int], hash_ids: Sequence[int]) -> int:
    """Leading blocks a cluster holds or is computing (queued or running prefills): what
    a prefill placed there now can expect to find when it starts, behind them."""
    hit = 0
    for h in hash_ids:
        if h not in cache and not pending.get(h):
            break
        hit += 1
    return hit


def _pending(state: SimState, i: int, add: int) -> None:
    pending = state.remote_pending if state.remote[i] else state.local_pending
    for h in state.requests[i].hash_ids:
        n = pending.get(h, 0) + add
        if n:
            pending[h] = n
        else:
            pending.pop(h, None)


def _smoothing(elapsed_s: float, time_constant_s: float) -> float:
    """Weight of a new bandwidth sample in an exponential moving average with time
    constant ``time_constant_s``, ``elapsed_s`` after the previous sample: control steps
    run only at arrivals, so their spacing varies and the weight must follow it."""
    if time_constant_s <= 0:
        return 1.0
    return -math.expm1(-max(elapsed_s, 0.0) / time_constant_s)


def _place(state: SimState, i: int) -> bool:
    """The policy's decision for request ``i`` at ``now`` (True: offload)."""
    if state.policy is PolicyName.LOCAL:
        return False
    if state.policy is PolicyName.OFFLOAD_ALL:
        return True
    r = state.requests[i]
    # The noise is adaptive's estimate of the link; selective's threshold is fixed in
    # advance, and its decisions see the link's rate.
    bw = _bandwidth_sample(state) if state.adaptive is not None else state.link_rate_bps
    threshold = state.threshold_tokens
    if state.adaptive is not None:
        if state.now >= state.next_control_s and state.table is not None:
            local_s, remote_s = backlogs(state, state.adaptive.estimate_bps or bw)
            state.adaptive = retune_threshold(
                state.adaptive,
                bw,
                state.table,
                local_backlog_s=local_s,
                remote_backlog_s=remote_s,
                smoothing=_smoothing(
                    state.now - state.last_control_s, state.config.bandwidth_time_constant_s
                ),
                hysteresis=state.config.hysteresis,
            )
            state.last_control_s = state.now
            state.next_control_s = state.now + state.config.control_interval_s
        threshold = state.adaptive.threshold_tokens
    state.thresholds_seen.append(threshold)
    # The scheduler sees what each cache holds now; the prefill looks again when it starts.
    local_hit = _planned_hit(state.local_cache, state.local_pending, r.hash_ids)
    remote_hit = _planned_hit(state.remote_cache, state.remote_pending, r.hash_ids)
    demand = egress_demand(state)
    # No demand, no rule reads the plan: skip computing it.
    plan = planned_egress(state, threshold) if demand > 0 else None
    decision = decide(
        PolicyRequest(request_id=str(i), input_length=r.input_length, output_length=r.output_length),
        SchedulerState(
            threshold_tokens=threshold,
            bandwidth_bps=bw,
            egress_demand_bps=demand,
            planned_egress_bps=plan[0] if plan is not None else None,
            planned_bandwidth_bps=plan[1] if plan is not None else None,
            local_prefix_hit=tuple((h, 0) for h in r.hash_ids[:local_hit]),
            remotes=(
                ClusterView(name=REMOTE, prefix_hit=tuple((h, 0) for h in r.hash_ids[:remote_hit])),
            ),
            block_tokens=BLOCK_TOKENS,
        ),
    )
    state.reasons[i] = decision.reason
    if isinstance(decision, Offload):
        _record_offload(state, _ship_bytes(state, i))
        return True
    return False


# -- the handlers ---------------------------------------------------------------------------


def on_arrival(state: SimState, i: int) -> list[Event]:
    """Place request ``i`` and queue it for a prefill."""
    remote = state.remote[i] = _place(state, i)
    _pending(state, i, +1)
    state.queued_est[i] = _est_prefill_s(state, i, remote)
    if remote:
        state.remote_queue.append(i)
        state.remote_queued_s += state.queued_est[i]
    else:
        state.local_queue.append(i)
        state.local_queued_s += state.queued_est[i]
    return _dispatch_prefills(state)


def on_prefill_start(state: SimState, i: int) -> list[Event]:
    """Look up the prefix cache where the prefill runs, now, and compute the rest."""
    r = state.requests[i]
    cl = state.config.cluster
    if state.remote[i]:
        cache, profile, speed = state.remote_cache, cl.remote_profile, 1.0
        state.remote_queued_s -= state.queued_est[i]
    else:
        cache, profile, speed = state.local_cache, cl.local_prefill_profile, state.speed[i]
        state.local_queued_s -= state.queued_est[i]
    hit = min(cache.lookup(r.hash_ids) * BLOCK_TOKENS, r.input_length)
    state.hit_tokens[i] = hit
    state.service_s[i] = profile.prefill_seconds(max(r.input_length - hit, 1)) / speed
    return [(state.now + state.service_s[i], EventKind.PREFILL_END, i)]


def on_prefill_end(state: SimState, i: int) -> list[Event]:
    """Free the server; the computed prefix enters that cluster's cache."""
    r = state.requests[i]
    _pending(state, i, -1)
    out: list[Event]
    if state.remote[i]:
        state.remote_free += 1
        state.remote_cache.insert(r.hash_ids)
        state.queued_est[i] = _ship_bytes(state, i)
        state.link_queued_bytes += state.queued_est[i]
        state.link_queue.append(i)
        out = _dispatch_link(state)
    else:
        state.local_free.append(state.speed[i])
        state.local_cache.insert(r.hash_ids)
        out = [(state.now, EventKind.DECODE_START, i)]
    return out + _dispatch_prefills(state)


def on_transfer_start(state: SimState, i: int) -> list[Event]:
    """Ship the KV the decode side does not hold yet (its cached prefix's per-token KV
    stays; a hybrid model's fixed recurrent state always moves)."""
    nbytes = _ship_bytes(state, i)
    state.link_queued_bytes -= state.queued_est[i]
    state.ship_bytes[i] = nbytes
    state.link_busy = True
    end = state.config.link.finish_time(state.now, nbytes)
    state.link_busy_until = end
    state.transfer_s[i] = end - state.now
    state.transfers.append((state.now, end, nbytes))
    return [(end, EventKind.TRANSFER_END, i)]


def on_transfer_end(state: SimState, i: int) -> list[Event]:
    """The last byte has left: the link takes the next transfer; the KV lands RTT/2 later."""
    state.link_busy = False
    return [(state.now + state.config.rtt_s / 2.0, EventKind.DECODE_START, i), *_dispatch_link(state)]


def _take_slot(state: SimState, i: int) -> list[Event]:
    r = state.requests[i]
    state.slots_free -= 1
    state.ttft_s[i] = state.now - r.arrival_s
    return [(state.now + r.output_length * state.config.cluster.decode_step_s, EventKind.DECODE_END, i)]


def on_decode_start(state: SimState, i: int) -> list[Event]:
    """The KV is at the decode side (a landed transfer's prefix is now cached there):
    take a decode slot, or wait for one."""
    if state.remote[i]:
        state.local_cache.insert(state.requests[i].hash_ids)
    if state.slots_free > 0:
        return _take_slot(state, i)
    state.decode_queue.append(i)
    return []


def on_decode_end(state: SimState, i: int) -> list[Event]:
    """The request completes; the longest-waiting one takes its slot."""
    state.slots_free += 1
    if not state.finish_order:
        state.first_finish_s = state.now
    state.finish_order.append(i)
    state.last_finish_s = state.now
    if state.decode_queue:
        return _take_slot(state, state.decode_queue.popleft())
    return []


def on_link_change(state: SimState, k: int) -> list[Event]:
    """The link's rate changes to the schedule's ``k``-th (transfers in flight already
    account for it: their end is integrated over the schedule)."""
    state.link_rate_bps = state.config.link.rates_bps[k]
    return []


HANDLERS: dict[EventKind, Callable[[SimState, int], list[Event]]] = {
    EventKind.ARRIVAL: on_arrival,
    EventKind.PREFILL_START: on_prefill_start,
    EventKind.PREFILL_END: on_prefill_end,
    EventKind.TRANSFER_START: on_transfer_start,
    EventKind.TRANSFER_END: on_transfer_end,
    EventKind.DECODE_START: on_decode_start,
    EventKind.DECODE_END: on_decode_end,
    EventKind.LINK_CHANGE: on_link_change,
}


def run_events(state: SimState) -> SimState:
    """Run the simulation to the end: every arrival and link change is an initial event;
    handlers add the rest. A time that overflows (inputs far out of range: a decode step
    or an RTT of 10^300 s) is a :class:`UsageError`, not a run that never ends."""
    heap: list[tuple[float, int, int, int]] = []
    seq = 0

    def push(ev: Event) -> None:
        nonlocal seq
        heapq.heappush(heap, (ev[0], int(ev[1]), seq, ev[2]))
        seq += 1

    for i, r in enumerate(state.requests):
        push((r.arrival_s, EventKind.ARRIVAL, i))
    for k, start in enumerate(state.config.link.starts_s[1:], 1):
        push((start, EventKind.LINK_CHANGE, k))
    while heap:
        t, kind, _, idx = heapq.heappop(heap)
        if not math.isfinite(t):
            raise UsageError(
                "the simulated time overflowed: a decode step, RTT, profile latency or "
                "link rate far out of range"
            )
        state.now = t
        for ev in HANDLERS[EventKind(kind)](state, idx):
            push(ev)
    return state


# -- the model's side ------------------------------------------------------------------------


def check_workload(requests: Sequence[TraceRequest]) -> None:
    """Raise :class:`UsageError` unless ``requests`` can be simulated: at least one,
    arrival times finite and spanning at most :data:`MAX_ARRIVAL_SPAN_S`, lengths between
    0 and :data:`~kvwire.scheduler.workload.MAX_TOKENS`."""
    if not requests:
        raise UsageError("no requests to simulate")
    arrivals = [r.arrival_s for r in requests]
    if not all(math.isfinite(t) for t in arrivals):
        raise UsageError("arrival times must be finite")
    span = max(arrivals) - min(arrivals)
    if not span <= MAX_ARRIVAL_SPAN_S:
        raise UsageError(
            f"the arrivals span {span:.3g} s; at most {MAX_ARRIVAL_SPAN_S:.0e} s (about 31.7 years) "
            "can be simulated"
        )
    for r in requests:
        if not (0 <= r.input_length <= MAX_TOKENS and 0 <= r.output_length <= MAX_TOKENS):
            raise UsageError(
                f"request lengths must be between 0 and {MAX_TOKENS:,} tokens "
                f"(got {r.input_length} in, {r.output_length} out)"
            )


def offered_rate(requests: Sequence[TraceRequest]) -> float:
    """Arrivals per second over the arrival window (``(n - 1) / (last - first)``)."""
    if len(requests) < 2:
        return math.nan
    span = max(r.arrival_s for r in requests) - min(r.arrival_s for r in requests)
    return (len(requests) - 1) / span if span > 0 else math.inf


def scale_to_load(requests: Sequence[TraceRequest], rate_rps: float) -> tuple[TraceRequest, ...]:
    """The trace with arrival times rescaled so its offered rate is ``rate_rps``."""
    current = offered_rate(requests)
    if not rate_rps > 0 or not math.isfinite(current) or current <= 0:
        raise UsageError("cannot rescale the arrivals: need >= 2 requests spread in time")
    factor = current / rate_rps
    t0 = min(r.arrival_s for r in requests)
    return tuple(replace(r, arrival_s=(r.arrival_s - t0) * factor) for r in requests)


def model_cluster(requests: Sequence[TraceRequest], config: SimulationConfig) -> ClusterConfig:
    """The model's cluster for this trace: its mean output length and the link's mean rate
    over the arrival window (first to last arrival; the schedule is on the trace's clock)."""
    first = min(r.arrival_s for r in requests)
    last = max(r.arrival_s for r in requests)
    mean_out = float(np.mean([r.output_length for r in requests])) or 1.0
    return replace(
        config.cluster,
        egress_bps=config.link.mean_rate_between(first, last),
        mean_output_tokens=max(mean_out, 1.0),
    )


def optimizer_for(requests: Sequence[TraceRequest], config: SimulationConfig) -> OptimizerResult:
    """The model's answer for this trace: incremental lengths, mean output, mean link rate.

    ``selective`` and ``adaptive`` run at its split, and the requests they keep local need
    a local prefill server: without ``config.prefill_instances`` it searches only the
    splits that leave one (``N_p`` of at least one split step), where there are any. (The
    bare model may find ``N_p = 0`` best, every prefill remote; that is ``offload-all``.)"""
    cl = config.cluster
    floor = cl.split_step if config.prefill_instances is None and len(cl.splits()) > 1 else 0.0
    return optimize(
        LengthDistribution.from_trace(requests),
        model_cluster(requests, config),
        step_tokens=config.threshold_step_tokens,
        prefill_instances=config.prefill_instances,
        min_prefill_instances=floor,
    )


def _split_for(
    policy: PolicyName,
    dist: LengthDistribution,
    config: SimulationConfig,
    opt: OptimizerResult,
    model: ClusterConfig,
) -> float:
    """The split ``policy`` runs at. ``local`` and ``offload-all`` take the model's best
    split with every prefill local (``t`` = infinity) or remote (``t`` = -1) on ``model``,
    the trace's :func:`model_cluster` (its mean output and the link's mean rate), as
    ``selective``'s optimizer does: ``config.cluster`` holds neither (its
    ``mean_output_tokens`` is the 1,024 default, which ran ``local`` on the Mooncake
    trace, 149 output tokens on average, at a split the model says is 29% worse)."""
    cl = config.cluster
    if config.prefill_instances is not None:
        n_p = config.prefill_instances
    elif policy is PolicyName.LOCAL:
        n_p = best_split(dist, model, threshold_tokens=math.inf).prefill_instances
    elif policy is PolicyName.OFFLOAD_ALL:
        n_p = best_split(dist, model, threshold_tokens=-1.0).prefill_instances
    else:
        n_p = opt.best.prefill_instances
    if policy is not PolicyName.OFFLOAD_ALL and n_p <= 1e-9:
        # The requests that stay local need a local prefill server (it used to be added
        # silently, an instance taken from decode, while the threshold and the model's
        # figures stayed those of the split without it).
        raise UsageError(
            f"bad split: N_p = {n_p:g} leaves {policy} no local prefill server "
            f"(only offload-all runs without one)"
        )
    if cl.local_instances - n_p < cl.split_step - 1e-9:
        raise UsageError(f"bad split: {n_p:g} prefill of {cl.local_instances} local instances")
    return n_p


def _policy_threshold(policy: PolicyName, opt: OptimizerResult) -> float:
    if policy is PolicyName.LOCAL:
        return math.inf
    if policy is PolicyName.OFFLOAD_ALL:
        return -1.0
    return opt.threshold_tokens


def policy_capacity(
    policy: PolicyName | str,
    requests: Sequence[TraceRequest],
    config: SimulationConfig,
    *,
    optimizer: OptimizerResult | None = None,
    threshold_tokens: float | None = None,
    lengths: Sequence[float] | None = None,
) -> Capacity:
    """The model's ``Lambda_max`` (and every term) for ``policy`` on this trace, at the
    split and threshold the simulator gives it. ``lengths``: incremental lengths to use
    instead of the unbounded-cache ones (e.g. the hits a simulation realized)."""
    policy = PolicyName(policy)
    opt = optimizer if optimizer is not None else optimizer_for(requests, config)
    dist = LengthDistribution.from_trace(requests)
    model = model_cluster(requests, config)
    n_p = _split_for(policy, dist, config, opt, model)
    t = _policy_threshold(policy, opt)
    if threshold_tokens is not None and policy in (PolicyName.SELECTIVE, PolicyName.ADAPTIVE):
        t = threshold_tokens
    use = LengthDistribution(lengths) if lengths is not None else dist
    return capacity(use, model, threshold_tokens=t, prefill_instances=n_p)


# -- results ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyResult:
    """What one policy achieved on one trace."""

    policy: str
    requests: int
    completed: int
    makespan_s: float
    throughput_rps: float
    """Completions per second between the first and the last completion. It counts each
    request's decode, so one long answer late in a lightly loaded run puts it below the
    offered rate: whether the system keeps up is :attr:`keep_up`. NaN (n/a) when the
    arrivals span less than :data:`MIN_ARRIVAL_WINDOW_S` (a burst: five requests at one
    instant completing 2 ms apart read 500 req/s) or fewer than two requests complete."""
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    egress_gbps_mean: float
    """Mean of the 1-second egress averages in the arrival window: the whole seconds from
    the first arrival that end by the last one (NaN, n/a, when it spans under 1 s)."""
    egress_gbps_p99: float
    """P99 of the same 1-second averages (NaN when the window spans under 1 s)."""
    egress_gbps_peak: float
    """Highest 1-second average of the whole run."""
    offload_fraction: float
    cache_hit_ratio: float
    """Prompt tokens served from a prefix cache / all prompt tokens."""
    threshold_tokens: float | None
    """``selective``: the optimizer's ``t``; ``adaptive``: mean of its threshold at arrivals."""
    prefill_instances: float
    decode_instances: float
    offered_rps: float = math.nan
    """Arrivals per second over the arrival window."""
    arrival_window_s: float = math.nan
    """Last arrival minus first arrival."""
    capacity_rps: float = math.nan
    """The model's ``Lambda_max`` for this policy's threshold and split."""
    capacity_realized_rps: float = math.nan
    """The same with the incremental lengths the simulation realized (its prefix hits)."""
    balance_slack: float = math.nan
    """The model's ``Theta_pdd / prefill rate - 1`` at this policy's split (0: balanced)."""
    retunes: int = 0
    """``adaptive``: how often its threshold moved."""
    decisions: tuple[tuple[str, int], ...] = ()
    """``selective`` and ``adaptive``: how many requests got each of :func:`decide`'s
    reasons (``"long"``, ``"short"``, ``"link-saturated"``...), by reason."""
    finish_order: tuple[int, ...] = ()
    """Trace indices in order of completion (each exactly once)."""
    keep_up: float = math.nan
    """Requests served per arrival: the rate at which requests left the queues for their
    first token over the rate at which they arrived, each a least-squares fit over the
    whole run (the slope of the ``k``-th arrival time and of the ``k``-th time a request
    left the queues, its first-token time less its own service time, against ``k``:
    :func:`keep_up_ratio`), so a long decode, one late first token, a burst that queues
    and drains, or later prompts that are longer, does not decide it. 1: the system keeps
    up; below :data:`SATURATION_MARGIN`: saturated. NaN for fewer than two requests or
    arrivals all at one instant."""

    @property
    def utilization(self) -> float:
        """Offered rate / the model's capacity for this policy."""
        return self.offered_rps / self.capacity_rps if self.capacity_rps > 0 else math.inf

    @property
    def saturated(self) -> bool | None:
        """Requests leave the queues at fewer than :data:`SATURATION_MARGIN` of the rate
        they arrive (:attr:`keep_up`): the queues grow for as long as the arrivals last.
        Judged on waiting (first-token time less the request's own service time), not on
        completions, whose decode tail says nothing about queueing, nor on raw first-token
        times, which later, longer prompts delay with nothing queued. ``None`` (n/a) when
        the arrivals span less than :data:`MIN_ARRIVAL_WINDOW_S` (a burst: no rate to keep
        up with)."""
        if not self.arrival_window_s >= MIN_ARRIVAL_WINDOW_S or not math.isfinite(self.offered_rps):
            return None
        return bool(self.keep_up < SATURATION_MARGIN)

    def as_json(self) -> dict[str, Any]:
        out: dict[str, float | int | str | bool | None] = {
            "throughput_rps": self.throughput_rps,
            "offered_rps": self.offered_rps,
            "capacity_rps": self.capacity_rps,
            "capacity_realized_rps": self.capacity_realized_rps,
            "utilization": self.utilization,
            "saturated": self.saturated,
            "keep_up": self.keep_up,
            "ttft_mean_s": self.ttft_mean_s,
            "ttft_p50_s": self.ttft_p50_s,
            "ttft_p90_s": self.ttft_p90_s,
            "ttft_p99_s": self.ttft_p99_s,
            "offload_fraction": self.offload_fraction,
            "egress_gbps_mean": self.egress_gbps_mean,
            "egress_gbps_p99": self.egress_gbps_p99,
            "egress_gbps_peak": self.egress_gbps_peak,
            "cache_hit_ratio": self.cache_hit_ratio,
            "requests": self.requests,
            "completed": self.completed,
            "makespan_s": self.makespan_s,
            "prefill_instances": self.prefill_instances,
            "decode_instances": self.decode_instances,
            "balance_slack": self.balance_slack,
        }
        if self.threshold_tokens is not None:
            out["threshold_tokens"] = self.threshold_tokens
        if self.policy == PolicyName.ADAPTIVE:
            out["retunes"] = self.retunes
        doc: dict[str, Any] = {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in out.items()
        }
        if self.decisions:
            doc["decisions"] = dict(self.decisions)
        return doc


def _percentile(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if values.size else math.nan


EgressRun = tuple[int, int, float]
"""``(first, stop, bytes)``: 1-second bins ``first`` to ``stop - 1`` each carried ``bytes``."""


def egress_runs(transfers: Sequence[tuple[float, float, float]], t0: float) -> list[EgressRun]:
    """Bytes per 1-second bin from ``t0``, each transfer spread evenly over its duration,
    as ascending, disjoint runs of equal bins (a bin in no run carried nothing). Memory
    and time grow with the number of transfers, not with the seconds they span: a
    transfer over a slow link may take months of simulated time."""
    points: dict[int, float] = {}
    edges: list[tuple[float, float]] = []
    for s, e, b in transfers:
        if b <= 0:
            continue
        a, z = s - t0, e - t0
        if z - a <= 0:
            k = math.floor(a)
            points[k] = points.get(k, 0.0) + b
            continue
        rate = b / (z - a)
        edges += [(a, rate), (z, -rate)]
    edges.sort()
    partial = points
    runs: list[EgressRun] = []

    def spread(x: float, y: float, rate: float) -> None:
        kx, ky = math.floor(x), math.floor(y)
        if kx == ky:
            partial[kx] = partial.get(kx, 0.0) + rate * (y - x)
            return
        partial[kx] = partial.get(kx, 0.0) + rate * (kx + 1 - x)
        if ky > kx + 1:
            runs.append((kx + 1, ky, rate))
        if y > ky:
            partial[ky] = partial.get(ky, 0.0) + rate * (y - ky)

    rate, active, prev = 0.0, 0, -math.inf
    for x, change in edges:
        if active and x > prev:
            spread(prev, x, rate)
        rate += change
        active += 1 if change > 0 else -1
        if not active:
            rate = 0.0  # no rounding left over between transfers
        prev = x
    # The segments are disjoint, so only an instantaneous transfer's bin can fall inside
    # a run of whole bins: split the run there.
    keys = sorted(partial)
    out: list[EgressRun] = []
    for first, stop, value in runs:
        cur = first
        for k in keys[bisect.bisect_left(keys, first) : bisect.bisect_left(keys, stop)]:
            if k > cur:
                out.append((cur, k, value))
            partial[k] += value
            cur = k + 1
        if stop > cur:
            out.append((cur, stop, value))
    out += [(k, k + 1, v) for k, v in partial.items() if v > 0]
    out.sort()
    return out


def _window_stats(runs: Sequence[EgressRun], nbins: int) -> tuple[float, float]:
    """Mean and P99 (``numpy.percentile``'s linear method) of bins ``0`` to ``nbins - 1``,
    bytes; NaN for no bins."""
    if nbins <= 0:
        return math.nan, math.nan
    values: list[float] = []
    counts: list[int] = []
    for first, stop, value in runs:
        n = min(stop, nbins) - max(first, 0)
        if n > 0:
            values.append(value)
            counts.append(n)
    if nbins > sum(counts):
        values.append(0.0)
        counts.append(nbins - sum(counts))
    vals = np.asarray(values, dtype=np.float64)
    cnt = np.asarray(counts, dtype=np.int64)
    mean = float(np.dot(vals, cnt) / nbins)
    order = np.argsort(vals, kind="stable")
    vals, ends = vals[order], np.cumsum(cnt[order])
    h = (nbins - 1) * 0.99
    lo = math.floor(h)
    a = float(vals[np.searchsorted(ends, lo, side="right")])
    b = float(vals[np.searchsorted(ends, min(lo + 1, nbins - 1), side="right")])
    return mean, a + (b - a) * (h - lo)


def keep_up_ratio(
    arrivals_s: Sequence[float],
    ttft_s: Sequence[float],
    service_s: Sequence[float] | None = None,
) -> float:
    """:attr:`PolicyResult.keep_up` of a run: the least-squares slope of the ``k``-th
    arrival time against ``k`` over that of the ``k``-th time a request left the queues:
    its arrival plus its TTFT less ``service_s``, its own service time (its prefill,
    transfer and landing, which it would take on an idle system; ``None``: none), so
    only its waiting counts. A request that never got a first token counts as never.
    Each series is sorted. Constant waiting (none, on an idle system, whatever the
    lengths) gives 1; queues that grow through the run give the service rate over the
    arrival rate. NaN when the arrivals have no spread (fewer than two, or all at one
    instant)."""
    if len(arrivals_s) < 2:
        return math.nan
    t0 = min(arrivals_s)
    a = np.asarray(arrivals_s, dtype=np.float64) - t0
    wait = np.nan_to_num(np.asarray(ttft_s, dtype=np.float64), nan=math.inf)
    if service_s is not None:
        wait = np.maximum(wait - np.asarray(service_s, dtype=np.float64), 0.0)
    d = np.sort(a + wait)
    a.sort()
    if not math.isfinite(d[-1]):
        return 0.0
    k = np.arange(a.size, dtype=np.float64)
    k -= k.mean()
    slope_a = float(np.dot(k, a - a.mean()))
    slope_d = float(np.dot(k, d - d.mean()))
    if not slope_a > 0:
        return math.nan
    return slope_a / slope_d if slope_d > 0 else math.inf


def _service_times(state: SimState) -> list[float]:
    """Each request's own time from arrival to first token on an idle system: its prefill
    as it ran (its prefix hit, its server's speed), and for an offload its transfer as it
    ran (the link's rate then) and half the RTT. Its TTFT less this is what it waited
    (prefill queue, link queue, a decode slot)."""
    half_rtt = state.config.rtt_s / 2.0
    return [
        state.service_s[i] + (state.transfer_s[i] + half_rtt if state.remote[i] else 0.0)
        for i in range(len(state.requests))
    ]


def _summarize(state: SimState, n_p: float) -> PolicyResult:
    reqs = state.requests
    n = len(reqs)
    first_arrival = min(r.arrival_s for r in reqs)
    last_arrival = max(r.arrival_s for r in reqs)
    done = len(state.finish_order)
    makespan = max(state.last_finish_s - first_arrival, 1e-9)
    # Departure rate between the first and last completion: every request spends
    # output_length decode steps after its prefill, and counting that fixed tail against
    # a short trace would understate the rate the system sustains.
    # A burst (arrivals within MIN_ARRIVAL_WINDOW_S) has no rate to sustain, and its
    # completions can come microseconds apart: n/a, as its egress and saturated are.
    span = state.last_finish_s - state.first_finish_s
    window = last_arrival - first_arrival
    throughput = (
        (done - 1) / span
        if done >= 2 and span > 0 and window >= MIN_ARRIVAL_WINDOW_S
        else math.nan
    )
    tt = np.asarray([x for x in state.ttft_s if not math.isnan(x)])
    runs = egress_runs(state.transfers, first_arrival)
    # Mean and P99 over the same bins: the whole seconds of the arrival window (the drain
    # after the last arrival does not dilute them). None whole: too short to say.
    egress_mean, egress_p99 = _window_stats(
        runs, math.floor(window) if window >= MIN_ARRIVAL_WINDOW_S else 0
    )
    thr: float | None
    if state.policy is PolicyName.SELECTIVE:
        thr = state.threshold_tokens
    elif state.policy is PolicyName.ADAPTIVE:
        thr = float(np.mean(state.thresholds_seen)) if state.thresholds_seen else None
    else:
        thr = None
    return PolicyResult(
        policy=str(state.policy),
        requests=n,
        completed=done,
        makespan_s=makespan,
        throughput_rps=throughput,
        ttft_mean_s=float(tt.mean()) if tt.size else math.nan,
        ttft_p50_s=_percentile(tt, 50),
        ttft_p90_s=_percentile(tt, 90),
        ttft_p99_s=_percentile(tt, 99),
        egress_gbps_mean=egress_mean * 8.0 / 1e9,
        egress_gbps_p99=egress_p99 * 8.0 / 1e9,
        egress_gbps_peak=max((v for *_, v in runs), default=0.0) * 8.0 / 1e9,
        offload_fraction=sum(state.remote) / n,
        cache_hit_ratio=sum(state.hit_tokens) / max(1, sum(r.input_length for r in reqs)),
        threshold_tokens=thr,
        prefill_instances=n_p,
        decode_instances=state.config.cluster.local_instances - n_p,
        offered_rps=offered_rate(reqs),
        arrival_window_s=last_arrival - first_arrival,
        retunes=state.adaptive.retunes if state.adaptive is not None else 0,
        decisions=tuple(sorted(Counter(x for x in state.reasons if x).items())),
        finish_order=tuple(state.finish_order),
        keep_up=keep_up_ratio([r.arrival_s for r in reqs], state.ttft_s, _service_times(state)),
    )


def simulate(
    requests: Sequence[TraceRequest],
    config: SimulationConfig,
    policy: PolicyName | str,
    *,
    seed: int = 0,
    threshold_tokens: float | None = None,
    optimizer: OptimizerResult | None = None,
    table: ThresholdTable | None = None,
) -> PolicyResult:
    """Replay ``requests`` under ``policy``. Deterministic for a given ``seed``.

    ``threshold_tokens`` overrides the optimizer's ``t`` for ``selective`` (``adaptive``
    takes its threshold from its table: at the link's nominal rate the optimizer's).
    ``table``: ``adaptive``'s threshold table (computed when absent, with the nominal rate
    tabulated exactly).
    """
    policy = PolicyName(policy)
    check_workload(requests)
    cl = config.cluster
    if policy is not PolicyName.LOCAL and cl.remote_instances < 1:
        raise UsageError(f"policy {policy} needs at least one remote instance")
    opt = optimizer if optimizer is not None else optimizer_for(requests, config)
    dist = LengthDistribution.from_trace(requests)
    trace_cluster = model_cluster(requests, config)
    n_p = _split_for(policy, dist, config, opt, trace_cluster)
    t = _policy_threshold(policy, opt)
    if threshold_tokens is not None and policy is PolicyName.SELECTIVE:
        t = threshold_tokens
    if policy is PolicyName.ADAPTIVE:
        t = math.inf
        if table is None:
            table = threshold_table(
                dist,
                trace_cluster,
                prefill_instances=n_p,
                step_tokens=config.threshold_step_tokens,
                include_bps=(config.link.rate_at(0.0),) if config.link.rate_at(0.0) > 0 else (),
            )
    state = new_state(
        requests,
        config,
        policy,
        prefill_instances=n_p,
        threshold_tokens=t,
        table=table,
        seed=seed,
        plan_lengths=dist,
    )
    run_events(state)
    result = _summarize(state, n_p)
    model = policy_capacity(
        policy, requests, config, optimizer=opt, threshold_tokens=result.threshold_tokens
    )
    realized = [max(0.0, r.input_length - h) for r, h in zip(requests, state.hit_tokens, strict=True)]
    model_realized = policy_capacity(
        policy,
        requests,
        config,
        optimizer=opt,
        threshold_tokens=result.threshold_tokens,
        lengths=realized,
    )
    return replace(
        result,
        capacity_rps=model.lambda_max_rps,
        capacity_realized_rps=model_realized.lambda_max_rps,
        balance_slack=model.balance_slack,
    )


def simulate_policies(
    requests: Sequence[TraceRequest],
    config: SimulationConfig,
    policies: Sequence[PolicyName | str] = tuple(PolicyName),
    *,
    seed: int = 0,
    threshold_tokens: float | None = None,
) -> tuple[OptimizerResult, tuple[PolicyResult, ...]]:
    """The optimizer's answer for the trace, then every policy replayed on it."""
    check_workload(requests)
    opt = optimizer_for(requests, config)
    dist = LengthDistribution.from_trace(requests)
    model = model_cluster(requests, config)
    for p in policies:  # a split some policy cannot run at fails before any run
        _split_for(PolicyName(p), dist, config, opt, model)
    results = tuple(
        simulate(requests, config, p, seed=seed, threshold_tokens=threshold_tokens, optimizer=opt)
        for p in policies
    )
    return opt, results
