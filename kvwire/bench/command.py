"""``kvwire bench`` and ``kvwire serve``: measure KV transfers, and receive them remotely."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import ipaddress
import json
import logging
import os
import signal
import socket
import stat
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvwire.aio._logtext import address
from kvwire.bench import EMULATOR_PUMPS
from kvwire.bench.models import MODELS
from kvwire.errors import KvwireError, UsageError
from kvwire.scheduler.command import same_file
from kvwire.scheduler.plot import plot_format
from kvwire.session.options import AUTO_CODEC_MODES
from kvwire.units import (
    argument_type,
    format_duration,
    format_rate,
    format_schedule,
    format_size,
    is_ipv6,
    parse_duration,
    parse_rate,
    parse_schedule,
    parse_size,
    positive,
    split_hostport,
    take_negative_values,
    whole_number,
)
from kvwire.wire.frames import DEFAULT_CHUNK_BYTES

__all__ = [
    "add_parsers",
    "check_bench_options",
    "check_output_path",
    "is_loopback",
    "plot_format",
    "run_bench_command",
    "run_serve_command",
    "wire_label",
    "write_plot",
]

log = logging.getLogger("kvwire")


# -- argument types ---------------------------------------------------------------------------
# Rates, durations, sizes and schedules are read by kvwire.units, the one syntax of every
# command: 10gbps, 20ms, 1MiB, 0s:10gbps,3s:2.5gbps (a bare duration is in seconds).


_LINK_RATE = argument_type(positive(parse_rate, "link rate"), "rate")
_POSITIVE_DURATION = argument_type(positive(parse_duration, "duration"), "duration")


def stream_count(text: str) -> int | str:
    """``--streams``: an int in [1, 64] or ``auto`` (with kvwire.units' ``argument_type``)."""
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
    from kvwire.bench.runner import check_codec

    return check_codec(text)


#: What ``--peer`` takes, for its errors.
_PEER = "--peer takes HOST:PORT, an IPv6 host in brackets ([::1]:7070)"


def _hostport(text: str) -> tuple[str, int]:
    """``--peer``: ``HOST:PORT``, an IPv6 host in brackets (``[::1]:7070``, the brackets
    not the host's; :func:`kvwire.units.split_hostport`)."""
    try:
        host, port = split_hostport(text)
    except ValueError:
        raise UsageError(f"{_PEER}, not {text!r}") from None
    if not (port.isascii() and port.isdigit() and len(port) <= 5 and 0 < int(port) < 65536):
        raise UsageError(f"bad port in {text!r}: {_PEER}, PORT in 1-65535")
    return host, int(port)


def _host(text: str) -> str:
    """``--host``: a name or an address, an IPv6 one with or without brackets (``[::1]``,
    as ``--peer`` takes it); no port (``--port`` gives it)."""
    if text.startswith("["):
        if text.endswith("]") and is_ipv6(text[1:-1]):
            return text[1:-1]
        raise UsageError(f"--host takes a name or an address without a port (give it with --port), "
                         f"an IPv6 one with or without brackets, not {text!r}")
    if ":" in text and not is_ipv6(text):
        raise UsageError(f"--host takes a name or an address without a port (give it with --port), not {text!r}")
    return text


def _port(text: str) -> int:
    try:
        number = int(text)
    except ValueError:
        raise UsageError(f"--port takes an int in [0, 65535], not {text!r}") from None
    if not 0 <= number < 65536:
        raise UsageError(f"--port takes an int in [0, 65535], not {number}")
    return number


# -- output checks ------------------------------------------------------------------------------


def check_output_path(path: str, what: str) -> None:
    """Raise UsageError unless ``path`` can be written (checked before a run, so that a
    typo costs nothing): its folder exists and takes a new file, and it is not a folder.
    A symbolic link is checked as the file it names (the report is written through it)."""
    given = Path(path)
    if given.is_dir():
        raise UsageError(f"{what} {path!r} is a directory")
    if _not_a_file(given):  # a pipe or a device (/dev/stdout): written as it is
        if not os.access(given, os.W_OK):
            raise UsageError(f"{what} {path!r} is not writable")
        return
    target = Path(os.path.realpath(path))
    folder = target.parent
    if not folder.is_dir():
        raise UsageError(f"{what} {path!r}: no such directory {str(folder)!r}")
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".kvwire-", suffix=".check")
    except OSError as exc:
        raise UsageError(f"{what} {path!r}: cannot write in {str(folder)!r}: {exc.strerror}") from None
    os.close(fd)
    os.unlink(probe)
    if target.exists() and not os.access(target, os.W_OK):
        raise UsageError(f"{what} {path!r} is not writable")


