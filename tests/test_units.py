"""kvwire.units: the one parser/formatter for rates, durations, sizes and schedules."""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire import UsageError
from kvwire.units import (
    argument_type,
    format_duration,
    format_rate,
    format_schedule,
    format_size,
    is_ipv6,
    number,
    parse_duration,
    parse_rate,
    parse_schedule,
    parse_size,
    split_hostport,
    whole_number,
)
from kvwire.units import (
    positive as positive_value,
)

# .4g formatting keeps four significant digits: a round trip is within 5e-4 relative.
REL = 5e-4


@pytest.mark.parametrize(
    ("text", "bps"),
    [
        ("10gbps", 10e9),
        ("10Gbit/s", 10e9),
        ("10 Gbit/s", 10e9),
        ("2.5gbit", 2.5e9),
        ("800mbps", 800e6),
        ("1.25GB/s", 10e9),
        ("100MBps", 800e6),
        ("5", 5.0),
        ("1e9", 1e9),
    ],
)
def test_parse_rate(text: str, bps: float) -> None:
    assert parse_rate(text) == pytest.approx(bps)


@pytest.mark.parametrize("text", ["", "fast", "-1gbps", "10xbps", "10GBit", "1e999gbps"])
def test_parse_rate_rejects(text: str) -> None:
    with pytest.raises(UsageError, match="rate"):
        parse_rate(text)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("20ms", 0.02),
        ("1.5s", 1.5),
        ("500us", 500e-6),
        ("2", 2.0),
        ("2min", 120.0),
        ("1h", 3600.0),
        ("20 ms", 0.02),
        ("0", 0.0),
        ("750ns", 750e-9),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


def test_parse_duration_default_unit() -> None:
    assert parse_duration("20", default_unit="ms") == pytest.approx(0.02)
    assert parse_duration("1s", default_unit="ms") == 1.0


