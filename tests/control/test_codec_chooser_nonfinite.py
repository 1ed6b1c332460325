"""CodecChooser against measurements and priors that are no numbers (NaN, infinities,
negative times): ignored by the observe_* methods, refused by the constructor, and never
a choose() that fails."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvwire.control import CodecCandidate, CodecChooser
from kvwire.control.codec_choice import STAGE_COUPLING, coupled

GB = 1e9
MIB = 1 << 20
NAMES = ("raw", "fp8", "int8", "int4")
BAD_SECONDS = (math.nan, math.inf, -math.inf, -0.5)


def candidates(*, with_raw: bool = True) -> list[CodecCandidate]:
    compact = [
        CodecCandidate(name="fp8", size_ratio=0.52, encode_bytes_per_s=4 * GB, decode_bytes_per_s=8 * GB),
        CodecCandidate(name="int8", size_ratio=0.53, encode_bytes_per_s=3.5 * GB, decode_bytes_per_s=7 * GB),
        CodecCandidate(name="int4", size_ratio=0.375, encode_bytes_per_s=3 * GB, decode_bytes_per_s=6 * GB),
    ]
    return ([CodecCandidate(name="raw", size_ratio=1.0)] if with_raw else []) + compact


def model(ch: CodecChooser) -> dict[str, Any]:
    """Everything the observe_* methods may change."""
    per = {c: (ch.encode_speed(c), ch.decode_speed(c), ch.size_ratio(c), ch.transport_cost_of(c))
           for c in ch.codecs}
    return {"per": per, "transport": ch.transport_cost, "receiver": ch.receiver_transport_cost,
            "measured": ch.meter.measured}


@pytest.mark.parametrize("seconds", BAD_SECONDS)
def test_an_encode_time_that_is_no_time_is_ignored(seconds: float) -> None:
    # A server without raw: a NaN encode speed made every rate NaN, and choose() failed
    # with AssertionError("unreachable ...") for good (good measurements did not heal it).
    ch = CodecChooser(candidates(with_raw=False))
    ch.observe_encode("fp8", MIB, seconds)
    assert ch.encode_speed("fp8") == 4 * GB  # the prior, untouched
    ch.observe_encode("fp8", MIB, 1e-3)
    assert ch.encode_speed("fp8") == pytest.approx(4 * GB + 0.25 * (MIB / 1e-3 - 4 * GB))
    assert ch.choose(10e9).codec in ch.codecs


@pytest.mark.parametrize("seconds", BAD_SECONDS)
def test_a_decode_time_that_is_no_time_is_ignored(seconds: float) -> None:
    ch = CodecChooser(candidates(with_raw=False))
    ch.observe_decode("int4", 2 * MIB, seconds)
    assert ch.decode_speed("int4") == 6 * GB
    assert ch.choose(10e9).codec in ch.codecs


def test_a_time_below_a_nanosecond_counts_as_one() -> None:
    ch = CodecChooser(candidates(), speed_gain=1.0)
    ch.observe_encode("int4", MIB, 0.0)  # a clock too coarse to see it
    assert ch.encode_speed("int4") == pytest.approx(MIB / 1e-9)


@pytest.mark.parametrize("cpu_seconds", BAD_SECONDS)
@pytest.mark.parametrize("pipeline", ["serial", "hosts"])
def test_a_transport_cost_that_is_no_time_is_ignored(cpu_seconds: float, pipeline: str) -> None:
    ch = CodecChooser(candidates(), pipeline=pipeline)
    ch.observe_transport(MIB, cpu_seconds, "raw", runnable=0.5)
    assert ch.transport_cost is None and ch.transport_cost_of("raw") is None
    assert ch.choose(10e9).codec in ch.codecs


@pytest.mark.parametrize("now", [math.nan, math.inf, -math.inf])
def test_an_acknowledgement_at_no_time_is_ignored(now: float) -> None:
    ch = CodecChooser(candidates(), measure_goodput=True)
    codec = ch.choose(10e9, now=0.0).codec
    for k in range(20):
        ch.observe_delivered(codec, MIB, 0.001 * k)
    assert ch.meter.measured
    ch.observe_delivered(codec, MIB, now)
    for k in range(20, 40):
        ch.observe_delivered(codec, MIB, 0.001 * k)
    assert ch.meter.rate(codec) == pytest.approx(MIB / 0.001)
    assert ch.choose(10e9, now=0.1).codec in ch.codecs


@pytest.mark.parametrize("bad", [math.nan, math.inf, 0.0, -1.0])
def test_the_constructor_refuses_a_ratio_or_speed_that_is_no_number_above_zero(bad: float) -> None:
    with pytest.raises(ValueError, match="size_ratio"):
        CodecChooser([CodecCandidate(name="raw", size_ratio=1.0), CodecCandidate(name="x", size_ratio=bad)])
    with pytest.raises(ValueError, match="encode_bytes_per_s"):
        CodecChooser([CodecCandidate(name="x", size_ratio=0.5, encode_bytes_per_s=bad)])
    with pytest.raises(ValueError, match="decode_bytes_per_s"):
        CodecChooser([CodecCandidate(name="x", size_ratio=0.5, decode_bytes_per_s=bad)])


@pytest.mark.parametrize("kw", [{"speed_gain": math.nan}, {"speed_gain": 0.0}, {"speed_gain": 1.5},
                                {"probe_interval": math.nan}, {"refresh_after": math.nan}])
def test_the_constructor_refuses_a_nan_setting(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        CodecChooser(candidates(), **kw)


def test_coupled_stages_far_below_one_byte_per_second_do_not_overflow() -> None:
    # A receiver reporting an absurd CPU cost per byte (its REPORT's figure is the peer's
    # to choose) put a stage at 1e-78 B/s, whose power overflowed in choose().
    assert coupled([1e-78, 1.0]) == pytest.approx(1e-78)
    assert coupled([2.0, 2.0]) == pytest.approx(2.0 * 2 ** (-1 / STAGE_COUPLING))
    assert coupled([3.0, math.inf]) == 3.0
    assert coupled([math.inf, math.inf]) == math.inf
    assert coupled([0.0, 1.0]) == 0.0
    ch = CodecChooser(candidates(with_raw=False))
    ch.observe_receiver_transport(2e77)
    assert ch.choose(1.0).codec in ch.codecs


# -- properties ---------------------------------------------------------------------------

ANY = st.floats()
FINITE = st.floats(allow_nan=False, allow_infinity=False)
NO_NUMBER = st.sampled_from([math.nan, math.inf, -math.inf])
SIZES = st.integers(1, 1 << 40)
CODEC = st.sampled_from(NAMES)


def observations(value: st.SearchStrategy[float]) -> st.SearchStrategy[tuple[Any, ...]]:
    """A call of an observe_* method whose measured value is drawn from ``value``."""
    return st.one_of(
        st.tuples(st.just("observe_encode"), CODEC, SIZES, value),
        st.tuples(st.just("observe_decode"), CODEC, SIZES, value),
        st.tuples(st.just("observe_transport"), SIZES, value, st.none() | CODEC, st.none() | value),
        st.tuples(st.just("observe_receiver_transport"), value),
        st.tuples(st.just("observe_path_rtt"), value),
        st.tuples(st.just("observe_delivered"), CODEC, st.integers(0, 1 << 40), value),
    )


STEPS = st.one_of(
    observations(FINITE),
    st.tuples(st.just("observe_size"), CODEC, SIZES, SIZES),
    st.tuples(st.just("observe_idle")),
    st.tuples(st.just("observe_shared_host")),
    st.tuples(st.just("choose"), st.none() | ANY, st.booleans(), st.none() | FINITE, st.none() | ANY),
)


def apply(ch: CodecChooser, step: tuple[Any, ...]) -> None:
    name, *args = step
    if name == "choose":
        bandwidth, app_limited, now, peak = args
        choice = ch.choose(bandwidth, app_limited=app_limited, now=now, peak_bps=peak)
        assert choice.codec in ch.codecs
    elif name == "observe_transport":
        wire, cpu, codec, runnable = args
        ch.observe_transport(wire, cpu, codec, runnable=runnable)
    elif args and args[0] in NAMES and args[0] not in ch.codecs:
        return  # a codec this chooser has not
    else:
        getattr(ch, name)(*args)


def chooser_of(with_raw: bool, pipeline: str, cores: int, measure: bool) -> CodecChooser:
    return CodecChooser(candidates(with_raw=with_raw), pipeline=pipeline, cores=cores,
                        measure_goodput=measure)


SETUPS = st.tuples(st.booleans(), st.sampled_from(["hosts", "cpu", "serial", "full"]),
                   st.integers(1, 4), st.booleans())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(SETUPS, st.lists(STEPS, max_size=40), st.floats(min_value=1e3, max_value=1e13))
def test_finite_observations_never_make_choose_fail(
    setup: tuple[bool, str, int, bool], steps: list[tuple[Any, ...]], bandwidth: float
) -> None:
    ch = chooser_of(*setup)
    for step in steps:
        apply(ch, step)
    choice = ch.choose(bandwidth, now=1e6)
    assert choice.codec in ch.codecs
    assert not math.isnan(choice.delivered_bytes_per_s)
    assert all(not math.isnan(r) for r in ch.rates(bandwidth).values())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(SETUPS, st.lists(STEPS, max_size=30), observations(NO_NUMBER))
def test_an_observation_that_is_no_number_changes_nothing(
    setup: tuple[bool, str, int, bool], steps: list[tuple[Any, ...]], bad: tuple[Any, ...]
) -> None:
    ch = chooser_of(*setup)
    for step in steps:
        apply(ch, step)
    before = model(ch)
    apply(ch, bad)
    assert model(ch) == before
    assert ch.choose(10e9).codec in ch.codecs


@pytest.mark.parametrize("setup", [(False, "serial", 1, False), (True, "serial", 1, False), (False, "hosts", 1, False)])
def test_a_bandwidth_whose_byte_rate_underflows_is_no_division_by_zero(setup: tuple[bool, str, int, bool]) -> None:
    """5e-324 bit/s is positive, but its rate in bytes per wire byte underflows to 0.0."""
    choice = chooser_of(*setup).choose(5e-324, app_limited=False)
    assert choice.delivered_bytes_per_s == 0.0
