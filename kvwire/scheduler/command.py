"""``kvwire simulate``: replay a trace (or a synthetic workload) under each policy."""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from kvwire.errors import KvwireError, UsageError
from kvwire.scheduler.link import LinkSchedule
from kvwire.scheduler.model import (
    MAX_GPUS_PER_INSTANCE,
    MAX_INSTANCES,
    MAX_SPLITS,
    ClusterConfig,
    OptimizerResult,
)
from kvwire.scheduler.profile import BUILTIN_PROFILES, MIN_RELATIVE_COMPUTE, load_profile
from kvwire.scheduler.simulator import (
    MAX_BANDWIDTH_NOISE,
    PolicyName,
    PolicyResult,
    SimulationConfig,
    check_workload,
    model_cluster,
    offered_rate,
    policy_capacity,
    scale_to_load,
    simulate,
    simulate_policies,
)
from kvwire.scheduler.workload import MAX_TOKENS, TraceRequest, load_trace, synthetic_trace
from kvwire.units import (
    argument_type,
    format_duration,
    format_rate,
    format_schedule,
    number,
    parse_duration,
    parse_rate,
    parse_schedule,
    positive,
    take_negative_values,
    whole_number,
)

__all__ = ["add_parser", "run"]


def _policy(text: str) -> PolicyName:
    try:
        return PolicyName(text)
    except ValueError:
        raise UsageError(f"unknown policy {text!r}; use {', '.join(PolicyName)}") from None


def _policies(text: str) -> list[PolicyName]:
    out = [_policy(x.strip()) for x in text.split(",") if x.strip()]
    if not out:
        raise UsageError("no policy given")
    twice = sorted({str(p) for p in out if out.count(p) > 1})
    if twice:
        # The table gave it a row per mention, the JSON (keyed by policy) one entry.
        raise UsageError(f"policy {', '.join(twice)} given more than once")
    return out


def _real(text: str) -> float:
    """A finite number of either sign (a log-normal's mu)."""
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise UsageError(f"{text!r} must be a finite number")
    return value


#: ``--plot-points``: each is a simulation of ``selective``, and the thresholds are
#: quantiles of the input lengths (more points than distinct lengths add nothing).
MAX_PLOT_POINTS = 1000

#: Upper bounds of the options that enter the simulated times (and the bandwidth estimate's,
#: ``MAX_BANDWIDTH_NOISE``, which the library enforces too): far beyond any real system, so
#: that no value makes a figure meaningless (a decode step of 10^300 s ran and printed
#: throughputs of 10^-300 req/s) or garbles the table (an RTT of 10^300 s).
MAX_DECODE_STEP_S = 60.0
MAX_RTT_S = 3600.0
#: ``--load``: offered rate over capacity. At 1,000 x capacity the arrivals of any trace
#: come in a burst that the model's capacity serves over a thousand times as long, so a
#: larger F changes nothing but the labels; past it they broke the table (a utilization
#: of 10^12 in a column sized for 1000.00) or, at 10^308, overflowed the offered rate.
MAX_LOAD = 1000.0


def _at_most(parse: Callable[[str], float], maximum: float, shown: str, what: str) -> Callable[[str], float]:
    """An ``argparse`` type: ``parse``, refusing values above ``maximum`` (``shown``)."""

    def parse_bounded(text: str) -> float:
        value = parse(text)
        if value > maximum:
            raise UsageError(f"{text!r} must be at most {shown}")
        return value

    return argument_type(parse_bounded, what)


def _at_least(parse: Callable[[str], float], minimum: float, shown: str, what: str) -> Callable[[str], float]:
    """An ``argparse`` type: ``parse``, refusing values below ``minimum`` (``shown``)."""

    def parse_bounded(text: str) -> float:
        value = parse(text)
        if value < minimum:
            raise UsageError(f"{text!r} must be at least {shown}")
        return value

    return argument_type(parse_bounded, what)


POSITIVE_INT = argument_type(whole_number, "int")
NON_NEGATIVE_INT = argument_type(functools.partial(whole_number, minimum=0), "int")
POSITIVE = argument_type(number, "number")
NON_NEGATIVE = argument_type(functools.partial(number, strictly_positive=False), "number")


