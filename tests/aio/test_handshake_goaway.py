"""A server that closes a client's stream with a GOAWAY during its handshake fails
``connect()`` with what that GOAWAY says: the error class of its code and its message.
A clean GOAWAY (NO_ERROR: the server shutting down) made it "connection closed during the
handshake", as for a connection that merely broke.  (Before AUTH the server's clean GOAWAY
carries the fixed text "the server is shutting down"; an earlier server's carried none:
tests/aio/test_pre_auth_shutdown.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
from collections.abc import AsyncIterator

import numpy as np
import pytest

import kvwire
from kvwire.errors import ErrorCode
from kvwire.testing.fault_proxy import FaultPlan, FaultProxy, Faults
from kvwire.wire.frames import Challenge, encode_frame
from tests.aio.handshake_helpers import from_server, refused, until
from tests.conftest import SECRET

pytestmark = pytest.mark.timeout(60)

SPEC = kvwire.KVSpec(num_layers=2, num_kv_heads=1, head_dim=16, model="a")
#: Bytes of the server's CHALLENGE on the wire: what a stream gets before it sends AUTH.
CHALLENGE_BYTES = sum(len(p) for p in encode_frame(Challenge(version=2, nonce=bytes(32))))


@pytest.mark.parametrize(("why", "options", "error", "message"), [
    ("wrong secret", {"secret": b"wrong-secret-0123"}, kvwire.AuthenticationError,
     r"authentication with 127\.0\.0\.1:\d+ failed: the secret given to connect\(\) is not the server's .*"),
    ("layout", {"spec": kvwire.KVSpec(num_layers=2, num_kv_heads=1, head_dim=16, model="b")},
     kvwire.IncompatiblePeerError, "this server does not accept that KV layout"),
    ("max_sessions", {}, kvwire.LimitExceededError, "server has reached max_sessions"),
])
async def test_a_refused_first_stream_says_the_refusal(
    why: str, options: dict[str, object], error: type[kvwire.KvwireError], message: str,
) -> None:
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, spec=SPEC, max_sessions=1) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET):  # the one session allowed
            exc = await refused(server.port, **options)
    assert type(exc) is error and re.fullmatch(message, str(exc)), exc


async def test_a_server_timing_out_the_handshake_says_timeout() -> None:
    """The server's handshake deadline passes while its CHALLENGE is held on the way."""
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, handshake_timeout=0.3) as server:
        async with FaultProxy("127.0.0.1", server.port, plan=FaultPlan(backward=Faults(stall_at=0))) as proxy:
            opening = asyncio.ensure_future(refused(proxy.port, connect_timeout=30))
            await until(lambda: from_server(proxy, 0) > CHALLENGE_BYTES)  # CHALLENGE, then its GOAWAY
            proxy.resume(0)
            exc = await opening
    assert isinstance(exc, kvwire.TransferTimeoutError) and exc.code == ErrorCode.TIMEOUT


async def test_a_server_shutting_down_before_auth_says_it_closed_on_purpose() -> None:
    """The server closes while its CHALLENGE is held on the way: its GOAWAY(NO_ERROR) has
    only the fixed text an unauthenticated client may learn, and connect() said
    "connection closed during the handshake", as for a break."""
    server = kvwire.serve("127.0.0.1", 0, secret=SECRET)
    async with server, FaultProxy("127.0.0.1", server.port, plan=FaultPlan(backward=Faults(stall_at=0))) as proxy:
        opening = asyncio.ensure_future(refused(proxy.port, connect_timeout=30))
        await until(lambda: from_server(proxy, 0) > 0)
        await server.close()
        proxy.resume(0)
        exc = await opening
    assert type(exc) is kvwire.ConnectionLostError
    assert str(exc) == "the server is shutting down", exc


