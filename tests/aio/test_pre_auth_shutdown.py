"""A server shutting down says so before AUTH too: its clean GOAWAY carries the fixed text
"the server is shutting down", which tells nothing of its secret, to every peer alike
(docs/protocol.md 5.8), and a client's connect() fails saying that.  Every other reason,
and every other code's message, is still dropped before AUTH; a client of a server that
sends none (an earlier release) still says the server closed on purpose."""

from __future__ import annotations

import asyncio

import pytest

import kvwire
from kvwire.errors import ErrorCode
from kvwire.session.sender import HANDSHAKE_GOODBYE
from kvwire.testing.fault_proxy import FaultPlan, FaultProxy, Faults
from kvwire.wire import FrameDecoder, GoAway, connection
from kvwire.wire.connection import SHUTTING_DOWN, Connection, ConnectionConfig, Role, State
from tests.aio.handshake_helpers import from_server, refused, until
from tests.conftest import SECRET
from tests.rawpeer import read_one_frame

pytestmark = pytest.mark.timeout(60)


def _server_goaway(conn: Connection) -> GoAway:
    out = b"".join(bytes(p) for p in conn.data_to_send())
    frames = [f for f, _ in FrameDecoder(1 << 16).feed(out)]
    assert isinstance(frames[-1], GoAway), frames
    return frames[-1]


def _pre_auth_server(challenged: bool) -> Connection:
    server = Connection(Role.SERVER, ConnectionConfig(secret=SECRET))
    if challenged:  # HELLO taken, CHALLENGE sent: waiting for AUTH
        client = Connection(Role.CLIENT, ConnectionConfig(secret=SECRET))
        client.initiate()
        server.receive_data(b"".join(bytes(p) for p in client.data_to_send()))
        server.data_to_send()
    assert server.state is (State.SERVER_CHALLENGE_SENT if challenged else State.SERVER_AWAIT_HELLO)
    return server


@pytest.mark.parametrize("challenged", [False, True], ids=["before-hello", "before-auth"])
@pytest.mark.parametrize(("code", "message", "sent"), [
    (ErrorCode.NO_ERROR, SHUTTING_DOWN, SHUTTING_DOWN),  # the one clean reason told
    (ErrorCode.NO_ERROR, "closing: 3 sessions, secret starts with 'ab'", ""),
    (ErrorCode.PROTOCOL_ERROR, SHUTTING_DOWN, ""),  # only with its own code
    (ErrorCode.AUTHENTICATION_FAILED, "proof 1234 != 5678", "authentication failed"),
], ids=["shutting-down", "other-reason", "other-code", "wrong-proof"])
def test_before_auth_a_goaway_carries_only_a_fixed_text(
    challenged: bool, code: ErrorCode, message: str, sent: str,
) -> None:
    server = _pre_auth_server(challenged)
    server.close(code, message)
    goaway = _server_goaway(server)
    assert (goaway.code, goaway.message) == (code, sent)


async def test_a_raw_peer_that_never_authenticated_reads_that_the_server_is_shutting_down() -> None:
    server = kvwire.serve("127.0.0.1", 0, secret=SECRET)
    async with server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        try:
            async def connected() -> None:
                while server.statistics()["connections"] < 1:
                    await asyncio.sleep(0.01)
            await asyncio.wait_for(connected(), 20)
            await asyncio.wait_for(server.close(), 20)
            goaway = await read_one_frame(reader, 20)
            assert isinstance(goaway, GoAway)
            assert (goaway.code, goaway.message) == (ErrorCode.NO_ERROR, "the server is shutting down")
            assert await asyncio.wait_for(reader.read(), 20) == b""
        finally:
            writer.close()


@pytest.mark.parametrize("earlier_server", [False, True], ids=["this-server", "earlier-server"])
async def test_connect_to_a_server_shutting_down_before_auth_says_why(
    earlier_server: bool, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server closes while its CHALLENGE is held on the way.  An earlier server sent
    its clean GOAWAY with no text before AUTH: the client then says the server closed on
    purpose, as a kvwire server does when it shuts down."""
    if earlier_server:
        monkeypatch.setitem(connection.PRE_AUTH_MESSAGES, ErrorCode.NO_ERROR, "")
    server = kvwire.serve("127.0.0.1", 0, secret=SECRET)
    async with server, FaultProxy("127.0.0.1", server.port, plan=FaultPlan(backward=Faults(stall_at=0))) as proxy:
        opening = asyncio.ensure_future(refused(proxy.port, connect_timeout=30))
        await until(lambda: from_server(proxy, 0) > 0)
        await asyncio.wait_for(server.close(), 20)
        proxy.resume(0)
        exc = await asyncio.wait_for(opening, 30)
    assert type(exc) is kvwire.ConnectionLostError
    assert str(exc) == (HANDSHAKE_GOODBYE if earlier_server else "the server is shutting down"), exc
