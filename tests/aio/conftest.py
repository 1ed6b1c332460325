"""Fixtures the tests of kvwire.aio share."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest


class Records(logging.Handler):
    """Every record logged to it, kept."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def at_least(self, level: int) -> list[logging.LogRecord]:
        return [r for r in self.records if r.levelno >= level]


@pytest.fixture
def records() -> Iterator[Records]:
    """Every record of the ``kvwire`` logger (DEBUG up) while the test runs."""
    handler = Records()
    logger = logging.getLogger("kvwire")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)

