"""What a first-time user's mistakes read like: connecting to something that is not a
kvwire server (an HTTP server, a silent socket) says so, with what it sent; a wrong secret
names the server and says the secrets differ; an unknown codec's list holds ``auto``,
which connect() takes; a send on a peer the user closed says it was closed, not to close
it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest

import kvwire
from kvwire.errors import ConnectionLostError, ProtocolError, UsageError
from kvwire.sync import SyncPeer, SyncServer
from tests.conftest import SECRET

pytestmark = pytest.mark.timeout(60)

SPEC = kvwire.KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16")
LAYERS = [(np.ones((4, 2, 8), np.float16), np.ones((4, 2, 8), np.float16))] * 2
HTTP_ANSWER = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


# -- something else answers -----------------------------------------------------------------


async def _serving(handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]) -> asyncio.Server:
    return await asyncio.start_server(handle, "127.0.0.1", 0)


async def _connect_error(port: int, **options: Any) -> kvwire.KvwireError:
    with pytest.raises(kvwire.KvwireError) as info:
        async with asyncio.timeout(30):
            async with kvwire.connect("127.0.0.1", port, **{"secret": SECRET, **options}):
                pass
    return info.value


async def test_an_http_server_is_said_not_to_be_a_kvwire_server_with_what_it_sent() -> None:
    # it said "frame type 0x48 announces 791752241 bytes, limit 16384"
    async def http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)
        writer.write(HTTP_ANSWER)
        await writer.drain()
        writer.close()

    server = await _serving(http)
    async with server:
        port = server.sockets[0].getsockname()[1]
        exc = await _connect_error(port)
    assert isinstance(exc, ProtocolError)  # (FrameTooLargeError, as before)
    text = str(exc)
    assert f"127.0.0.1:{port} did not answer as a kvwire server" in text
    assert repr(HTTP_ANSWER[:40]) + "..." in text  # escaped, cut
    assert "\r" not in text and "\n" not in text


async def test_a_silent_server_times_out_naming_the_address_and_connect_timeout() -> None:
    # it said "handshake did not complete in time"
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until the client goes
        writer.close()

    server = await _serving(silent)
    async with server:
        port = server.sockets[0].getsockname()[1]
        exc = await _connect_error(port, connect_timeout=0.3)
    assert isinstance(exc, kvwire.TransferTimeoutError)
    assert str(exc) == (f"127.0.0.1:{port} did not complete the kvwire handshake within "
                        "connect_timeout=0.3 s (nothing came back)")


async def test_a_server_sending_a_few_bytes_of_something_else_then_closing_says_what_it_sent() -> None:
    async def banner(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"hi\r\n")  # fewer bytes than a frame header
        await writer.drain()
        writer.close()

    server = await _serving(banner)
    async with server:
        port = server.sockets[0].getsockname()[1]
        exc = await _connect_error(port)
    assert isinstance(exc, ConnectionLostError)
    assert "without answering as a kvwire server" in str(exc) and r"b'hi\r\n'" in str(exc)


# -- a wrong secret -------------------------------------------------------------------------


async def test_a_wrong_secret_names_the_server_and_says_the_secrets_differ() -> None:
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        exc = await _connect_error(server.port, secret=b"another-secret-0")
    assert isinstance(exc, kvwire.AuthenticationError)
    assert f"127.0.0.1:{server.port}" in str(exc) and "not the server's" in str(exc)


def test_a_sync_peer_with_a_wrong_secret_says_so_too() -> None:
    server = SyncServer("127.0.0.1", 0, secret=SECRET)
    try:
        with pytest.raises(kvwire.AuthenticationError) as info:
            SyncPeer("127.0.0.1", server.port, secret=b"another-secret-0")
        assert f"127.0.0.1:{server.port}" in str(info.value) and "not the server's" in str(info.value)
    finally:
        server.close()


# -- options --------------------------------------------------------------------------------


def test_an_unknown_codec_lists_auto_with_the_others() -> None:
    with pytest.raises(UsageError, match=r"^unknown codec 'bogus'; known: auto, .*\braw\b"):
        kvwire.connect("127.0.0.1", 7070, secret=SECRET, codec="bogus")
    kvwire.connect("127.0.0.1", 7070, secret=SECRET, codec="auto")  # (what the list offers)


# -- a closed peer --------------------------------------------------------------------------


async def test_a_send_on_a_closed_peer_says_it_was_closed_and_to_connect_again() -> None:
    # it said "peer closed (this peer's session has ended: close it and connect() again)"
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        peer = kvwire.connect("127.0.0.1", server.port, secret=SECRET)
        await peer.open()
        await peer.close()
        assert peer.closed and isinstance(peer.broken, ConnectionLostError)  # as the README says
        with pytest.raises(ConnectionLostError) as info:
            await peer.send("a", SPEC, LAYERS, timeout=10)
    assert "close it" not in str(info.value)
    assert str(info.value) == "this peer was closed: connect() again for a new session"


async def test_a_peer_closed_after_its_session_ended_keeps_the_error_class() -> None:
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        peer = kvwire.connect("127.0.0.1", server.port, secret=SECRET, reconnect_attempts=0)
        await peer.open()
        await server.close()
        async with asyncio.timeout(30):
            while peer.broken is None:
                await asyncio.sleep(0.01)
        ended = peer.broken
        await peer.close()
        with pytest.raises(type(ended)) as info:
            await peer.send("a", SPEC, LAYERS, timeout=10)
    assert str(ended) in str(info.value) and "close it" not in str(info.value)
    assert "connect() again" in str(info.value)


async def test_a_layer_whose_k_and_v_differ_in_tokens_is_named_with_both_counts() -> None:
    """The shape and dtype errors name the layer; the token count's does too, with the
    counts it compared."""
    ragged = [LAYERS[0], (np.ones((4, 2, 8), np.float16), np.ones((3, 2, 8), np.float16))]
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server, \
            kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
        with pytest.raises(UsageError, match=r"^layer 1: every k and v of a cache must have the same token "
                                             r"count \(k has 4, v 3, earlier layers 4\)$"):
            await peer.send("r", SPEC, ragged, timeout=20)