def _check_plot(path: str) -> None:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'kvwire[plot]'") from None
    suffix = plot_format(path)
    supported = Figure().canvas.get_supported_filetypes()
    if suffix not in supported:
        raise UsageError(
            f"--plot {path!r}: matplotlib cannot write .{suffix} (use one of: "
            f"{', '.join(sorted(supported))})"
        )
    check_output_path(path, "--plot")


def _not_a_file(target: Path) -> bool:
    """Whether ``target`` exists and is something other than a regular file."""
    try:
        return not stat.S_ISREG(target.stat().st_mode)
    except OSError:
        return False


def _write_atomic(path: str, text: str) -> None:
    """``text`` into file ``path`` whole or not at all (a new file renamed over it); a pipe
    or a device is written as it is. A symbolic link is written through (its target
    replaced), and the file keeps the mode it had, or a new one gets the mode ``open``
    would give it (0666 less the umask), not mkstemp's 0600."""
    if _not_a_file(Path(path)):  # (/dev/stdout names a pipe by a link that resolves to none)
        with open(path, "w") as f:
            f.write(text)
        return
    target = Path(os.path.realpath(path))
    try:
        mode = stat.S_IMODE(target.stat().st_mode)
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _umask() -> int:
    """The process's umask: the ``Umask:`` line of ``/proc/self/status`` (Linux 4.7 on),
    else read by setting it and setting it back (which, for that moment, gives a file
    another thread creates the wrong mode)."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# -- parsers ----------------------------------------------------------------------------------


def add_parsers(subparsers: Any) -> None:
    """Register ``bench`` and ``serve`` on an ``argparse`` subparsers object."""
    b: argparse.ArgumentParser = subparsers.add_parser(
        "bench",
        help="measure KV transfers over loopback, an emulated link, or to a remote server",
        description=(
            "Send a model's KV cache (random fp16 of the model's shape) again and again for "
            "--duration and report goodput, wire rate, link utilization, the bandwidth "
            "estimate, time to first layer, CPU use, TCP retransmits (and how many of them the "
            "receiver got twice) and the codec's error. "
            "Without --link it runs over plain loopback against a raw-socket baseline "
            "measured in the same run; with --link/--rtt through a userspace link emulator "
            "(or --kernel: tbf between two network namespaces, root only); with --peer to a "
            "`kvwire serve`. A report line per --interval goes to stderr (with a progress "
            "bar when stderr is a terminal). Units: rates 10gbps, 800mbps, 1.25GB/s; times "
            "20ms, 1.5s (a bare number is seconds); sizes 1MiB, 64KiB."
        ),
    )
    b.set_defaults(func=run_bench_command)
    take_negative_values(b)  # --link -5gbps: refused as negative, not "expected one argument"
    link = b.add_argument_group("link")
    # One or the other, as in kvwire simulate: given both, the schedule replaced --link
    # without a word.
    rate = link.add_mutually_exclusive_group()
    rate.add_argument("--link", type=_LINK_RATE, metavar="RATE",
                      help="link rate, e.g. 10gbps, 800mbps (at least 10kbps, at most 1.6tbps): an Ethernet line rate, "
                           "of which TCP payload is at most (MTU-52)/(MTU+38), 94%% at MTU 1500 "
                           "(see --link-layer)")
    rate.add_argument("--link-schedule", type=argument_type(parse_schedule), metavar="TIME:RATE,...",
                      help="rate over time, e.g. '0s:10gbps,3s:2.5gbps' (instead of --link)")
    link.add_argument("--link-layer", choices=("ethernet", "payload"), default="ethernet",
                      help="what --link and --link-schedule count: ethernet (default: the line rate of "
                           "Ethernet frames of --mtu, headers, preamble and gap included; TCP payload "
                           "is charged as if carried in full segments) or payload (TCP payload bytes)")
    link.add_argument("--mtu", type=int, default=1500, metavar="BYTES",
                      help="the link's MTU, 576-65535 (default 1500; 9000 for jumbo frames)")
    link.add_argument("--rtt", type=argument_type(parse_duration), default=0.0, metavar="TIME",
                      help="round-trip time added by the emulator, e.g. 20ms (default 0)")
    link.add_argument("--jitter", type=argument_type(parse_duration), default=0.0, metavar="TIME",
                      help="+- variation of each one-way delay, e.g. 1ms (default 0)")
    link.add_argument("--emulator", choices=EMULATOR_PUMPS, default="auto",
                      help="the emulator's pump: splice (splice(2) through kernel pipes, Linux; less "
                           "CPU per byte), copy (through Python; a higher ceiling for links above "
                           "about 11 Gbit/s on 2 cores), auto (default: splice where available)")
    link.add_argument("--kernel", action="store_true",
                      help="shape with tc tbf between two network namespaces (root only; rate only, "
                           "at most about 670 Gbit/s: tbf's queue of 50 ms holds 4 GiB)")
    link.add_argument("--peer", type=argument_type(_hostport), metavar="HOST:PORT",
                      help="send to a remote `kvwire serve` instead of a local receiver")
    link.add_argument("--secret-file", metavar="FILE",
                      help="file holding the shared secret for --peer: its bytes less one line ending at "
                           "the end, so keep a text secret in it (openssl rand -hex 32 > FILE); else "
                           "$KVWIRE_SECRET, else the development default")
    load = b.add_argument_group("transfer")
    load.add_argument("--codec", type=argument_type(_codec), default="raw",
                      help="raw, fp8, int8, int4, auto or any registered codec (default raw)")
    load.add_argument("--auto-codec", choices=AUTO_CODEC_MODES, default="model",
                      help="how --codec auto chooses: model (default: the cost model) or measured "
                           "(each codec's measured KV goodput)")
    load.add_argument("--streams", type=argument_type(stream_count), default=4, metavar="N|auto",
                      help="TCP streams per session, or auto (default 4)")
    load.add_argument("--model", choices=sorted(MODELS), default="llama3-8b",
                      help="KV shape to send (default llama3-8b: 32 x 8 x 128 fp16)")
    load.add_argument("--tokens", type=argument_type(whole_number, "int"), default=8192, metavar="N",
                      help="tokens per transfer (default 8192)")
    load.add_argument("--chunk-size", type=argument_type(parse_size), default=DEFAULT_CHUNK_BYTES, metavar="SIZE",
                      help=f"target size of one chunk of K or V before encoding (default {format_size(DEFAULT_CHUNK_BYTES)})")
    load.add_argument("--duration", type=_POSITIVE_DURATION, default=10.0, metavar="TIME",
                      help="keep starting transfers for this long (default 10s); one still under way "
                           "then may finish, for up to 30 s more (as long again as --duration, if that "
                           "is longer), and is abandoned if it has not")
    load.add_argument("--seed", type=int, default=0, metavar="N",
                      help="seed of the random cache (default 0)")
    load.add_argument("--no-baseline", action="store_true",
                      help="skip the raw-socket baseline of loopback runs")
    out = b.add_argument_group("output")
    out.add_argument("--json", metavar="FILE",
                     help="write the full report (start block, intervals, samples) here; - for stdout")
    out.add_argument("--plot", metavar="FILE.png",
                     help="plot wire rate, estimate and the link's TCP payload capacity over time (needs kvwire[plot]) into "
                          "FILE as named: in the format its suffix names (png, svg, pdf, ...), a PNG "
                          "without one")
    out.add_argument("--interval", type=_POSITIVE_DURATION, default=1.0, metavar="TIME",
                     help="seconds between report lines and JSON intervals (default 1s; at least 100ms, "
                          "the sample period)")
    out.add_argument("--quiet", action="store_true",
                     help="no progress, no report lines and no table (errors still go to stderr)")

    s: argparse.ArgumentParser = subparsers.add_parser(
        "serve",
        help="receive KV transfers (the far end of `kvwire bench --peer`)",
        description=(
            "Accept kvwire transfers (up to 16 at once, each on its own) and log one line per "
            "transfer; for bench transfers, compare one layer of each with the layer "
            "regenerated from the bench's seed, and log the codec's max relative error at "
            "the end of each bench. Listens on 127.0.0.1 unless --host says "
            "otherwise; any other address needs a secret you chose (--secret-file or "
            "$KVWIRE_SECRET): the development default is public."
        ),
    )
    s.set_defaults(func=run_serve_command)
    s.add_argument("--port", type=argument_type(_port), default=7070,
                   help="port to listen on (default 7070; 0 picks one)")
    s.add_argument("--host", type=argument_type(_host, "host"), default="127.0.0.1",
                   help="name or address to listen on, every address it names (default 127.0.0.1; '' "
                        "every interface, IPv4 and IPv6; 0.0.0.0 every IPv4 interface; :: every IPv6 "
                        "interface, IPv6 only; an IPv6 address with or without brackets: ::1 or [::1])")
    s.add_argument("--secret-file", metavar="FILE",
                   help="file holding the shared secret: its bytes less one line ending at the end, "
                        "so keep a text secret in it (openssl rand -hex 32 > FILE); else $KVWIRE_SECRET "
                        "(the public development default is allowed on loopback only)")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="least severe log lines shown (default info)")
    s.add_argument("--once", action="store_true", help="exit after one bench has ended")


def _fail(command: str, exc: Exception, code: int) -> int:
    # Some errors have no text of their own (a bare TimeoutError): name them then.
    print(f"kvwire {command}: error: {str(exc) or type(exc).__name__}", file=sys.stderr)
    return code


# -- bench --------------------------------------------------------------------------------------


def check_bench_options(cfg: Any) -> None:
    """Refuse what the run would ignore or cannot do as asked (UsageError): ``--auto-codec
    measured`` without ``--codec auto``, ``--mtu`` or ``--link-layer`` without a shaped link,
    ``--no-baseline`` outside plain loopback, and a ``--jitter`` over half of ``--rtt``.
    Checked here, not by BenchConfig: a script may give every run of a set the same
    auto_codec (benchmarks/link.py)."""
    from kvwire.bench.runner import BenchConfig

    default = BenchConfig.__dataclass_fields__
    if cfg.codec != "auto" and cfg.auto_codec != default["auto_codec"].default:
        raise UsageError(f"--auto-codec {cfg.auto_codec} is for --codec auto: --codec {cfg.codec} sends every "
                         "chunk with that codec (drop --auto-codec)")
    if not cfg.shaped:
        where = "--peer's network" if cfg.mode == "peer" else (
            "plain loopback" if cfg.mode == "loopback" else "a link with no rate (--rtt alone)")
        for flag, value, name in (("--mtu", cfg.mtu, "mtu"), ("--link-layer", cfg.link_layer, "link_layer")):
            if value != default[name].default:
                raise UsageError(f"{flag} is for a shaped link (--link or --link-schedule, emulated or "
                                 f"--kernel): {where} is not shaped, so {flag} {value} would be ignored")
    if not cfg.baseline and cfg.mode != "loopback":
        where = {"peer": "--peer's runs", "kernel": "a --kernel link"}.get(cfg.mode, "the emulated link")
        raise UsageError("--no-baseline is for plain loopback runs (the raw-socket baseline runs "
                         f"only there): {where} has none to skip, so drop --no-baseline")
    if cfg.jitter > cfg.rtt / 2:
        raise UsageError(
            f"--jitter {format_duration(cfg.jitter)} is more than half of --rtt {format_duration(cfg.rtt)}: "
            f"each one-way delay is --rtt/2 +- --jitter, a delay under 0 cannot be applied (it is "
            "clamped at 0, and bytes stay in order), so the RTT the run had would be well over the "
            f"one reported; {_jitter_advice(cfg)}"
        )


def _jitter_advice(cfg: Any) -> str:
    """What to change for a ``--jitter`` over half of ``--rtt``: a smaller jitter (or none,
    with --rtt 0), or the RTT that makes room for this one."""
    fix_rtt = f"give --rtt {format_duration(2 * cfg.jitter)} or more"
    if cfg.rtt <= 0:
        return f"drop --jitter, or {fix_rtt}"
    return f"give --jitter {format_duration(cfg.rtt / 2)} or less, or --rtt {format_duration(2 * cfg.jitter)} or more"



def run_bench_command(args: argparse.Namespace) -> int:
    from kvwire.bench.runner import BenchConfig, load_secret

    try:
        # Every output and optional extra is checked before the run, not after it.
        if args.json not in (None, "-") and args.plot is not None and same_file(args.json, args.plot):
            # The plot, written last, would replace the report.
            raise UsageError(f"--json and --plot name the same file {args.plot!r}: give each its own")
        if args.json is not None and args.json != "-":
            check_output_path(args.json, "--json")
        if args.plot is not None:
            _check_plot(args.plot)
        if args.secret_file is not None and args.peer is None:
            raise UsageError("--secret-file is for --peer (local runs make their own secret)")
        cfg = BenchConfig(
            model=args.model, tokens=args.tokens, codec=args.codec, auto_codec=args.auto_codec,
            streams=args.streams,
            duration=args.duration, link_bps=args.link, schedule=args.link_schedule or (),
            rtt=args.rtt, jitter=args.jitter, emulator=args.emulator, kernel=args.kernel, peer=args.peer,
            baseline=not args.no_baseline, seed=args.seed, chunk_bytes=args.chunk_size,
            interval=args.interval, link_layer=args.link_layer, mtu=args.mtu,
        )
        check_bench_options(cfg)
        if args.peer is not None:
            secret, warning = load_secret(args.secret_file)
            if warning:
                print(warning, file=sys.stderr)
            cfg = dataclasses.replace(cfg, secret=secret)
    except UsageError as exc:
        return _fail("bench", exc, 2)

    argv = ["kvwire", *getattr(args, "argv", sys.argv[1:])]
    try:
        result = _run_with_reports(cfg, quiet=args.quiet, argv=argv)
    except UsageError as exc:
        return _fail("bench", exc, 2)
    except KvwireError as exc:
        return _fail("bench", exc, 1)
    except MemoryError:
        return _fail("bench", KvwireError(f"not enough memory for a cache of {cfg.tokens} tokens of "
                                          f"{cfg.model} (--tokens)"), 1)

    text = json.dumps(result, indent=2) + "\n"
    code = 0
    if args.json == "-":
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except BrokenPipeError:
            _stdout_gone("the report (--json -)")
            code = 1
    elif args.json is not None:
        try:
            _write_atomic(args.json, text)
        except OSError as exc:
            fd, rescue = tempfile.mkstemp(prefix="kvwire-bench-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                f.write(text)
            print(f"kvwire bench: error: cannot write {args.json!r} ({exc.strerror}); "
                  f"the report is in {rescue}", file=sys.stderr)
            code = 1
    if args.plot:
        try:
            write_plot(result, args.plot)
        except OSError as exc:
            print(f"kvwire bench: error: cannot write {args.plot!r}: {exc}", file=sys.stderr)
            code = 1
    if not args.quiet:
        _print_summary(result, stderr=args.json == "-")  # rich exits 1 on a closed stdout
    return code


def _stdout_gone(what: str) -> None:
    """Stdout's reader went away (``kvwire bench --json - | head``): say so in one line,
    and point stdout at /dev/null so that the interpreter's last flush does not fail
    again."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    print(f"kvwire bench: error: stdout was closed before {what} was written", file=sys.stderr)


