"""Running a script of benchmarks/ as a user does (its own process, output captured), or
importing it to call its functions."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def run_script(name: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python benchmarks/<name> ARGS``: its exit status, stdout and stderr."""
    return subprocess.run([sys.executable, str(BENCHMARKS / name), *args], capture_output=True, text=True,
                          timeout=timeout)


def load_script(file: str, module_name: str, monkeypatch: pytest.MonkeyPatch | None = None) -> ModuleType:
    """``benchmarks/<file>`` imported as a fresh module called ``module_name``; with
    ``monkeypatch`` it is in sys.modules while the test runs (a script whose dataclasses
    look their module up there needs that)."""
    spec = importlib.util.spec_from_file_location(module_name, BENCHMARKS / file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    if monkeypatch is not None:
        monkeypatch.setitem(sys.modules, module_name, module)
    spec.loader.exec_module(module)
    return module
