"""``kvwire bench`` and ``kvwire serve``: measure KV transfers, and receive them remotely."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

from kvwire.bench.models import MODELS
from kvwire.errors import KvwireError, UsageError
from kvwire.scheduler.units import format_rate, parse_rate, parse_rate_schedule

__all__ = [
    "add_parsers",
    "parse_duration",
    "parse_link_schedule",
    "run_bench_command",
    "run_serve_command",
    "write_plot",
]


# -- argument types ---------------------------------------------------------------------------

_DURATION_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(us|ms|s)?\s*$")
_SCALE = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def parse_duration(text: str, default_unit: str = "ms") -> float:
    """Seconds for ``20ms``, ``0.5s``, ``250us``; a bare number is in ``default_unit``."""
    match = _DURATION_RE.match(text)
    if match is None:
        raise UsageError(f"cannot parse duration {text!r} (try 20ms, 0.5s)")
    value = float(match[1]) * _SCALE[match[2] or default_unit]
    if not math.isfinite(value):
        raise UsageError(f"duration {text!r} is not finite")
    return value


def parse_link_schedule(text: str) -> tuple[tuple[float, float], ...]:
    """A rate schedule: ``10gbps,2.5gbps@3s,10gbps@6s`` (each ``RATE@START``, the first
    at 0 unless it says otherwise) or the ``0:10gbps,3:2.5gbps`` form of ``simulate``."""
    if ":" in text:
        return parse_rate_schedule(text)
    items: list[tuple[float, float]] = []
    for i, part in enumerate(p.strip() for p in text.split(",")):
        if not part:
            continue
        rate_text, sep, at_text = part.partition("@")
        if sep:
            at = parse_duration(at_text, default_unit="s")
        elif i == 0:
            at = 0.0
        else:
            raise UsageError(f"schedule item {part!r} needs a start time, e.g. {part}@3s")
        items.append((at, parse_rate(rate_text)))
    if not items:
        raise UsageError("empty rate schedule")
    items.sort()
    if items[0][0] != 0.0:
        raise UsageError("a rate schedule must start at time 0")
    for _, rate in items:
        if not rate > 0:
            raise UsageError("schedule rates must be > 0")
    return tuple(items)


def _arg(fn: Any, *extra: Any) -> Any:
    """An argparse ``type=`` that turns UsageError into argparse's own error (exit 2)."""

    def convert(text: str) -> Any:
        try:
            return fn(text, *extra)
        except UsageError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = getattr(fn, "__name__", "value")
    return convert


def _rate(text: str) -> float:
    rate = parse_rate(text)
    if not rate > 0 or not math.isfinite(rate):
        raise UsageError(f"link rate {text!r} must be > 0")
    return rate


def _streams(text: str) -> int | str:
    if text == "auto":
        return "auto"
    try:
        n = int(text)
    except ValueError:
        raise UsageError(f"--streams takes an int in [1, 64] or 'auto', not {text!r}") from None
    if not 1 <= n <= 64:
        raise UsageError(f"--streams takes an int in [1, 64] or 'auto', not {n}")
    return n


def _codec(text: str) -> str:
    from kvwire.codec import available_codecs

    known = available_codecs()
    if text != "auto" and text not in known:
        raise UsageError(f"unknown codec {text!r} (known: auto, {', '.join(sorted(known))})")
    return text


