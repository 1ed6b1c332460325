"""kvwire over emulated links: the bench scenarios, one table.

Each scenario is one ``kvwire bench`` run (userspace link emulator, sender, receiver
and emulator in three processes). ``--link`` is an Ethernet line rate (at MTU 1500): the
estimate and the wire rate count TCP payload, so they are held against the link's TCP
payload capacity (the report's ``payload_capacity_gbps``: 9.41 Gbit/s of a 10 Gbit/s
link), not the line rate.

1. ``--link 10gbps --rtt 20ms --codec raw``: link utilization, and whether the
   bandwidth estimate stays within 10% of the link's payload capacity after the first
   second;
2. the same with the rate stepping from 10 to 2.5 Gbit/s mid-run: how long after the
   step the estimate first comes within 15% of the new payload capacity (target: 1 s);
3. ``--link 1gbps --rtt 20ms --codec auto``: fp16 KV goodput over the link's payload
   capacity (above 1 means the codec delivered more KV than the link carries raw);
4. from run 1: time to first layer against the whole transfer;
5. on each of 10 and 1 Gbit/s (20 ms): every fixed codec and ``auto``, fp16 KV goodput
   each, and ``auto`` against the best fixed codec on that link (``--codec-links ''`` skips).
   Each round runs every codec afresh, one after another (none reuses a run of the
   scenarios above, made minutes earlier). With ``--rounds N`` the comparison runs N
   interleaved rounds (the codecs' order rotated each round) and reports medians with
   min-max, and ``auto`` against the best fixed codec of each round: on a shared host the
   speed drifts between runs by more than the codecs differ, so one run per codec ranks
   the host's moments as much as the codecs.

Run::

    python benchmarks/link.py
    python benchmarks/link.py --duration 6 --rounds 3
    python benchmarks/link.py --duration 6 --model llama3-8b --tokens 4096 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

from kvwire.bench import EMULATOR_PUMPS
from kvwire.bench.command import stream_count
from kvwire.bench.models import MODELS
from kvwire.bench.report import payload_capacity, payload_share
from kvwire.bench.runner import MIN_LINK_BPS, BenchConfig, run_bench
from kvwire.errors import KvwireError
from kvwire.session.options import AUTO_CODEC_MODES
from kvwire.units import argument_type, format_rate, whole_number


def _after(samples: list[dict[str, Any]], t: float) -> list[dict[str, Any]]:
    return [s for s in samples if s["t"] >= t and s["estimated_gbps"] is not None]


def within(samples: list[dict[str, Any]], tol: float, share: float = 1.0) -> float | None:
    """Share of samples whose estimate is within ``tol`` of the link's payload capacity
    then: the sample's line rate times ``share`` (:func:`payload_share`)."""
    if not samples:
        return None
    ok = sum(1 for s in samples
             if abs(s["estimated_gbps"] - s["link_gbps"] * share) <= tol * s["link_gbps"] * share)
    return ok / len(samples)


def settle_time(samples: list[dict[str, Any]], step_at: float, rate: float, tol: float) -> float | None:
    """Seconds after ``step_at`` until the estimate first comes within ``tol`` of ``rate``."""
    for s in _after(samples, step_at):
        if abs(s["estimated_gbps"] - rate) <= tol * rate:
            return float(s["t"] - step_at)
    return None


def _run(name: str, cfg: BenchConfig) -> dict[str, Any] | str:
    print(f"running: {name} ...", flush=True)
    try:
        return run_bench(cfg)
    except KvwireError as exc:
        return f"failed: {exc}"