def _where(cfg: Any) -> str:
    if cfg.mode == "peer":
        return f"peer {address(cfg.peer)}"
    if cfg.mode == "loopback":
        return "loopback"
    link = format_schedule(cfg.steps) if len(cfg.steps) > 1 else (
        format_rate(cfg.steps[0][1]) if cfg.steps else "unshaped")
    if cfg.steps and cfg.link_layer == "payload":
        link += " of TCP payload"
    elif len(cfg.steps) == 1:
        link += (f" Ethernet, MTU {cfg.mtu} ({format_rate(cfg.steps[0][1] * cfg.payload_share)} "
                 "of TCP payload)")
    elif cfg.steps:
        link += f" Ethernet, MTU {cfg.mtu}"
    if cfg.mode == "kernel":  # tbf adds no delay: the table gives the RTT measured
        return f"kernel-shaped link (tbf) {link}, no added delay"
    return f"emulated link {link}, RTT {format_duration(cfg.rtt)}"


def _run_with_reports(cfg: Any, *, quiet: bool, argv: list[str]) -> dict[str, Any]:
    from kvwire import __version__
    from kvwire.bench.report import format_gbps, format_interval
    from kvwire.bench.runner import run_bench

    if quiet:
        return run_bench(cfg, argv=argv)
    codec = f"{cfg.codec} ({cfg.auto_codec})" if cfg.codec == "auto" else cfg.codec
    header = (
        f"kvwire {__version__} bench: {cfg.model} x {cfg.tokens} tokens, {_where(cfg)}, "
        f"codec {codec}, streams {cfg.streams}, chunk {format_size(cfg.chunk_bytes)}, "
        f"seed {cfg.seed}, {format_duration(cfg.duration)}"
    )

    def interval_line(iv: dict[str, Any]) -> str:
        return format_interval(iv, cfg.codec)

    if not sys.stderr.isatty():
        # Logs, CI and pipes: one line per interval, like iperf3's reports.
        def emit(line: str) -> None:
            print(line, file=sys.stderr, flush=True)

        emit(header)
        return run_bench(cfg, log=emit, on_interval=lambda iv: emit(interval_line(iv)), argv=argv)

    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True, highlight=False)
    progress = Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), TimeElapsedColumn(),
        TextColumn("{task.fields[status]}"), console=console, transient=True,
        auto_refresh=False,
    )
    task = progress.add_task("bench", total=cfg.duration, status="starting")

    def update(point: dict[str, Any]) -> None:
        est = point.get("estimated_gbps")
        status = (
            f"{point['transfers']} transfers  to TCP {format_gbps(point['wire_gbps'])}  estimate {format_gbps(est)}"
        )
        if point.get("link_gbps") is not None:
            status += f"  link {format_gbps(point['link_gbps'])}"
        progress.update(task, completed=min(point["elapsed"], cfg.duration), status=status)
        progress.refresh()

    def show(line: str) -> None:
        progress.console.print(line, markup=False)

    show(header)
    with progress:
        return run_bench(cfg, on_progress=update, log=show,
                         on_interval=lambda iv: show(interval_line(iv)), argv=argv)


