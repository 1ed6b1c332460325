"""SyncServer.unclaimed_request_ids(): the server's arrived, unclaimed transfers' request
ids read from another thread (on the bridge's loop), over real loopback sockets."""

from __future__ import annotations

import threading

import pytest

import kvwire
from kvwire.errors import ConnectionLostError, UsageError
from kvwire.sync import Bridge, SyncPeer, SyncServer
from tests.conftest import SECRET, make_layers

pytestmark = pytest.mark.timeout(90)

SPEC = kvwire.KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32")


def layers(seed: int) -> list[tuple[object, object]]:
    return list(make_layers(2, 3, 2, 16, "float32", seed=seed))


def test_lists_what_expect_would_hand_out_oldest_first() -> None:
    with SyncServer(secret=SECRET) as server, SyncPeer("127.0.0.1", server.port, secret=SECRET) as peer:
        assert server.unclaimed_request_ids() == []
        for rid in ("x", "y", "x"):
            peer.send(rid, SPEC, layers(0), timeout=30)
        assert server.unclaimed_request_ids() == ["x", "y", "x"]
        handle = server.expect("x", timeout=30)
        handle.wait(30)  # claimed, and every layer taken
        assert server.unclaimed_request_ids() == ["y", "x"]
        ids: list[list[str]] = []
        reader = threading.Thread(target=lambda: ids.append(server.unclaimed_request_ids(timeout=30)))
        reader.start()
        reader.join(60)
        assert ids == [["y", "x"]]  # (from any thread)
        for rid in ("y", "x"):
            server.expect(rid, timeout=30).wait(30)
        assert server.unclaimed_request_ids() == []


def test_on_a_shared_bridge_and_after_close() -> None:
    bridge = Bridge("test-unclaimed")
    try:
        server = SyncServer(secret=SECRET, bridge=bridge)
        with SyncPeer("127.0.0.1", server.port, secret=SECRET, bridge=bridge) as peer:
            peer.send("kept", SPEC, layers(1), timeout=30)
            assert server.unclaimed_request_ids(timeout=30) == ["kept"]
        with pytest.raises(UsageError):
            server.unclaimed_request_ids(timeout=-1)
        server.close()
        assert server.unclaimed_request_ids() == []  # (the bridge runs on: the server lists none)
    finally:
        bridge.close()
    with pytest.raises(ConnectionLostError):
        server.unclaimed_request_ids()


def test_its_own_bridge_closed_raises() -> None:
    server = SyncServer(secret=SECRET)
    server.close()
    with pytest.raises(ConnectionLostError):
        server.unclaimed_request_ids()
