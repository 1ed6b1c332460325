"""What a bench report says beyond raw totals: where the run happened and with what
configuration (the ``start`` block), per-interval figures (like iperf3's per-second
reports), what ``auto`` chose, CPU use, and a one-line diagnosis of low utilization.

Pure functions over the samples the runner collects, except :func:`start_block` and
:func:`machine_cpu_times`, which read the host.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import socket
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvwire.units import format_rate

__all__ = [
    "CPU_BOUND",
    "LOW_UTILIZATION",
    "codec_shares",
    "diagnose",
    "format_interval",
    "format_retransmits",
    "format_shares",
    "intervals",
    "machine_cpu_times",
    "one_interval",
    "start_block",
    "trust_note",
]

#: Utilization below which the report explains why.
LOW_UTILIZATION = 0.85
#: A process using this much of one core is taken as the limit (asyncio is one thread).
CPU_BOUND = 0.85


def machine_cpu_times() -> tuple[float, float] | None:
    """``(busy, total)`` CPU seconds of the whole machine since boot (Linux ``/proc/stat``).

    Busy is the time the CPUs ran anything: user, nice, system, irq and softirq time
    (guest time is part of user). Idle, iowait and a virtual machine's steal time (its
    vCPUs waiting while the hypervisor runs something else) are not busy; total counts
    all of them, so ``busy / total`` is the share of the wall-clock CPU time spent busy."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:]]
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    # idle + iowait + steal: no work of this machine's (steal: the hypervisor's others')
    idle = ticks[3] + sum(ticks[i] for i in (4, 7) if len(ticks) > i)
    total = sum(ticks[:8])  # guest time is already counted in user
    return (total - idle) / hz, total / hz


