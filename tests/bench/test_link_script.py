"""benchmarks/link.py: the codec comparison in interleaved rounds (a tiny cache, short
runs over the emulated link), and bad arguments answered with a usage error."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.bench.script_helpers import load_script, run_script


def _run(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return run_script("link.py", *args, timeout=timeout)


def test_rounds_run_every_codec_each_round_and_compare_within_rounds(tmp_path: Path) -> None:
    out = tmp_path / "link.json"
    got = _run("--model", "tiny", "--tokens", "64", "--duration", "0.5", "--rounds", "2",
               "--codec-links", "1", "--codecs", "raw,int4", "--emulator", "copy", "--json", str(out))
    assert got.returncode == 0, got.stderr
    runs = json.loads(out.read_text())
    # the first table's runs, then each round of the comparison, every codec run afresh
    assert sorted(runs) == ["10G raw", "10G->2.5G raw", "1G auto", "1G auto #1", "1G auto #2", "1G int4 #1",
                            "1G int4 #2", "1G raw #1", "1G raw #2"]
    assert all(isinstance(r, dict) and r["goodput_gbps"] > 0 for r in runs.values()), runs
    assert "median of 2 rounds (min-max)" in got.stdout
    assert "emulator pump copy" in got.stdout
    assert all(r["start"]["config"]["emulator"] == "copy" for r in runs.values())
    row = next(line for line in got.stdout.splitlines() if line.strip().startswith("1 Gbit/s"))
    cells = re.findall(r"(\d+\.\d+) \((\d+\.\d+)-(\d+\.\d+)\)", row)
    assert len(cells) == 3  # raw, int4, auto
    for med, lo, hi in cells:
        assert float(lo) <= float(med) <= float(hi)
    per_round = re.search(r"rounds (\d+\.\d+), (\d+\.\d+)", row)
    assert per_round is not None, row
    for rnd, ratio in zip((" #1", " #2"), per_round.groups(), strict=True):
        fixed = max(runs[f"1G {c}{rnd}"]["goodput_gbps"] for c in ("raw", "int4"))
        assert abs(float(ratio) - runs[f"1G auto{rnd}"]["goodput_gbps"] / fixed) < 0.006


def test_bad_arguments_are_usage_errors() -> None:
    for args, says in ((["--rounds", "0"], "--rounds"), (["--streams", "x"], "--streams"), (["--streams", "65"], "[1, 64]"),
                       (["--codecs", "raw,fp9"], "unknown codec 'fp9'"),
                       (["--codec-links", "0"], "--codec-links: every link must be at least"), (["--duration", "0"], "--duration")):
        got = _run(*args, timeout=60)
        assert got.returncode == 2, (args, got.stderr)
        assert says in got.stderr, (args, got.stderr)
        assert "Traceback" not in got.stderr


def test_each_round_runs_every_codec_afresh_and_together(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """The comparison's first round reuses no run of the scenarios before it (10 Gbit/s
    raw, 1 Gbit/s auto, made a while earlier): every round runs each codec of each link,
    one right after another. run_bench stubbed: the order of the runs is what is checked."""
    link = load_script("link.py", "link_script_under_test")
    order: list[tuple[float | None, str]] = []

    def fake_run_bench(cfg: Any) -> dict[str, Any]:
        order.append((cfg.link_bps, cfg.codec))
        return {"goodput_gbps": 1.0, "link_gbps": 1.0, "wire_gbps": 1.0, "utilization": 1.0,
                "estimated_gbps": 1.0, "samples": [], "max_rel_error": None, "codecs_used": [cfg.codec],
                "codec_shares": {cfg.codec: 1.0}, "per_transfer": [], "transfers": 1}

    monkeypatch.setattr(link, "run_bench", fake_run_bench)
    monkeypatch.setattr(sys, "argv", ["link.py", "--duration", "6", "--rounds", "2", "--codec-links", "10,1",
                                      "--codecs", "raw,fp8"])
    link.main()
    capsys.readouterr()
    assert order[:3] == [(10e9, "raw"), (None, "raw"), (1e9, "auto")]  # the first table's scenarios
    compared = order[3:]
    assert len(compared) == 2 * 2 * 3  # rounds x links x (raw, fp8, auto)
    for block in range(4):  # round 1 at 10, at 1 Gbit/s, then round 2 at each
        runs = compared[3 * block : 3 * block + 3]
        assert {bps for bps, _ in runs} == {10e9 if block % 2 == 0 else 1e9}, runs
        assert sorted(codec for _, codec in runs) == ["auto", "fp8", "raw"], runs


def test_a_codec_named_twice_or_auto_among_the_fixed_ones_is_refused() -> None:
    for codecs, says in (("raw,auto", "auto is always compared"), ("raw,fp8,raw", "a codec named twice")):
        got = _run("--codecs", codecs, timeout=60)
        assert got.returncode == 2, (codecs, got.stderr)
        assert says in got.stderr, (codecs, got.stderr)
