"""Trace-driven discrete-event simulation of local vs offloaded prefill.

Resources: a remote prefill cluster (``N_remote`` instances, one request each, FIFO), a
local PD cluster (``N_p`` prefill instances, FIFO; ``N_d`` decode instances of ``BS_max``
slots each, FIFO for a slot), one link from remote to local (FIFO, full rate per transfer,
rate from a :class:`LinkSchedule`, plus half the RTT of latency), and a prefix cache per
cluster (LRU over 512-token blocks). Decode holds a slot for ``output_length`` steps of
``T_decode``.

TTFT is measured from arrival to the moment the request's KV is in a decode slot, which
counts prefill queueing, prefill, transfer and any wait for a decode slot.

Policies: ``local`` (homogeneous PD, nothing offloaded), ``offload-all`` (every prefill
remote), ``selective`` (:func:`decide` with the optimizer's fixed threshold, ignoring link
load), ``adaptive`` (the threshold retuned every ``control_interval_s`` from the two prefill
backlogs, and raised by :func:`decide` as egress utilization grows).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum

import numpy as np

from kvwire.errors import UsageError
from kvwire.scheduler.cache import PrefixCache
from kvwire.scheduler.link import LinkSchedule
from kvwire.scheduler.model import ClusterConfig, OptimizerResult, best_split, optimize
from kvwire.scheduler.policy import (
    ClusterView,
    Offload,
    PolicyRequest,
    SchedulerState,
    decide,
)
from kvwire.scheduler.workload import BLOCK_TOKENS, LengthDistribution, TraceRequest

__all__ = [
    "PolicyName",
    "PolicyResult",
    "SimulationConfig",
    "optimizer_for",
    "retune_threshold",
    "simulate",
    "simulate_policies",
]

REMOTE = "remote"


class PolicyName(StrEnum):
    LOCAL = "local"
    OFFLOAD_ALL = "offload-all"
    SELECTIVE = "selective"
    ADAPTIVE = "adaptive"


@dataclass(frozen=True, slots=True, kw_only=True)
class SimulationConfig:
    """The simulated system. The model parts (profiles, instance counts, decode) come from
    ``cluster``; its ``egress_bps`` is ignored in favour of ``link``."""

    cluster: ClusterConfig
    link: LinkSchedule = field(default_factory=LinkSchedule)
    rtt_s: float = 0.01
    """Round-trip time between the clusters; a transfer lands half of it after it leaves."""
    prefill_instances: int | None = None
    """``N_p``; ``None``: each policy uses the model's best split for its own threshold."""
    remote_cache_blocks: int = 32768
    local_cache_blocks: int = 32768
    control_interval_s: float = 1.0
    """How often ``adaptive`` retunes its threshold."""
    demand_window_s: float = 5.0
    """Window over which offloaded KV bytes are averaged into the egress demand estimate."""
    bandwidth_noise: float = 0.0
    """Relative standard deviation of the bandwidth estimate the policy sees (seeded)."""
    threshold_step_tokens: float = 256.0
    """Grid step of the optimizer that sets ``selective``'s threshold."""

    def __post_init__(self) -> None:
        if self.rtt_s < 0 or self.control_interval_s <= 0 or self.demand_window_s <= 0:
            raise UsageError("rtt must be >= 0; control interval and demand window > 0")
        if self.bandwidth_noise < 0:
            raise UsageError("bandwidth_noise must be >= 0")


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyResult:
    """What one policy achieved on one trace."""

    policy: str
    requests: int
    completed: int
    makespan_s: float
    throughput_rps: float
    """Completions per second between the first and the last completion."""
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    egress_gbps_mean: float
    egress_gbps_peak: float
    """Highest 1-second average."""
    offload_fraction: float
    cache_hit_ratio: float
    """Prompt tokens served from a prefix cache / all prompt tokens."""
    threshold_tokens: float | None
    """``selective``: the optimizer's ``t``; ``adaptive``: mean of its base threshold."""
    prefill_instances: int
    decode_instances: int
    finish_order: tuple[int, ...] = ()
    """Trace indices in order of completion (each exactly once)."""

    def as_json(self) -> dict[str, float | int | str | None]:
        out: dict[str, float | int | str | None] = {
            "throughput_rps": self.throughput_rps,
            "ttft_mean_s": self.ttft_mean_s,
            "ttft_p50_s": self.ttft_p50_s,
            "ttft_p90_s": self.ttft_p90_s,
            "ttft_p99_s": self.ttft_p99_s,
            "offload_fraction": self.offload_fraction,
            "egress_gbps_mean": self.egress_gbps_mean,
            "egress_gbps_peak": self.egress_gbps_peak,
            "cache_hit_ratio": self.cache_hit_ratio,
            "requests": self.requests,
            "completed": self.completed,
            "makespan_s": self.makespan_s,
            "prefill_instances": self.prefill_instances,
            "decode_instances": self.decode_instances,
        }
        if self.threshold_tokens is not None:
            out["threshold_tokens"] = self.threshold_tokens
        return out


