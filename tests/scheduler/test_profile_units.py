from __future__ import annotations

from pathlib import Path

import pytest

from kvwire.errors import UsageError
from kvwire.scheduler.profile import BUILTIN_PROFILES, builtin_profile, load_profile
from kvwire.scheduler.units import format_rate, parse_rate, parse_rate_schedule
from kvwire.scheduler.workload import LengthDistribution, load_trace

MiB = 1024 * 1024
TRACE = Path(__file__).resolve().parents[1] / "data" / "traces" / "mooncake_synthetic.jsonl.gz"


@pytest.mark.parametrize(
    ("text", "bps"),
    [
        ("100gbps", 100e9),
        ("10gbit", 10e9),
        ("2.5gbps", 2.5e9),
        ("800mbps", 800e6),
        ("10Gbit/s", 10e9),
        ("1.25GB/s", 10e9),
        ("5", 5.0),
        ("0gbps", 0.0),
    ],
)
def test_parse_rate(text: str, bps: float) -> None:
    assert parse_rate(text) == pytest.approx(bps)


@pytest.mark.parametrize("text", ["", "fast", "-1gbps", "10xbps", "10GBit"])
def test_parse_rate_rejects(text: str) -> None:
    with pytest.raises(UsageError):
        parse_rate(text)


def test_schedule_and_format() -> None:
    assert parse_rate_schedule("60:2.5gbps, 0:10gbps") == ((0.0, 10e9), (60.0, 2.5e9))
    with pytest.raises(UsageError):
        parse_rate_schedule("5:10gbps")
    assert format_rate(100e9) == "100 Gbit/s"
    assert format_rate(800e6) == "800 Mbit/s"


def test_hybrid_profile_matches_published_points() -> None:
    p = builtin_profile("hybrid-1t")
    assert p.prefill_seconds(32768) == pytest.approx(1.84)
    assert p.kv_size_bytes(8192) == pytest.approx(308.9 * MiB)
    assert p.kv_rate_bps(1024) / 1e9 == pytest.approx(3.61, rel=0.02)
    assert p.kv_size_bytes(0) / MiB == pytest.approx(173.9, abs=0.5)  # fixed state
    assert p.prefill_seconds(20000) == pytest.approx(0.72 + (1.84 - 0.72) * (20000 - 8192) / 24576)


def test_dense_profile_and_loading(tmp_path: Path) -> None:
    assert set(BUILTIN_PROFILES) == {"hybrid-1t", "llama-3-70b"}
    d = load_profile("llama-3-70b")
    assert d.kv_size_bytes(1000) == pytest.approx(327_680_000)
    # Dense KV production at 32K is tens of Gbit/s: it cannot leave the RDMA domain.
    assert 30e9 < d.kv_rate_bps(32768) < 60e9
    toml = tmp_path / "m.toml"
    toml.write_text(
        'name = "m"\ntokens = [1000, 2000]\nkv_bytes = [1e6, 2e6]\nprefill_s = [1.0, 2.0]\n'
    )
    m = load_profile(toml)
    assert m.prefill_seconds(1500) == pytest.approx(1.5)
    local = m.scaled(0.5)
    assert local.prefill_seconds(2000) == pytest.approx(4.0)
    bad = tmp_path / "bad.json"
    bad.write_text('{"tokens": [2, 1], "kv_bytes": [1, 1], "prefill_s": [1, 1]}')
    with pytest.raises(UsageError):
        load_profile(bad)
    with pytest.raises(UsageError):
        load_profile("no-such-model")


def test_distribution_queries() -> None:
    d = LengthDistribution([100, 200, 300, 400])
    assert d.fraction_above(250) == 0.5
    assert d.mean_above(250) == 350 and d.mean_at_most(250) == 150
    assert d.mean_above(1000) == 0 and d.mean_at_most(-1) == 0
    ln = LengthDistribution.lognormal(points=2000)
    assert ln.lengths[0] >= 128 and ln.max <= 131072
    assert 20_000 < ln.mean < 40_000


def test_shipped_trace_loads() -> None:
    reqs = load_trace(TRACE)
    assert len(reqs) == 3993
    assert sum(r.input_length for r in reqs) / len(reqs) == pytest.approx(15325, rel=0.001)
    inc = LengthDistribution.from_trace(reqs)
    assert inc.mean < 15325  # prefix reuse