@pytest.mark.parametrize("text", ["", "soon", "-1s", "3 parsecs", "1e999s"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(UsageError, match="duration"):
        parse_duration(text)


@pytest.mark.parametrize(
    ("text", "n"),
    [
        ("4096", 4096),
        ("1GiB", 1 << 30),
        ("128MiB", 128 << 20),
        ("64 KiB", 65536),
        ("1GB", 10**9),
        ("1.5KiB", 1536),
        ("10B", 10),
    ],
)
def test_parse_size(text: str, n: int) -> None:
    assert parse_size(text) == n


@pytest.mark.parametrize("text", ["", "big", "-1MiB", "1XiB"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(UsageError, match="size"):
        parse_size(text)


def test_parse_schedule() -> None:
    assert parse_schedule("0s:10gbps,30s:1gbps") == ((0.0, 10e9), (30.0, 1e9))
    assert parse_schedule("30:1gbps, 0:10gbps") == ((0.0, 10e9), (30.0, 1e9))
    assert parse_schedule("0:10gbps,1500ms:2.5gbps") == ((0.0, 10e9), (1.5, 2.5e9))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty"),
        ("5s:10gbps", "start at time 0"),
        ("10gbps,2.5gbps@3s", "TIME:RATE"),
        ("10gbps", "TIME:RATE"),
        ("0:10gbps,0:1gbps", "two schedule items"),
        ("0:0gbps", "> 0"),
        ("0:fast", "rate"),
        ("soon:10gbps", "duration"),
    ],
)
def test_parse_schedule_rejects(text: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        parse_schedule(text)


def test_formats() -> None:
    assert format_rate(100e9) == "100 Gbit/s"
    assert format_rate(800e6) == "800 Mbit/s"
    assert format_rate(2.5e9) == "2.5 Gbit/s"
    assert format_duration(0.02) == "20 ms"
    assert format_duration(1.5) == "1.5 s"
    assert format_duration(500e-6) == "500 us"
    assert format_duration(0) == "0 s"
    assert format_size(1 << 30) == "1 GiB"
    assert format_size(128 << 20) == "128 MiB"
    assert format_size(100) == "100 B"
    assert format_schedule(((0.0, 10e9), (30.0, 1e9))) == "0 s:10 Gbit/s, 30 s:1 Gbit/s"


def test_argument_type_turns_usage_error_into_argparse_error() -> None:
    parser = argparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--link", type=argument_type(parse_rate))
    assert parser.parse_args(["--link", "10gbps"]).link == 10e9
    with pytest.raises(argparse.ArgumentError, match="cannot parse rate"):
        parser.parse_args(["--link", "fast"])


positive = st.floats(min_value=1e-3, max_value=1e15, allow_nan=False, allow_infinity=False)


@settings(deadline=None)
@given(positive)
def test_rate_round_trip(bps: float) -> None:
    text = format_rate(bps)
    assert parse_rate(text) == pytest.approx(bps, rel=REL)
    assert format_rate(parse_rate(text)) == text


@settings(deadline=None)
@given(st.floats(min_value=1e-9, max_value=1e6, allow_nan=False))
def test_duration_round_trip(seconds: float) -> None:
    text = format_duration(seconds)
    assert parse_duration(text) == pytest.approx(seconds, rel=REL)
    assert format_duration(parse_duration(text)) == text


@settings(max_examples=500, deadline=None)
@given(st.integers(min_value=0, max_value=1 << 50))
def test_size_round_trip(n: int) -> None:
    text = format_size(n)
    # Four digits, then a whole number of bytes.
    assert abs(parse_size(text) - n) <= REL * n + 0.5 + 1e-9
    assert format_size(parse_size(text)) == text


@settings(deadline=None)
@given(
    st.dictionaries(
        st.integers(min_value=1, max_value=9999), positive.filter(lambda r: r >= 1e3), max_size=5
    ),
    st.floats(min_value=1e3, max_value=1e13),
)
def test_schedule_round_trip(later: dict[int, float], first_rate: float) -> None:
    # Whole seconds below 10,000 format exactly, so distinct starts stay distinct.
    schedule = tuple(sorted([(0.0, first_rate), *((float(t), r) for t, r in later.items())]))
    text = format_schedule(schedule)
    parsed = parse_schedule(text)
    assert [t for t, _ in parsed] == [t for t, _ in schedule]
    for (_, r0), (_, r1) in zip(schedule, parsed, strict=True):
        assert r1 == pytest.approx(r0, rel=REL)
    assert format_schedule(parsed) == text


@settings(deadline=None)
@given(st.text(max_size=20))
def test_parsers_raise_only_usage_error(text: str) -> None:
    for parse in (parse_rate, parse_duration, parse_size, parse_schedule):
        with contextlib.suppress(UsageError):
            parse(text)


@settings(deadline=None)
@given(st.integers(-(10**6), 10**6), st.integers(-5, 5))
def test_whole_number_accepts_exactly_the_integers_at_or_above_the_minimum(
    value: int, minimum: int
) -> None:
    if value >= minimum:
        assert whole_number(str(value), minimum=minimum) == value
    else:
        with pytest.raises(UsageError, match=f"must be >= {minimum}"):
            whole_number(str(value), minimum=minimum)


@settings(deadline=None)
@given(st.integers(-(10**6), 10**6), st.integers(0, 1000))
def test_whole_number_refuses_what_is_above_the_maximum(value: int, maximum: int) -> None:
    if 0 <= value <= maximum:
        assert whole_number(str(value), minimum=0, maximum=maximum) == value
    elif value > maximum:
        with pytest.raises(UsageError, match=f"must be at most {maximum:,}"):
            whole_number(str(value), minimum=0, maximum=maximum)


@pytest.mark.parametrize("text", ["inf", "-inf", "nan", "Infinity"])
@pytest.mark.parametrize("strict", [True, False])
def test_number_says_a_non_finite_value_is_not_finite(text: str, strict: bool) -> None:
    # 'inf' must be >= 0: inf is >= 0; the message named the wrong condition.
    sign = "> 0" if strict else ">= 0"
    with pytest.raises(UsageError) as caught:
        number(text, strictly_positive=strict)
    assert str(caught.value) == f"{text!r} must be a finite number {sign}"
    with pytest.raises(UsageError, match=f"'-1' must be {sign}$"):
        number("-1", strictly_positive=strict)


@pytest.mark.parametrize("text", ["", "1.5", "ten", "1e3"])
def test_whole_number_refuses_what_is_not_a_whole_number(text: str) -> None:
    with pytest.raises(UsageError, match="not a whole number"):
        whole_number(text)


@settings(deadline=None)
@given(st.floats(allow_nan=True, allow_infinity=True), st.booleans())
def test_number_keeps_finite_values_of_the_right_sign(value: float, strict: bool) -> None:
    ok = (value > 0 if strict else value >= 0) and value != float("inf")
    if ok:
        assert number(repr(value), strictly_positive=strict) == value
    else:
        with pytest.raises(UsageError):
            number(repr(value), strictly_positive=strict)


def test_positive_wraps_a_unit_parser() -> None:
    rate = positive_value(parse_rate, "link rate")
    assert rate("10gbps") == 10e9
    with pytest.raises(UsageError, match="link rate '0gbps' must be > 0"):
        rate("0gbps")
    assert positive_value(parse_duration, "duration")("20ms") == pytest.approx(0.02)
    with pytest.raises(UsageError, match="must be > 0"):
        positive_value(parse_duration, "duration")("0s")


# -- HOST:PORT ----------------------------------------------------------------------------------


@settings(deadline=None)
@given(st.ip_addresses(v=6), st.integers(0, 65535))
def test_an_ipv6_host_in_brackets_splits_from_its_port(address: Any, port: int) -> None:
    assert split_hostport(f"[{address}]:{port}") == (str(address), str(port))
    with pytest.raises(ValueError, match=r"IPv6 host in brackets \(\[::1\]:7070\)"):
        split_hostport(f"{address}:{port}")  # (where would the host end?)


@settings(deadline=None)
@given(st.ip_addresses(v=4), st.integers(0, 65535))
def test_an_ipv4_host_splits_from_its_port(address: Any, port: int) -> None:
    assert split_hostport(f"{address}:{port}") == (str(address), str(port))


@pytest.mark.parametrize(
    "text",
    [
        "decode-host",
        ":7070",
        "[::1]",
        "[::1]7070",
        "[decode-host]:7070",
        "[1.2.3.4]:7070",
        "::1",
        "fe80::1:7070",
        "[::1:7070",
    ],
)
def test_what_is_not_host_and_port_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="is not HOST:PORT"):
        split_hostport(text)


def test_the_port_is_left_to_the_caller() -> None:
    assert split_hostport("decode-host:http") == ("decode-host", "http")
    assert split_hostport("[fe80::1%eth0]:7070") == ("fe80::1%eth0", "7070")
    assert is_ipv6("fe80::1%eth0") and not is_ipv6("1.2.3.4") and not is_ipv6("decode-host")
