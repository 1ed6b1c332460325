"""The one parser and formatter for rates, durations, sizes and rate schedules (and the
splitter of ``HOST:PORT`` addresses).

Every command line option and configuration value that names a rate, a time, a size or a
rate-over-time schedule goes through this module, so ``kvwire bench``, ``kvwire serve`` and
``kvwire simulate`` read the same text the same way. Pure: no I/O, no clock.

Syntax
------
rate
    ``10gbps``, ``10Gbit/s``, ``2.5gbit``, ``800mbps``, ``1.25GB/s``. Decimal prefixes
    (k, M, G, T), as network rates use them. A capital ``B`` (``GB/s``, ``MBps``) means
    bytes; everything else means bits. A bare number is bits per second.
duration
    ``20ms``, ``1.5s``, ``500us``, ``2min``, ``1h``; a bare number is seconds (or the
    ``default_unit`` the caller names).
size
    ``4096``, ``64KiB``, ``128MiB``, ``1GiB`` (binary prefixes), ``1GB``/``1MB`` (decimal);
    a bare number is bytes.
schedule
    ``TIME:RATE[,TIME:RATE...]``, for example ``0s:10gbps,30s:1gbps,60s:10gbps``: the rate
    from each start time until the next. The first item starts at 0. ``TIME`` is a duration
    (bare numbers are seconds).

Formatting uses one style: ``10 Gbit/s``, ``20 ms``, ``128 MiB``; every formatted value
parses back to (nearly) the same number.
"""

from __future__ import annotations

import argparse
import ipaddress
import itertools
import math
import re
from collections.abc import Callable
from typing import TypeVar

from kvwire.errors import UsageError

__all__ = [
    "Schedule",
    "argument_type",
    "format_duration",
    "format_rate",
    "format_schedule",
    "format_size",
    "is_ipv6",
    "number",
    "parse_duration",
    "parse_rate",
    "parse_schedule",
    "parse_size",
    "positive",
    "split_hostport",
    "take_negative_values",
    "whole_number",
]

Schedule = tuple[tuple[float, float], ...]
"""``((start_seconds, bits_per_second), ...)``, sorted by start, the first at 0."""

_NUM = r"(?P<num>[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"

# -- rates --------------------------------------------------------------------------------------

_RATE_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_RATE_RE = re.compile(rf"^\s*{_NUM}\s*(?P<prefix>[kKmMgGtT]?)(?P<unit>.*?)\s*$")
_BIT_UNITS = {"", "bps", "bit", "bits", "bit/s", "bits/s", "b/s", "bitps"}
_BYTE_UNITS = {"B/s", "Bps", "byte/s", "bytes/s", "Byte/s", "Bytes/s"}


def parse_rate(text: str) -> float:
    """Bits per second for ``10gbps``, ``10Gbit/s``, ``800mbps``, ``1.25GB/s`` or ``5``.

    Raises :class:`kvwire.UsageError` for anything else, including negative or non-finite
    values. Zero is accepted here; callers that need a positive rate check it.
    """
    match = _RATE_RE.match(text)
    if match is None:
        raise UsageError(f"cannot parse rate {text!r} (try 10gbps, 800mbps, 1.25GB/s)")
    value = float(match["num"])
    prefix = _RATE_PREFIX[match["prefix"].lower()]
    unit = match["unit"]
    if unit in _BYTE_UNITS:
        result = value * prefix * 8.0
    elif unit.lower() in _BIT_UNITS and not unit.startswith("B"):
        result = value * prefix
    else:
        raise UsageError(
            f"cannot parse rate {text!r}: unknown unit {unit!r} (try 10gbps, 800mbps, 1.25GB/s)"
        )
    if not math.isfinite(result):
        raise UsageError(f"rate {text!r} is not finite")
    return result


def _pick(value: float, units: tuple[tuple[str, float], ...]) -> tuple[str, float]:
    """The largest unit in which ``value`` prints (four significant digits) as >= 1, and
    the printed number; the last unit takes whatever is left."""
    for name, scale in units:
        printed = float(f"{value / scale:.4g}")
        if abs(printed) >= 1:
            return name, printed
    name, scale = units[-1]
    return name, float(f"{value / scale:.4g}")


def _format(value: float, units: tuple[tuple[str, float], ...]) -> str:
    # Printed again from the number as printed, so a value that rounds up into the next
    # unit (999.96 Mbit/s, 1023.95 KiB) is written in that unit and reads back the same.
    name, printed = _pick(value, units)
    name, printed = _pick(printed * dict(units)[name], units)
    return f"{printed:.4g} {name}"


_RATE_UNITS = (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3), ("bit/s", 1.0))


def format_rate(bits_per_second: float) -> str:
    """``100 Gbit/s``, ``2.5 Gbit/s``, ``800 Mbit/s``: the largest prefix that keeps >= 1."""
    return _format(bits_per_second, _RATE_UNITS)


# -- durations ----------------------------------------------------------------------------------

