"""CodecChooser decisions on exact bandwidths, ratios and encode speeds."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.control import CodecCandidate, CodecChooser

GB = 1e9


def chooser(**kw: Any) -> CodecChooser:
    return CodecChooser(
        [
            CodecCandidate(name="raw", size_ratio=1.0, encode_bytes_per_s=50 * GB),
            CodecCandidate(name="fp8", size_ratio=0.5, encode_bytes_per_s=2 * GB),
            CodecCandidate(name="int4", size_ratio=0.25, encode_bytes_per_s=1 * GB),
        ],
        **{"pipeline": "full", **kw},  # the examples below: free decode, overlapped encode
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
        pipeline="full",
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


def test_receiver_decode_counts_against_a_codec() -> None:
    candidates = [
        CodecCandidate(name="raw", size_ratio=1.0),
        CodecCandidate(name="fp8", size_ratio=0.5, encode_bytes_per_s=2 * GB, decode_bytes_per_s=0.4 * GB),
    ]
    # 10 Gbit/s, serial: fp8 costs 0.5/1.25 + 1/2 + 1/0.4 = 3.4 s/GB, raw 0.8 s/GB.
    c = CodecChooser(candidates)
    assert c.choose(10e9).codec == "raw"
    assert c.delivered_rate("fp8", 10e9) == pytest.approx(GB / 3.4)
    # 1 Gbit/s: fp8 4 + 0.5 + 2.5 = 7 s/GB beats raw's 8 s/GB, only just.
    assert c.choose(1e9).codec == "fp8"
    assert c.delivered_rate("fp8", 1e9) == pytest.approx(GB / 7)
    # Wire overlapped with one CPU budget: max(4, 3) s/GB at 1 Gbit/s.
    assert CodecChooser(candidates, pipeline="cpu").delivered_rate("fp8", 1e9) == pytest.approx(0.25 * GB)
    # Every stage overlapped: the decoder's 0.4 GB/s bounds it at 10 Gbit/s.
    assert CodecChooser(candidates, pipeline="full").delivered_rate("fp8", 10e9) == pytest.approx(0.4 * GB)
    with pytest.raises(ValueError):
        CodecChooser(candidates, pipeline="parallel")


def test_a_cpu_bound_transport_keeps_raw() -> None:
    # The transport delivers 2 Gbit/s of raw (4 s/GB) because it is CPU-bound; fp8 at
    # 0.8 GB/s encode and 0.7 GB/s decode on the same CPUs: 2.08 + 1.25 + 1.43 s/GB.
    c = CodecChooser([
        CodecCandidate(name="raw", size_ratio=1.0),
        CodecCandidate(name="fp8", size_ratio=0.52, encode_bytes_per_s=0.8 * GB, decode_bytes_per_s=0.7 * GB),
    ])
    assert c.choose(2e9).codec == "raw"
    assert c.choose(0.5e9).codec == "fp8"  # 16 s/GB against 8.3 + 2.7


def test_observed_decode_speed_moves_the_choice() -> None:
    c = CodecChooser(
        [
            CodecCandidate(name="raw", size_ratio=1.0),
            CodecCandidate(name="int4", size_ratio=0.25, encode_bytes_per_s=5 * GB),
        ],
        speed_gain=1.0,
    )
    assert c.choose(1e9).codec == "int4"  # 0.125 GB/s raw against 0.5 GB/s int4
    c.observe_decode("int4", 10_000_000, 1.0)  # 10 MB/s on the receiver
    assert c.decode_speed("int4") == pytest.approx(1e7)
    assert c.choose(1e9).codec == "raw"


def _true_rate(pipeline: str, bandwidth_bps: float, ratio: float, enc: float | None, dec: float | None) -> float:
    """KV bytes/s end to end, written out independently of the chooser."""
    wire = ratio * 8 / bandwidth_bps
    stages = [1 / s for s in (enc, dec) if s is not None]
    if pipeline == "serial":
        return 1 / (wire + sum(stages))
    if pipeline == "cpu":
        return 1 / max(wire, sum(stages))
    return 1 / max([wire, *stages])


_speed = st.one_of(st.none(), st.floats(0.05 * GB, 50 * GB))


@settings(max_examples=300, deadline=None)
@given(
    bandwidth=st.floats(1e8, 4e11),
    codecs=st.lists(st.tuples(st.floats(0.1, 0.99), _speed, _speed), min_size=1, max_size=4),
    time_left=st.one_of(st.none(), st.floats(0.001, 10.0)),
    pipeline=st.sampled_from(["serial", "cpu", "full"]),
)
def test_auto_never_picks_a_codec_slower_end_to_end_than_raw(
    bandwidth: float, codecs: list[tuple[float, float | None, float | None]],
    time_left: float | None, pipeline: str,
) -> None:
    candidates = [CodecCandidate(name="raw", size_ratio=1.0)]
    candidates += [
        CodecCandidate(name=f"q{i}", size_ratio=r, encode_bytes_per_s=e, decode_bytes_per_s=d)
        for i, (r, e, d) in enumerate(codecs)
    ]
    chooser = CodecChooser(candidates, pipeline=pipeline)
    remaining = None if time_left is None else int(GB)
    choice = chooser.choose(bandwidth, remaining_bytes=remaining, time_left=time_left)
    params = {c.name: (c.size_ratio, c.encode_bytes_per_s, c.decode_bytes_per_s) for c in candidates}
    raw_rate = _true_rate(pipeline, bandwidth, *params["raw"])
    chosen_rate = _true_rate(pipeline, bandwidth, *params[choice.codec])
    assert choice.codec == "raw" or chosen_rate >= raw_rate * (1 - 1e-9)
    if time_left is None:  # throughput mode: raw whenever it is within tolerance of the best
        best = max(_true_rate(pipeline, bandwidth, *p) for p in params.values())
        if abs(raw_rate - 0.95 * best) > 1e-6 * best:
            assert (choice.codec == "raw") == (raw_rate > 0.95 * best)


def test_a_decode_prior_slows_down_with_the_measured_encode() -> None:
    c = CodecChooser(
        [
            CodecCandidate(name="raw", size_ratio=1.0),
            CodecCandidate(name="fp8", size_ratio=0.5, encode_bytes_per_s=2 * GB, decode_bytes_per_s=2 * GB),
        ],
        speed_gain=1.0,
    )
    assert c.decode_speed("fp8") == pytest.approx(2 * GB)
    c.observe_encode("fp8", 500_000_000, 1.0)  # the host got busy: encode at a quarter
    assert c.decode_speed("fp8") == pytest.approx(0.5 * GB)
    c.observe_encode("fp8", 4_000_000_000, 1.0)  # faster than the prior: no extrapolation up
    assert c.decode_speed("fp8") == pytest.approx(2 * GB)
    c.observe_decode("fp8", 300_000_000, 1.0)  # a real measurement replaces the prior
    assert c.decode_speed("fp8") == pytest.approx(0.3 * GB)
    c.observe_encode("fp8", 100_000_000, 1.0)
    assert c.decode_speed("fp8") == pytest.approx(0.3 * GB)


def test_a_small_measurement_moves_the_speed_in_proportion_to_its_size() -> None:
    def chooser() -> CodecChooser:
        return CodecChooser(
            [CodecCandidate(name="fp8", size_ratio=0.5, encode_bytes_per_s=4 * GB, decode_bytes_per_s=4 * GB)],
            speed_gain=0.5,
        )

    full, small = chooser(), chooser()
    full.observe_encode("fp8", 1 << 20, (1 << 20) / (2 * GB))  # 2 GB/s over a whole sample
    small.observe_encode("fp8", 1 << 16, (1 << 16) / (2 * GB))  # the same speed over 64 KiB
    assert full.encode_speed("fp8") == pytest.approx(3 * GB)
    assert small.encode_speed("fp8") == pytest.approx(4 * GB - 0.5 * 2 * GB / 16)
    # a first small decode measurement blends with the prior instead of replacing it
    small.observe_decode("fp8", 1 << 16, (1 << 16) / (1 * GB))
    assert small.decode_speed("fp8") == pytest.approx(4 * GB - 1.5 * GB / 16, rel=1e-6)
    full.observe_decode("fp8", 1 << 20, (1 << 20) / (1 * GB))
    assert full.decode_speed("fp8") == pytest.approx(1 * GB)
