"""kvwire.sync's SendHandle and SyncPeer.begin(): what a transfer fed layer by layer from a
thread says when it fails, and what it refuses at once.  Real loopback sockets."""

from __future__ import annotations

import pytest

import kvwire
from kvwire.errors import ConnectionLostError, TransferTimeoutError, UsageError
from kvwire.sync import Bridge, SendHandle, SyncPeer, SyncServer
from tests.conftest import SECRET, make_layers

pytestmark = pytest.mark.timeout(60)

SPEC = kvwire.KVSpec(num_layers=3, num_kv_heads=2, head_dim=16, dtype="float32")


@pytest.mark.parametrize("wait_timeout", [30.0, None])
def test_wait_raises_the_sends_own_timeout(wait_timeout: float | None) -> None:
    """A send that ran out of its own ``timeout`` fails wait() with that error (the
    send's message, and its cause kept), not with one saying wait() itself gave up."""
    with SyncServer(secret=SECRET) as server, SyncPeer("127.0.0.1", server.port, secret=SECRET) as peer:
        h = server.expect("x", timeout=30)
        s = peer.begin("x", SPEC, timeout=0.3)
        s.send_layer(*make_layers(1, 4, 2, 16, "float32")[0])  # the other layers never come
        with pytest.raises(TransferTimeoutError, match=r"did not complete in 0\.3 s") as info:
            s.wait(wait_timeout)
        assert "not done after" not in str(info.value)
        with pytest.raises(TransferTimeoutError, match=r"did not complete in 0\.3 s"):
            h.wait(30)


def test_wait_for_less_than_the_send_takes_says_so() -> None:
    """wait(timeout) running out before the send ended is this wait's timeout."""
    with SyncServer(secret=SECRET) as server, SyncPeer("127.0.0.1", server.port, secret=SECRET) as peer:
        h = server.expect("y", timeout=30)
        s = peer.begin("y", SPEC, timeout=30)
        layers = make_layers(3, 4, 2, 16, "float32")
        s.send_layer(*layers[0])
        with pytest.raises(TransferTimeoutError, match=r"not done after 0\.05 s"):
            s.wait(0.05)
        for k, v in layers[1:]:
            s.send_layer(k, v)
        assert s.wait(30).request_id == "y"
        h.wait(30)


@pytest.mark.parametrize("request_id", [5, b"x", "", "x" * 0x10000, "\ud800"])
def test_begin_refuses_a_bad_request_id_at_once(request_id: object) -> None:
    """As SyncServer.expect() and Peer.send() do: a UsageError from begin(), not from
    wait() once every send_layer() seemed to succeed."""
    with SyncServer(secret=SECRET) as server, SyncPeer("127.0.0.1", server.port, secret=SECRET) as peer:
        with pytest.raises(UsageError, match="request_id must be a non-empty str"):
            peer.begin(request_id, SPEC)  # type: ignore[arg-type]


def test_a_layer_a_closed_bridge_refused_is_not_counted() -> None:
    """send_layer() on a closed bridge raises ConnectionLostError and queues nothing: the
    next call says the same, not that every layer was already queued."""
    bridge = Bridge("closed")
    handle = SendHandle(bridge, "r", 1)  # as SyncPeer.begin() makes it
    bridge.close()
    k, v = make_layers(1, 4, 2, 16, "float32")[0]
    for _ in range(2):
        with pytest.raises(ConnectionLostError):
            handle.send_layer(k, v)