def add_parser(subparsers: Any) -> None:
    """Register ``simulate`` on an ``argparse`` subparsers object."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "simulate",
        help="simulate prefill offload policies over a request trace",
        description=(
            "Replay a Mooncake-format trace (or a synthetic log-normal workload) over a "
            "remote prefill cluster, a local PD cluster and the link between them, under "
            "each policy, and report the load it ran at, each policy's capacity according "
            "to the throughput model, and which policies saturate. Defaults: the case study "
            "(1T hybrid, 4 remote 8xH200, 8 local 8xH20 at 0.15 relative compute, 100 Gbit/s). "
            "Rates: 100gbps, 2.5gbit, 800mbps, 1.25GB/s; times: 20ms, 1.5s; schedules: "
            "TIME:RATE[,TIME:RATE...] starting at 0."
        ),
    )
    p.set_defaults(func=run)
    take_negative_values(p)  # --link -5gbps: refused as negative, not "expected one argument"
    w = p.add_argument_group("workload")
    w.add_argument("--trace", metavar="FILE",
                   help="Mooncake-format JSONL trace (.gz accepted); omitted: synthetic log-normal")
    w.add_argument("--limit", type=POSITIVE_INT, metavar="N",
                   help="use only the first N records of the trace, in file order")
    load = w.add_mutually_exclusive_group()
    load.add_argument("--speedup", type=POSITIVE, default=1.0, metavar="X",
                      help="compress arrival times by this factor (default 1: as recorded)")
    load.add_argument("--load", type=_at_most(number, MAX_LOAD, f"{MAX_LOAD:,.0f}", "number"),
                      metavar="F",
                      help="rescale arrivals so the offered rate is F x the model's capacity "
                           "of --load-baseline (e.g. 0.7), at --threshold for selective "
                           f"(at most {MAX_LOAD:,.0f})")
    # Options that only some runs use default to None (argparse's default), so that one
    # given where it does nothing can be told from one left out; _resolved() fills in
    # their defaults.
    w.add_argument("--load-baseline", type=argument_type(_policy, "policy"), metavar="POLICY",
                   help="policy whose capacity --load refers to (default: selective)")
    w.add_argument("--requests", type=POSITIVE_INT, metavar="N",
                   help=f"synthetic: number of requests (default {SYNTHETIC_DEFAULTS['requests']})")
    w.add_argument("--rate", type=POSITIVE, metavar="RPS",
                   help=f"synthetic: Poisson arrivals per second (default {SYNTHETIC_DEFAULTS['rate']:g})")
    w.add_argument("--mu", type=argument_type(_real, "number"),
                   help=f"synthetic: log-normal mu of the input length (default {SYNTHETIC_DEFAULTS['mu']:.2f})")
    w.add_argument("--sigma", type=POSITIVE,
                   help=f"synthetic: log-normal sigma of the input length (default {SYNTHETIC_DEFAULTS['sigma']:.2f})")
    w.add_argument("--min-tokens", type=POSITIVE_INT,
                   help=f"synthetic: shortest input (default {SYNTHETIC_DEFAULTS['min_tokens']})")
    w.add_argument("--max-tokens", type=POSITIVE_INT,
                   help=f"synthetic: longest input (default {SYNTHETIC_DEFAULTS['max_tokens']})")
    w.add_argument("--clip-lengths", action="store_true", default=None,
                   help="synthetic: clip the log-normal to [min, max] instead of truncating it")
    w.add_argument("--output-tokens", type=POSITIVE_INT,
                   help=f"synthetic: output length of every request (default {SYNTHETIC_DEFAULTS['output_tokens']})")
    w.add_argument("--seed", type=NON_NEGATIVE_INT, default=0,
                   help="seed of the synthetic workload and of the bandwidth noise (default 0)")
    s = p.add_argument_group("system")
    s.add_argument("--profile", default="hybrid-1t",
                   help=f"remote instance profile: {', '.join(BUILTIN_PROFILES)} or a .json/.toml file")
    s.add_argument("--local-profile", metavar="FILE",
                   help="local prefill profile file (default: the remote one at --relative-compute)")
    s.add_argument("--relative-compute", default=0.15,
                   type=_at_least(number, MIN_RELATIVE_COMPUTE, f"{MIN_RELATIVE_COMPUTE:g}", "number"),
                   help="local instance compute relative to a remote one (default 0.15: H20 vs H200; "
                        f"at least {MIN_RELATIVE_COMPUTE:g})")
    s.add_argument("--remote-instances", type=NON_NEGATIVE_INT, default=4,
                   help=f"remote prefill instances (default 4; at most {MAX_INSTANCES:,})")
    s.add_argument("--local-instances", type=POSITIVE_INT, default=8,
                   help=f"local PD instances, split between prefill and decode (default 8; at most {MAX_INSTANCES:,})")
    s.add_argument("--prefill-instances", type=NON_NEGATIVE, metavar="N_P",
                   help="local prefill instances N_p, > 0 unless the only policy is offload-all; "
                        "whole instances, or whole GPUs at --split-granularity gpu "
                        "(default: the model's best split per policy)")
    s.add_argument("--split-granularity", choices=["instance", "gpu"], default="instance",
                   help="prefill/decode split in whole instances or in GPUs (default instance)")
    s.add_argument("--gpus-per-instance", type=POSITIVE_INT, default=8,
                   help=f"GPUs of one local instance, for --split-granularity gpu (default 8; at most "
                        f"{MAX_GPUS_PER_INSTANCE}, and {MAX_SPLITS:,} local GPUs in all)")
    s.add_argument("--decode-step", type=_at_most(parse_duration, MAX_DECODE_STEP_S, "1 min", "duration"),
                   default=0.05, metavar="TIME",
                   help="one decode step of a full batch (default 50ms; at most 1 min)")
    s.add_argument("--decode-batch", type=POSITIVE_INT, default=64,
                   help="concurrent sequences per decode instance (default 64)")
    link = s.add_mutually_exclusive_group()
    link.add_argument("--link", type=argument_type(positive(parse_rate, "rate"), "rate"), default=100e9,
                      metavar="RATE", help="link rate, e.g. 100gbps, 10gbit, 800mbps (default 100gbps; "
                           "10kbps to 1000tbps)")
    link.add_argument("--link-schedule", type=argument_type(parse_schedule, "schedule"),
                      metavar="SCHEDULE",
                      help="rate over time from the first arrival, e.g. 0s:10gbps,300s:1gbps,600s:10gbps "
                           "(instead of --link; rates as --link's)")
    s.add_argument("--rtt", type=_at_most(parse_duration, MAX_RTT_S, "1 h", "duration"), default=0.01,
                   metavar="TIME", help="round-trip time between the clusters (default 10ms; at most 1 h)")
    s.add_argument("--cache-blocks", type=NON_NEGATIVE_INT, metavar="N",
                   help="prefix cache of each cluster, 512-token blocks "
                        "(default: the profile's per-instance size x instances)")
    a = p.add_argument_group("adaptive policy and the link rules")
    a.add_argument("--bandwidth-noise", default=0.0,
                   type=_at_most(functools.partial(number, strictly_positive=False),
                                 MAX_BANDWIDTH_NOISE, f"{MAX_BANDWIDTH_NOISE:g}", "number"),
                   help="relative standard deviation of adaptive's bandwidth estimate, log-normal around "
                        "the link's rate (default 0; at most 100)")
    a.add_argument("--bandwidth-window", type=argument_type(parse_duration, "duration"),
                   default=60.0, metavar="TIME",
                   help="time constant of adaptive's bandwidth average (default 60s)")
    a.add_argument("--hysteresis", type=NON_NEGATIVE, default=0.25,
                   help="relative bandwidth change before adaptive retunes (default 0.25)")
    a.add_argument("--egress-window", type=argument_type(parse_duration, "duration"),
                   default=0.0, metavar="TIME",
                   help="selective and adaptive: pass decide() the KV they offloaded over this "
                        "window as egress demand (e.g. 60s), so its link rules raise the threshold, "
                        "then refuse to offload, when the link carries less than their threshold's "
                        "plan needs (default 0: no demand, those rules off)")
    o = p.add_argument_group("policies and output")
    o.add_argument("--policy", type=argument_type(_policies, "policies"),
                   default=list(PolicyName), metavar="LIST",
                   help="comma-separated: " + ", ".join(PolicyName) + " (default: all)")
    o.add_argument("--threshold", type=NON_NEGATIVE, metavar="TOKENS",
                   help="fixed t for selective (default: the optimizer's); adaptive ignores it "
                        "and follows the optimizer's t for its bandwidth estimate")
    o.add_argument("--json", metavar="FILE",
                   help="write the configuration and per-policy results as JSON ('-': stdout)")
    o.add_argument("--plot", metavar="FILE.png",
                   help="plot throughput against t, model and simulated (needs matplotlib)")
    o.add_argument("--plot-points", default=12,
                   type=argument_type(functools.partial(whole_number, maximum=MAX_PLOT_POINTS), "int"),
                   help=f"simulated thresholds on the plot (default 12; at most {MAX_PLOT_POINTS:,})")


#: The synthetic workload's options (without --trace) and their defaults (their help
#: texts quote them from here).
SYNTHETIC_DEFAULTS: dict[str, Any] = {
    "requests": 4000,
    "rate": 2.0,
    "mu": 9.90,
    "sigma": 1.00,
    "min_tokens": 128,
    "max_tokens": 131072,
    "clip_lengths": False,
    "output_tokens": 1024,
}


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def _resolved(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with the defaults of the options left out filled in (a copy: the parsed
    namespace is left as it was), after refusing options that the run would ignore: they
    were accepted and did nothing, so a typo'd or misplaced option went unnoticed."""
    if args.trace:
        ignored = [_option(k) for k in SYNTHETIC_DEFAULTS if getattr(args, k, None) is not None]
        if ignored:
            raise UsageError(
                f"{', '.join(ignored)} shape{'s' if len(ignored) == 1 else ''} the synthetic "
                "workload, not --trace (a trace has its own requests, arrivals and lengths): "
                "drop " + ("it" if len(ignored) == 1 else "them") + " or --trace"
            )
    elif args.limit is not None:
        raise UsageError(
            "--limit N keeps the first N records of --trace; without a trace, --requests N "
            "sets the synthetic workload's size"
        )
    if args.load_baseline is not None and args.load is None:
        raise UsageError("--load-baseline names the policy whose capacity --load refers to: "
                         "give --load too, or drop it")
    baseline = PolicyName.SELECTIVE if args.load_baseline is None else args.load_baseline
    if (
        args.threshold is not None
        and PolicyName.SELECTIVE not in args.policy
        and not (args.load is not None and baseline is PolicyName.SELECTIVE)
    ):
        raise UsageError(
            "--threshold fixes selective's t (adaptive takes its own from the optimizer), and "
            f"--policy {','.join(args.policy)} does not run selective: add it to --policy, "
            "or drop --threshold"
        )
    out = argparse.Namespace(**vars(args))
    out.load_baseline = baseline
    for name, default in SYNTHETIC_DEFAULTS.items():
        if getattr(out, name, None) is None:
            setattr(out, name, default)
    return out


