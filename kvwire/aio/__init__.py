"""The I/O layer: the only package that touches asyncio, sockets, TLS and clocks.

``serve()`` and ``connect()`` are the library's entry points; both return objects used
with ``async with``.
"""

from __future__ import annotations

import os
import ssl as _ssl
from collections.abc import Sequence
from dataclasses import fields
from typing import Any, Unpack

from kvwire.aio.client import Peer
from kvwire.aio.server import Server, Transfer, check_ssl_context
from kvwire.errors import UsageError
from kvwire.options import ConnectOptions, ServeOptions, Streams
from kvwire.session.options import ClientOptions, Receipt, ServerOptions, make_server_options
from kvwire.spec import KVSpec


def serve(
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    secret: bytes,
    ssl: _ssl.SSLContext | None = None,
    spec: KVSpec | Sequence[KVSpec] | None = None,
    registry: Any = None,
    **options: Unpack[ServeOptions],
) -> Server:
    """A server receiving KV caches on ``host:port`` (``port=0`` picks a free one, the same
    on every address it listens on: :attr:`Server.addresses`).  ``host`` ``""`` listens on
    every interface of both families, ``"0.0.0.0"`` on IPv4's, ``"::"`` on IPv6's only (as
    the OS binds it), a name on every address it resolves to; an IPv6 address may be
    given in brackets (``"[::1]"``, as ``connect()`` takes it).  Resolving that name and
    binding have no deadline of their own (as ``asyncio.start_server``): bound them with
    ``asyncio.timeout()`` around the ``async with`` (the blocking API's ``SyncServer``
    bounds them by its ``start_timeout``).

    ``spec`` restricts the KV layouts accepted; ``registry`` (a
    :mod:`kvwire.consistency` registry) makes the server refuse transfers whose prefix
    blocks are stale and publish the blocks of those it completes; ``options`` are the
    fields of :class:`ServerOptions` (limits, windows, timeouts; typed by
    :class:`kvwire.options.ServeOptions`).  Use as ``async with``.  An invalid
    ``KVWIRE_RECV_POOL_MB`` (the receive pool's size) is a UsageError here, as is an
    ``ssl`` that is not a server's :class:`ssl.SSLContext` (anything else, or one made
    for clients: ``PROTOCOL_TLS_CLIENT``).  A TLS handshake that fails (a context
    without a certificate, a client that refuses it) is logged with the peer's address
    at WARNING on the ``kvwire`` logger.
    """
    return Server(
        host, port, secret=secret, ssl=ssl, options=make_server_options(spec, **options),
        registry=registry,
    )


def connect(
    host: str,
    port: int,
    *,
    secret: bytes,
    streams: Streams = 1,
    codec: str = "raw",
    ssl: _ssl.SSLContext | None = None,
    server_hostname: str | None = None,
    **options: Unpack[ConnectOptions],
) -> Peer:
    """A client session of ``streams`` TCP connections to a kvwire server.

    ``host`` is a name or an address, an IPv6 one with or without brackets (``"::1"`` or
    ``"[::1]"``; brackets around anything else are a UsageError).  The session's first
    stream resolves it and connects to the first of its addresses to answer (tried in
    turn, the next started 0.25 s after the one before or as soon as that one fails, all
    within ``connect_timeout``); every other stream of the session, and every reconnect,
    goes to the address that stream reached, so a name with several addresses (round-robin
    DNS) cannot lead them to a server that does not know the session.  A new session
    resolves the name again.

    ``streams="auto"`` opens ``max_streams`` connections and stripes over as many as the
    path rewards (more while one stream's window is the limit, fewer when not).
    ``codec`` is the default for :meth:`Peer.send` (``"auto"``: chosen per chunk from
    the live bandwidth estimate); ``options`` are the fields of :class:`ClientOptions`
    (typed by :class:`kvwire.options.ConnectOptions`).  ``ssl`` (a client
    :class:`ssl.SSLContext`) runs every stream over TLS, checking the server's certificate
    against ``server_hostname`` (default ``host``, an IPv6 address without its ``%scope``,
    whichever of its addresses was reached); ``server_hostname`` without ``ssl`` is a
    UsageError, as are a ``host`` or ``server_hostname`` that is not a str and an ``ssl``
    that is not a client's :class:`ssl.SSLContext` (``True``, a file name, one made for
    servers: ``PROTOCOL_TLS_SERVER``).  Use as ``async with`` (or ``await peer.close()``):
    a peer dropped unclosed has its connections aborted, nothing more sent, with a
    ResourceWarning once it is garbage-collected (a ``send()`` under way keeps it alive).
    """
    if not isinstance(host, str):
        raise UsageError(f"host must be a str (a name or an address), not {type(host).__name__}")
    check_ssl_context(ssl, server_side=False)
    if server_hostname is not None and not isinstance(server_hostname, str):
        raise UsageError(f"server_hostname must be a str or None, not {type(server_hostname).__name__}")
    known = {f.name for f in fields(ClientOptions)}
    unknown = set(options) - known
    if unknown:
        raise UsageError(f"unknown connect option(s): {', '.join(sorted(unknown))}")
    return Peer(
        host, port, secret=secret, streams=streams, codec=codec, ssl=ssl,
        options=ClientOptions(**options), server_hostname=server_hostname,
    )


def read_secret_file(path: str | os.PathLike[str]) -> bytes:
    """The shared secret held in the file at ``path``: its bytes less one line ending at
    the end (``"\\n"`` or ``"\\r\\n"``, as ``echo`` or an editor leaves it), nothing
    else (whitespace elsewhere is part of the secret).  Keep a text secret in it, e.g.
    ``openssl rand -hex 32 > secret``: a binary one that ends in a line ending loses it.
    What ``kvwire serve`` / ``kvwire bench --secret-file`` and the vLLM connector's
    ``kvwire_secret_file`` use, so an application that reads the same file with it has
    the same secret; :class:`OSError` if it cannot be read."""
    with open(path, "rb") as f:
        data = f.read()
    if data.endswith(b"\r\n"):
        return data[:-2]
    return data[:-1] if data.endswith(b"\n") else data


def run(main: Any) -> Any:
    """Run a coroutine on uvloop when it is installed, else on the default loop."""
    import asyncio

    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


__all__ = [
    "ClientOptions",
    "Peer",
    "Receipt",
    "Server",
    "ServerOptions",
    "Transfer",
    "connect",
    "read_secret_file",
    "run",
    "serve",
]
