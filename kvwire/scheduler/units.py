"""Parse and format link rates ("100gbps", "2.5gbit", "800mbps", "1.25GB/s").

Rates are bits per second (float). Decimal prefixes, as network rates use them. A capital
``B`` (``GB/s``, ``MBps``) means bytes; everything else means bits, so ``gbps``, ``Gbps``,
``gbit`` and ``gbit/s`` all read the same.
"""

from __future__ import annotations

import re

from kvwire.errors import UsageError

__all__ = ["format_rate", "parse_rate", "parse_rate_schedule"]

_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_RATE_RE = re.compile(
    r"^\s*(?P<num>[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(?P<prefix>[kKmMgGtT]?)(?P<unit>.*?)\s*$"
)
_BIT_UNITS = {"", "bps", "bit", "bits", "bit/s", "bits/s", "b/s", "bitps"}
_BYTE_UNITS = {"B/s", "Bps", "byte/s", "bytes/s", "Byte/s", "Bytes/s"}


def parse_rate(text: str) -> float:
    """Bits per second for a rate such as ``100gbps``, ``10gbit``, ``800mbps`` or ``1.25GB/s``.

    A bare number is bits per second. Raises :class:`kvwire.UsageError` on anything else,
    including negative or non-finite values.
    """
    match = _RATE_RE.match(text)
    if match is None:
        raise UsageError(f"cannot parse rate {text!r} (try 100gbps, 10gbit, 800mbps)")
    value = float(match["num"])
    prefix = _PREFIX[match["prefix"].lower()]
    unit = match["unit"]
    if unit in _BYTE_UNITS:
        return value * prefix * 8.0
    if unit.lower() in _BIT_UNITS and not unit.startswith("B"):
        return value * prefix
    raise UsageError(f"cannot parse rate {text!r}: unknown unit {unit!r}")


def parse_rate_schedule(text: str) -> tuple[tuple[float, float], ...]:
    """A piecewise-constant rate schedule ``"0:10gbps,60:2.5gbps,120:10gbps"``.

    Each item is ``START_SECONDS:RATE``; returns ``((start_s, bits_per_s), ...)`` sorted by
    start. The first item must start at 0 so the rate is defined for the whole run.
    """
    items: list[tuple[float, float]] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        start_text, sep, rate_text = part.partition(":")
        if not sep:
            raise UsageError(f"schedule item {part!r} is not START_SECONDS:RATE")
        try:
            start = float(start_text.rstrip("s"))
        except ValueError:
            raise UsageError(f"schedule item {part!r}: bad start time") from None
        items.append((start, parse_rate(rate_text)))
    if not items:
        raise UsageError("empty rate schedule")
    items.sort()
    if items[0][0] != 0.0:
        raise UsageError("a rate schedule must start at time 0")
    return tuple(items)


def format_rate(bits_per_second: float) -> str:
    """``100 Gbit/s``, ``2.5 Gbit/s``, ``800 Mbit/s``: the largest prefix that keeps >= 1."""
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(bits_per_second) >= scale:
            return f"{bits_per_second / scale:.4g} {prefix}bit/s"
    return f"{bits_per_second:.4g} bit/s"
