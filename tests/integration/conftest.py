"""The serving-engine checks run where the engine is installed: ``bash .ci/vllm`` makes a
virtual environment with the ``[vllm]`` extra and runs them.  The main ``python -m pytest``
does not collect them when vLLM is not importable (it is a 3.5 GB install), so nothing
here imports vLLM or torch when run."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from kvwire.integrations.vllm import KvwireConnector

collect_ignore_glob = [] if importlib.util.find_spec("vllm") is not None else ["test_*.py"]


@pytest.fixture
def workers() -> Iterator[list[KvwireConnector]]:
    """Worker-side connectors a test made (tests/integration/vllm_workers.py), appended
    producers first: each is shut down at the end of the test."""
    made: list[KvwireConnector] = []
    yield made
    for worker in made:
        worker.shutdown()
