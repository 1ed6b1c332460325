"""kvwire.sync: a Bridge garbage-collected without close() is closed then (its loop, its
thread, the servers and peers made on it) with a ResourceWarning, as an unclosed socket
is.  Its loop thread held it, so it was never collected: each one dropped kept its thread,
its loop and their descriptors for the process's life, and a shared bridge dropped with
the SyncServer made on it left the server listening, without a word.  A closed bridge
says nothing; one a SyncServer or SyncPeer made on it holds is not collected.  Real
loopback sockets."""

from __future__ import annotations

import gc
import re
import threading
import warnings
import weakref

import pytest

import kvwire
from kvwire.sync import Bridge, SyncPeer, SyncServer
from tests.conftest import SECRET
from tests.sync_helpers import (
    bridge_warning,
    connections,
    layers,
    refused,
    resource_warnings,
    thread_ended,
    until,
)

pytestmark = pytest.mark.timeout(90)

SPEC = kvwire.KVSpec(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32")


def test_a_dropped_unclosed_bridge_warns_and_its_thread_ends() -> None:
    bridge = Bridge("dropped-bridge")
    thread, loop, collected = bridge._thread, bridge.loop, weakref.ref(bridge)
    assert thread.is_alive()
    with pytest.warns(ResourceWarning, match=bridge_warning("dropped-bridge")):
        del bridge
        gc.collect()
    assert collected() is None
    assert thread_ended(thread)
    assert loop.is_closed()


def test_a_dropped_shared_bridge_closes_the_server_and_peer_made_on_it() -> None:
    with SyncServer(secret=SECRET) as other:
        bridge = Bridge("shared-dropped")
        thread = bridge._thread
        server = SyncServer(secret=SECRET, bridge=bridge)
        peer = SyncPeer("127.0.0.1", other.port, secret=SECRET, bridge=bridge)
        port = server.port
        assert until(lambda: connections(other) >= 1)
        with pytest.warns(ResourceWarning, match=bridge_warning("shared-dropped")):
            del server, peer, bridge
            gc.collect()
        assert thread_ended(thread)
        assert until(lambda: refused(port))  # no longer listening
        assert until(lambda: connections(other) == 0)  # the peer's connection closed


def test_a_bridge_is_kept_while_a_server_made_on_it_is() -> None:
    bridge = Bridge("kept")
    collected = weakref.ref(bridge)
    server = SyncServer(secret=SECRET, bridge=bridge)
    del bridge
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        gc.collect()
    assert resource_warnings(seen) == []
    assert collected() is server.bridge and not server.bridge.closed
    with SyncPeer("127.0.0.1", server.port, secret=SECRET) as peer:  # it still serves
        got = server.expect("r")
        peer.send("r", SPEC, layers(), timeout=20)
        got.wait(timeout=20)
    thread = server.bridge._thread
    with pytest.warns(ResourceWarning, match=bridge_warning("kept")):
        del server, got
        gc.collect()
    assert collected() is None
    assert thread_ended(thread)


def test_a_closed_bridge_does_not_warn() -> None:
    bridge = Bridge("closed")
    server = SyncServer(secret=SECRET, bridge=bridge)
    thread = bridge._thread
    bridge.close()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        del server, bridge
        gc.collect()
    assert resource_warnings(seen) == []
    assert thread_ended(thread)


def test_a_dropped_own_bridge_warns_once_for_its_server() -> None:
    """A SyncServer with its own bridge dropped unclosed warns for itself: its bridge,
    closed by that, says nothing more."""
    server = SyncServer(secret=SECRET)
    thread = server.bridge._thread
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        del server
        gc.collect()
    found = resource_warnings(seen)
    assert len(found) == 1 and "SyncServer" in found[0], found
    assert thread_ended(thread)


def test_a_bridge_dropped_on_its_own_loop_thread_is_closed() -> None:
    """Its finalizer may run on its own loop thread: it begins the close there and
    returns (the finalizer waits for nothing, on any thread)."""
    bridge = Bridge("dropped-on-loop")
    thread, loop, collected = bridge._thread, bridge.loop, weakref.ref(bridge)
    dropped_on: list[threading.Thread] = []
    holder = [bridge]
    del bridge

    def drop() -> None:  # the last reference goes on the loop thread
        dropped_on.append(threading.current_thread())
        holder.clear()

    with warnings.catch_warnings(record=True) as seen:  # (the warning is the loop thread's)
        warnings.simplefilter("always")
        loop.call_soon_threadsafe(drop)
        assert thread_ended(thread)
    assert dropped_on == [thread]
    assert collected() is None
    assert loop.is_closed()
    assert any(re.search(bridge_warning("dropped-on-loop"), m) for m in resource_warnings(seen))