def _check_output(path: str, what: str) -> None:
    """Fail before the run, not after it: the folder exists and is writable."""
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"{what} {path!r} is a directory")
    folder = target.parent if str(target.parent) else Path(".")
    if not folder.is_dir():
        raise UsageError(f"{what} {path!r}: folder {str(folder)!r} does not exist")
    if not os.access(folder, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise UsageError(f"{what} {path!r} is not writable")


def same_file(a: str, b: str) -> bool:
    """Whether two output paths name one file (spelled alike or not, or hard-linked); the
    bench's outputs are checked with it too."""
    if Path(a).resolve() == Path(b).resolve():
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist yet
        return False


def _preflight(args: argparse.Namespace) -> None:
    if args.json and args.json != "-" and args.plot and same_file(args.json, args.plot):
        # The plot, written last, would replace the JSON.
        raise UsageError(f"--json and --plot name the same file {args.plot!r}: give each its own")
    inputs = (
        ("--trace", args.trace),
        ("--profile", None if args.profile in BUILTIN_PROFILES else args.profile),
        ("--local-profile", args.local_profile),
    )
    for option, output in (("--json", args.json if args.json != "-" else None), ("--plot", args.plot)):
        for source, path in inputs:
            if output and path and same_file(output, path):
                # It was read before the output was written, then replaced by it.
                raise UsageError(
                    f"{option} {output!r} is the {source} file: writing it would replace the "
                    "input; give another path"
                )
    if args.json and args.json != "-":
        _check_output(args.json, "--json")
    if args.plot:
        _check_output(args.plot, "--plot")
        try:
            import matplotlib  # noqa: F401
            from matplotlib.backend_bases import FigureCanvasBase
        except ImportError:
            raise UsageError("--plot needs matplotlib (pip install kvwire[plot])") from None
        from kvwire.scheduler.plot import plot_format

        suffix = plot_format(args.plot)
        formats = FigureCanvasBase.get_supported_filetypes()
        if suffix not in formats:
            raise UsageError(
                f"--plot {args.plot!r}: matplotlib cannot write {suffix!r} files "
                f"(use one of {', '.join(sorted(formats))})"
            )
    if args.min_tokens >= args.max_tokens:
        raise UsageError("--min-tokens must be below --max-tokens")
    for option in ("min_tokens", "max_tokens", "output_tokens"):
        if getattr(args, option) > MAX_TOKENS:
            raise UsageError(f"--{option.replace('_', '-')} must be at most {MAX_TOKENS:,} tokens")


def _check_plot(reqs: tuple[TraceRequest, ...], config: SimulationConfig) -> None:
    """``--plot`` simulates ``selective`` at a range of thresholds, whatever ``--policy``
    says: fail before the simulation, not after the table, where it cannot run (no remote
    instance; a split without a local prefill server, which policy_capacity refuses)."""
    if config.cluster.remote_instances < 1:
        raise UsageError("--plot simulates selective, which needs at least one remote instance")
    try:
        policy_capacity(PolicyName.SELECTIVE, reqs, config)
    except UsageError as exc:
        raise UsageError(f"--plot simulates selective: {exc}") from None


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
            min_tokens=args.min_tokens,
            max_tokens=args.max_tokens,
            output_tokens=args.output_tokens,
            clip=args.clip_lengths,
        )
    # The link schedule's times count from the first arrival, whatever clock the trace's
    # timestamps are on (--load rescales from it too).
    t0 = min(r.arrival_s for r in reqs)
    reqs = tuple(replace(r, arrival_s=(r.arrival_s - t0) / args.speedup) for r in reqs)
    check_workload(reqs)
    return reqs


