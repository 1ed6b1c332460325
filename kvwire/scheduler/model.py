"""The Prefill-as-a-Service throughput model and its optimizer.

Requests whose incremental length ``l`` exceeds the threshold ``t`` are prefilled on the
remote cluster and their KV shipped over the egress link; the rest are prefilled locally;
every request decodes locally. With ``p = P(L > t)``::

    Theta_prfaas = min(N_remote / T_remote(l_long), B_out / S_kv(l_long))
    Theta_pdp    = N_p / T_local(l_short)
    Theta_pdd    = N_d * BS_max / (T_decode * L_out)
    Lambda_max   = min(Theta_prfaas / p, Theta_pdp / (1 - p), Theta_pdd)

The local cluster's prefill and decode speeds are inputs: its profile is the remote profile
scaled by ``relative_compute`` (0.15 for H20 against H200 dense BF16) unless one is given,
and decode is a step time and a maximum batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from enum import StrEnum

import numpy as np
import numpy.typing as npt

from kvwire.errors import UsageError
from kvwire.scheduler._checks import check_number, check_whole
from kvwire.scheduler.profile import MIN_RELATIVE_COMPUTE, ModelProfile
from kvwire.scheduler.workload import LengthDistribution

__all__ = [
    "MAX_GPUS_PER_INSTANCE",
    "MAX_INSTANCES",
    "MAX_SPLITS",
    "Bound",
    "Capacity",
    "ClusterConfig",
    "OptimizerResult",
    "best_split",
    "capacity",
    "optimize",
]


MAX_INSTANCES = 10_000
"""Most remote, and most local, instances a :class:`ClusterConfig` may have (10,000 of 8
GPUs: 80,000 GPUs a side, beyond any PD cluster of today)."""
MAX_GPUS_PER_INSTANCE = 64
"""Most GPUs of one local instance (the profiles describe 8-GPU instances)."""
MAX_SPLITS = 10_000
"""Most prefill/decode splits (``N_p`` values) the optimizer tries: local instances at
instance granularity, local GPUs (instances x GPUs per instance) at GPU granularity. It
evaluates every split at every distinct input length: 10,000 splits of a 4,000-request
trace take about 30 s and 1.7 GB, and the time and memory grow with the splits (a
hundred million local instances, or 100,000 GPUs per instance, ran for hours)."""


class Bound(StrEnum):
    """Which resource limits ``Lambda_max``."""

    REMOTE_COMPUTE = "remote-compute"
    EGRESS_BANDWIDTH = "egress-bandwidth"
    LOCAL_PREFILL = "local-prefill"
    DECODE = "decode"


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterConfig:
    """Both clusters and the link between them. Defaults: the case study (4 remote 8xH200
    instances, 8 local 8xH20 instances, 100 Gbit/s)."""

    remote_profile: ModelProfile
    """Prefill profile of one remote instance."""
    remote_instances: int = 4
    """``N_prfaas``: remote prefill instances."""
    local_instances: int = 8
    """Local PD instances, split between prefill (``N_p``) and decode (``N_d``)."""
    egress_bps: float = 100e9
    """``B_out``: egress bandwidth of the remote cluster, bits per second."""
    relative_compute: float = 0.15
    """Local instance compute relative to a remote one (H20 has about 15% of H200's dense
    BF16 compute). Without ``local_profile``, the local prefill latency is the remote one
    with its length-dependent part divided by this (see :meth:`ModelProfile.scaled`)."""
    local_profile: ModelProfile | None = None
    """Prefill profile of one local instance, when measured."""
    decode_step_s: float = 0.05
    """``T_decode``: one decode step of a full batch on a local instance (assumed 50 ms)."""
    decode_batch_max: int = 64
    """``BS_max``: concurrent sequences per decode instance (assumed)."""
    mean_output_tokens: float = 1024.0
    """``L_out``: mean output length."""
    gpus_per_instance: int = 8
    """GPUs of one local instance (the profiles describe 8-GPU instances)."""
    split_granularity: str = "instance"
    """``"instance"``: ``N_p`` and ``N_d`` are whole instances; ``"gpu"``: they are counted
    in GPUs (``N_p`` in steps of ``1 / gpus_per_instance``), so the balance condition
    ``Theta_prfaas + Theta_pdp = Theta_pdd`` can be met more closely. A fractional instance
    is modelled as proportionally less capacity (linear scaling)."""
    _local_prefill: ModelProfile = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.split_granularity not in ("instance", "gpu"):
            raise UsageError("split_granularity is 'instance' or 'gpu'")
        # Every numeric field finite and in range, the counts whole (kept as ints: the
        # splits are counted with them).
        for name, least in (("gpus_per_instance", 1), ("remote_instances", 0),
                            ("local_instances", 1), ("decode_batch_max", 1)):
            object.__setattr__(self, name, check_whole(name, getattr(self, name), at_least=least))
        # The messages name the fields: the CLI says its options' names instead.
        for name, most in (("remote_instances", MAX_INSTANCES), ("local_instances", MAX_INSTANCES),
                         ("gpus_per_instance", MAX_GPUS_PER_INSTANCE)):
            if getattr(self, name) > most:
                raise UsageError(f"{name} must be at most {most:,}")
        gpus = self.local_instances * self.gpus_per_instance
        if self.split_granularity == "gpu" and gpus > MAX_SPLITS:
            raise UsageError(
                f"split_granularity 'gpu': at most {MAX_SPLITS:,} local GPUs (local_instances "
                f"{self.local_instances:,} x gpus_per_instance {self.gpus_per_instance} is {gpus:,})"
            )
        check_number("egress_bps", self.egress_bps, at_least=0.0)
        for name in ("relative_compute", "decode_step_s", "mean_output_tokens"):
            check_number(name, getattr(self, name), above=0.0)
        if self.local_profile is None:  # (the local profile is the remote one scaled by it)
            check_number("relative_compute", self.relative_compute, at_least=MIN_RELATIVE_COMPUTE)
        # Scaled once here: the model and the simulator read it for every request.
        object.__setattr__(self, "_local_prefill", self.local_profile if self.local_profile is not None
                           else self.remote_profile.scaled(self.relative_compute))

    @property
    def local_prefill_profile(self) -> ModelProfile:
        """Prefill profile of one local instance: ``local_profile``, or the remote one
        scaled by ``relative_compute``."""
        return self._local_prefill

    def with_egress(self, egress_bps: float) -> ClusterConfig:
        return replace(self, egress_bps=egress_bps)

    @property
    def split_step(self) -> float:
        """Smallest change of ``N_p``, in instances."""
        return 1.0 / self.gpus_per_instance if self.split_granularity == "gpu" else 1.0

    def splits(self) -> list[float]:
        """Every ``N_p`` at the split granularity with ``N_d >= split_step``."""
        k = round(1.0 / self.split_step)
        return [i / k for i in range(self.local_instances * k)]


@dataclass(frozen=True, slots=True, kw_only=True)
class Capacity:
    """The model evaluated at one threshold and prefill/decode split (rates in requests/s)."""

    threshold_tokens: float
    prefill_instances: float
    """``N_p``, in instances (fractional at GPU granularity)."""
    decode_instances: float
    offload_fraction: float
    """``p``."""
    mean_long_tokens: float
    """``l_long``."""
    mean_short_tokens: float
    """``l_short``."""
    remote_compute_rps: float
    """``N_prfaas / T_prefill(l_long)``."""
    egress_rps: float
    """``B_out / S_kv(l_long)``."""
    local_prefill_rps: float
    """``Theta_pdp``."""
    decode_rps: float
    """``Theta_pdd``."""
    remote_path_rps: float
    """``Theta_prfaas / p`` (inf when nothing is offloaded)."""
    local_path_rps: float
    """``Theta_pdp / (1 - p)`` (inf when everything is offloaded)."""
    lambda_max_rps: float
    binding: Bound
    egress_demand_bps: float
    """Egress the offloaded share needs at ``Lambda_max``: ``p * Lambda * S_kv(l_long) * 8``."""

    @property
    def theta_prfaas_rps(self) -> float:
        return min(self.remote_compute_rps, self.egress_rps)

    @property
    def prefill_rps(self) -> float:
        """Rate both prefill paths sustain together: ``min(Theta_prfaas / p,
        Theta_pdp / (1 - p))``; equal to ``Theta_prfaas + Theta_pdp`` when they balance."""
        return min(self.remote_path_rps, self.local_path_rps)

    @property
    def balance_slack(self) -> float:
        """``Theta_pdd / (prefill rate) - 1``: 0 when the split meets the balance condition
        ``Theta_prfaas + Theta_pdp = Theta_pdd``; > 0: decode capacity to spare; < 0:
        prefill capacity to spare."""
        prefill = self.prefill_rps
        if not math.isfinite(prefill) or prefill <= 0:
            return math.inf
        return self.decode_rps / prefill - 1.0


@dataclass(frozen=True, slots=True)
class _Terms:
    """The parts of the model that depend on the threshold only (not on the split)."""

    t: float
    p: float
    l_long: float
    l_short: float
    remote_compute: float
    egress: float
    kv_bits: float
    t_local: float


def _terms(dist: LengthDistribution, config: ClusterConfig, t: float, local: ModelProfile) -> _Terms:
    p = dist.fraction_above(t)
    l_long = dist.mean_above(t)
    l_short = dist.mean_at_most(t)
    remote = config.remote_profile
    if p > 0:
        t_remote = remote.prefill_seconds(l_long)
        remote_compute = config.remote_instances / t_remote if t_remote > 0 else math.inf
        kv_bits = 8.0 * remote.kv_size_bytes(l_long)
        egress = config.egress_bps / kv_bits if kv_bits > 0 else math.inf
    else:
        remote_compute = egress = math.inf
        kv_bits = 0.0
    return _Terms(t, p, l_long, l_short, remote_compute, egress, kv_bits, local.prefill_seconds(l_short))


def _assemble(terms: _Terms, config: ClusterConfig, n_p: float) -> Capacity:
    n_d = config.local_instances - n_p
    if n_p < 0 or n_d < config.split_step - 1e-9:
        raise UsageError(f"bad split: {n_p} prefill of {config.local_instances} local instances")
    p = terms.p
    remote_compute, egress = terms.remote_compute, terms.egress
    remote_path = min(remote_compute, egress) / p if p > 0 else math.inf
    t_local = terms.t_local
    local_prefill = (n_p / t_local if t_local > 0 else math.inf) if p < 1 else math.inf
    local_path = local_prefill / (1.0 - p) if p < 1 else math.inf
    decode = n_d * config.decode_batch_max / (config.decode_step_s * config.mean_output_tokens)

    lam = min(remote_path, local_path, decode)
    if lam == decode:
        binding = Bound.DECODE
    elif lam == local_path:
        binding = Bound.LOCAL_PREFILL
    elif egress < remote_compute:
        binding = Bound.EGRESS_BANDWIDTH
    else:
        binding = Bound.REMOTE_COMPUTE
    return Capacity(
        threshold_tokens=terms.t,
        prefill_instances=n_p,
        decode_instances=n_d,
        offload_fraction=p,
        mean_long_tokens=terms.l_long,
        mean_short_tokens=terms.l_short,
        remote_compute_rps=remote_compute,
        egress_rps=egress,
        local_prefill_rps=local_prefill,
        decode_rps=decode,
        remote_path_rps=remote_path,
        local_path_rps=local_path,
        lambda_max_rps=lam,
        binding=binding,
        egress_demand_bps=p * lam * terms.kv_bits if math.isfinite(lam) else math.inf,
    )


def capacity(
    dist: LengthDistribution,
    config: ClusterConfig,
    *,
    threshold_tokens: float,
    prefill_instances: float,
) -> Capacity:
    """``Lambda_max`` and every term of the model for one ``(t, N_p)``."""
    terms = _terms(dist, config, float(threshold_tokens), config.local_prefill_profile)
    return _assemble(terms, config, float(prefill_instances))


def _rank(c: Capacity) -> tuple[float, float]:
    # Several (t, N_p) can tie on Lambda_max when decode binds; among them prefer the one
    # with the most prefill headroom, i.e. the two prefill paths closest to balanced.
    return (c.lambda_max_rps, min(c.remote_path_rps, c.local_path_rps))


@dataclass(frozen=True, slots=True, kw_only=True)
class OptimizerResult:
    """The best ``(t, N_p)`` of the grid, and ``Lambda_max(t)`` at the best split for plots."""

    best: Capacity
    thresholds: tuple[float, ...]
    """The threshold grid, tokens."""
    lambda_at_best_split: tuple[float, ...]
    """``Lambda_max(t)`` over ``thresholds`` with ``N_p`` fixed at ``best.prefill_instances``."""
    lambda_best_over_splits: tuple[float, ...] = field(default=())
    """``max over N_p of Lambda_max(t)`` over ``thresholds``."""
    step_tokens: float = 0.0
    """The grid's step (the one asked for, or wider past :data:`MAX_GRID_POINTS` points)."""

    @property
    def threshold_tokens(self) -> float:
        return self.best.threshold_tokens

    @property
    def binding(self) -> Bound:
        return self.best.binding


