"""What a bench report says beyond raw totals: where the run happened and with what
configuration (the ``start`` block), per-interval figures (like iperf3's per-second
reports), what ``auto`` chose, CPU use, and a one-line diagnosis of what held a run down.

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

from kvwire.session.options import MAX_STREAMS
from kvwire.units import format_rate

__all__ = [
    "CPU_BOUND",
    "LOW_UTILIZATION",
    "codec_shares",
    "diagnose",
    "folds_into_previous",
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
    ``interval`` seconds from ``initial`` (the counters at the start, with its ``t``).
    The last one may be shorter; one shorter than half an interval is folded into the
    one before it (:func:`folds_into_previous`)."""
    if not samples or interval <= 0:
        return []
    groups: list[tuple[Mapping[str, Any], list[Mapping[str, Any]]]] = []
    prev = initial
    group: list[Mapping[str, Any]] = []
    edge = initial["t"] + interval
    for i, s in enumerate(samples):
        group.append(s)
        last = i == len(samples) - 1
        if s["t"] >= edge - 1e-9 or last:
            groups.append((prev, group))
            prev, group = s, []
            while edge <= s["t"] + 1e-9:
                edge += interval
    if len(groups) > 1 and folds_into_previous(groups[-1][0], groups[-1][1][-1], interval):
        _, last_group = groups.pop()
        groups[-1] = (groups[-1][0], [*groups[-1][1], *last_group])
    return [one_interval(p, g) for p, g in groups]