def start_block(config: Any, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Version, UTC timestamp, host (with the compiled parts this process uses,
    :func:`kvwire.extensions`) and the full configuration of a run (no secret)."""
    from kvwire import __version__, extensions

    cfg = {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(config)
        if f.name != "secret"
    }
    if cfg.get("peer") is not None:
        cfg["peer"] = f"{cfg['peer'][0]}:{cfg['peer'][1]}"
    cfg["schedule"] = [[t, r] for t, r in cfg.get("schedule", ())]
    load: list[float] | None
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {
        "version": __version__,
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": list(argv) if argv is not None else None,
        "host": {
            "hostname": socket.gethostname(),
            "system": platform.platform(),
            "python": sys.version.split()[0],
            "cpus": os.cpu_count(),
            "loadavg": load,
            "extensions": extensions(),
        },
        "config": cfg,
    }


def _delta_counts(a: Mapping[str, int], b: Mapping[str, int]) -> dict[str, int]:
    out = {k: b.get(k, 0) - a.get(k, 0) for k in set(a) | set(b)}
    return {k: v for k, v in sorted(out.items()) if v > 0}


def codec_shares(chunks_by_codec: Mapping[str, int]) -> dict[str, float]:
    """Fraction of chunks each codec carried, largest first."""
    total = sum(chunks_by_codec.values())
    if total <= 0:
        return {}
    return {
        k: v / total
        for k, v in sorted(chunks_by_codec.items(), key=lambda kv: (-kv[1], kv[0]))
        if v > 0
    }


def intervals(
    samples: Sequence[Mapping[str, Any]], interval: float, initial: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """Group the runner's samples (cumulative counters, ~0.1 s apart) into reports of
    ``interval`` seconds from ``initial`` (the counters at the start, with its ``t``);
    the last one may be shorter."""
    out: list[dict[str, Any]] = []
    if not samples or interval <= 0:
        return out
    prev = initial
    group: list[Mapping[str, Any]] = []
    edge = initial["t"] + interval
    for i, s in enumerate(samples):
        group.append(s)
        last = i == len(samples) - 1
        if s["t"] >= edge - 1e-9 or last:
            out.append(one_interval(prev, group))
            prev, group = s, []
            while edge <= s["t"] + 1e-9:
                edge += interval
    return out


def one_interval(prev: Mapping[str, Any], group: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    end = group[-1]
    dt = max(end["t"] - prev["t"], 1e-9)
    wires = [g["wire_gbps"] for g in group if g.get("wire_gbps") is not None]
    links = [g["link_gbps"] for g in group if g.get("link_gbps") is not None]
    streams = [g["streams"] for g in group if g.get("streams") is not None]
    retr: int | None = None
    if end.get("retransmits") is not None and prev.get("retransmits") is not None:
        # A reconnected stream starts a new counter: never report a negative count.
        retr = max(0, int(end["retransmits"]) - int(prev["retransmits"]))
    return {
        "start": prev["t"],
        "end": end["t"],
        "sent_gbps": (end["bytes_sent"] - prev["bytes_sent"]) * 8 / dt / 1e9,
        "wire_gbps": sum(wires) / len(wires) if wires else None,
        "goodput_gbps": (end["kv_bytes_done"] - prev["kv_bytes_done"]) * 8 / dt / 1e9,
        "estimated_gbps": end.get("estimated_gbps"),
        "link_gbps": sum(links) / len(links) if links else None,
        "streams": end.get("streams"),
        "streams_min": min(streams) if streams else None,
        "streams_max": max(streams) if streams else None,
        "transfers": end["transfers"] - prev["transfers"],
        "chunks_by_codec": _delta_counts(prev.get("chunks_by_codec", {}), end.get("chunks_by_codec", {})),
        "retransmits": retr,
        "sender_cpu": (end["cpu_s"] - prev["cpu_s"]) / dt,
    }


def format_gbps(value: float | None) -> str:
    """A rate given in Gbit/s, in the unit that suits it (``99.45 kbit/s``, ``9.38 Gbit/s``)."""
    return "-" if value is None else format_rate(value * 1e9)


def format_shares(shares: Mapping[str, float]) -> str:
    """``fp8 62% int8 38%`` (a share under half a percent shows as ``<1%``)."""
    return " ".join(f"{k} {'<1' if v < 0.005 else f'{100 * v:.0f}'}%" for k, v in shares.items())


def format_retransmits(result: Mapping[str, Any]) -> str:
    """The sender's TCP retransmits, with how many of them the receiver's kernel reported
    receiving twice (D-SACK): ``206 (205 of them not needed: D-SACK)``. Over the link
    emulator on one host nearly all are (tail loss probes, not lost packets:
    docs/benchmarks.md)."""
    retr, dup = result.get("retransmits"), result.get("spurious_retransmits")
    if retr is None:
        return "-"
    if dup is None or not retr:
        return str(retr)
    return f"{retr} ({min(dup, retr)} of them not needed: D-SACK)"


def format_interval(iv: Mapping[str, Any], codec: str) -> str:
    """One iperf3-style line: ``[ 1.0- 2.0 s]  sent 9.4 Gbit/s  estimate ...``."""
    parts = [
        f"[{iv['start']:5.1f}-{iv['end']:5.1f} s]",
        f"sent {format_gbps(iv['sent_gbps'])}",
        f"estimate {format_gbps(iv['estimated_gbps'])}",
    ]
    if iv.get("link_gbps") is not None:
        parts.append(f"link {format_gbps(iv['link_gbps'])}")
    if iv.get("streams") is not None:
        lo, hi = iv.get("streams_min"), iv.get("streams_max")
        parts.append(f"streams {iv['streams']}" + (f" ({lo}-{hi})" if lo != hi else ""))
    if iv.get("retransmits") is not None:
        parts.append(f"retr {iv['retransmits']}")
    parts.append(f"cpu {100 * iv['sender_cpu']:.0f}%")
    parts.append(f"transfers {iv['transfers']}")
    if codec == "auto" and iv.get("chunks_by_codec"):
        parts.append("codec " + format_shares(codec_shares(iv["chunks_by_codec"])))
    return "  ".join(parts)


def trust_note(mode: str, *, measured_link: bool = True) -> str:
    """Which rate to believe, what it is computed from, and why."""
    if mode == "emulated" and measured_link:
        where = "TCP payload bytes the link emulator forwarded"
    elif mode == "kernel" and measured_link:
        where = ("TCP payload: the bytes the shaped veth transmitted less 66 of Ethernet, "
                 "IP and TCP headers per packet it counted")
    else:
        where = {
            "peer": "chunk bytes the remote receiver acknowledged",
        }.get(mode, "chunk bytes the receiver acknowledged")
    return (
        f"trust the wire rate (measured: {where}, an abandoned transfer's included, "
        "divided by the run's seconds); the estimate is "
        "the sender's recent, ack-based view that steers streams and codecs, and it lags "
        "or overshoots around changes"
    )


def diagnose(result: Mapping[str, Any], *, window_bytes: int, threshold: float = LOW_UTILIZATION) -> str | None:
    """One line naming what held utilization down, or None when it was not low.

    Checked in order, every match reported: a process using a whole core (sender,
    receiver, the emulator), the other processes of a saturated machine, the flow-control
    window per round trip, too little in flight for the estimate, then the estimate
    itself far from the measured rate.
    """
    util = result.get("utilization")
    if util is None or util >= threshold:
        return None
    causes: list[str] = []
    cpu = result.get("cpu") or {}
    for side in ("sender", "receiver", "emulator"):
        used = cpu.get(side)
        if used is not None and used >= CPU_BOUND:
            what = "the link emulator is the limit" if side == "emulator" else f"{side} CPU-bound"
            causes.append(f"{what} ({100 * used:.0f}% of a core)")
    busy, others, cores = cpu.get("machine_busy"), cpu.get("others"), cpu.get("cores")
    if busy is not None and busy >= 0.9 and cores:
        causes.append(
            f"the machine's {cores} cores were {100 * busy:.0f}% busy"
            + (f" ({100 * others:.0f}% of them by other processes)" if others is not None else "")
        )
    link_gbps = result.get("link_gbps")
    rtt_ms = result.get("rtt_ms") or result.get("measured_rtt_ms")
    streams = result.get("streams_max") or result.get("streams")
    if link_gbps and rtt_ms and isinstance(streams, int) and rtt_ms > 0:
        cap = streams * window_bytes * 8 / (rtt_ms / 1e3) / 1e9
        if cap < link_gbps:
            need = int(-(-link_gbps * 1e9 * rtt_ms / 1e3 // (window_bytes * 8)))
            causes.append(
                f"window/RTT limit: {streams} streams x {window_bytes >> 20} MiB window per "
                f"{rtt_ms:.3g} ms RTT carry at most {cap:.3g} Gbit/s (try --streams {need})"
            )
    est = result.get("estimated_gbps")
    inflight = result.get("bytes_in_flight_mean")
    if link_gbps and rtt_ms and inflight is not None:
        bdp = link_gbps * 1e9 / 8 * rtt_ms / 1e3
        if inflight < 0.7 * bdp:
            causes.append(
                f"too little in flight: {inflight / 2**20:.3g} MiB on average for a "
                f"{bdp / 2**20:.3g} MiB bandwidth-delay product"
                + (f" (estimate {est:.3g} Gbit/s under the link's {link_gbps:.3g})" if est is not None and est < 0.8 * link_gbps else "")
            )
    wire = result.get("wire_gbps")
    abandoned = result.get("incomplete_transfers") or 0
    # The estimate at the end of a run that waited on an abandoned transfer says nothing
    # of the rate over the run: not a cause.
    if not causes and not abandoned and est is not None and wire and abs(est - wire) > 0.25 * wire:
        causes.append(
            f"estimator: {est:.3g} Gbit/s at the end against {wire:.3g} Gbit/s measured"
        )
    if not causes:
        parts = [f"{k} {100 * v:.0f}%" for k, v in cpu.items() if k in ("sender", "receiver", "emulator") and v is not None]
        causes.append(
            "no single limit found (CPU of a core: " + (", ".join(parts) or "n/a") + ")"
        )
    line = f"utilization {100 * util:.0f}%: " + "; ".join(causes)
    if abandoned:
        line += (
            f" ({abandoned} transfer{'s' if abandoned > 1 else ''} abandoned at the run's hard stop: the run's seconds "
            "include its wait, and a cache too large for the link leaves it idle between "
            "transfers)"
        )
    return line


def merge_counts(items: Iterable[Mapping[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        for k, v in item.items():
            out[k] = out.get(k, 0) + int(v)
    return out
