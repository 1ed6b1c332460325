"""Prefill offload scheduling: the throughput model and optimizer, the per-request policy,
and a trace-driven simulator. Pure: time is passed in, randomness comes from a seeded
generator, and nothing here does I/O besides reading trace and profile files."""

from kvwire.scheduler.cache import PrefixCache
from kvwire.scheduler.link import LinkSchedule
from kvwire.scheduler.model import (
    Bound,
    Capacity,
    ClusterConfig,
    OptimizerResult,
    best_split,
    capacity,
    optimize,
)
from kvwire.scheduler.policy import (
    ClusterView,
    Decision,
    Local,
    Offload,
    PolicyRequest,
    SchedulerState,
    decide,
    effective_threshold,
)
from kvwire.scheduler.profile import (
    BUILTIN_PROFILES,
    ModelProfile,
    builtin_profile,
    dense_profile,
    load_profile,
)
from kvwire.scheduler.simulator import (
    PolicyName,
    PolicyResult,
    SimulationConfig,
    optimizer_for,
    retune_threshold,
    simulate,
    simulate_policies,
)
from kvwire.scheduler.units import format_rate, parse_rate, parse_rate_schedule
from kvwire.scheduler.workload import (
    BLOCK_TOKENS,
    LengthDistribution,
    TraceRequest,
    incremental_lengths,
    load_trace,
    synthetic_trace,
)

__all__ = [
    "BLOCK_TOKENS",
    "BUILTIN_PROFILES",
    "Bound",
    "Capacity",
    "ClusterConfig",
    "ClusterView",
    "Decision",
    "LengthDistribution",
    "LinkSchedule",
    "Local",
    "ModelProfile",
    "Offload",
    "OptimizerResult",
    "PolicyName",
    "PolicyRequest",
    "PolicyResult",
    "PrefixCache",
    "SchedulerState",
    "SimulationConfig",
    "TraceRequest",
    "best_split",
    "builtin_profile",
    "capacity",
    "decide",
    "dense_profile",
    "effective_threshold",
    "format_rate",
    "incremental_lengths",
    "load_profile",
    "load_trace",
    "optimize",
    "optimizer_for",
    "parse_rate",
    "parse_rate_schedule",
    "retune_threshold",
    "simulate",
    "simulate_policies",
    "synthetic_trace",
]