def _fmt(value: Any, spec: str = ".3g", unit: str = "") -> str:
    if value is None:
        return "-"
    return f"{value:{spec}}{unit}"


def _ms(value: float | None) -> str:
    """A time given in ms, in the unit that suits it (``31.7 ms``, ``1 s``)."""
    return "-" if value is None else format_duration(value / 1e3)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _capacity_text(r: dict[str, Any]) -> str:
    """``9.415 Gbit/s (Ethernet, MTU 1500)``: what the link carries of TCP payload when
    saturated, the 100% of ``utilization``."""
    text = format_rate(r["payload_capacity_gbps"] * 1e9)
    if r.get("link_layer") == "ethernet":
        return text + f" (Ethernet, MTU {r['mtu']})"
    return text + " (--link-layer payload)"


def _print_summary(r: dict[str, Any], *, stderr: bool = False) -> None:
    from rich.console import Console
    from rich.table import Table

    from kvwire.bench.report import format_gbps, format_retransmits, format_shares

    where = {
        "loopback": "loopback",
        "emulated": "emulated link",
        "kernel": "kernel-shaped link (tbf)",
        "peer": f"peer {r.get('peer')}",
    }[r["mode"]]
    table = Table(title=f"kvwire bench: {r['model']}, {r['tokens']} tokens, {where}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    codec = r["codec"]
    if r["codec_shares"] and list(r["codec_shares"]) != [r["codec"]]:
        codec += f": {format_shares(r['codec_shares'])} of chunks"
    streams = str(r["streams"])
    if r["streams"] == "auto" and r["streams_min"] is not None:
        streams += f": {r['streams_min']}-{r['streams_max']} in use, median {r['streams_median']:g}"
    cpu = r["cpu"]
    cpu_text = ", ".join(
        f"{side} {_pct(cpu.get(side))}" for side in ("sender", "receiver", "emulator")
        if cpu.get(side) is not None
    )
    link = format_rate(r["link_gbps"] * 1e9) if r["link_gbps"] else "unshaped"
    if r["mode"] == "emulated":
        link += f", emulated ({r['start']['config']['emulator']} pump)"
    rows: list[tuple[str, str]] = [
        ("link", link),
        *([("TCP payload capacity", _capacity_text(r))] if r.get("payload_capacity_gbps") else []),
        ("RTT", _ms(r["rtt_ms"])),
        ("codec", codec),
        ("streams", streams),
        ("chunk size", format_size(r["chunk_bytes"]) + (
            f" (asked {format_size(r['chunk_bytes_requested'])}: the receiver's frame limit)"
            if r["chunk_bytes"] != r["chunk_bytes_requested"] else "")),
        ("transfers", f"{r['transfers']} x {r['kv_bytes_per_transfer'] / 1e6:.1f} MB"
         + (f" ({r['incomplete_transfers']} abandoned)" if r["incomplete_transfers"] else "")),
        ("seconds", _fmt(r["seconds"], ".2f")),
        ("goodput (fp16 KV)", format_gbps(r["goodput_gbps"])
         + (" (completed transfers only)" if r["incomplete_transfers"] else "")),
        ("acknowledged KV (fp16)", format_gbps(r.get("acked_kv_gbps"))),
        ("wire rate (measured)", format_gbps(r["wire_gbps"])),
        ("utilization", _fmt(None if r["utilization"] is None else 100 * r["utilization"], ".1f", " %")),
        ("estimate at end (from acks)", format_gbps(r["estimated_gbps"])),
        ("time to first layer (median)", _ms(r["time_to_first_layer_ms"])),
        ("transfer time (median)", _ms(None if r["transfer_seconds_median"] is None else r["transfer_seconds_median"] * 1e3)),
        ("CPU, share of one core", cpu_text or "-"),
    ]
    if cpu.get("machine_busy") is not None:
        rows.append(("machine CPU busy", f"{_pct(cpu['machine_busy'])} of {cpu['cores']} cores"
                     f" ({_pct(cpu.get('others'))} by other processes)"))
    rows += [
        ("TCP retransmits (sender)", format_retransmits(r)),
        ("max rel. error (checked layers)", "see the server's output" if r["mode"] == "peer" else _fmt(r["max_rel_error"], ".3g")),
    ]
    if r.get("baseline_gbps") is not None:
        rows.append(("raw-socket baseline", format_gbps(r["baseline_gbps"])))
        rows.append(("goodput / baseline", _fmt(r["baseline_ratio"], ".2f")))
    for name, value in rows:
        table.add_row(name, value)
    console = Console(stderr=stderr, highlight=False)
    console.print(table)
    if r.get("diagnosis"):
        console.print(f"diagnosis: {r['diagnosis']}", markup=False)
    missing = [name for name, where in r["start"]["host"].get("extensions", {}).items() if where is None]
    if missing:
        console.print(f"note: this kvwire runs pure-Python code for {', '.join(missing)} (not compiled: "
                      "kvwire.extensions(); reinstall with a C compiler present), slower per byte than "
                      "the compiled parts", markup=False)
    console.print(f"note: {r['trust']}", markup=False)


def wire_label(mode: str) -> str:
    """What a sample's ``wire_gbps`` is in ``mode``: the link's counter where there is a
    link, else the bytes the sender handed to its sockets (docs/bench.md)."""
    if mode in ("emulated", "kernel"):
        return "wire rate (TCP payload the link carried)"
    return "handed to TCP (sender's sockets)"


def write_plot(result: dict[str, Any], path: str) -> None:
    """Wire rate, bandwidth estimate and the link's TCP payload capacity over time, into the file ``path``
    names, in the format :func:`plot_format` says (a PNG without a suffix)."""
    try:
        import matplotlib
    except ImportError as exc:
        raise UsageError("--plot needs matplotlib: pip install 'kvwire[plot]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvwire.bench.report import payload_capacity, payload_share

    samples = result["samples"]
    t = [s["t"] for s in samples]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.plot(t, [s["wire_gbps"] for s in samples], label=wire_label(result["mode"]), lw=1.2)
    ax.plot(t, [s["estimated_gbps"] if s["estimated_gbps"] is not None else float("nan") for s in samples],
            label="estimate", lw=1.2)
    if any(s["link_gbps"] is not None for s in samples):
        # The wire series counts TCP payload: the line is what the link carries of it at
        # each moment's rate (the line rate in a report without payload_capacity_gbps).
        share = payload_share(result)
        known = payload_capacity(result)[1] and result.get("link_gbps")
        label = "link's TCP payload capacity" if known else "link rate (line rate)"
        ax.step(t, [s["link_gbps"] * share if s["link_gbps"] is not None else float("nan") for s in samples],
                where="post", label=label, color="black", ls="--", lw=1)
    ax.set_xlabel("seconds")
    ax.set_ylabel("Gbit/s")
    ax.set_ylim(bottom=0)
    ax.set_title(
        f"{result['model']} x {result['tokens']} tokens, codec {result['codec']}, "
        f"{result['streams']} streams, RTT {_ms(result['rtt_ms'])}"
    )
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110, format=plot_format(path))
    plt.close(fig)


# -- serve --------------------------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` names is a loopback address (``127.0.0.0/8``, ``::1``).

    ``""`` (every interface), ``0.0.0.0`` (every IPv4 one) and ``::`` (every IPv6 one)
    are not; a name is resolved.
    """
    if host in ("", "0.0.0.0", "::"):
        return False
    try:
        return bool(ipaddress.ip_address(host.strip("[]")).is_loopback)
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    addrs = {info[4][0] for info in infos}
    return bool(addrs) and all(ipaddress.ip_address(str(a).split("%")[0]).is_loopback for a in addrs)


def _listen_target(host: str) -> str:
    """``--host`` in a line: ``[::1]`` for an IPv6 address, ``''`` named."""
    if host == "":
        return "every interface ('')"
    return f"[{host}]" if ":" in host else host


class _UTCFormatter(logging.Formatter):
    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        return f"{stamp}.{int(record.msecs):03d}Z"


def configure_logging(level: str) -> logging.Handler:
    """Timestamped (UTC) lines of the ``kvwire`` logger and its children on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_UTCFormatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    log.addHandler(handler)
    log.setLevel(level.upper())
    return handler


_STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


def run_serve_command(args: argparse.Namespace) -> int:
    from kvwire.bench._signals import run
    from kvwire.bench.runner import load_secret, serve_benches

    handler = configure_logging(args.log_level)
    try:
        try:
            secret, warning = load_secret(args.secret_file)
            if warning and not is_loopback(args.host):
                raise UsageError(
                    f"refusing to listen on {_listen_target(args.host)} with the public development secret: "
                    "give a secret of your own with --secret-file FILE or KVWIRE_SECRET "
                    "(or listen on 127.0.0.1)"
                )
        except UsageError as exc:
            log.error("%s", exc)
            return 2
        if warning:
            log.warning("%s (accepted on loopback only)", warning.removeprefix("warning: "))

        def listening(addresses: Sequence[tuple[str, int]]) -> None:
            log.info("listening on %s", " and ".join(address(a) for a in addresses))

        try:
            # Ctrl-C (or SIGTERM, SIGHUP) closes the server first: a sender with a
            # transfer in progress is told that the server is shutting down.
            run(serve_benches(args.host, args.port, secret=secret, once=args.once,
                              log=log.info, listening=listening, stop_signals=_STOP_SIGNALS))
        except UsageError as exc:
            log.error("%s", exc)
            return 2
        except (KvwireError, OSError) as exc:
            log.error("%s", exc)
            return 1
        return 0
    finally:
        log.removeHandler(handler)
