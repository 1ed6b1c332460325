"""What kvwire simulate says: the table's headers carry their units and no two are alike, a
trace record without a field says which, and a relative compute too small to scale a
profile is refused naming ``relative_compute`` (``--relative-compute``), not the profile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvwire.cli import main
from kvwire.errors import UsageError
from kvwire.scheduler import profile
from kvwire.scheduler.model import ClusterConfig
from kvwire.scheduler.profile import ModelProfile, builtin_profile
from kvwire.scheduler.workload import load_trace

LEAST = 1e-3
"""``MIN_RELATIVE_COMPUTE``."""


def _headers(err: str) -> list[str]:
    """The table's column headers, each one's lines joined by a space."""
    lines = [line for line in err.splitlines() if line.startswith("┃")]
    assert lines, err
    rows = [[cell.strip() for cell in line.strip("┃").split("┃")] for line in lines]
    return [" ".join(part for part in column if part) for column in zip(*rows, strict=True)]


def test_the_table_headers_carry_units_and_differ(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--requests", "20", "--policy", "local,selective"]) == 0
    headers = _headers(capsys.readouterr().out)
    # It had two columns both called "P99" (TTFT's and egress's) and no units on the
    # capacity or the TTFTs.
    assert len(headers) == len(set(headers)), headers
    for header in ("capacity rps", "thr rps", "TTFT P50 s", "P90 s", "P99 s",
                   "egress mean Gbit/s", "egress P99 Gbit/s", "t tok"):
        assert header in headers, headers


def test_the_table_fits_its_console(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--requests", "20"]) == 0
    out = capsys.readouterr().out
    assert "…" not in out  # rich shortens a cell (or header) that does not fit
    assert max(len(line) for line in out.splitlines()) <= 160


@pytest.mark.parametrize("missing", ["timestamp", "input_length", "output_length"])
def test_a_missing_field_is_named(tmp_path: Path, missing: str) -> None:
    record = {"timestamp": 5, "input_length": 100, "output_length": 10}
    trace = tmp_path / "missing.jsonl"
    trace.write_text(
        json.dumps({"timestamp": 0, "input_length": 100, "output_length": 10}) + "\n"
        + json.dumps({k: v for k, v in record.items() if k != missing}) + "\n"
    )
    with pytest.raises(UsageError) as exc:
        load_trace(trace)
    # It said "not a trace record ('output_length')", a KeyError's repr.
    assert str(exc.value) == (
        f"{trace}:2: missing field {missing!r} (a record needs timestamp, input_length, "
        "output_length)"
    )


@pytest.mark.parametrize("value", ["1e-17", "1e-300", "0.0009"])
def test_a_tiny_relative_compute_is_refused_at_the_option(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--requests", "20", "--policy", "local", "--relative-compute", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    # It ran (1e-300: TTFTs of 10^300 s) or blamed the built-in profile's points (1e-17).
    assert f"argument --relative-compute: '{value}' must be at least 0.001" in err
    assert "prefill_s" not in err and "Traceback" not in err


def test_the_least_relative_compute_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert profile.MIN_RELATIVE_COMPUTE == LEAST
    assert main(["simulate", "--requests", "20", "--policy", "local",
                 "--relative-compute", "0.001", "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["system"]["relative_compute"] == LEAST


@pytest.mark.parametrize("value", [1e-17, 1e-4, 0.0, -0.15, float("nan"), float("inf")])
def test_scaled_refuses_a_relative_compute_out_of_range(value: float) -> None:
    with pytest.raises(UsageError, match=r"^relative_compute must be a finite number >= 0\.001"):
        builtin_profile("hybrid-1t").scaled(value)


def test_the_library_names_relative_compute_not_the_profile() -> None:
    with pytest.raises(UsageError, match=r"^relative_compute must be a finite number >= 0\.001"):
        ClusterConfig(remote_profile=builtin_profile("hybrid-1t"), relative_compute=1e-17)
    # With a measured local profile, relative_compute scales nothing and is not held to it.
    local = builtin_profile("hybrid-1t")
    cluster = ClusterConfig(remote_profile=local, relative_compute=1e-17, local_profile=local)
    assert cluster.local_prefill_profile is local


def test_a_profile_through_the_origin_scales() -> None:
    # prefill 0.1 s at 1,000 tokens, 0.3 s at 3,000: proportional, so its line reaches 0 s
    # at exactly 0 tokens, which a profile may. Scaled by 0.15 it was refused by rounding
    # ("prefill_s extended below its first point ... reaches 0 s at 0 tokens").
    p = ModelProfile(name="p", tokens=(1000.0, 3000.0), kv_bytes=(1.0, 2.0), prefill_s=(0.1, 0.3))
    scaled = p.scaled(0.15)
    assert scaled.prefill_seconds(2000.0) == pytest.approx(0.2 / 0.15)
    assert scaled.prefill_seconds(0.0) == pytest.approx(0.0, abs=1e-12)


@given(
    x0=st.floats(1.0, 1e6),
    ratio=st.floats(1.01, 100.0),
    per_token=st.floats(1e-9, 1e-2),
    relative_compute=st.floats(LEAST, 1e6),
)
def test_proportional_profiles_construct_and_scale(
    x0: float, ratio: float, per_token: float, relative_compute: float
) -> None:
    x1 = x0 * ratio
    p = ModelProfile(name="p", tokens=(x0, x1), kv_bytes=(1.0, 2.0),
                     prefill_s=(per_token * x0, per_token * x1))
    scaled = p.scaled(relative_compute)
    assert scaled.prefill_seconds(x1) == pytest.approx(per_token * x1 / relative_compute)


def test_a_line_below_zero_is_still_refused() -> None:
    # 0.1 s at 1,000 tokens, 0.5 s at 2,000: 0 s at 750 tokens, -0.3 s at 0.
    with pytest.raises(UsageError, match="reaches 0 s at 750 tokens"):
        ModelProfile(name="p", tokens=(1000.0, 2000.0), kv_bytes=(1.0, 2.0), prefill_s=(0.1, 0.5))
