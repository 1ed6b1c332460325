"""kvwire.sync: a SyncPeer or SyncServer with its own bridge garbage-collected without
close() is closed then (its connection or listening socket, its loop, its thread) with a
ResourceWarning, as an unclosed socket is; it kept its thread, loop and sockets for the
process's life without a word.  Nothing the loop runs keeps one alive (or it would never
be collected); a SendHandle held keeps its peer.  Real loopback sockets."""

from __future__ import annotations

import gc
import re
import threading
import warnings
import weakref

import pytest

import kvwire
from kvwire.errors import KvwireError
from kvwire.sync import Bridge, SyncPeer, SyncServer
from tests.conftest import SECRET
from tests.sync_helpers import connections, layers, refused, until

pytestmark = pytest.mark.timeout(90)

SPEC = kvwire.KVSpec(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32")
PEER_WARNING = r"unclosed kvwire\.sync\.SyncPeer to 127\.0\.0\.1:\d+"
SERVER_WARNING = r"unclosed kvwire\.sync\.SyncServer on 127\.0\.0\.1:\d+"


def ended(bridge: Bridge) -> bool:
    bridge._thread.join(20)
    return not bridge._thread.is_alive() and bridge.closed and bridge.loop.is_closed()


def test_a_dropped_unclosed_peer_warns_and_is_closed() -> None:
    with SyncServer(secret=SECRET) as server:
        peer = SyncPeer("127.0.0.1", server.port, secret=SECRET)
        bridge = peer.bridge
        assert until(lambda: connections(server) >= 1)
        with pytest.warns(ResourceWarning, match=PEER_WARNING):
            del peer
            gc.collect()
        assert ended(bridge)
        assert until(lambda: connections(server) == 0)  # its connection closed, not left open


def test_a_dropped_unclosed_server_warns_and_is_closed() -> None:
    server = SyncServer(secret=SECRET)
    bridge, port = server.bridge, server.port
    waiting = server.expect("never")  # (a receive pending on its loop keeps nothing alive)
    with pytest.warns(ResourceWarning, match=SERVER_WARNING):
        del server
        gc.collect()
    assert ended(bridge)
    assert refused(port)
    with pytest.raises(KvwireError):
        waiting.wait(timeout=10)  # failed, not left waiting


def test_a_dropped_peer_whose_send_waits_on_the_loop_is_collected() -> None:
    with SyncServer(secret=SECRET) as server:
        peer = SyncPeer("127.0.0.1", server.port, secret=SECRET)
        bridge, collected = peer.bridge, weakref.ref(peer)
        peer.begin("r", SPEC, timeout=None).send_layer(*layers()[0])  # waits for its second layer
        with pytest.warns(ResourceWarning, match=PEER_WARNING):
            del peer
            gc.collect()
        assert collected() is None
        assert ended(bridge)


def test_a_dropped_peer_used_before_is_collected() -> None:
    with SyncServer(secret=SECRET) as server:
        got = server.expect("a")
        peer = SyncPeer("127.0.0.1", server.port, secret=SECRET)
        bridge, collected = peer.bridge, weakref.ref(peer)
        peer.send("a", SPEC, layers(), timeout=20)
        got.wait(timeout=20)
        assert peer.written_past(peer.write_marks(timeout=10), timeout=10) in (True, False)
        aborted = peer.begin("b", SPEC)
        aborted.abort()
        with pytest.raises(KvwireError):
            aborted.wait(timeout=10)
        del aborted
        with pytest.warns(ResourceWarning, match=PEER_WARNING):
            del peer
            gc.collect()
        assert collected() is None
        assert ended(bridge)


def test_a_send_handle_keeps_its_peer() -> None:
    with SyncServer(secret=SECRET) as server:
        got = server.expect("r")
        handle = SyncPeer("127.0.0.1", server.port, secret=SECRET).begin("r", SPEC)
        gc.collect()  # (the peer is not collected, nor closed, while its handle is held)
        for k, v in layers():
            handle.send_layer(k, v)
        assert isinstance(handle.wait(timeout=20), kvwire.Receipt)
        got.wait(timeout=20)
        handle._owner.close()


def test_closed_or_shared_bridge_ones_do_not_warn() -> None:
    bridge = Bridge()
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            server = SyncServer(secret=SECRET)
            peer = SyncPeer("127.0.0.1", server.port, secret=SECRET)
            shared = SyncPeer("127.0.0.1", server.port, secret=SECRET, bridge=bridge)
            shared_server = SyncServer(secret=SECRET, bridge=bridge)
            peer.close()
            server.close()
            own = [peer.bridge, server.bridge]
            del peer, server, shared, shared_server  # (a shared bridge's close closes them)
            gc.collect()
        assert [w for w in seen if issubclass(w.category, ResourceWarning)] == []
        assert all(ended(b) for b in own)
        assert not bridge.closed
    finally:
        bridge.close()
    assert ended(bridge)


def test_one_whose_bridge_close_was_begun_does_not_warn() -> None:
    """``bridge.close_soon()`` called (the close begun, its stop queued), then the server
    dropped before the loop ran the stop: it is being closed, no warning (before, it
    warned unless the queued stop had run by the collection)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        server = SyncServer(secret=SECRET)
        bridge, port = server.bridge, server.port
        with bridge._core.lock:  # (the loop cannot finish its close meanwhile)
            bridge.close_soon()
            del server
            gc.collect()
        assert until(lambda: ended(bridge))
    assert [str(w.message) for w in seen if issubclass(w.category, ResourceWarning)] == []
    assert refused(port)


def test_a_peer_dropped_on_its_own_loop_thread_is_closed() -> None:
    """Its finalizer may run on the bridge's own thread: it closes it without waiting
    there (a blocking close on that thread would wait on itself)."""
    with SyncServer(secret=SECRET) as server:
        peer = SyncPeer("127.0.0.1", server.port, secret=SECRET)
        bridge, collected = peer.bridge, weakref.ref(peer)
        dropped_on: list[threading.Thread] = []
        holder = [peer]
        del peer

        def drop() -> None:  # the last reference goes on the loop thread
            dropped_on.append(threading.current_thread())
            holder.clear()

        with warnings.catch_warnings(record=True) as seen:  # (the warning is the loop thread's)
            warnings.simplefilter("always")
            bridge.loop.call_soon_threadsafe(drop)
            assert ended(bridge)
        assert dropped_on == [bridge._thread]
        assert collected() is None
        assert any(issubclass(w.category, ResourceWarning) and re.search(PEER_WARNING, str(w.message)) for w in seen)
        assert until(lambda: connections(server) == 0)


def test_a_dropped_sync_server_names_an_ipv6_address_in_brackets() -> None:
    server = SyncServer("::1", 0, secret=SECRET)
    with pytest.warns(ResourceWarning, match=rf"unclosed kvwire\.sync\.SyncServer on \[::1\]:{server.port}\b"):
        del server
        gc.collect()
