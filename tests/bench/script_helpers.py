"""Running a script of benchmarks/ as a user does: its own process, output captured."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def run_script(name: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python benchmarks/<name> ARGS``: its exit status, stdout and stderr."""
    return subprocess.run([sys.executable, str(BENCHMARKS / name), *args], capture_output=True, text=True,
                          timeout=timeout)
