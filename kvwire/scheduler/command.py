"""``kvwire simulate``: replay a trace (or a synthetic workload) under each policy."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from typing import Any

import numpy as np

from kvwire.errors import KvwireError, UsageError
from kvwire.scheduler.link import LinkSchedule
from kvwire.scheduler.model import ClusterConfig
from kvwire.scheduler.profile import BUILTIN_PROFILES, load_profile
from kvwire.scheduler.simulator import (
    PolicyName,
    PolicyResult,
    SimulationConfig,
    simulate,
    simulate_policies,
)
from kvwire.scheduler.units import format_rate, parse_rate, parse_rate_schedule
from kvwire.scheduler.workload import TraceRequest, load_trace, synthetic_trace

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> None:
    """Register ``simulate`` on an ``argparse`` subparsers object."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "simulate",
        help="simulate prefill offload policies over a request trace",
        description=(
            "Replay a Mooncake-format trace (or a synthetic log-normal workload) over a "
            "remote prefill cluster, a local PD cluster and the link between them, under "
            "each policy. Defaults: the case study (1T hybrid, 4 remote 8xH200, 8 local "
            "8xH20 at 0.15 relative compute, 100 Gbit/s)."
        ),
    )
    p.set_defaults(func=run)
    w = p.add_argument_group("workload")
    w.add_argument("--trace", help="JSONL trace (Mooncake format); omitted: synthetic log-normal")
    w.add_argument("--limit", type=int, help="use only the first N requests of the trace")
    w.add_argument(
        "--speedup", type=float, default=1.0, help="compress arrival times by this factor"
    )
    w.add_argument("--requests", type=int, default=4000, help="synthetic: number of requests")
    w.add_argument("--rate", type=float, default=2.0, help="synthetic: arrivals per second")
    w.add_argument("--mu", type=float, default=9.90, help="synthetic: log-normal mu")
    w.add_argument("--sigma", type=float, default=1.00, help="synthetic: log-normal sigma")
    w.add_argument("--output-tokens", type=int, default=1024, help="synthetic: output length")
    w.add_argument("--seed", type=int, default=0)
    s = p.add_argument_group("system")
    s.add_argument(
        "--profile",
        default="hybrid-1t",
        help=f"remote instance profile: {', '.join(BUILTIN_PROFILES)} or a .json/.toml file",
    )
    s.add_argument("--local-profile", help="local prefill profile file (default: scaled remote)")
    s.add_argument("--relative-compute", type=float, default=0.15, help="local/remote compute")
    s.add_argument("--remote-instances", type=int, default=4)
    s.add_argument("--local-instances", type=int, default=8)
    s.add_argument("--prefill-instances", type=int, help="local N_p (default: model's best)")
    s.add_argument("--decode-step-ms", type=float, default=50.0)
    s.add_argument("--decode-batch", type=int, default=64)
    s.add_argument("--link", default="100gbps", help="link rate, e.g. 100gbps, 10gbit, 800mbps")
    s.add_argument("--link-schedule", help="rate over time, e.g. '0:10gbps,300:2.5gbps,600:10gbps'")
    s.add_argument("--rtt-ms", type=float, default=10.0)
    s.add_argument("--cache-blocks", type=int, default=32768, help="prefix cache per cluster")
    o = p.add_argument_group("policies and output")
    o.add_argument(
        "--policy",
        default=",".join(PolicyName),
        help="comma-separated: " + ", ".join(PolicyName),
    )
    o.add_argument("--threshold", type=float, help="fixed t for selective / start t for adaptive")
    o.add_argument("--json", help="write per-policy results to this file")
    o.add_argument("--plot", help="write throughput against t (model + simulated) to this PNG")
    o.add_argument("--plot-points", type=int, default=12, help="simulated thresholds on the plot")


def _workload(args: argparse.Namespace) -> tuple[TraceRequest, ...]:
    if args.trace:
        reqs = load_trace(args.trace, limit=args.limit)
    else:
        reqs = synthetic_trace(
            np.random.default_rng(args.seed),
            requests=args.requests,
            rate_rps=args.rate,
            mu=args.mu,
            sigma=args.sigma,
            output_tokens=args.output_tokens,
        )
    if args.speedup <= 0:
        raise UsageError("--speedup must be > 0")
    if args.speedup != 1.0:
        reqs = tuple(replace(r, arrival_s=r.arrival_s / args.speedup) for r in reqs)
    return reqs


