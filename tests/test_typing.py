"""The public API is typed: ``mypy --strict`` rejects misspelt or mistyped options and
layers that are not ``(k, v)`` arrays, and accepts (with the right inferred types) the
calls the README shows. Runs mypy on tests/typing/*.py against this checkout."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import get_type_hints

import pytest

from kvwire.aio import ClientOptions, ServerOptions
from kvwire.options import ConnectOptions, ServeOptions

ROOT = Path(__file__).resolve().parents[1]
SNIPPETS = ROOT / "tests" / "typing"
ERROR = re.compile(r"^(?P<file>[^:]+):(?P<line>\d+): error: (?P<msg>.*)$", re.MULTILINE)


@pytest.fixture(scope="module")
def mypy_output(tmp_path_factory: pytest.TempPathFactory) -> str:
    tmp = tmp_path_factory.mktemp("mypy")
    config = tmp / "mypy.ini"
    config.write_text("[mypy]\nstrict = True\npython_version = 3.11\n")
    env = {**os.environ, "MYPYPATH": str(ROOT)}  # this checkout, however it is installed
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(config), "--no-incremental",
         "--cache-dir", str(tmp / "cache"), "--follow-imports=silent", "--show-error-codes",
         str(SNIPPETS / "bad_calls.py"), str(SNIPPETS / "good_calls.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=280, check=False,
    )
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr  # 2 would be a crash
    return proc.stdout


def _errors(output: str, name: str) -> dict[int, list[str]]:
    found: dict[int, list[str]] = {}
    for m in ERROR.finditer(output):
        if Path(m["file"]).name == name:
            found.setdefault(int(m["line"]), []).append(m["msg"])
    return found


@pytest.mark.timeout(300)
def test_mypy_rejects_the_bad_calls(mypy_output: str) -> None:
    lines = (SNIPPETS / "bad_calls.py").read_text().splitlines()
    expected = {i + 1: line.split("# expect:")[1].strip() for i, line in enumerate(lines)
                if "# expect:" in line}
    found = _errors(mypy_output, "bad_calls.py")
    assert set(found) == set(expected), mypy_output
    assert any('Unexpected keyword argument "windw" for "serve"' in m for m in found[_line(lines, "windw=1")])
    assert any('"streams"' in m and "Literal['auto']" in m for m in found[_line(lines, 'streams="4"')])
    assert any('"send"' in m and "int" in m for m in found[_line(lines, "spec, 42)")])


@pytest.mark.timeout(300)
def test_mypy_accepts_the_good_calls_with_their_types(mypy_output: str) -> None:
    assert _errors(mypy_output, "good_calls.py") == {}, mypy_output
    assert "good_calls.py" not in mypy_output, mypy_output  # no notes either


def _line(lines: list[str], text: str) -> int:
    return next(i + 1 for i, line in enumerate(lines) if text in line)


def test_option_dicts_mirror_the_option_dataclasses() -> None:
    # serve() takes the accepted layouts as spec=, not as the specs option.
    server_fields = {f.name for f in dataclasses.fields(ServerOptions)} - {"specs"}
    client_fields = {f.name for f in dataclasses.fields(ClientOptions)}
    assert set(ServeOptions.__annotations__) == server_fields
    assert set(ConnectOptions.__annotations__) == client_fields
    assert not ServeOptions.__required_keys__ and not ConnectOptions.__required_keys__
    hints = get_type_hints(ConnectOptions)
    assert hints["chunk_bytes"] is int and hints["max_streams"] is int


def test_py_typed_is_shipped() -> None:
    assert (ROOT / "kvwire" / "py.typed").is_file()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["kvwire"]
    assert any(dep.startswith("mypy") for dep in project["project"]["optional-dependencies"]["test"])