def _cell(values: list[float], width: int) -> str:
    """One codec's goodput: the value of one run, or median (min-max) of several."""
    if not values:
        return f"{'failed':>{width}}"
    if len(values) == 1:
        return f"{values[0]:>{width}.3f}"
    text = f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"
    return f"{text:>{width}}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="llama3-8b")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--streams", type=argument_type(stream_count), default=4, metavar="N|auto",
                    help="TCP streams, 1-64, or auto (default 4)")
    ap.add_argument("--json", help="write every run's full report here")
    ap.add_argument("--codec-links", default="10,1", help="Gbit/s of the links for the codec comparison ('' to skip)")
    ap.add_argument("--codecs", default="raw,fp8,int8,int4", help="fixed codecs auto is compared with, each once")
    ap.add_argument("--auto-codec", choices=AUTO_CODEC_MODES, default="model",
                    help="how auto chooses (ClientOptions.auto_codec)")
    ap.add_argument("--emulator", choices=EMULATOR_PUMPS, default="auto",
                    help="the link emulator's pump (kvwire bench --emulator)")
    ap.add_argument("--rounds", type=argument_type(whole_number, "int"), default=1, help="interleaved rounds of the codec comparison")
    args = ap.parse_args()
    streams: int | str = args.streams
    try:
        link_gbps = [float(x) for x in args.codec_links.split(",") if x]
    except ValueError as exc:
        ap.error(f"--codec-links takes Gbit/s separated by commas ({exc})")
    if any(not gbps * 1e9 >= MIN_LINK_BPS for gbps in link_gbps):
        ap.error(f"--codec-links: every link must be at least {format_rate(MIN_LINK_BPS)}")
    fixed_codecs = args.codecs.split(",")
    if "auto" in fixed_codecs:
        ap.error("--codecs: auto is always compared; name the fixed codecs only")
    if len(set(fixed_codecs)) < len(fixed_codecs):
        ap.error(f"--codecs: a codec named twice ({args.codecs})")
    common: dict[str, Any] = {"model": args.model, "tokens": args.tokens, "duration": args.duration,
                              "streams": streams, "rtt": 0.020, "auto_codec": args.auto_codec,
                              "emulator": args.emulator}
    try:  # every run's settings are checked before the first one starts
        for gbps in [10.0, *link_gbps]:
            for codec in {"raw", "auto", *fixed_codecs}:
                BenchConfig(link_bps=gbps * 1e9, codec=codec, **common)
    except KvwireError as exc:
        ap.error(str(exc))
    step_at = args.duration / 2
    runs: dict[str, dict[str, Any] | str] = {
        "10G raw": _run("10 Gbit/s, 20 ms, raw", BenchConfig(link_bps=10e9, codec="raw", **common)),
        "10G->2.5G raw": _run(
            f"10 -> 2.5 Gbit/s at {step_at:g} s, 20 ms, raw",
            BenchConfig(schedule=((0.0, 10e9), (step_at, 2.5e9)), codec="raw", **common),
        ),
        "1G auto": _run("1 Gbit/s, 20 ms, auto", BenchConfig(link_bps=1e9, codec="auto", **common)),
    }
    scenarios = list(runs)  # the first table; the codec comparison has its own
    # Each round of the codec comparison runs every codec afresh, one after another: a
    # run of the scenarios above on the same link and codec was made a while earlier, on
    # a host whose speed has drifted since, and is not reused.
    names = [*fixed_codecs, "auto"]
    compared: dict[float, dict[str, list[dict[str, Any] | str]]] = {g: {n: [] for n in names} for g in link_gbps}
    for rnd in range(args.rounds):
        for gbps in link_gbps:
            order = names[rnd % len(names):] + names[:rnd % len(names)]  # rotated: no codec always last
            for codec in order:
                key = f"{gbps:g}G {codec} #{rnd + 1}"  # "1G auto" is the scenario above
                what = f"{gbps:g} Gbit/s, 20 ms, {codec}" + (f", round {rnd + 1}" if args.rounds > 1 else "")
                runs[key] = _run(what, BenchConfig(link_bps=gbps * 1e9, codec=codec, **common))
                compared[gbps][codec].append(runs[key])

    print()
    print(f"{args.model}, {args.tokens} tokens per transfer, {args.duration:g} s per run, "
          f"RTT 20 ms, {streams} streams, emulator pump {BenchConfig(**common).emulator}")
    header = f"{'scenario':<16} {'link':>10} {'goodput':>9} {'wire':>9} {'util':>6} {'estimate':>9}  check"
    print(header)
    print("-" * len(header))
    for name in scenarios:
        r = runs[name]
        if isinstance(r, str):
            print(f"{name:<16} {r}")
            continue
        if name == "10G raw":
            share = within(_after(r["samples"], 1.0), 0.10, payload_share(r))
            check = "estimate within 10% of the payload capacity after 1 s: " + (
                "-" if share is None else f"{100 * share:.0f}% of samples")
        elif name == "10G->2.5G raw":
            after = 2.5 * payload_share(r)  # the payload a 2.5 Gbit/s link carries
            t = settle_time(r["samples"], step_at, after, 0.15)
            check = f"estimate within 15% of {after:.3g} Gbit/s (2.5 Gbit/s's payload) " + (
                "never" if t is None else f"{t:.2f} s after the step ({'yes' if t <= 1.0 else 'NO'}, target 1 s)")
        else:
            err = r["max_rel_error"]
            capacity, _ = payload_capacity(r)
            check = (f"goodput/payload capacity {r['goodput_gbps'] / capacity:.2f}, "
                     f"codecs {', '.join(r['codecs_used'])}, "
                     f"max rel. error {'-' if err is None else f'{err:.3g}'}")
        est = r["estimated_gbps"]
        print(f"{name:<16} {r['link_gbps']:>6.2f} Gbit/s {r['goodput_gbps']:>9.3f} {r['wire_gbps']:>9.3f} "
              f"{100 * (r['utilization'] or 0):>5.1f}% {'-' if est is None else f'{est:9.3f}'}  {check}")
    first = runs["10G raw"]
    if not isinstance(first, str) and first["per_transfer"]:
        ttfl = [t["time_to_first_layer_ms"] for t in first["per_transfer"] if t["time_to_first_layer_ms"] is not None]
        total = [t["seconds"] * 1e3 for t in first["per_transfer"]]
        if ttfl:
            print(f"time to first layer (10G raw): median {statistics.median(ttfl):.1f} ms of a "
                  f"{statistics.median(total):.0f} ms transfer ({first['transfers']} transfers; "
                  f"first transfer {ttfl[0]:.1f} of {total[0]:.0f} ms)")
    if compared:
        many = args.rounds > 1
        print("\nfp16 KV goodput, Gbit/s" + (f", median of {args.rounds} rounds (min-max)" if many else "")
              + " (auto's chunks by codec in brackets)")
        width = 20 if many else 8
        head = f"{'link':>10} " + " ".join(f"{n:>{width}}" for n in names) + "  auto / best fixed"
        print(head)
        print("-" * len(head))
        for gbps, row in compared.items():
            got = {n: [x["goodput_gbps"] for x in rs if not isinstance(x, str)] for n, rs in row.items()}
            med = {n: statistics.median(v) for n, v in got.items() if v}

            fixed = [v for n, v in med.items() if n != "auto"]
            verdict = "-"
            if "auto" in med and fixed:
                best = max(fixed)
                verdict = f"{med['auto'] / best:.2f} ({'yes' if med['auto'] >= best else 'no'})"
                if many:  # within each round, against that round's best fixed codec
                    per = []
                    for rnd in range(args.rounds):
                        one = {n: x["goodput_gbps"] for n, rs in row.items() if not isinstance(x := rs[rnd], str)}
                        if "auto" in one and len(one) > 1:
                            per.append(one["auto"] / max(v for n, v in one.items() if n != "auto"))
                    verdict += " rounds " + ", ".join(f"{x:.2f}" for x in per)
            mixes = [x["codec_shares"] for x in row["auto"] if not isinstance(x, str)]
            shares = {n: statistics.fmean(m.get(n, 0.0) for m in mixes) for n in {n for m in mixes for n in m}}
            used = ("  [" + ", ".join(f"{n} {100 * v:.0f}%" for n, v in sorted(shares.items(), key=lambda kv: -kv[1]))
                    + "]") if shares else ""
            print(f"{gbps:>4g} Gbit/s " + " ".join(_cell(got[n], width) for n in names) + f"  {verdict}{used}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(runs, fh, indent=2)


if __name__ == "__main__":
    main()
