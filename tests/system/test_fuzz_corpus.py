"""The atheris harnesses in fuzz/ run over their committed corpus without atheris: a
harness that no longer matches the core it drives (a changed signature, a broken
property) fails here instead of at its next fuzzing campaign."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

FUZZ = Path(__file__).resolve().parents[2] / "fuzz"
HARNESSES = ("frames", "server", "session")


@pytest.fixture
def harness_module(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Loads ``fuzz/fuzz_<name>.py`` with a stand-in for the parts of atheris it uses at
    import (``instrument_imports``); its helper modules are forgotten afterwards."""
    stub = types.ModuleType("atheris")
    stub.instrument_imports = contextlib.nullcontext  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "atheris", stub)
    monkeypatch.syspath_prepend(str(FUZZ))  # (sys.path is restored afterwards, the harness's own insert included)
    before = set(sys.modules)

    def load(name: str) -> Any:
        spec = importlib.util.spec_from_file_location(f"kvwire_fuzz_{name}", FUZZ / f"fuzz_{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    yield load
    for name in set(sys.modules) - before:
        if name in ("_common", "make_corpus") or name.startswith("kvwire_fuzz_"):
            del sys.modules[name]


@pytest.mark.parametrize("name", HARNESSES)
def test_each_harness_holds_its_properties_over_its_corpus(name: str, harness_module: Any) -> None:
    module = harness_module(name)
    seeds = sorted((FUZZ / "corpus" / name).iterdir())
    assert seeds, f"fuzz/corpus/{name} is empty"
    for seed in seeds:
        module.TestOneInput(seed.read_bytes())  # raises (an assertion, a TypeError) on a failure