_TIME_SCALE = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "sec": 1.0,
    "min": 60.0,
    "h": 3600.0,
}
_DURATION_RE = re.compile(rf"^\s*{_NUM}\s*(?P<unit>[a-zµ]*)\s*$")


def parse_duration(text: str, default_unit: str = "s") -> float:
    """Seconds for ``20ms``, ``1.5s``, ``500us``, ``2min``; a bare number is in
    ``default_unit`` (seconds unless the caller says otherwise)."""
    if default_unit not in _TIME_SCALE:
        raise UsageError(f"unknown default time unit {default_unit!r}")
    match = _DURATION_RE.match(text)
    if match is None:
        raise UsageError(f"cannot parse duration {text!r} (try 20ms, 1.5s, 500us)")
    unit = match["unit"] or default_unit
    if unit not in _TIME_SCALE:
        raise UsageError(
            f"cannot parse duration {text!r}: unknown unit {unit!r} (use ns, us, ms, s, min, h)"
        )
    value = float(match["num"]) * _TIME_SCALE[unit]
    if not math.isfinite(value):
        raise UsageError(f"duration {text!r} is not finite")
    return value


_TIME_UNITS = (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9))


def format_duration(seconds: float) -> str:
    """``20 ms``, ``1.5 s``, ``500 us``, ``0 s``: the largest unit that keeps >= 1 (up to s)."""
    if seconds == 0:
        return "0 s"
    return _format(seconds, _TIME_UNITS)


# -- sizes --------------------------------------------------------------------------------------

_SIZE_SCALE = {
    "": 1,
    "b": 1,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
}
_SIZE_RE = re.compile(rf"^\s*{_NUM}\s*(?P<unit>[A-Za-z]*)\s*$")


def parse_size(text: str) -> int:
    """Bytes for ``4096``, ``64KiB``, ``128MiB``, ``1GiB``, ``1GB`` (rounded to a whole byte)."""
    match = _SIZE_RE.match(text)
    if match is None:
        raise UsageError(f"cannot parse size {text!r} (try 4096, 128MiB, 1GiB)")
    unit = match["unit"].lower()
    if unit not in _SIZE_SCALE:
        raise UsageError(
            f"cannot parse size {text!r}: unknown unit {match['unit']!r} "
            "(use B, KiB, MiB, GiB, TiB or KB, MB, GB, TB)"
        )
    value = float(match["num"]) * _SIZE_SCALE[unit]
    if not math.isfinite(value):
        raise UsageError(f"size {text!r} is not finite")
    return round(value)


_SIZE_UNITS = (("TiB", 1024.0**4), ("GiB", 1024.0**3), ("MiB", 1024.0**2), ("KiB", 1024.0), ("B", 1.0))


def format_size(n_bytes: float) -> str:
    """``4 KiB``, ``128 MiB``, ``1 GiB``, ``100 B``: binary prefixes, largest that keeps >= 1."""
    if n_bytes == 0:
        return "0 B"
    return _format(n_bytes, _SIZE_UNITS)


# -- schedules ----------------------------------------------------------------------------------


def parse_schedule(text: str) -> Schedule:
    """``((start_s, bits_per_s), ...)`` for ``"0s:10gbps,30s:1gbps"`` (``TIME:RATE`` items).

    Items may come in any order; they are sorted by start. The first must start at 0 so the
    rate is defined for the whole run; starts must be distinct and rates > 0.
    """
    items: list[tuple[float, float]] = []
    for raw in text.split(","):
        part = raw.strip()
        if not part:
            continue
        if "@" in part:
            raise UsageError(
                f"schedule item {part!r}: the schedule syntax is TIME:RATE, "
                "e.g. 0s:10gbps,30s:1gbps"
            )
        time_text, sep, rate_text = part.partition(":")
        if not sep:
            raise UsageError(
                f"schedule item {part!r} is not TIME:RATE (e.g. 0s:10gbps,30s:1gbps)"
            )
        try:
            start = parse_duration(time_text)
            rate = parse_rate(rate_text)
        except UsageError as exc:
            raise UsageError(f"schedule item {part!r}: {exc}") from None
        if not rate > 0:
            raise UsageError(f"schedule item {part!r}: the rate must be > 0")
        items.append((start, rate))
    if not items:
        raise UsageError("empty rate schedule (expected TIME:RATE[,TIME:RATE...])")
    items.sort()
    if items[0][0] != 0.0:
        raise UsageError(
            f"a rate schedule must start at time 0 (first item starts at "
            f"{format_duration(items[0][0])}; e.g. 0s:10gbps,30s:1gbps)"
        )
    for (a, _), (b, _) in itertools.pairwise(items):
        if a == b:
            raise UsageError(f"two schedule items start at {format_duration(a)}")
    return tuple(items)


def format_schedule(schedule: Schedule) -> str:
    """``0 s:10 Gbit/s, 30 s:1 Gbit/s`` for display; :func:`parse_schedule` reads it back."""
    return ", ".join(f"{format_duration(t)}:{format_rate(r)}" for t, r in schedule)


# -- addresses ----------------------------------------------------------------------------------


