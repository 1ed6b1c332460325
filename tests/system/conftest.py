"""Fixtures of the system tests: a throwaway certificate authority (``trustme``) and a
server certificate it signed for ``localhost`` and ``127.0.0.1``, made once per module."""

from __future__ import annotations

import pytest
import trustme


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def server_cert(ca: trustme.CA) -> trustme.LeafCert:
    return ca.issue_cert("localhost", "127.0.0.1")
