"""CodecChooser decisions on exact bandwidths, ratios and encode speeds."""

from __future__ import annotations

import math

import pytest

from kvwire.control import CodecCandidate, CodecChooser

GB = 1e9


def chooser(**kw: float) -> CodecChooser:
    return CodecChooser(
        [
            CodecCandidate(name="raw", size_ratio=1.0, encode_bytes_per_s=50 * GB),
            CodecCandidate(name="fp8", size_ratio=0.5, encode_bytes_per_s=2 * GB),
            CodecCandidate(name="int4", size_ratio=0.25, encode_bytes_per_s=1 * GB),
        ],
        **kw,
    )


def test_fast_link_sends_raw() -> None:
    c = chooser()
    choice = c.choose(100e9)  # 12.5 GB/s link
    assert choice.codec == "raw"
    assert choice.delivered_bytes_per_s == pytest.approx(12.5 * GB)
    assert choice.meets_deadline is None


def test_middle_link_sends_fp8() -> None:
    # 10 Gbit/s = 1.25 GB/s: raw 1.25, fp8 min(2.5, 2) = 2, int4 min(5, 1) = 1.
    assert chooser().choose(10e9).codec == "fp8"


def test_slow_link_sends_int4() -> None:
    # 1 Gbit/s: raw 0.125, fp8 min(0.25, 2) = 0.25, int4 min(0.5, 1) = 0.5 -> int4.
    assert chooser().choose(1e9).codec == "int4"


def test_tie_prefers_precision() -> None:
    c = CodecChooser(
        [
            CodecCandidate(name="raw", size_ratio=1.0, encode_bytes_per_s=1 * GB),
            CodecCandidate(name="fp8", size_ratio=0.5, encode_bytes_per_s=1.02 * GB),
        ],
        tolerance=0.05,
    )
    # Link 80 Gbit/s = 10 GB/s: both are encode-bound near 1 GB/s.
    assert c.choose(80e9).codec == "raw"


def test_measured_encode_speed_moves_the_choice() -> None:
    c = chooser(speed_gain=1.0)
    assert c.choose(10e9).codec == "fp8"
    c.observe_encode("fp8", 100_000_000, 1.0)  # fp8 measured at 0.1 GB/s
    assert c.encode_speed("fp8") == pytest.approx(0.1 * GB)
    assert c.choose(10e9).codec == "raw"


def test_unmeasured_codec_is_optimistic() -> None:
    c = CodecChooser.from_ratios({"raw": 1.0, "int8": 0.52})
    assert c.codecs == ["raw", "int8"]
    assert c.choose(10e9).codec == "int8"
    assert c.choose(None).codec == "raw"
    assert math.isnan(c.choose(None).delivered_bytes_per_s)


def test_observed_size_ratio_is_smoothed() -> None:
    c = chooser(speed_gain=0.5)
    c.observe_size("fp8", 1000, 400)
    assert c.size_ratio("fp8") == pytest.approx(0.45)


def test_deadline_keeps_precision_when_it_fits() -> None:
    c = chooser(deadline_margin=0.0)
    # 10 Gbit/s: raw moves 1.25 GB/s; 1 GB in 1 s fits raw.
    d = c.choose(10e9, remaining_bytes=int(1 * GB), time_left=1.0)
    assert d.codec == "raw" and d.meets_deadline is True


def test_deadline_steps_down_only_as_far_as_needed() -> None:
    c = chooser(deadline_margin=0.0)
    # 2 GB in 1 s at 10 Gbit/s: raw 1.25 no, fp8 2.0 yes.
    d = c.choose(10e9, remaining_bytes=int(2 * GB), time_left=1.0)
    assert d.codec == "fp8" and d.meets_deadline is True
    # At 2.5 Gbit/s: raw 0.31, fp8 0.62, int4 min(1.25, 1) = 1.0 -> int4 for 0.9 GB.
    d = c.choose(2.5e9, remaining_bytes=int(0.9 * GB), time_left=1.0)
    assert d.codec == "int4" and d.meets_deadline is True


def test_deadline_unreachable_picks_fastest() -> None:
    c = chooser()
    d = c.choose(1e9, remaining_bytes=int(10 * GB), time_left=1.0)
    assert d.codec == "int4" and d.meets_deadline is False
    d = c.choose(1e9, remaining_bytes=10, time_left=0.0)
    assert d.meets_deadline is False


def test_margin_makes_a_borderline_codec_miss() -> None:
    c = chooser(deadline_margin=0.1)
    d = c.choose(10e9, remaining_bytes=int(1.2 * GB), time_left=1.0)
    assert d.codec == "fp8"


def test_invalid_candidates() -> None:
    with pytest.raises(ValueError):
        CodecChooser([])
    with pytest.raises(ValueError):
        CodecChooser.from_ratios({"raw": 0.0})