#: ClusterConfig's fields whose CLI option is the field's name (``--remote-instances``).
_OPTION_FIELDS = re.compile(r"\b(remote_instances|local_instances|gpus_per_instance|split_granularity)\b")
#: SimulationConfig's fields and their options.
_SIM_OPTIONS = {
    "prefill_instances": "--prefill-instances",
    "remote_cache_blocks": "--cache-blocks",
    "local_cache_blocks": "--cache-blocks",
    "rtt_s": "--rtt",
    "bandwidth_noise": "--bandwidth-noise",
    "bandwidth_time_constant_s": "--bandwidth-window",
    "hysteresis": "--hysteresis",
    "egress_window_s": "--egress-window",
}
_SIM_FIELDS = re.compile(r"\b(" + "|".join(_SIM_OPTIONS) + r")\b")


def _config(args: argparse.Namespace) -> SimulationConfig:
    schedule = args.link_schedule or ((0.0, args.link),)
    link = LinkSchedule.from_pairs(schedule)
    remote_profile = load_profile(args.profile)
    local_profile = load_profile(args.local_profile) if args.local_profile else None
    if not args.decode_step > 0:  # ClusterConfig's own message names its fields, not this option
        raise UsageError("--decode-step must be > 0")
    try:
        cluster = ClusterConfig(
            remote_profile=remote_profile,
            local_profile=local_profile,
            remote_instances=args.remote_instances,
            local_instances=args.local_instances,
            relative_compute=args.relative_compute,
            decode_step_s=args.decode_step,
            decode_batch_max=args.decode_batch,
            egress_bps=link.rates_bps[0],
            gpus_per_instance=args.gpus_per_instance,
            split_granularity=args.split_granularity,
        )
    except UsageError as exc:  # its checks (the count caps) name its fields: say the options
        raise UsageError(_OPTION_FIELDS.sub(lambda m: "--" + m[0].replace("_", "-"), str(exc))) from None
    try:
        return SimulationConfig(
            cluster=cluster,
            link=link,
            rtt_s=args.rtt,
            prefill_instances=args.prefill_instances,
            remote_cache_blocks=args.cache_blocks,
            local_cache_blocks=args.cache_blocks,
            bandwidth_noise=args.bandwidth_noise,
            bandwidth_time_constant_s=args.bandwidth_window,
            hysteresis=args.hysteresis,
            egress_window_s=args.egress_window,
        )
    except UsageError as exc:  # its checks name its fields (--prefill-instances 2.5): say the options
        raise UsageError(_SIM_FIELDS.sub(lambda m: _SIM_OPTIONS[m[0]], str(exc))) from None


