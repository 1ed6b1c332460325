"""Fixtures the tests of kvwire.aio share."""

from __future__ import annotations

import logging
import ssl
from collections.abc import Iterator

import pytest
import trustme


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


def tls_contexts() -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A server context with a certificate for 127.0.0.1 from a throwaway CA, and a client
    context that trusts that CA."""
    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    client_ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    ca.configure_trust(client_ctx)
    return server_ctx, client_ctx
