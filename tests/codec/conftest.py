from __future__ import annotations

from typing import Any

import pytest

from tests.codec.emulation import build_emulation


@pytest.fixture(scope="session")
def kernel_emulation(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The kernel emulation (tests/codec/emulation.py), compiled once per test session for
    every test module that launches kernels on it.  Its error count is read and cleared
    after every launch, so one module's launches leave nothing for the next."""
    return build_emulation(tmp_path_factory.mktemp("kvquant_emu"))