def _hostport(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise UsageError(f"--peer takes HOST:PORT, not {text!r}")
    try:
        number = int(port)
    except ValueError:
        raise UsageError(f"bad port in {text!r}") from None
    if not 0 < number < 65536:
        raise UsageError(f"bad port in {text!r}")
    return host.strip("[]"), number


def _positive(kind: type) -> Any:
    def convert(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise UsageError(f"{text!r} is not a number") from None
        if not value > 0 or not math.isfinite(value):
            raise UsageError(f"{text!r} must be > 0")
        return value

    convert.__name__ = kind.__name__
    return convert


# -- parsers ----------------------------------------------------------------------------------


def add_parsers(subparsers: Any) -> None:
    """Register ``bench`` and ``serve`` on an ``argparse`` subparsers object."""
    b: argparse.ArgumentParser = subparsers.add_parser(
        "bench",
        help="measure KV transfers over loopback, an emulated link, or to a remote server",
        description=(
            "Send a model's KV cache (random fp16 of the model's shape) again and again for "
            "--duration seconds and report goodput, wire rate, link utilization, the "
            "bandwidth estimate, time to first layer and the codec's error. Without --link "
            "it runs over plain loopback against a raw-socket baseline measured in the same "
            "run; with --link/--rtt through a userspace link emulator (or --kernel: tbf "
            "between two network namespaces, root only); with --peer to a `kvwire serve`."
        ),
    )
    b.set_defaults(func=run_bench_command)
    link = b.add_argument_group("link")
    link.add_argument("--link", type=_arg(_rate), metavar="RATE", help="link rate, e.g. 10gbps, 800mbps")
    link.add_argument("--rtt", type=_arg(parse_duration), default=0.0, metavar="TIME",
                      help="round-trip time added by the emulator, e.g. 20ms (default 0)")
    link.add_argument("--jitter", type=_arg(parse_duration), default=0.0, metavar="TIME",
                      help="+- variation of each one-way delay, e.g. 1ms (default 0)")
    link.add_argument("--link-schedule", type=_arg(parse_link_schedule), metavar="SCHEDULE",
                      help="rate over time, e.g. '10gbps,2.5gbps@3s' (replaces --link)")
    link.add_argument("--kernel", action="store_true",
                      help="shape with tc tbf between two network namespaces (root only; rate only)")
    link.add_argument("--peer", type=_arg(_hostport), metavar="HOST:PORT",
                      help="send to a remote `kvwire serve` instead of a local receiver")
    link.add_argument("--secret-file", metavar="FILE",
                      help="shared secret for --peer (else $KVWIRE_SECRET, else the development default)")
    load = b.add_argument_group("transfer")
    load.add_argument("--codec", type=_arg(_codec), default="raw",
                      help="raw, fp8, int8, int4, auto or any registered codec (default raw)")
    load.add_argument("--streams", type=_arg(_streams), default=4, metavar="N|auto",
                      help="TCP streams per session (default 4)")
    load.add_argument("--model", choices=sorted(MODELS), default="llama3-8b",
                      help="KV shape to send (default llama3-8b: 32 x 8 x 128 fp16)")
    load.add_argument("--tokens", type=_arg(_positive(int)), default=8192,
                      help="tokens per transfer (default 8192)")
    load.add_argument("--duration", type=_arg(_positive(float)), default=10.0, metavar="SECONDS",
                      help="keep starting transfers for this long (default 10)")
    load.add_argument("--seed", type=int, default=0, help="seed of the random cache")
    load.add_argument("--no-baseline", action="store_true",
                      help="skip the raw-socket baseline of loopback runs")
    out = b.add_argument_group("output")
    out.add_argument("--json", metavar="FILE", help="write the full report (with samples) here")
    out.add_argument("--plot", metavar="FILE.png",
                     help="plot wire rate, estimate and link rate over time (needs matplotlib)")
    out.add_argument("--quiet", action="store_true", help="no progress bar and no table")

    s: argparse.ArgumentParser = subparsers.add_parser(
        "serve",
        help="receive KV transfers (the far end of `kvwire bench --peer`)",
        description=(
            "Accept kvwire transfers and print one line per transfer; for bench transfers, "
            "regenerate the sent cache from its seed at the end of each bench and print "
            "the codec's max relative error."
        ),
    )
    s.set_defaults(func=run_serve_command)
    s.add_argument("--port", type=int, default=7070, help="port to listen on (default 7070; 0 picks one)")
    s.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    s.add_argument("--secret-file", metavar="FILE",
                   help="shared secret (else $KVWIRE_SECRET, else the development default)")
    s.add_argument("--once", action="store_true", help="exit after one bench has ended")


def _fail(command: str, exc: Exception, code: int) -> int:
    print(f"kvwire {command}: error: {exc}", file=sys.stderr)
    return code


# -- bench --------------------------------------------------------------------------------------


def run_bench_command(args: argparse.Namespace) -> int:
    from kvwire.bench.runner import BenchConfig, load_secret

    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return _fail("bench", UsageError(
                "--plot needs matplotlib: pip install 'kvwire[plot]'"), 2)
    try:
        if args.secret_file is not None and args.peer is None:
            raise UsageError("--secret-file is for --peer (local runs make their own secret)")
        cfg = BenchConfig(
            model=args.model, tokens=args.tokens, codec=args.codec, streams=args.streams,
            duration=args.duration, link_bps=args.link, schedule=args.link_schedule or (),
            rtt=args.rtt, jitter=args.jitter, kernel=args.kernel, peer=args.peer,
            baseline=not args.no_baseline, seed=args.seed,
        )
        if args.peer is not None:
            secret, warning = load_secret(args.secret_file)
            if warning:
                print(warning, file=sys.stderr)
            cfg = dataclasses.replace(cfg, secret=secret)
    except UsageError as exc:
        return _fail("bench", exc, 2)

    try:
        result = _run_with_progress(cfg, quiet=args.quiet)
    except UsageError as exc:
        return _fail("bench", exc, 2)
    except KvwireError as exc:
        return _fail("bench", exc, 1)

    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if args.plot:
        write_plot(result, args.plot)
    if not args.quiet:
        _print_summary(result)
    return 0


def _run_with_progress(cfg: Any, *, quiet: bool) -> dict[str, Any]:
    from kvwire.bench.runner import run_bench

    if quiet:
        return run_bench(cfg)
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    progress = Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), TimeElapsedColumn(),
        TextColumn("{task.fields[status]}"), console=console, transient=True,
        auto_refresh=False,
    )
    task = progress.add_task("bench", total=cfg.duration, status="starting")

    def update(point: dict[str, Any]) -> None:
        est = point.get("estimated_gbps")
        status = (
            f"{point['transfers']} transfers  wire {point['wire_gbps']:.2f} Gbit/s  "
            f"estimate {'-' if est is None else f'{est:.2f}'} Gbit/s"
        )
        if point.get("link_gbps") is not None:
            status += f"  link {point['link_gbps']:.2f} Gbit/s"
        progress.update(task, completed=min(point["elapsed"], cfg.duration), status=status)
        progress.refresh()

    def log(line: str) -> None:
        progress.console.print(line)

    with progress:
        return run_bench(cfg, on_progress=update, log=log)