def retune_threshold(
    threshold: float,
    *,
    local_backlog_s: float,
    remote_backlog_s: float,
    max_tokens: float,
    factor: float = 1.25,
    floor_tokens: float = 512.0,
    slack_s: float = 0.5,
) -> float:
    """One step of the adaptive controller: move ``t`` toward the idler prefill path.

    Backlogs are seconds of queued work per instance (remote includes the link's queue).
    A remote backlog well above the local one means too much is offloaded: raise ``t``;
    the reverse: lower it. ``slack_s`` and the 25% margin keep it still near balance.
    Steps are multiplicative (thresholds span 100 to 100K tokens); below ``floor_tokens``
    the threshold snaps to 0 (offload everything not fully cached) and climbs back from
    ``floor_tokens``.
    """
    if remote_backlog_s > 1.25 * local_backlog_s + slack_s:
        threshold = max(threshold * factor, floor_tokens)
    elif local_backlog_s > 1.25 * remote_backlog_s + slack_s:
        threshold /= factor
        if threshold < floor_tokens:
            threshold = 0.0
    return min(max(threshold, 0.0), max_tokens)


class _Ev(IntEnum):
    # Completions before arrivals at equal times, so freed capacity is visible.
    DECODE_DONE = 0
    TRANSFER_DONE = 1
    REMOTE_DONE = 2
    LOCAL_DONE = 3
    ARRIVAL = 4


