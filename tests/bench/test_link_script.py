"""benchmarks/link.py: the codec comparison in interleaved rounds (a tiny cache, short
runs over the emulated link), and bad arguments answered with a usage error."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from tests.bench.script_helpers import run_script


def _run(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return run_script("link.py", *args, timeout=timeout)


def test_rounds_run_every_codec_each_round_and_compare_within_rounds(tmp_path: Path) -> None:
    out = tmp_path / "link.json"
    got = _run("--model", "tiny", "--tokens", "64", "--duration", "0.5", "--rounds", "2",
               "--codec-links", "1", "--codecs", "raw,int4", "--emulator", "copy", "--json", str(out))
    assert got.returncode == 0, got.stderr
    runs = json.loads(out.read_text())
    # the first table's runs, round 1 reusing "1G auto", and round 2 of each codec
    assert sorted(runs) == ["10G raw", "10G->2.5G raw", "1G auto", "1G auto #2", "1G int4",
                            "1G int4 #2", "1G raw", "1G raw #2"]
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
    for rnd, ratio in zip(("", " #2"), per_round.groups(), strict=True):
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
