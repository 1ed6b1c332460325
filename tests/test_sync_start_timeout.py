"""kvwire.sync: a SyncPeer whose handshake is not done within ``start_timeout`` closes the
connection its failed open left once, at once (lingering 0 s): with its own bridge, the
bridge's close cancelled that close midway along with everything else, and the peer's
close() then began another, which lingered a second for a server that never reads."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

import kvwire.aio.client as client_mod
from kvwire.errors import TransferTimeoutError
from kvwire.sync import Bridge, SyncPeer
from tests.conftest import SECRET

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port whose listener takes connections (the kernel's backlog) and never answers."""
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(16)
    try:
        yield ls.getsockname()[1]
    finally:
        ls.close()


@pytest.fixture
def teardowns(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The linger of each teardown a Peer begins."""
    lingers: list[float] = []
    teardown = client_mod.Peer._teardown

    async def recorded(self: Any, linger: float) -> None:
        lingers.append(linger)
        await teardown(self, linger)

    monkeypatch.setattr(client_mod.Peer, "_teardown", recorded)
    return lingers


@pytest.mark.parametrize("own_bridge", [True, False])
def test_start_timeout_closes_the_failed_open_once_without_linger(silent_port: int, teardowns: list[float],
                                                                    own_bridge: bool) -> None:
    bridge = None if own_bridge else Bridge()
    before = set(threading.enumerate())
    try:
        with pytest.raises(TransferTimeoutError):
            SyncPeer("127.0.0.1", silent_port, secret=SECRET, start_timeout=0.3, bridge=bridge)
    finally:
        if bridge is not None:
            bridge.close()
    assert teardowns == [0.0]  # the failed open's own close, not cancelled and begun again
    for t in set(threading.enumerate()) - before:  # (its own bridge's thread ended)
        t.join(10)
        assert not t.is_alive(), t
