"""The link emulator's pump, for tests that run with each."""

from __future__ import annotations

import pytest

from kvwire.bench.emulator import SPLICE_AVAILABLE


@pytest.fixture(params=[
    pytest.param(True, id="splice", marks=pytest.mark.skipif(not SPLICE_AVAILABLE, reason="splice(2) is Linux-only")),
    pytest.param(False, id="copy"),
])
def splice(request: pytest.FixtureRequest) -> bool:
    """``LinkEmulator(splice=...)``: the splice(2) pump, then the copying one."""
    value: bool = request.param
    return value