def _config(args: argparse.Namespace) -> SimulationConfig:
    if args.link_schedule:
        link = LinkSchedule.from_pairs(parse_rate_schedule(args.link_schedule))
    else:
        link = LinkSchedule.constant(parse_rate(args.link))
    cluster = ClusterConfig(
        remote_profile=load_profile(args.profile),
        local_profile=load_profile(args.local_profile) if args.local_profile else None,
        remote_instances=args.remote_instances,
        local_instances=args.local_instances,
        relative_compute=args.relative_compute,
        decode_step_s=args.decode_step_ms / 1000.0,
        decode_batch_max=args.decode_batch,
        egress_bps=link.rates_bps[0],
    )
    return SimulationConfig(
        cluster=cluster,
        link=link,
        rtt_s=args.rtt_ms / 1000.0,
        prefill_instances=args.prefill_instances,
        remote_cache_blocks=args.cache_blocks,
        local_cache_blocks=args.cache_blocks,
    )


def _fmt(x: float | None, spec: str) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, spec)


def _print_table(results: tuple[PolicyResult, ...], caption: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="kvwire simulate", caption=caption)
    for col in (
        "policy",
        "thr rps",
        "TTFT mean",
        "P50",
        "P90",
        "P99",
        "egress Gb/s",
        "peak",
        "offload",
        "cache hit",
        "t (tok)",
        "Np/Nd",
    ):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in results:
        table.add_row(
            r.policy,
            _fmt(r.throughput_rps, ".3f"),
            _fmt(r.ttft_mean_s, ".2f"),
            _fmt(r.ttft_p50_s, ".2f"),
            _fmt(r.ttft_p90_s, ".2f"),
            _fmt(r.ttft_p99_s, ".2f"),
            _fmt(r.egress_gbps_mean, ".2f"),
            _fmt(r.egress_gbps_peak, ".1f"),
            _fmt(r.offload_fraction, ".3f"),
            _fmt(r.cache_hit_ratio, ".3f"),
            _fmt(r.threshold_tokens, ".0f"),
            f"{r.prefill_instances}/{r.decode_instances}",
        )
    Console(width=130).print(table)


def run(args: argparse.Namespace) -> int:
    """Run the ``simulate`` subcommand; 0 on success, 2 on a usage error."""
    try:
        policies = [PolicyName(x.strip()) for x in args.policy.split(",") if x.strip()]
    except ValueError:
        print(f"kvwire simulate: unknown policy in {args.policy!r}; use {', '.join(PolicyName)}")
        return 2
    try:
        reqs = _workload(args)
        config = _config(args)
        opt, results = simulate_policies(
            reqs, config, policies, seed=args.seed, threshold_tokens=args.threshold
        )
    except KvwireError as exc:
        print(f"kvwire simulate: {exc}")
        return 2
    b = opt.best
    caption = (
        f"{len(reqs)} requests; model: t*={b.threshold_tokens:.0f} tokens, N_p/N_d="
        f"{b.prefill_instances}/{b.decode_instances}, Lambda_max={b.lambda_max_rps:.3f} rps, "
        f"binding: {b.binding}; link {format_rate(config.link.rates_bps[0])}"
    )
    _print_table(results, caption)
    if args.json:
        doc = {
            "model": {
                "threshold_tokens": b.threshold_tokens,
                "prefill_instances": b.prefill_instances,
                "decode_instances": b.decode_instances,
                "lambda_max_rps": b.lambda_max_rps,
                "offload_fraction": b.offload_fraction,
                "binding": str(b.binding),
            },
            "policies": {r.policy: r.as_json() for r in results},
        }
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2)
    if args.plot:
        from kvwire.scheduler.plot import plot_threshold_curve

        grid = np.unique(
            np.round(
                np.quantile([r.input_length for r in reqs], np.linspace(0, 0.98, args.plot_points))
            )
        )
        pts = [
            (
                float(t),
                simulate(
                    reqs,
                    config,
                    PolicyName.SELECTIVE,
                    seed=args.seed,
                    threshold_tokens=float(t),
                    optimizer=opt,
                ).throughput_rps,
            )
            for t in np.append(grid, opt.threshold_tokens)
        ]
        plot_threshold_curve(args.plot, opt, simulated=sorted(pts))
    return 0
