"""A client and a server of which one uses TLS and the other does not both fail at once,
and the errors say why (over real sockets on 127.0.0.1):

- a plain client of a TLS server: the server takes the HELLO for a broken ClientHello and
  closes without a byte, so connect() fails with a ConnectionLostError that says a server
  requiring TLS closes a plain client this way (it said only "connection closed during
  the handshake");
- a TLS client of a plain server: the server answers the ClientHello with a GOAWAY frame,
  no TLS record, and connect() fails with a ConnectionLostError that says the server
  answered without TLS (it said only "[SSL: WRONG_VERSION_NUMBER] wrong version number");
  the server logs the ClientHello as one (it logged "frame type 0x16 announces 65537
  bytes, limit 16384")."""

from __future__ import annotations

import logging

import pytest

import kvwire
from kvwire.errors import ConnectionLostError
from tests.aio.conftest import Records
from tests.conftest import SECRET
from tests.rawpeer import wait_until
from tests.system.tls_helpers import tls_contexts

pytestmark = pytest.mark.timeout(60)


async def test_a_plain_client_of_a_tls_server_is_told_to_pass_ssl() -> None:
    server_ctx, _ = tls_contexts()
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, ssl=server_ctx) as server:
        with pytest.raises(ConnectionLostError) as info:
            async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, max_reconnects=0):
                pass
    text = str(info.value)
    assert "(a server that requires TLS closes a plain client this way: pass ssl=)" in text
    assert f"127.0.0.1:{server.port}" in text


async def test_a_tls_client_of_a_plain_server_is_told_it_answered_without_tls() -> None:
    _, client_ctx = tls_contexts()
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        with pytest.raises(ConnectionLostError) as info:
            async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, ssl=client_ctx,
                                      max_reconnects=0):
                pass
    text = str(info.value)
    assert "WRONG_VERSION_NUMBER" in text
    assert text.endswith("(the server answered without TLS: is it serving without ssl=?)")


async def test_a_plain_server_logs_a_client_hello_as_one(records: Records) -> None:
    _, client_ctx = tls_contexts()
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        with pytest.raises(ConnectionLostError):
            async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, ssl=client_ctx,
                                      max_reconnects=0):
                pass

        def logged() -> list[str]:
            return [m for r in records.at_least(logging.WARNING) if "FRAME_TOO_LARGE" in (m := r.getMessage())]

        await wait_until(lambda: bool(logged()), 20)  # the server may log it after the client's failure
    lines = logged()
    assert lines, [r.getMessage() for r in records.records]
    assert all("a TLS ClientHello" in line for line in lines), lines
    assert all("this server does not use TLS (or the client expects TLS)" in line for line in lines), lines
    assert not any("announces" in line for line in lines), lines