def is_ipv6(text: str) -> bool:
    """Whether ``text`` is an IPv6 address (a zone too: ``fe80::1%eth0``)."""
    try:
        return ipaddress.ip_address(text).version == 6
    except ValueError:
        return False


def split_hostport(text: str) -> tuple[str, str]:
    """``HOST:PORT`` as the host and the port's text (unchecked: the caller says which ports
    it takes); an IPv6 host in brackets (``[::1]:7070``, the brackets not the host's).
    ValueError for no host, no ``:PORT``, brackets around anything but an IPv6 address, or
    a host with a colon outside brackets (``::1``, ``fe80::1:7070``: where the host would end
    and the port begin cannot be told)."""
    if text.startswith("["):
        inner, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":") or not is_ipv6(inner):
            raise ValueError(f"{text!r} is not HOST:PORT, an IPv6 host in brackets ([::1]:7070)")
        return inner, rest[1:]
    host, sep, port = text.rpartition(":")
    if ":" in host or not sep or not host:
        raise ValueError(f"{text!r} is not HOST:PORT, an IPv6 host in brackets ([::1]:7070)")
    return host, port


# -- argparse -----------------------------------------------------------------------------------

T = TypeVar("T")


def whole_number(text: str, *, minimum: int = 1, maximum: int | None = None) -> int:
    """A whole number >= ``minimum`` (a count: ``--requests 4000``), and at most
    ``maximum`` when one is given."""
    try:
        value = int(text)
    except ValueError:
        raise UsageError(f"{text!r} is not a whole number") from None
    if value < minimum:
        raise UsageError(f"{text!r} must be >= {minimum}")
    if maximum is not None and value > maximum:
        raise UsageError(f"{text!r} must be at most {maximum:,}")
    return value


def number(text: str, *, strictly_positive: bool = True) -> float:
    """A finite number > 0 (>= 0 when ``strictly_positive`` is false)."""
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"{text!r} is not a number") from None
    return _check_sign(value, text, strictly_positive)


def positive(parse: Callable[[str], float], what: str) -> Callable[[str], float]:
    """``parse`` (a rate or a duration parser here) refusing values that are not > 0."""

    def parse_positive(text: str) -> float:
        return _check_sign(parse(text), text, True, what)

    parse_positive.__name__ = what
    return parse_positive


def _check_sign(value: float, text: str, strictly_positive: bool, what: str = "") -> float:
    ok = value > 0 if strictly_positive else value >= 0
    if not ok or not math.isfinite(value):
        # inf is >= 0: say what it is not ('inf' must be >= 0 read as a contradiction).
        need = f"{'' if math.isfinite(value) else 'a finite number '}{'> 0' if strictly_positive else '>= 0'}"
        raise UsageError(f"{what + ' ' if what else ''}{text!r} must be {need}")
    return value


#: An option value that starts with a minus sign and a number (``-5gbps``, ``-1ms``,
#: ``-.5``, ``-1e3``): a value of the option before it, never an option of its own.
_NEGATIVE_VALUE = re.compile(r"^-\.?\d")


def take_negative_values(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Make ``parser`` read ``--link -5gbps`` as ``--link`` with the value ``-5gbps``, which
    the option's own check then refuses with what is wrong ("must not be negative").

    argparse takes a value that starts with ``-`` for an option unless it is a plain
    negative number (``-5``, ``-.5``), so ``--link -5gbps``, ``--rtt -1ms`` or ``--mu -1e-3``
    failed with "argument --link: expected one argument", which says nothing of the value.
    No option of these commands starts with ``-`` and a digit, so nothing else changes
    (Python 3.13's argparse reads such values the same way). Returns ``parser``."""
    parser._negative_number_matcher = _NEGATIVE_VALUE
    return parser


def _negative(parse: Callable[[str], object], text: str, message: str) -> str | None:
    """The message for ``text`` that ``parse`` could not read only for its minus sign
    ("'-5gbps' must not be negative": its own, "cannot parse rate '-5gbps'", said nothing
    of the sign); else None (a message that names the bound already, "'-1' must be > 0",
    is kept)."""
    stripped = text.strip()
    if "cannot parse" not in message or not _NEGATIVE_VALUE.match(stripped):
        return None
    try:
        parse(stripped[1:])
    except (UsageError, ValueError):
        return None
    return f"{text!r} must not be negative"


def argument_type(parse: Callable[[str], T], what: str | None = None) -> Callable[[str], T]:
    """An ``argparse`` ``type=`` from a parser here: a :class:`UsageError` becomes argparse's
    own error message (exit status 2) instead of a traceback. A negative value that the
    parser cannot read for its sign alone is refused as negative (see
    :func:`take_negative_values`)."""

    def convert(text: str) -> T:
        try:
            return parse(text)
        except UsageError as exc:
            message = str(exc)
            raise argparse.ArgumentTypeError(_negative(parse, text, message) or message) from None

    convert.__name__ = what or getattr(parse, "__name__", "value").removeprefix("parse_")
    return convert