MAX_GRID_POINTS = 65536
"""Most thresholds :func:`optimize` tries: past ``MAX_GRID_POINTS x step_tokens`` (16.8M
tokens at the default 256) the step widens to a multiple of ``step_tokens``, so the
optimizer's work and memory stay bounded whatever the longest prompt."""


def _grid(dist: LengthDistribution, step_tokens: float) -> tuple[npt.NDArray[np.float64], float]:
    # From "offload everything" (t = 0 keeps only zero-length requests local) to "offload
    # nothing" (t = the longest length).
    top = dist.max
    if (top + step_tokens) / step_tokens > MAX_GRID_POINTS:
        # A multiple of the step, with a point of slack for arange's rounding.
        step_tokens *= math.ceil(top / (step_tokens * (MAX_GRID_POINTS - 2)))
    grid = np.arange(0.0, top + step_tokens, step_tokens)
    grid[-1] = max(grid[-1], top)
    return grid, step_tokens


def _classes(
    dist: LengthDistribution, grid: npt.NDArray[np.float64]
) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.intp]]:
    """The model depends on ``t`` only through which lengths are above it, so every grid
    point between two consecutive distinct lengths gives the same capacity. Returns the
    first grid point of each such run (ascending) and, per grid point, its run's index."""
    new_run = np.diff(np.searchsorted(dist.lengths, grid, side="right"), prepend=-1) != 0
    return np.flatnonzero(new_run), np.cumsum(new_run) - 1


