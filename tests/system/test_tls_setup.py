"""TLS set-up over real loopback sockets, on the stdlib loop and on uvloop: what
``connect()`` and ``serve()`` refuse at once, connections still in their TLS handshake
when the server closes, failed handshakes logged with the peer's address, and the
shared secret read from a file.

Certificates come from a throwaway CA made by ``trustme`` for each test run.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
import trustme

import kvwire
from kvwire.errors import UsageError
from kvwire.session.receiver import ReceiverConfig
from kvwire.session.sender import SenderConfig
from kvwire.sync import Bridge, PendingPeer, SyncPeer, SyncServer
from kvwire.wire.connection import ConnectionConfig
from tests.conftest import SECRET, make_layers, same_cache
from tests.rawpeer import wait_until
from tests.system.tls_helpers import client_context, server_context

pytestmark = pytest.mark.timeout(60)

SPEC = kvwire.KVSpec(num_layers=2, num_kv_heads=2, head_dim=16)
LOOPS = ["asyncio", "uvloop"]


def run_on(loop: str, main: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    if loop == "asyncio":
        return asyncio.run(main())
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main())


# -- arguments refused at once --------------------------------------------------------------


@pytest.mark.parametrize("args", [
    {"ssl": "yes"},
    {"ssl": True},
    {"ssl": "client.pem"},
    {"ssl": "server-side", "server_hostname": "localhost"},
    {"ssl": "client", "server_hostname": b"localhost"},
    {"host": 123},
    {"host": b"127.0.0.1"},
], ids=lambda a: "-".join(f"{k}={v!r}" for k, v in a.items()))
def test_connect_refuses_tls_arguments_it_cannot_use_at_once(
    args: dict[str, Any], ca: trustme.CA, server_cert: trustme.LeafCert,
) -> None:
    """Each of these killed the connect task with an AttributeError or TypeError that
    nothing handled, and open() waited for ever (connect_timeout too)."""
    args = dict(args)
    if args.get("ssl") == "client":
        args["ssl"] = client_context(ca)
    elif args.get("ssl") == "server-side":
        args["ssl"] = server_context(server_cert)
    host = args.pop("host", "127.0.0.1")
    with pytest.raises(UsageError):
        kvwire.connect(host, 1, secret=SECRET, connect_timeout=1, **args)


def test_the_sync_api_refuses_them_too_and_a_pending_peer_ends() -> None:
    bridge = Bridge("tls-args")
    try:
        with pytest.raises(UsageError):
            SyncPeer("127.0.0.1", 1, secret=SECRET, bridge=bridge, ssl=True, start_timeout=5)
        with pytest.raises(UsageError):
            SyncPeer(123, 1, secret=SECRET, bridge=bridge, start_timeout=5)  # type: ignore[arg-type]
        pending = PendingPeer(bridge, "127.0.0.1", 1, secret=SECRET, ssl="yes", connect_timeout=1)
        assert pending.wait(10), "the connect never ended"
        with pytest.raises(UsageError):
            pending.result()
        with pytest.raises(UsageError):
            SyncServer(secret=SECRET, bridge=bridge, ssl=True, start_timeout=5)
    finally:
        bridge.close()


@pytest.mark.parametrize("bad", [True, "server.pem", "client-side"])
def test_serve_refuses_an_ssl_that_cannot_serve_at_once(bad: Any, ca: trustme.CA) -> None:
    """A non-SSLContext was asyncio's raw TypeError at start; a client-side context
    started, then failed every handshake with nothing logged."""
    ssl_arg = client_context(ca) if bad == "client-side" else bad
    with pytest.raises(UsageError, match="ssl"):
        kvwire.serve("127.0.0.1", 0, secret=SECRET, ssl=ssl_arg)


@pytest.mark.parametrize("host", [123, b"127.0.0.1", None, ["127.0.0.1"]], ids=repr)
def test_serve_refuses_a_host_that_is_not_a_str_at_once(host: Any) -> None:
    """serve(host=123) raised asyncio's raw TypeError once it listened."""
    with pytest.raises(UsageError, match="host must be a str"):
        kvwire.serve(host, 0, secret=SECRET)
    with pytest.raises(UsageError, match="host must be a str"):
        SyncServer(host, 0, secret=SECRET)


# -- Server.close() and connections in their TLS handshake ----------------------------------


