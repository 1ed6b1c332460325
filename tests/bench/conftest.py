"""The link emulator's pump, for tests that run with each."""

from __future__ import annotations

import pytest

from tests.environment import needs_splice


@pytest.fixture(params=[pytest.param(True, id="splice", marks=needs_splice), pytest.param(False, id="copy")])
def splice(request: pytest.FixtureRequest) -> bool:
    """``LinkEmulator(splice=...)``: the splice(2) pump, then the copying one."""
    value: bool = request.param
    return value
