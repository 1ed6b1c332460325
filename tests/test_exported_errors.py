"""The error classes README lists as what the API raises are exported from ``kvwire``,
and are the very classes ``connect()`` raises: a peer that answers with a frame too large
for the handshake (an HTTP server) or with a frame whose CRC32C does not match."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

import kvwire
import kvwire.errors
from kvwire.wire.frames import Ack, frame_bytes
from tests.conftest import SECRET

pytestmark = pytest.mark.timeout(60)

README = Path(__file__).resolve().parent.parent / "README.md"


async def _connect_error(handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]) -> BaseException:
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    async with server:
        port = server.sockets[0].getsockname()[1]
        with pytest.raises(kvwire.KvwireError) as info:
            async with asyncio.timeout(30):
                async with kvwire.connect("127.0.0.1", port, secret=SECRET):
                    pass
    return info.value


async def _answer(writer: asyncio.StreamWriter, reader: asyncio.StreamReader, data: bytes) -> None:
    await reader.read(1)
    writer.write(data)
    await writer.drain()
    await reader.read()  # until the client goes
    writer.close()


async def test_connect_to_an_http_server_raises_the_exported_frame_too_large_error() -> None:
    async def http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _answer(writer, reader, b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    exc = await _connect_error(http)
    assert type(exc) is kvwire.FrameTooLargeError
    assert isinstance(exc, kvwire.ProtocolError)


async def test_connect_to_a_peer_sending_a_corrupted_frame_raises_the_exported_integrity_error() -> None:
    data = bytearray(frame_bytes(Ack(transfer_id=1, layer=0, kind=0, token_start=0)))
    data[-1] ^= 0x01  # the CRC32C no longer matches

    async def corrupt(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _answer(writer, reader, bytes(data))

    exc = await _connect_error(corrupt)
    assert type(exc) is kvwire.IntegrityError
    assert isinstance(exc, kvwire.ProtocolError)


def test_every_error_class_of_kvwire_errors_is_exported_and_named_in_the_readme() -> None:
    text = README.read_text()
    start = text.index("Errors are typed and rooted at `kvwire.KvwireError`")
    listed = set(re.findall(r"`(?:kvwire\.)?(\w+Error)`", text[start : text.index("No raw `OSError`", start)]))
    classes = {name for name, value in vars(kvwire.errors).items()
               if isinstance(value, type) and issubclass(value, kvwire.KvwireError)}
    for name in classes:
        assert name in kvwire.__all__ and getattr(kvwire, name) is getattr(kvwire.errors, name), name
    assert classes <= listed, classes - listed