#: ``--load F`` is reached when the offered rate is within this share of F x the capacity.
LOAD_TOLERANCE = 1e-3


def _at_load(
    reqs: tuple[TraceRequest, ...],
    config: SimulationConfig,
    load: float,
    baseline: PolicyName,
    threshold_tokens: float | None = None,
) -> tuple[tuple[TraceRequest, ...], float]:
    """Arrivals rescaled so the offered rate is ``load`` x the baseline's capacity (within
    :data:`LOAD_TOLERANCE`), and that capacity. The model's capacity depends on the mean
    link rate over the arrival window, which the rescaling changes under a rate schedule:
    a few fixed-point rounds settle it where the capacity moves little with the window
    (at once under one link rate); where they do not (a schedule whose step lands in the
    window: the fixed point jumped between the two sides of it, and four rounds ended at
    utilization 0.67 of a run labelled load 2), a bisection on the offered rate between
    one rescaling below the load and one above it. A load no rescaling reaches (a
    capacity that jumps past it) raises :class:`UsageError`: a run is never labelled with
    a load it does not run at. ``threshold_tokens`` (``--threshold``) is the threshold
    ``selective`` runs at, so its capacity is taken there; other baselines ignore it, as
    they do in the simulation."""
    fixed = threshold_tokens if baseline is PolicyName.SELECTIVE else None

    def capacity_of(trace: tuple[TraceRequest, ...]) -> float:
        cap = policy_capacity(baseline, trace, config, threshold_tokens=fixed).lambda_max_rps
        if not math.isfinite(cap) or cap <= 0:
            raise UsageError(f"the model gives {baseline} no finite capacity to scale --load to")
        return cap

    def reached(trace: tuple[TraceRequest, ...], cap: float) -> bool:
        return abs(offered_rate(trace) / cap - load) < LOAD_TOLERANCE * load

    # Rescalings that missed the load, by the side they missed it on (True: over it):
    # (offered rate, its load), the latest of each.
    bounds: dict[bool, tuple[float, float]] = {}

    def attempt(rate: float) -> tuple[tuple[TraceRequest, ...], float, bool]:
        """The arrivals at offered ``rate``, the capacity there, and whether they reach the
        load (if not, they bound it from their side, in ``bounds``)."""
        trace = scale_to_load(reqs, rate)
        check_workload(trace)
        cap = capacity_of(trace)
        if reached(trace, cap):
            return trace, cap, True
        at = offered_rate(trace) / cap
        bounds[at >= load] = (rate, at)
        return trace, cap, False

    cap = capacity_of(reqs)
    if reached(reqs, cap):
        return reqs, cap
    rate = load * cap
    for _ in range(4):
        trace, cap, done = attempt(rate)
        if done:
            return trace, cap
        rate = load * cap
    # A bracket: the load grows without bound with the offered rate (the window shrinks
    # to the schedule's first rate) and falls to 0 as it falls (the window grows).
    for _ in range(64):
        if len(bounds) == 2:
            break
        rate = bounds[False][0] * 2.0 if False in bounds else bounds[True][0] / 2.0
        trace, cap, done = attempt(rate)
        if done:
            return trace, cap
    if len(bounds) == 2:
        for _ in range(200):
            lo, hi = bounds[False][0], bounds[True][0]
            rate = math.sqrt(lo * hi)
            if not min(lo, hi) < rate < max(lo, hi):
                break  # as close as floating point gets: the capacity jumps here
            trace, cap, done = attempt(rate)
            if done:
                return trace, cap
        below, above = bounds[False], bounds[True]
        between = f": {below[1]:.3g} at {below[0]:.4g} rps, {above[1]:.3g} at {above[0]:.4g} rps"
    else:
        between = ""
    # Only a schedule makes the capacity move with the window; under one rate, say no more
    # than what happened (there is no schedule to blame).
    if len(config.link.rates_bps) > 1:
        why = (
            f"{baseline}'s capacity changes with the arrival window under the link schedule, "
            f"and no rescaling of the arrivals offers {load:g} x it"
        )
    else:
        why = f"no rescaling of the arrivals offers {load:g} x {baseline}'s capacity"
    raise UsageError(f"--load {load:g} cannot be reached: {why}{between}")