def _fmt(value: Any, spec: str = ".3g", unit: str = "") -> str:
    if value is None:
        return "-"
    return f"{value:{spec}}{unit}"


def _print_summary(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    where = {
        "loopback": "loopback",
        "emulated": "emulated link",
        "kernel": "kernel-shaped link (tbf)",
        "peer": f"peer {r.get('peer')}",
    }[r["mode"]]
    table = Table(title=f"kvwire bench: {r['model']}, {r['tokens']} tokens, {where}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows: list[tuple[str, str]] = [
        ("link", format_rate(r["link_gbps"] * 1e9) if r["link_gbps"] else "unshaped"),
        ("RTT", _fmt(r["rtt_ms"], ".3g", " ms")),
        ("codec", r["codec"] + (f" ({', '.join(r['codecs_used'])})" if r["codecs_used"] and r["codecs_used"] != [r["codec"]] else "")),
        ("streams", str(r["streams"])),
        ("transfers", f"{r['transfers']} x {r['kv_bytes_per_transfer'] / 1e6:.1f} MB"
         + (f" ({r['incomplete_transfers']} abandoned)" if r["incomplete_transfers"] else "")),
        ("seconds", _fmt(r["seconds"], ".2f")),
        ("goodput (fp16 KV)", _fmt(r["goodput_gbps"], ".3f", " Gbit/s")),
        ("wire rate", _fmt(r["wire_gbps"], ".3f", " Gbit/s")),
        ("utilization", _fmt(None if r["utilization"] is None else 100 * r["utilization"], ".1f", " %")),
        ("estimate at end", _fmt(r["estimated_gbps"], ".3f", " Gbit/s")),
        ("time to first layer (median)", _fmt(r["time_to_first_layer_ms"], ".1f", " ms")),
        ("transfer time (median)", _fmt(None if r["transfer_seconds_median"] is None else r["transfer_seconds_median"] * 1e3, ".1f", " ms")),
        ("max rel. error (checked layers)", "see the server's output" if r["mode"] == "peer" else _fmt(r["max_rel_error"], ".3g")),
    ]
    if r.get("baseline_gbps") is not None:
        rows.append(("raw-socket baseline", _fmt(r["baseline_gbps"], ".3f", " Gbit/s")))
        rows.append(("goodput / baseline", _fmt(r["baseline_ratio"], ".2f")))
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)


def write_plot(result: dict[str, Any], path: str) -> None:
    """Wire rate, bandwidth estimate and link rate over time, to a PNG."""
    try:
        import matplotlib
    except ImportError as exc:
        raise UsageError("--plot needs matplotlib: pip install 'kvwire[plot]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["samples"]
    t = [s["t"] for s in samples]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.plot(t, [s["wire_gbps"] for s in samples], label="wire rate", lw=1.2)
    ax.plot(t, [s["estimated_gbps"] if s["estimated_gbps"] is not None else float("nan") for s in samples],
            label="estimate", lw=1.2)
    if any(s["link_gbps"] is not None for s in samples):
        ax.step(t, [s["link_gbps"] if s["link_gbps"] is not None else float("nan") for s in samples],
                where="post", label="link rate", color="black", ls="--", lw=1)
    ax.set_xlabel("seconds")
    ax.set_ylabel("Gbit/s")
    ax.set_ylim(bottom=0)
    ax.set_title(
        f"{result['model']} x {result['tokens']} tokens, codec {result['codec']}, "
        f"{result['streams']} streams, RTT {_fmt(result['rtt_ms'], '.3g', ' ms')}"
    )
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- serve --------------------------------------------------------------------------------------


def run_serve_command(args: argparse.Namespace) -> int:
    from kvwire.aio import run
    from kvwire.bench.runner import load_secret, serve_benches

    try:
        secret, warning = load_secret(args.secret_file)
    except UsageError as exc:
        return _fail("serve", exc, 2)
    if warning:
        print(warning, file=sys.stderr, flush=True)

    def log(line: str) -> None:
        print(line, flush=True)

    def ready(port: int) -> None:
        print(f"kvwire serve: listening on {args.host}:{port}", flush=True)

    try:
        run(serve_benches(args.host, args.port, secret=secret, once=args.once, log=log, ready=ready))
    except UsageError as exc:
        return _fail("serve", exc, 2)
    except (KvwireError, OSError) as exc:
        return _fail("serve", exc, 1)
    return 0