async def test_a_server_shutting_down_after_its_welcome_says_why() -> None:
    """The server closes once it sent WELCOME, held on the way with the GOAWAY behind it:
    connect() fails with the GOAWAY's reason, as send() does for a session the server
    closed (it said "stream 0 closed by server (GOAWAY NO_ERROR: ...)")."""
    server = kvwire.serve("127.0.0.1", 0, secret=SECRET)
    plan = FaultPlan(backward=Faults(stall_at=CHALLENGE_BYTES))
    async with server, FaultProxy("127.0.0.1", server.port, plan=plan) as proxy:
        opening = asyncio.ensure_future(refused(proxy.port, connect_timeout=30))
        await until(lambda: from_server(proxy, 0) > CHALLENGE_BYTES)  # the WELCOME
        await server.close()
        proxy.resume(0)
        exc = await opening
    assert type(exc) is kvwire.ConnectionLostError
    assert str(exc) == "the server is shutting down" and exc.code == ErrorCode.SESSION_LOST


async def test_a_server_shutting_down_while_a_stream_joins_says_it_closed_on_purpose() -> None:
    """Stream 0 is open, stream 1's CHALLENGE held on the way, when the server closes; stream
    1's clean GOAWAY arrives first (stream 0's is held): connect() said "connection closed
    during the handshake".  The join is not retried, so connect() (two streams asked for)
    fails naming it."""
    server = kvwire.serve("127.0.0.1", 0, secret=SECRET)
    stall_joins = FaultPlan(backward=Faults(stall_at=0))
    async with server, FaultProxy("127.0.0.1", server.port, plan=lambda i: stall_joins if i else FaultPlan()) as proxy:
        opening = asyncio.ensure_future(refused(proxy.port, streams=2, connect_timeout=30))
        await until(lambda: from_server(proxy, 1) > 0)
        proxy.stall(0)
        await server.close()
        proxy.resume(1)
        try:
            exc = await opening
        finally:
            with contextlib.suppress(IndexError):
                proxy.resume(0)
    assert type(exc) is kvwire.ConnectionLostError
    assert str(exc) == "stream 1: the server is shutting down", exc


async def test_a_rejoin_the_server_closes_on_purpose_leaves_the_open_stream_its_acknowledgements() -> None:
    """Stream 1 broke and its rejoin is held on the way when the server, the transfer
    complete and taken, shuts down; the rejoin's clean GOAWAY comes before stream 0's last
    ACK (held).  A clean goodbye on one stream while another is open does not end the
    session (protocol.md 6.3): the send ends with its receipt (it failed, the session
    taken for lost)."""
    server = kvwire.serve("127.0.0.1", 0, secret=SECRET)
    stall_rejoin = FaultPlan(backward=Faults(stall_at=0))
    async with server, FaultProxy("127.0.0.1", server.port,
                                  plan=lambda i: stall_rejoin if i == 2 else FaultPlan()) as proxy:
        async with kvwire.connect("127.0.0.1", proxy.port, secret=SECRET, streams=2) as peer:
            proxy.drop(1)  # stream 1 breaks; its reconnect (connection 2) waits for its CHALLENGE
            await until(lambda: from_server(proxy, 2) > 0)
            expecting = asyncio.ensure_future(server.expect("r"))
            release, asked = asyncio.Event(), asyncio.Event()
            k = np.ones((8, 1, 16), np.float16)

            async def layers() -> AsyncIterator[tuple[np.ndarray, np.ndarray]]:
                yield k, k
                asked.set()
                await release.wait()
                yield k, k

            sending = asyncio.ensure_future(peer.send("r", SPEC, layers()))
            await asked.wait()
            await until(lambda: from_server(proxy, 0) > 0)
            proxy.connections[0].backward.hold(math.inf)  # the last ACK and stream 0's GOAWAY wait
            release.set()
            transfer = await asyncio.wait_for(expecting, 20)
            async for _ in transfer:
                pass
            await server.close()
            proxy.resume(2)  # the rejoin's GOAWAY arrives first
            await until(lambda: peer.statistics().get("goaways_received", 0) > 0)
            proxy.connections[0].backward.release()
            receipt = await asyncio.wait_for(sending, 20)
    assert receipt.kv_bytes == 2 * 2 * k.nbytes