def _fmt(x: float | None, spec: str) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return format(x, spec)


#: The table's headers: a name, and under it the unit (none for a ratio, a count or a flag).
#: Every column says what it measures ("egress P99", not a second "P99" beside TTFT's).
_COLUMNS = (
    "policy", "capacity\nrps", "util", "thr\nrps", "saturated", "TTFT P50\ns", "P90\ns",
    "P99\ns", "egress mean\nGbit/s", "egress P99\nGbit/s", "offload", "cache hit", "t\ntok",
    "Np/Nd", "slack",
)


def _print_table(results: tuple[PolicyResult, ...], caption: str, out: TextIO) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="kvwire simulate", caption=caption)
    for col in _COLUMNS:
        table.add_column(col, justify="left" if col == "policy" else "right", no_wrap=True)
    for r in results:
        table.add_row(
            r.policy,
            _fmt(r.capacity_rps, ".3f"),
            _fmt(r.utilization, ".2f"),
            "n/a" if math.isnan(r.throughput_rps) else _fmt(r.throughput_rps, ".3f"),
            "n/a" if r.saturated is None else "SATURATED" if r.saturated else "no",
            _fmt(r.ttft_p50_s, ".2f"),
            _fmt(r.ttft_p90_s, ".2f"),
            _fmt(r.ttft_p99_s, ".2f"),
            _fmt(r.egress_gbps_mean, ".2f"),
            _fmt(r.egress_gbps_p99, ".1f"),
            _fmt(r.offload_fraction, ".3f"),
            _fmt(r.cache_hit_ratio, ".3f"),
            _fmt(r.threshold_tokens, ".0f"),
            f"{r.prefill_instances:g}/{r.decode_instances:g}",
            _fmt(r.balance_slack, "+.2f"),
        )
    Console(width=160, file=out).print(table)