def folds_into_previous(prev: Mapping[str, Any], end: Mapping[str, Any], interval: float) -> bool:
    """Whether the run's last interval, from ``prev`` to ``end``, is reported as part of
    the one before it: shorter than half an ``interval``, its rates are noise (the KV
    acknowledged is credited per chunk, and a 4 MiB chunk over 0.13 s read 18.9 Gbit/s
    on a 10 Gbit/s link)."""
    return bool(end["t"] - prev["t"] < interval / 2)


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
    """One iperf3-style line: ``[ 1.0- 2.0 s]  to TCP 9.4 Gbit/s  KV acked 9.3 Gbit/s
    estimate ...``: the bytes the sender handed to its sockets (not yet carried: the link
    rate is ``link``), and the fp16 KV the receiver acknowledged in the interval."""
    parts = [
        f"[{iv['start']:5.1f}-{iv['end']:5.1f} s]",
        f"to TCP {format_gbps(iv['sent_gbps'])}",
        f"KV acked {format_gbps(iv.get('goodput_gbps'))}",
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


def _abandoned(result: Mapping[str, Any], abandoned: int) -> str:
    """Why a run abandoned transfers, with a smaller ``--tokens`` or a longer
    ``--duration`` that lets several complete: a transfer's time at the run's
    acknowledged-KV rate (else its wire rate, as if raw)."""
    plural = "s" if abandoned > 1 else ""
    kv_per = result.get("kv_bytes_per_transfer")
    rate = result.get("acked_kv_gbps") or result.get("wire_gbps")
    config = (result.get("start") or {}).get("config") or {}
    duration = config.get("duration") or result.get("seconds")
    tokens = result.get("tokens") or config.get("tokens")
    text = (f"{abandoned} transfer{plural} abandoned at the run's hard stop: the run's seconds include "
            "its wait, and the goodput counts completed transfers only (the acknowledged KV counts "
            "its acknowledged chunks)")
    if not (kv_per and rate and duration and tokens):
        return text + "; a transfer too large for the link: try a smaller --tokens or a longer --duration"
    each = kv_per * 8 / (rate * 1e9)
    fit = int(tokens * duration / (4 * each))  # about four transfers in --duration
    text += (f"; one transfer of {kv_per / 1e6:.4g} MB of KV takes about {each:.3g} s at the "
             f"{rate * 1e3:.4g} Mbit/s of KV acknowledged, against --duration {duration:g} s")
    options = []
    if 1 <= fit < tokens:
        options.append(f"--tokens {fit} or less")
    options.append(f"--duration {max(1, int(-(-4 * each // 1)))} s or more")
    return text + ": try " + ", or ".join(options)


def _effective_rtt_ms(result: Mapping[str, Any]) -> tuple[float | None, str]:
    """The round trip the window and in-flight checks use, and how it was found.

    On the emulated link, the RTT configured (``rtt_ms``) plus one chunk's serialization
    at the link's TCP payload capacity (a stream waits that long for a chunk's acknowledgement on an idle
    link): the measured minimum is an application-level one (a chunk's sending and
    queueing included) and with ``--rtt 0`` made the check blame the window for a delay
    the link does not have. Elsewhere the measured minimum RTT. The explanation is
    empty or "--rtt X ms + Y ms to serialize a chunk", for the caller to bracket."""
    payload_gbps, _ = payload_capacity(result)
    if result.get("mode") == "emulated":
        rtt = result.get("rtt_ms") or 0.0
        chunk = result.get("chunk_bytes")
        if not (payload_gbps and chunk):
            return (rtt or None), ""
        serial = chunk * 8 / (payload_gbps * 1e9) * 1e3
        return rtt + serial, f"--rtt {rtt:.3g} ms + {serial:.3g} ms to serialize a chunk"
    return result.get("rtt_ms") or result.get("measured_rtt_ms"), ""


def payload_capacity(result: Mapping[str, Any]) -> tuple[float | None, bool]:
    """The TCP payload a saturated link carries, Gbit/s, and whether the report knew it:
    ``(payload_capacity_gbps, True)``, or in a report without it the line rate stands for
    it, ``(link_gbps, False)`` (``(None, False)`` without a link). The window, the bytes in
    flight, the estimate and the wire rate count TCP payload, so the diagnosis, the plot
    and benchmarks/link.py hold them against this, not the line rate."""
    capacity = result.get("payload_capacity_gbps")
    if capacity:
        return capacity, True
    return result.get("link_gbps"), False


def payload_share(result: Mapping[str, Any]) -> float:
    """The share of the link's line rate it carries as TCP payload: :func:`payload_capacity`
    over ``link_gbps``, 1 where the line rate stands for the capacity (or there is none):
    a sample's line rate times this is the payload capacity at that moment."""
    link, (capacity, _) = result.get("link_gbps"), payload_capacity(result)
    return capacity / link if link and capacity else 1.0


def diagnose(result: Mapping[str, Any], *, window_bytes: int, threshold: float = LOW_UTILIZATION) -> str | None:
    """One line naming what held the run down, or None when nothing did.

    Transfers abandoned at the run's hard stop are named whatever the utilization (a
    transfer too large for the link keeps it busy, and completes none). The CPU checks,
    a process using a whole core (sender, receiver, the emulator) and the other processes
    of a saturated machine, run when utilization is low or not known (loopback, --peer).
    With a link known and utilization low, the flow-control window per round trip, too
    little in flight for the bandwidth-delay product, then the estimate itself far from
    the measured rate are checked too.
    """
    util = result.get("utilization")
    abandoned = result.get("incomplete_transfers") or 0
    low = util is not None and util < threshold
    causes: list[str] = []
    cpu = result.get("cpu") or {}
    if util is None or low:
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
    payload_gbps, known = payload_capacity(result)
    # (a report without the payload capacity states the line rate, and says so)
    capacity_name = "the link's TCP payload capacity" if known else "the link's line rate"
    est = result.get("estimated_gbps")
    if low:
        rtt_ms, rtt_how = _effective_rtt_ms(result)
        streams = result.get("streams_max") or result.get("streams")
        if payload_gbps and rtt_ms and isinstance(streams, int) and rtt_ms > 0:
            cap = streams * window_bytes * 8 / (rtt_ms / 1e3) / 1e9
            if cap < payload_gbps:
                need = int(-(-payload_gbps * 1e9 * rtt_ms / 1e3 // (window_bytes * 8)))
                if need <= MAX_STREAMS:
                    advice = f"try --streams {need}"
                else:
                    most = MAX_STREAMS * window_bytes * 8 / (rtt_ms / 1e3) / 1e9
                    advice = (f"it takes {need} streams, and even --streams {MAX_STREAMS}, the most, carry at "
                              f"most {most:.3g} Gbit/s: streams alone cannot cover this link's "
                              "bandwidth-delay product")
                causes.append(
                    f"window/RTT limit: {streams} streams x {window_bytes >> 20} MiB window per "
                    f"{rtt_ms:.3g} ms RTT{f' ({rtt_how})' if rtt_how else ''} carry at most {cap:.3g} Gbit/s, "
                    f"{capacity_name} {payload_gbps:.3g} ({advice})"
                )
        inflight = result.get("bytes_in_flight_mean")
        if payload_gbps and rtt_ms and inflight is not None:
            bdp = payload_gbps * 1e9 / 8 * rtt_ms / 1e3
            if inflight < 0.7 * bdp:
                causes.append(
                    f"too little in flight: {inflight / 2**20:.3g} MiB on average for a "
                    f"{bdp / 2**20:.3g} MiB bandwidth-delay product ({rtt_ms:.3g} ms RTT{f': {rtt_how}' if rtt_how else ''})"
                    + (f" (estimate {est:.3g} Gbit/s under {capacity_name} {payload_gbps:.3g})" if est is not None and est < 0.8 * payload_gbps else "")
                )
        wire = result.get("wire_gbps")
        # The estimate at the end of a run that waited on an abandoned transfer says nothing
        # of the rate over the run: not a cause.
        if not causes and not abandoned and est is not None and wire and abs(est - wire) > 0.25 * wire:
            causes.append(
                f"estimator: {est:.3g} Gbit/s at the end against {wire:.3g} Gbit/s measured"
            )
        if not causes and not abandoned:
            parts = [f"{k} {100 * v:.0f}%" for k, v in cpu.items() if k in ("sender", "receiver", "emulator") and v is not None]
            causes.append(
                "no single limit found (CPU of a core: " + (", ".join(parts) or "n/a") + ")"
            )
    if abandoned:
        causes.append(_abandoned(result, abandoned))
    if not causes:
        return None
    prefix = f"utilization {100 * util:.0f}%: " if util is not None else ""
    return prefix + "; ".join(causes)


def merge_counts(items: Iterable[Mapping[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        for k, v in item.items():
            out[k] = out.get(k, 0) + int(v)
    return out
