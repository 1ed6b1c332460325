"""kvwire.sync: a finite timeout longer than a thread may wait (past
``threading.TIMEOUT_MAX``, some 292 years) is a wait without a limit in practice: each
blocking call returns as with a short one; they raised a raw OverflowError ("timestamp out
of range for platform time_t"), and ``SyncPeer.close(1e10)`` left its bridge's thread
running.  Real loopback sockets."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import kvwire
from kvwire.sync import Bridge, PendingPeer, SyncPeer, SyncServer
from tests.conftest import SECRET

pytestmark = pytest.mark.timeout(90)

SPEC = kvwire.KVSpec(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32")
LONG = [1e10, 1e300]  # past threading.TIMEOUT_MAX; 3 * 1e300 is inf (Bridge.close's step)


def layers() -> list[tuple[np.ndarray, np.ndarray]]:
    return [(np.full((4, 1, 8), i, np.float32), np.full((4, 1, 8), -i, np.float32)) for i in range(2)]


def in_thread(call: Any, within: float = 30.0) -> Any:
    """``call()``'s result, or what it raised, from another thread; "blocked" when it did
    not end within ``within`` s (a daemon thread: a regression fails, it does not hang)."""
    out: list[Any] = []

    def go() -> None:
        try:
            out.append(("returned", call()))
        except BaseException as exc:
            out.append(("raised", exc))

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(within)
    return out[0] if out else "blocked"


@pytest.mark.parametrize("long", LONG)
def test_waits_with_a_timeout_past_the_longest_a_thread_waits(long: float) -> None:
    with SyncServer(secret=SECRET) as server, SyncPeer("127.0.0.1", server.port, secret=SECRET) as peer:
        got = server.expect("r")
        sending = peer.begin("r", SPEC)
        for k, v in layers():
            sending.send_layer(k, v)
        how, receipt = in_thread(lambda: sending.wait(timeout=long))
        assert how == "returned", receipt
        assert isinstance(receipt, kvwire.Receipt)
        assert in_thread(lambda: got.wait(timeout=long)) == ("returned", None)
        how, layer = in_thread(lambda: got.wait_layer(1, timeout=long))
        assert how == "returned", layer
        assert np.array_equal(layer.k, layers()[1][0])
        how, marks = in_thread(lambda: peer.write_marks(timeout=long))
        assert how == "returned", marks
        assert in_thread(lambda: peer.written_past(marks, timeout=long))[0] == "returned"
        assert in_thread(lambda: server.expect("q").abort(timeout=long)) == ("returned", True)


@pytest.mark.parametrize("long", LONG)
def test_receive_wait_past_the_longest_wait_still_fails_when_aborted(long: float) -> None:
    with SyncServer(secret=SECRET) as server:
        h = server.expect("never")
        threading.Timer(0.2, h.abort).start()
        how, exc = in_thread(lambda: h.wait(timeout=long))
        assert how == "raised" and isinstance(exc, kvwire.TransferAbortedError), exc


@pytest.mark.parametrize("long", LONG)
def test_closes_with_a_timeout_past_the_longest_wait_close(long: float) -> None:
    server = SyncServer(secret=SECRET)
    peer = SyncPeer("127.0.0.1", server.port, secret=SECRET)
    threads = [peer.bridge._thread, server.bridge._thread]
    assert in_thread(lambda: peer.close(timeout=long)) == ("returned", None)
    assert in_thread(lambda: server.close(timeout=long)) == ("returned", None)
    assert peer.bridge.closed and server.bridge.closed
    for t in threads:
        t.join(10)
        assert not t.is_alive()


@pytest.mark.parametrize("long", LONG)
def test_bridge_and_pending_peer_with_a_timeout_past_the_longest_wait(long: float) -> None:
    bridge = Bridge()
    try:
        with SyncServer(secret=SECRET) as server:
            pending = PendingPeer(bridge, "127.0.0.1", server.port, secret=SECRET)
            assert in_thread(lambda: pending.wait(timeout=long)) == ("returned", True)
            peer = pending.result()
            assert in_thread(lambda: peer.close(timeout=long)) == ("returned", None)
    finally:
        assert in_thread(lambda: bridge.close(timeout=long)) == ("returned", None)
    bridge._thread.join(10)
    assert not bridge._thread.is_alive()