def _json_safe(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _document(
    args: argparse.Namespace,
    reqs: tuple[TraceRequest, ...],
    config: SimulationConfig,
    opt: OptimizerResult,
    results: tuple[PolicyResult, ...],
) -> dict[str, Any]:
    b = opt.best
    return {
        "workload": {
            "source": args.trace or "synthetic",
            "requests": len(reqs),
            "offered_rps": _json_safe(offered_rate(reqs)),
            "load": args.load,
            "load_baseline": str(args.load_baseline) if args.load else None,
            "speedup": args.speedup,
            "seed": args.seed,
        },
        "system": {
            "profile": config.cluster.remote_profile.name,
            "remote_instances": config.cluster.remote_instances,
            "local_instances": config.cluster.local_instances,
            "relative_compute": config.cluster.relative_compute,
            "split_granularity": config.cluster.split_granularity,
            "decode_step_s": config.cluster.decode_step_s,
            "decode_batch_max": config.cluster.decode_batch_max,
            "link_schedule": [[t, r] for t, r in zip(config.link.starts_s, config.link.rates_bps, strict=True)],
            "rtt_s": config.rtt_s,
            "egress_window_s": config.egress_window_s,
            "cache_blocks": {"remote": config.cache_blocks("remote"), "local": config.cache_blocks("local")},
        },
        "model": {
            "threshold_tokens": b.threshold_tokens,
            "prefill_instances": b.prefill_instances,
            "decode_instances": b.decode_instances,
            "lambda_max_rps": _json_safe(b.lambda_max_rps),
            "offload_fraction": b.offload_fraction,
            "binding": str(b.binding),
            "balance_slack": _json_safe(b.balance_slack),
            "egress_bps": _json_safe(model_cluster(reqs, config).egress_bps),
        },
        "policies": {r.policy: r.as_json() for r in results},
    }


def run(args: argparse.Namespace) -> int:
    """Run the ``simulate`` subcommand; 0 on success, 2 on a usage error."""
    to_stdout = args.json == "-"
    out = sys.stderr if to_stdout else sys.stdout
    try:
        args = _resolved(args)
        _preflight(args)
        config = _config(args)  # before the workload: a bad cluster fails at once
        reqs = _workload(args)
        if args.load is not None:
            reqs, _ = _at_load(reqs, config, args.load, args.load_baseline, args.threshold)
        if args.plot:
            _check_plot(reqs, config)
        opt, results = simulate_policies(
            reqs, config, args.policy, seed=args.seed, threshold_tokens=args.threshold
        )
    except KvwireError as exc:
        print(f"kvwire simulate: {exc}", file=sys.stderr)
        return 2
    b = opt.best
    saturated = [r.policy for r in results if r.saturated]
    saturated_text = ", ".join(saturated) or "none"
    if results and all(r.saturated is None for r in results):
        saturated_text = "n/a (the arrivals span under 1 s)"
    offered = offered_rate(reqs)
    # One request has no rate (NaN), a burst at one instant an infinite one: n/a, as in
    # the table and the JSON.
    load_text = (
        f"offered {offered:.3f} rps"
        + (f" = {args.load:g} x {args.load_baseline}'s capacity" if args.load else "")
        if math.isfinite(offered)
        else "offered rate n/a"
    )
    caption = (
        f"{len(reqs)} request{'' if len(reqs) == 1 else 's'}, {load_text}; saturated: {saturated_text}\n"
        f"model: t*={b.threshold_tokens:.0f} tokens, N_p/N_d={b.prefill_instances:g}/"
        f"{b.decode_instances:g} ({config.cluster.split_granularity} split, balance slack "
        f"{b.balance_slack:+.2f}), Lambda_max={b.lambda_max_rps:.3f} rps, binding: {b.binding}\n"
        f"link {format_schedule(tuple(zip(config.link.starts_s, config.link.rates_bps, strict=True)))}"
        f" (mean {format_rate(model_cluster(reqs, config).egress_bps)} over "
        f"the arrivals), RTT {format_duration(config.rtt_s)}; decide's link rules: "
        + (
            f"on (egress demand over {format_duration(config.egress_window_s)})"
            if config.egress_window_s > 0
            else "off (no --egress-window)"
        )
    )
    _print_table(results, caption, out)
    doc = _document(args, reqs, config, opt, results)
    if to_stdout:
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
    elif args.json:
        try:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(doc, f, indent=2)
        except OSError as exc:
            print(f"kvwire simulate: cannot write {args.json}: {exc}", file=sys.stderr)
            return 2
    if args.plot:
        try:
            _plot(args, reqs, config, opt)
        except KvwireError as exc:
            print(f"kvwire simulate: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:
            print(f"kvwire simulate: cannot write {args.plot}: {exc}", file=sys.stderr)
            return 2
    return 0


def _plot(args: argparse.Namespace, reqs: tuple[TraceRequest, ...], config: SimulationConfig,
          opt: OptimizerResult) -> None:
    """Throughput against ``t``: the model's curve and ``selective`` simulated at
    ``--plot-points`` thresholds (quantiles of the input lengths) and at ``t*``."""
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