async def _closed_by_peer(reader: asyncio.StreamReader) -> bool:
    """Whether the server closed the connection: EOF (or a reset) within a bounded wait
    (the server's handshake_timeout is far longer)."""
    try:
        while await asyncio.wait_for(reader.read(65536), 5.0):
            pass
    except TimeoutError:
        return False
    except ConnectionError:
        pass
    return True


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("sent_hello", [False, True], ids=["silent", "client-hello-sent"])
def test_close_closes_connections_still_in_their_tls_handshake(
    loop: str, sent_hello: bool, ca: trustme.CA, server_cert: trustme.LeafCert,
) -> None:
    """close() left a connection still in its TLS handshake open until handshake_timeout
    (and the handshake could still complete after it returned)."""

    async def main() -> None:
        server = kvwire.serve("127.0.0.1", 0, secret=SECRET, ssl=server_context(server_cert), handshake_timeout=60)
        await server.start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            try:
                if sent_hello:
                    tls = client_context(ca).wrap_bio(ssl.MemoryBIO(), out := ssl.MemoryBIO(), server_hostname="localhost")
                    with pytest.raises(ssl.SSLWantReadError):
                        tls.do_handshake()
                    writer.write(out.read())
                    assert await asyncio.wait_for(reader.read(1), 5)  # the server answered: mid-handshake
                else:  # accepted, its handshake begun
                    assert await wait_until(lambda: len(getattr(server, "_handshaking", ())) == 1, 5)
                await asyncio.wait_for(server.close(), 10)
                assert await _closed_by_peer(reader), "the connection outlived Server.close()"
            finally:
                writer.close()
        finally:
            await server.close()

    run_on(loop, main)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_connection_accepted_as_the_server_closes_is_not_kept(loop: str, server_cert: trustme.LeafCert) -> None:
    """close() begun in the loop step that accepts a connection aborts it and cancels its
    handshake task before that task ran: the server kept the connection (its stream and
    buffers) in the set of handshakes under way for good."""
    from kvwire.aio import server as server_mod

    async def main() -> int:
        server = kvwire.serve("127.0.0.1", 0, secret=SECRET, ssl=server_context(server_cert), handshake_timeout=60)
        await server.start()
        made = server_mod._TlsAccept.connection_made
        closing: list[asyncio.Future[None]] = []

        def closing_as_made(self: Any, transport: Any) -> None:
            if not closing:
                closing.append(asyncio.ensure_future(server.close()))
            made(self, transport)

        server_mod._TlsAccept.connection_made = closing_as_made  # type: ignore[method-assign]
        try:
            _reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            try:
                assert await wait_until(lambda: bool(closing), 5)
                await asyncio.wait_for(closing[0], 10)
                await asyncio.sleep(0)
                return len(server._handshaking)
            finally:
                writer.close()
        finally:
            server_mod._TlsAccept.connection_made = made  # type: ignore[method-assign]
            await server.close()

    assert run_on(loop, main) == 0


# -- failed handshakes are logged -----------------------------------------------------------


@pytest.mark.parametrize("loop", LOOPS)
def test_a_failed_tls_handshake_is_logged_with_the_peer_address(
    loop: str, ca: trustme.CA, caplog: pytest.LogCaptureFixture,
) -> None:
    """A server context without a certificate started fine and failed every handshake
    without a word; the client saw a reset."""
    caplog.set_level(logging.INFO, logger="kvwire")

    async def main() -> int:
        async with kvwire.serve("127.0.0.1", 0, secret=SECRET, ssl=server_context(None)) as server:
            sock = socket.socket()
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", server.port))
            port = int(sock.getsockname()[1])
            with pytest.raises((ssl.SSLError, ConnectionError)):
                await asyncio.wait_for(asyncio.open_connection(
                    sock=sock, ssl=client_context(ca), server_hostname="localhost"), 10)
            sock.close()
            assert await wait_until(lambda: any(str(port) in r.getMessage() for r in caplog.records), 5)
        return port

    port = run_on(loop, main)
    [record] = [r for r in caplog.records if str(port) in r.getMessage()]
    assert record.name == "kvwire" and record.levelno == logging.WARNING
    assert "TLS handshake failed" in record.getMessage() and "127.0.0.1" in record.getMessage()


@pytest.mark.parametrize("loop", LOOPS)
def test_tls_transfers_arrive_bit_identical_on_both_loops(
    loop: str, ca: trustme.CA, server_cert: trustme.LeafCert, caplog: pytest.LogCaptureFixture,
) -> None:
    """The server begins TLS on each connection itself: the ClientHello read before
    (uvloop reads at once) and a HELLO decrypted with the handshake's end both reach it."""
    caplog.set_level(logging.INFO, logger="kvwire")
    layers = make_layers(SPEC.num_layers, 40, SPEC.num_kv_heads, SPEC.head_dim)

    async def main() -> None:
        async with kvwire.serve("127.0.0.1", 0, secret=SECRET, ssl=server_context(server_cert)) as server:
            for i in range(3):
                async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, streams=2,
                                          ssl=client_context(ca), server_hostname="localhost") as peer:
                    await peer.send(f"r{i}", SPEC, layers, timeout=10)
                cache = await (await server.expect(f"r{i}", timeout=10)).collect(timeout=10)
                assert same_cache(cache.layers, layers)

    run_on(loop, main)
    assert not [r for r in caplog.records if "TLS" in r.getMessage()]


# -- the shared secret ----------------------------------------------------------------------


@pytest.mark.parametrize(("content", "secret"), [
    (b"0123456789abcdef\n", b"0123456789abcdef"),
    (b"0123456789abcdef\r\n", b"0123456789abcdef"),
    (b"0123456789abcdef", b"0123456789abcdef"),
    (b"0123456789abcdef\n\n", b"0123456789abcdef\n"),
    (b" \x8f\x01\x99\xaa\x10\x77\x42", b" \x8f\x01\x99\xaa\x10\x77\x42"),  # binary, 0x20 first
    (b"\t\x8f\x01\x99\xaa\x10\x77\x42\x0b", b"\t\x8f\x01\x99\xaa\x10\x77\x42\x0b"),
])
def test_a_secret_file_loses_one_line_ending_and_nothing_else(
    content: bytes, secret: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--secret-file (and vLLM's kvwire_secret_file) stripped whitespace at both ends: a
    binary secret starting with 0x20 or ending with 0x09-0x0d became another key than
    the file's bytes (or fewer than 8 bytes, refused)."""
    from kvwire.aio import read_secret_file
    from kvwire.bench.runner import load_secret

    monkeypatch.delenv("KVWIRE_SECRET", raising=False)
    path = tmp_path / "secret"
    path.write_bytes(content)
    assert load_secret(str(path)) == (secret, None)
    assert read_secret_file(path) == secret
    assert read_secret_file(os.fspath(path)) == secret


def test_the_secret_is_not_in_a_configs_repr() -> None:
    secret = b"do-not-print-this-secret"
    for config in (SenderConfig(secret=secret), ReceiverConfig(secret=secret), ConnectionConfig(secret=secret)):
        assert "do-not-print" not in repr(config), type(config).__name__
