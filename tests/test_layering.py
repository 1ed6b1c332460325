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


#: System headers of sockets and clocks; compiled code of the core includes none of them.
IO_HEADERS = {"sys/socket.h", "sys/uio.h", "netinet/in.h", "netinet/tcp.h", "poll.h", "sys/epoll.h",
              "sys/select.h", "unistd.h", "time.h", "sys/time.h", "pthread.h"}


def _includes(path: Path) -> set[str]:
    return {
        line.split("<", 1)[1].split(">", 1)[0]
        for line in path.read_text().splitlines()
        if line.lstrip().startswith("#include") and "<" in line
    }


@pytest.mark.parametrize("package", CORE)
def test_core_c_sources_include_no_socket_or_clock_headers(package: str) -> None:
    """The rule holds for compiled code too: a send loop on sockets lives in kvwire.aio."""
    bad = [
        f"{f.relative_to(ROOT)} includes <{h}>"
        for f in sorted((ROOT / package).rglob("*.c"))
        for h in sorted(_includes(f) & IO_HEADERS)
    ]
    assert not bad, "\n".join(bad)


def test_the_header_check_sees_the_send_queue() -> None:
    assert {"sys/socket.h", "sys/uio.h"} <= _includes(ROOT / "aio" / "_sendq.c")
