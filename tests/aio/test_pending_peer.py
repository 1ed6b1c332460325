"""kvwire.sync.PendingPeer: a connect started on a bridge's loop without waiting for it."""

from __future__ import annotations

import socket
from contextlib import closing

import numpy as np
import pytest

import kvwire
from kvwire.sync import Bridge, PendingPeer, SyncServer
from tests.conftest import SECRET

pytestmark = pytest.mark.timeout(60)

SPEC = kvwire.KVSpec(num_layers=1, num_kv_heads=2, head_dim=16)


def _wait_done(pending: PendingPeer) -> None:
    assert pending.wait(30), "the connect never ended"  # (never raises the connect's error)
    assert pending.done()


def test_a_pending_peer_becomes_a_peer_that_sends() -> None:
    with closing(Bridge("test")) as bridge, SyncServer("127.0.0.1", 0, secret=SECRET, bridge=bridge) as server:
        pending = PendingPeer(bridge, "127.0.0.1", server.port, secret=SECRET)
        _wait_done(pending)
        peer = pending.result()
        k = np.arange(8 * 2 * 16, dtype=np.float16).reshape(8, 2, 16)
        handle = server.expect("r", timeout=30)
        peer.send("r", SPEC, [(k, k)], timeout=30)
        layer = handle.wait_layer(0, timeout=30)
        np.testing.assert_array_equal(np.asarray(layer.k), k)
        peer.close()
        assert not bridge.closed  # the bridge is the caller's


def test_result_before_the_connect_ended_and_after_the_bridge_closed_are_kvwire_errors() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        bridge = Bridge("test")
        try:
            pending = PendingPeer(bridge, "127.0.0.1", listener.getsockname()[1], secret=SECRET, connect_timeout=30)
            with pytest.raises(kvwire.UsageError, match="still under way"):
                pending.result()
        finally:
            bridge.close()
        _wait_done(pending)
        with pytest.raises(kvwire.ConnectionLostError, match="bridge was closed"):
            pending.result()


def test_a_connect_that_fails_raises_from_result() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with closing(Bridge("test")) as bridge:
        pending = PendingPeer(bridge, "127.0.0.1", port, secret=SECRET, connect_timeout=5)
        _wait_done(pending)
        with pytest.raises(kvwire.ConnectionLostError):
            pending.result()
        pending.cancel()  # done: nothing to stop


def test_cancel_stops_a_handshake_that_never_ends_and_closes_its_socket() -> None:
    with socket.socket() as listener, closing(Bridge("test")) as bridge:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        pending = PendingPeer(bridge, "127.0.0.1", listener.getsockname()[1], secret=SECRET, connect_timeout=30)
        listener.settimeout(30)
        conn, _ = listener.accept()  # accepted, never answered
        with conn:
            assert not pending.done()
            assert not pending.wait(0.05)  # still under way: wait says so when its time is up
            pending.cancel()
            assert pending.done()
            conn.settimeout(30)
            data = conn.recv(65536)  # its HELLO, then the end of the stream
            while data:
                data = conn.recv(65536)
        with pytest.raises(kvwire.ConnectionLostError, match="the connect was cancelled"):
            pending.result()