def best_split(
    dist: LengthDistribution, config: ClusterConfig, *, threshold_tokens: float
) -> Capacity:
    """The prefill/decode split with the highest ``Lambda_max`` at a fixed threshold."""
    terms = _terms(dist, config, float(threshold_tokens), config.local_prefill_profile)
    cands = [_assemble(terms, config, n_p) for n_p in config.splits()]
    return max(cands, key=_rank)


def optimize(
    dist: LengthDistribution,
    config: ClusterConfig,
    *,
    step_tokens: float = 256.0,
    prefill_instances: float | None = None,
    min_prefill_instances: float = 0.0,
) -> OptimizerResult:
    """Grid search over the threshold (``step_tokens`` apart, wider past
    :data:`MAX_GRID_POINTS` points) and the split ``N_p`` (every value at the config's
    split granularity from ``min_prefill_instances`` up, or only ``prefill_instances``)."""
    step_tokens = check_number("step_tokens", step_tokens, above=0.0)
    if prefill_instances is not None:
        prefill_instances = check_number("prefill_instances", prefill_instances, at_least=0.0)
    min_prefill_instances = check_number("min_prefill_instances", min_prefill_instances)
    grid, step_tokens = _grid(dist, step_tokens)
    # Evaluated once per run of grid points with the same lengths above them (at most
    # one per distinct length), at its first point: what the first best of the whole grid
    # would be, since max() keeps the first of equal ranks.
    starts, run_of = _classes(dist, grid)
    splits = (
        [prefill_instances]
        if prefill_instances is not None
        else [n for n in config.splits() if n >= min_prefill_instances - 1e-9]
    )
    if not splits:
        raise UsageError(
            f"no split of {config.local_instances} local instances has N_p >= "
            f"{min_prefill_instances:g} and a decode instance"
        )
    local = config.local_prefill_profile
    terms = [_terms(dist, config, float(grid[i]), local) for i in starts]
    table = [[_assemble(tt, config, float(n_p)) for tt in terms] for n_p in splits]
    best = max((c for row in table for c in row), key=_rank)
    row = next(r for r in table if r[0].prefill_instances == best.prefill_instances)
    lam = np.asarray([[c.lambda_max_rps for c in r] for r in table], dtype=np.float64)
    return OptimizerResult(
        best=best,
        thresholds=tuple(grid.tolist()),
        lambda_at_best_split=tuple(np.asarray([c.lambda_max_rps for c in row])[run_of].tolist()),
        lambda_best_over_splits=tuple(lam.max(axis=0)[run_of].tolist()),
        step_tokens=step_tokens,
    )
