"""The dependency rule: the sans-IO core imports no I/O, no clock, and never kvwire.aio."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "kvwire"
CORE = ["wire", "codec", "control", "consistency", "scheduler", "session"]
BANNED = {"asyncio", "socket", "ssl", "selectors", "time", "uvloop", "threading", "redis"}
# Packages allowed to do I/O: the transport, the bench tools, the test helpers, the CLI.
IO_ALLOWED = {"aio", "bench", "testing"}


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
    return out


@pytest.mark.parametrize("package", CORE)
def test_core_package_imports_no_io_and_no_clock(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"kvwire/{package} has no modules"
    bad = [
        f"{f.relative_to(ROOT)}:{line} imports {mod}"
        for f in files
        for line, mod in _imports(f)
        if mod.split(".")[0] in BANNED or mod.startswith("kvwire.aio") or mod.startswith("kvwire.bench")
    ]
    assert not bad, "\n".join(bad)


def test_wire_does_not_import_numpy() -> None:
    bad = [
        f"{f.name}:{line}" for f in (ROOT / "wire").rglob("*.py") for line, mod in _imports(f)
        if mod.split(".")[0] in {"numpy", "kvwire.codec"} or mod.startswith("kvwire.codec")
    ]
    assert not bad, bad


def test_only_io_packages_import_asyncio_or_socket() -> None:
    bad = []
    for f in sorted(ROOT.rglob("*.py")):
        rel = f.relative_to(ROOT)
        top = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        if top in IO_ALLOWED or top in {"cli", "__main__"}:
            continue
        bad += [f"{rel}:{line} {mod}" for line, mod in _imports(f) if mod.split(".")[0] in {"asyncio", "socket", "ssl"}]
    assert not bad, bad


def test_the_checker_catches_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "m.py"
    bad.write_text("import time\nfrom asyncio import sleep\n")
    assert {m for _, m in _imports(bad)} == {"time", "asyncio"}