def _percentile(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if values.size else math.nan


def _split_for(
    policy: PolicyName, dist: LengthDistribution, config: SimulationConfig, opt: OptimizerResult
) -> int:
    if config.prefill_instances is not None:
        return config.prefill_instances
    if policy is PolicyName.LOCAL:
        return best_split(dist, config.cluster, threshold_tokens=math.inf).prefill_instances
    if policy is PolicyName.OFFLOAD_ALL:
        return best_split(dist, config.cluster, threshold_tokens=-1.0).prefill_instances
    return opt.best.prefill_instances


def optimizer_for(requests: Sequence[TraceRequest], config: SimulationConfig) -> OptimizerResult:
    """The model's answer for this trace: incremental lengths, mean output, mean link rate."""
    dist = LengthDistribution.from_trace(requests)
    horizon = max(r.arrival_s for r in requests) or 1.0
    mean_out = float(np.mean([r.output_length for r in requests])) or 1.0
    cluster = ClusterConfig(
        remote_profile=config.cluster.remote_profile,
        remote_instances=config.cluster.remote_instances,
        local_instances=config.cluster.local_instances,
        egress_bps=config.link.mean_rate(horizon),
        relative_compute=config.cluster.relative_compute,
        local_profile=config.cluster.local_profile,
        decode_step_s=config.cluster.decode_step_s,
        decode_batch_max=config.cluster.decode_batch_max,
        mean_output_tokens=max(mean_out, 1.0),
    )
    return optimize(
        dist,
        cluster,
        step_tokens=config.threshold_step_tokens,
        prefill_instances=config.prefill_instances,
    )


def simulate(
    requests: Sequence[TraceRequest],
    config: SimulationConfig,
    policy: PolicyName | str,
    *,
    seed: int = 0,
    threshold_tokens: float | None = None,
    optimizer: OptimizerResult | None = None,
) -> PolicyResult:
    """Replay ``requests`` under ``policy``. Deterministic for a given ``seed``.

    ``threshold_tokens`` overrides the optimizer's ``t`` for ``selective`` and the starting
    ``t`` of ``adaptive``.
    """
    policy = PolicyName(policy)
    if not requests:
        raise UsageError("no requests to simulate")
    opt = optimizer if optimizer is not None else optimizer_for(requests, config)
    dist = LengthDistribution.from_trace(requests)
    n_p = _split_for(policy, dist, config, opt)
    cl = config.cluster
    n_d = cl.local_instances - n_p
    n_r = cl.remote_instances
    if n_p < 0 or n_d < 1:
        raise UsageError(f"bad split: {n_p} prefill of {cl.local_instances} local instances")
    if policy is not PolicyName.LOCAL and n_r < 1:
        raise UsageError(f"policy {policy} needs at least one remote instance")
    if policy in (PolicyName.LOCAL, PolicyName.SELECTIVE, PolicyName.ADAPTIVE) and n_p < 1:
        # The model may find offloading everything best; a prefill path still needs a
        # local instance for the requests that stay.
        n_p, n_d = 1, cl.local_instances - 1
        if n_d < 1:
            raise UsageError("need at least two local instances")

    rng = np.random.default_rng(seed)
    remote_prof, local_prof = cl.remote_profile, cl.local_prefill_profile
    kv0 = remote_prof.kv_size_bytes(0)
    bt = BLOCK_TOKENS
    base_t = threshold_tokens if threshold_tokens is not None else opt.threshold_tokens
    max_len = float(max(r.input_length for r in requests))
    thresholds_seen: list[float] = []

    local_cache = PrefixCache(config.local_cache_blocks)
    remote_cache = PrefixCache(config.remote_cache_blocks)

    n = len(requests)
    heap: list[tuple[float, int, int, int]] = []
    seq = 0

    def push(t: float, kind: _Ev, idx: int) -> None:
        nonlocal seq
        heapq.heappush(heap, (t, int(kind), seq, idx))
        seq += 1

    for i, r in enumerate(requests):
        push(r.arrival_s, _Ev.ARRIVAL, i)

    service = [0.0] * n
    ship_bytes = [0.0] * n
    ttft = np.full(n, np.nan)
    offloaded = np.zeros(n, dtype=bool)
    hit_tok = np.zeros(n)
    local_q: deque[int] = deque()
    remote_q: deque[int] = deque()
    decode_q: deque[int] = deque()
    local_free, remote_free, slots_free = n_p, n_r, n_d * cl.decode_batch_max
    local_work = remote_work = 0.0
    link_free_at = 0.0
    transfers: list[tuple[float, float, float]] = []
    demand: deque[tuple[float, float]] = deque()
    demand_bits = 0.0
    next_control = 0.0
    finish_order: list[int] = []
    last_finish = first_finish = 0.0

    def start_prefills(now: float) -> None:
        nonlocal local_free, remote_free, local_work, remote_work
        while local_free and local_q:
            j = local_q.popleft()
            local_free -= 1
            local_work -= service[j]
            push(now + service[j], _Ev.LOCAL_DONE, j)
        while remote_free and remote_q:
            j = remote_q.popleft()
            remote_free -= 1
            remote_work -= service[j]
            push(now + service[j], _Ev.REMOTE_DONE, j)

    def to_decode(now: float, j: int) -> None:
        nonlocal slots_free
        if slots_free:
            slots_free -= 1
            ttft[j] = now - requests[j].arrival_s
            push(now + requests[j].output_length * cl.decode_step_s, _Ev.DECODE_DONE, j)
        else:
            decode_q.append(j)

    while heap:
        now, kind, _, i = heapq.heappop(heap)
        r = requests[i]
        if kind == _Ev.ARRIVAL:
            local_hit = local_cache.lookup(r.hash_ids)
            local_hit_tokens = min(local_hit * bt, r.input_length)
            if policy is PolicyName.LOCAL:
                go_remote = False
            elif policy is PolicyName.OFFLOAD_ALL:
                go_remote = True
                remote_hit = remote_cache.lookup(r.hash_ids)
            else:
                remote_hit = remote_cache.lookup(r.hash_ids)
                bw = config.link.rate_at(now)
                if config.bandwidth_noise:
                    bw = max(0.0, bw * (1.0 + config.bandwidth_noise * rng.standard_normal()))
                while demand and demand[0][0] <= now - config.demand_window_s:
                    demand_bits -= demand.popleft()[1]
                if policy is PolicyName.ADAPTIVE and now >= next_control:
                    base_t = retune_threshold(
                        base_t,
                        local_backlog_s=local_work / max(n_p, 1),
                        remote_backlog_s=remote_work / n_r + max(0.0, link_free_at - now),
                        max_tokens=max_len,
                    )
                    next_control = now + config.control_interval_s
                thresholds_seen.append(base_t)
                state = SchedulerState(
                    threshold_tokens=base_t,
                    bandwidth_bps=bw,
                    egress_demand_bps=(
                        demand_bits / config.demand_window_s
                        if policy is PolicyName.ADAPTIVE
                        else 0.0
                    ),
                    local_prefix_hit=tuple((h, 0) for h in r.hash_ids[:local_hit]),
                    remotes=(
                        ClusterView(
                            name=REMOTE,
                            prefix_hit=tuple((h, 0) for h in r.hash_ids[:remote_hit]),
                        ),
                    ),
                )
                d = decide(
                    PolicyRequest(
                        request_id=str(i),
                        input_length=r.input_length,
                        output_length=r.output_length,
                    ),
                    state,
                )
                go_remote = isinstance(d, Offload)
            if go_remote:
                remote_hit_tokens = min(remote_hit * bt, r.input_length)
                incr = r.input_length - remote_hit_tokens
                service[i] = remote_prof.prefill_seconds(max(incr, 1))
                # The decode side already holds the locally cached prefix's per-token KV;
                # fixed recurrent state (hybrid models) is always shipped.
                per_token_local = (
                    remote_prof.kv_size_bytes(local_hit_tokens) - kv0 if local_hit_tokens else 0.0
                )
                ship_bytes[i] = max(
                    0.0, remote_prof.kv_size_bytes(r.input_length) - per_token_local
                )
                demand.append((now, 8.0 * ship_bytes[i]))
                demand_bits += 8.0 * ship_bytes[i]
                offloaded[i] = True
                hit_tok[i] = remote_hit_tokens
                remote_work += service[i]
                remote_q.append(i)
            else:
                incr = r.input_length - local_hit_tokens
                service[i] = local_prof.prefill_seconds(max(incr, 1))
                hit_tok[i] = local_hit_tokens
                local_work += service[i]
                local_q.append(i)
            start_prefills(now)
        elif kind == _Ev.LOCAL_DONE:
            local_free += 1
            local_cache.insert(r.hash_ids)
            to_decode(now, i)
            start_prefills(now)
        elif kind == _Ev.REMOTE_DONE:
            remote_free += 1
            remote_cache.insert(r.hash_ids)
            start = max(now, link_free_at)
            done = config.link.finish_time(start, ship_bytes[i])
            link_free_at = done
            transfers.append((start, done, ship_bytes[i]))
            push(done + config.rtt_s / 2.0, _Ev.TRANSFER_DONE, i)
            start_prefills(now)
        elif kind == _Ev.TRANSFER_DONE:
            local_cache.insert(r.hash_ids)
            to_decode(now, i)
        else:  # DECODE_DONE
            slots_free += 1
            if not finish_order:
                first_finish = now
            finish_order.append(i)
            last_finish = now
            if decode_q:
                to_decode(now, decode_q.popleft())

    first_arrival = min(r.arrival_s for r in requests)
    makespan = max(last_finish - first_arrival, 1e-9)
    # Departure rate between the first and last completion: every request spends
    # output_length decode steps after its prefill, and counting that fixed tail against
    # a short trace would understate the rate the system sustains.
    span = last_finish - first_finish
    throughput = (len(finish_order) - 1) / span if span > 0 else len(finish_order) / makespan
    total_bytes = float(sum(ship_bytes))
    tt = ttft[~np.isnan(ttft)]
    thr: float | None
    if policy is PolicyName.SELECTIVE:
        thr = base_t
    elif policy is PolicyName.ADAPTIVE:
        thr = float(np.mean(thresholds_seen)) if thresholds_seen else base_t
    else:
        thr = None
    return PolicyResult(
        policy=str(policy),
        requests=n,
        completed=len(finish_order),
        makespan_s=makespan,
        throughput_rps=throughput,
        ttft_mean_s=float(tt.mean()) if tt.size else math.nan,
        ttft_p50_s=_percentile(tt, 50),
        ttft_p90_s=_percentile(tt, 90),
        ttft_p99_s=_percentile(tt, 99),
        egress_gbps_mean=8.0 * total_bytes / makespan / 1e9,
        egress_gbps_peak=_peak_gbps(transfers, first_arrival),
        offload_fraction=float(offloaded.mean()),
        cache_hit_ratio=float(hit_tok.sum() / max(1, sum(r.input_length for r in requests))),
        threshold_tokens=thr,
        prefill_instances=n_p,
        decode_instances=n_d,
        finish_order=tuple(finish_order),
    )


def _peak_gbps(transfers: list[tuple[float, float, float]], t0: float) -> float:
    """Highest 1-second average egress, spreading each transfer evenly over its duration."""
    if not transfers:
        return 0.0
    end = max(e for _, e, _ in transfers)
    bins = np.zeros(math.ceil(end - t0) + 2)
    for s, e, b in transfers:
        if b <= 0:
            continue
        a, z = s - t0, e - t0
        if z - a <= 0:
            bins[int(a)] += b
            continue
        rate = b / (z - a)
        k = int(a)
        while k < z:
            lo, hi = max(a, k), min(z, k + 1)
            bins[k] += rate * (hi - lo)
            k += 1
    return float(bins.max() * 8.0 / 1e9)


def simulate_policies(
    requests: Sequence[TraceRequest],
    config: SimulationConfig,
    policies: Sequence[PolicyName | str] = tuple(PolicyName),
    *,
    seed: int = 0,
    threshold_tokens: float | None = None,
) -> tuple[OptimizerResult, tuple[PolicyResult, ...]]:
    """The optimizer's answer for the trace, then every policy replayed on it."""
    opt = optimizer_for(requests, config)
    results = tuple(
        simulate(requests, config, p, seed=seed, threshold_tokens=threshold_tokens, optimizer=opt)
        for p in policies
    )
    return opt, results
