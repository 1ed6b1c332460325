"""Which wire protocol version a session agreed is visible on both ends:
``Peer.protocol_version`` and its statistics, and the server's open sessions counted by
version, so an operator can tell during a rolling upgrade which hosts speak which."""

from __future__ import annotations

import pytest

import kvwire
from kvwire.wire.frames import PROTOCOL_VERSION
from tests.conftest import SECRET

pytestmark = pytest.mark.timeout(60)


async def test_the_agreed_version_is_on_the_peer_and_counted_by_the_server() -> None:
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        assert server.statistics()["sessions_by_version"] == {}
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, streams=2) as peer:
            assert peer.protocol_version == PROTOCOL_VERSION
            assert peer.statistics()["protocol_version"] == PROTOCOL_VERSION
            assert server.statistics()["sessions_by_version"] == {PROTOCOL_VERSION: 1}  # (one session, two streams)
