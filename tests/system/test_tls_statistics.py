"""Failed TLS handshakes are counted in ``statistics()`` (``tls_handshake_failures``), as
README says, and logged once each with the peer's address: a handshake that fails at
WARNING, one the client ends by closing the connection at INFO; a handshake that
completes counts nothing."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest
import trustme

import kvwire
from tests.conftest import SECRET
from tests.rawpeer import wait_until
from tests.system.tls_helpers import client_context, server_context

pytestmark = pytest.mark.timeout(60)


async def not_tls(port: int) -> str:
    """A client that speaks plain bytes to the TLS server: its handshake fails."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"\x16\x03\x01\x00\x05hello-not-tls" * 4)
    with contextlib.suppress(ConnectionError):
        await asyncio.wait_for(reader.read(), 5)
    writer.close()
    host, port = writer.get_extra_info("sockname")[:2]
    return f"{host}:{port}"


async def closes_at_once(port: int) -> str:
    """A client that connects and closes (a health check)."""
    _reader, writer = await asyncio.open_connection("127.0.0.1", port)
    host, port = writer.get_extra_info("sockname")[:2]
    writer.close()
    return f"{host}:{port}"


async def test_failed_tls_handshakes_are_counted_and_logged_once_each(
    ca: trustme.CA, server_cert: trustme.LeafCert, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="kvwire")
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, ssl=server_context(server_cert)) as server:
        assert server.statistics()["tls_handshake_failures"] == 0
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, ssl=client_context(ca),
                                  server_hostname="localhost"):
            pass
        failed = [await not_tls(server.port) for _ in range(2)]
        closed = await closes_at_once(server.port)
        assert await wait_until(lambda: server.statistics()["tls_handshake_failures"] == 3, 10)
    for peer, level, said in [(failed[0], logging.WARNING, "TLS handshake failed for"),
                              (failed[1], logging.WARNING, "TLS handshake failed for"),
                              (closed, logging.INFO, "closed the connection during the TLS handshake")]:
        [record] = [r for r in caplog.records if peer in r.getMessage()]
        assert record.levelno == level and said in record.getMessage()
        assert not record.getMessage().startswith("kvwire")
