"""The goodput meter: KV bytes/s per codec from acknowledgements, in fake time."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.control.goodput import GoodputMeter

MIB = 1 << 20


def acks(meter: GoodputMeter, codec: str, times: list[float], kv: int = 4 * MIB) -> None:
    for t in times:
        meter.on_ack(codec, kv, t)


def test_the_first_ack_starts_the_clock_and_sample_acks_after_it_make_a_sample() -> None:
    m = GoodputMeter(sample_acks=4)
    m.chosen("fp8")
    acks(m, "fp8", [1.0, 1.01, 1.02, 1.03])
    assert m.rate("fp8") is None  # three after the first: not yet
    acks(m, "fp8", [1.05])
    # four chunks after the first, over 50 ms: the first chunk's bytes are not counted
    assert m.rate("fp8") == pytest.approx(4 * 4 * MIB / 0.05)
    assert m.samples("fp8") == 1


def test_a_long_run_averages_its_last_window_samples() -> None:
    m = GoodputMeter(sample_acks=2, min_acks=2, window=2)
    m.chosen("raw")
    acks(m, "raw", [0.0, 0.1, 0.2])  # 2 chunks / 0.2 s
    acks(m, "raw", [0.3, 0.4])  # 2 chunks / 0.2 s (the sample before ended at 0.2)
    assert m.rate("raw") == pytest.approx(2 * 4 * MIB / 0.2)
    acks(m, "raw", [0.9, 1.4])  # 2 chunks / 1.0 s: the first sample drops out
    assert m.rate("raw") == pytest.approx(4 * 4 * MIB / 1.2)
    assert m.samples("raw") == 3


def test_only_the_chosen_codec_is_measured_and_other_acks_do_not_end_its_run() -> None:
    m = GoodputMeter(sample_acks=3)
    m.chosen("int8")
    acks(m, "fp8", [0.0, 0.01, 0.02, 0.03, 0.04])  # the previous codec's, still in flight
    assert m.measured == {}
    acks(m, "int8", [0.05, 0.06])
    acks(m, "fp8", [0.065])
    acks(m, "int8", [0.07, 0.08])
    assert m.measured == {"int8": pytest.approx(3 * 4 * MIB / 0.03)}


def test_choosing_another_codec_ends_the_run_and_its_tail_does_not_count() -> None:
    m = GoodputMeter(sample_acks=8, min_acks=3)
    m.chosen("raw")
    acks(m, "raw", [0.0, 0.01, 0.02, 0.03])  # three counted: a shorter sample at the switch
    m.chosen("fp8")
    assert m.rate("raw") == pytest.approx(3 * 4 * MIB / 0.03)
    acks(m, "raw", [0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3])  # in flight at the switch
    assert m.rate("raw") == pytest.approx(3 * 4 * MIB / 0.03)
    m.chosen("fp8")  # the same codec again changes nothing
    acks(m, "fp8", [2.0, 2.1])
    m.chosen("raw")  # one counted: too short to be a sample
    assert m.rate("fp8") is None


def test_pause_keeps_the_idle_gap_out() -> None:
    m = GoodputMeter(sample_acks=4, min_acks=2)
    m.chosen("int4")
    acks(m, "int4", [0.0, 0.01, 0.02])
    m.pause()  # the transfer is done: two counted, a shorter sample
    assert m.rate("int4") == pytest.approx(2 * 4 * MIB / 0.02)
    acks(m, "int4", [5.0, 5.02, 5.04, 5.06, 5.08])  # the next transfer, 5 s later
    assert m.rate("int4") == pytest.approx(4 * 4 * MIB / 0.08)  # a new run: its rate only


def test_a_new_run_replaces_the_rate_of_an_earlier_one() -> None:
    m = GoodputMeter(sample_acks=2, min_acks=2, window=4)
    m.chosen("fp8")
    acks(m, "fp8", [0.0, 0.5, 1.0])  # slow: 2 chunks / s
    m.chosen("raw")
    m.chosen("fp8")
    acks(m, "fp8", [2.0, 2.01, 2.02])
    assert m.rate("fp8") == pytest.approx(2 * 4 * MIB / 0.02)
    assert m.samples("fp8") == 2


def test_acks_at_one_instant_or_from_the_past_make_no_rate() -> None:
    m = GoodputMeter(sample_acks=2, min_acks=1)
    m.chosen("raw")
    acks(m, "raw", [1.0, 1.0, 1.0])
    assert m.rate("raw") is None
    acks(m, "raw", [0.5])  # a clock that went back: a new run starts there
    acks(m, "raw", [0.6, 0.7])
    assert m.rate("raw") == pytest.approx(2 * 4 * MIB / 0.2)


def test_invalid_settings() -> None:
    for kw in ({"sample_acks": 0}, {"min_acks": 0}, {"sample_acks": 2, "min_acks": 3}, {"window": 0}):
        with pytest.raises(ValueError):
            GoodputMeter(**kw)  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(
    period=st.floats(1e-4, 1.0),
    chunks=st.integers(1, 64),
    sample_acks=st.integers(1, 16),
    window=st.integers(1, 8),
    kv=st.integers(1, 64 * MIB),
)
def test_evenly_spaced_acks_measure_the_exact_rate(
    period: float, chunks: int, sample_acks: int, window: int, kv: int,
) -> None:
    """Whatever the settings, acknowledgements ``period`` apart measure ``kv / period``,
    and the rate is never anything else (no sample folds a gap or a partial wrongly)."""
    m = GoodputMeter(sample_acks=sample_acks, min_acks=1, window=window)
    m.chosen("fp8")
    acks(m, "fp8", [i * period for i in range(chunks + 1)], kv)
    m.pause()
    assert m.rate("fp8") == pytest.approx(kv / period, rel=1e-6)


def test_a_transfers_first_layer_does_not_start_a_run_but_counts_in_one_under_way() -> None:
    m = GoodputMeter(sample_acks=2, min_acks=2)
    m.chosen("int4")
    # After a pause: the first layer's acks, then the wait for the receiver's grant (a
    # round trip), then the flow. The run starts at the first ack after the wait.
    for t in (0.0, 0.01, 0.02):
        m.on_ack("int4", 4 * MIB, t, starts_run=False)
    assert m.measured == {}
    acks(m, "int4", [0.12, 0.13, 0.14])
    assert m.rate("int4") == pytest.approx(2 * 4 * MIB / 0.02)  # the wait is not in it
    # Under way, a first layer's ack (another transfer overlapping) counts as any other.
    m.on_ack("int4", 4 * MIB, 0.15, starts_run=False)
    acks(m, "int4", [0.16])
    assert m.samples("int4") == 2 and m.rate("int4") == pytest.approx(4 * 4 * MIB / 0.04)
