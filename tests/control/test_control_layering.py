"""kvwire.control is sans-IO: it imports no I/O, clock or threading module."""

from __future__ import annotations

import ast
import pathlib

import kvwire.control

FORBIDDEN = {"asyncio", "socket", "ssl", "selectors", "time", "threading", "uvloop"}


def test_control_imports_no_io() -> None:
    root = pathlib.Path(kvwire.control.__file__).parent
    offenders = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top in FORBIDDEN or name.startswith("kvwire.aio"):
                    offenders.append(f"{path.name}: {name}")
    assert offenders == []
