"""benchmarks/emulator.py: each pump's unshaped and shaped runs against a raw pair, with
the emulator's CPU per GB, and a bad --pumps answered with a usage error."""

from __future__ import annotations

import re

from tests.bench.script_helpers import run_script
from tests.environment import needs_splice


@needs_splice
def test_each_pump_reports_its_rate_and_cpu() -> None:
    got = run_script("emulator.py", "--rate", "1e9", "--seconds", "1.5", "--warmup", "0.25", timeout=120)
    assert got.returncode == 0, got.stderr
    assert got.stdout.startswith("raw socket pair:")
    for pump in ("splice", "copy"):
        for run in ("unlimited", "shaped"):
            line = next(x for x in got.stdout.splitlines() if x.startswith(f"{pump} pump, {run}:"))
            cpu = re.search(r"emulator CPU (\d+\.\d+) s/GB", line)
            assert cpu is not None and float(cpu.group(1)) > 0, line
    assert got.stdout.count("worst 1 s error:") == 2


def test_unknown_pump_is_a_usage_error() -> None:
    got = run_script("emulator.py", "--pumps", "splice,zero", timeout=60)
    assert got.returncode == 2
    assert "--pumps takes splice and/or copy" in got.stderr
