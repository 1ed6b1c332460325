"""kvwire.sync: a Bridge closed by a garbage collector, racing what else closes it.

- A SyncPeer (or SyncServer) with its own bridge dropped unclosed closes its bridge, and the
  bridge, freed right after, was closed again by its own finalizer: a second stop of its
  loop, which, once the loop thread had left its run on the first, stopped the loop thread's
  close of what it owns midway ("Event loop stopped before Future completed" ended the
  thread, the peer was never closed).  A close begun queues no second stop now, and the
  loop thread's close runs to its end through a stray stop.
- A shared Bridge dropped with its SyncServer while an expect() was pending was kept alive
  by that expect's coroutine on its own loop (it held the handle, which holds the bridge):
  the server kept listening.
- A Bridge collected on another thread joined its loop thread there (at most 5 s): a
  collection on another event loop's thread held that loop up.  It waits for nothing now.

Each race is made deterministic with a thing owned by the bridge whose close waits until
the test lets it go.  Real loopback sockets."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import re
import threading
import warnings
import weakref
from typing import Any

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

pytestmark = pytest.mark.timeout(120)

SPEC = kvwire.KVSpec(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32")


class Blocker:
    """Owned by a bridge as its servers and peers are: its close() waits for ``release``."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.closed = False

    async def close(self) -> None:
        self.started.set()
        while not self.release.is_set():
            await asyncio.sleep(0.01)
        self.closed = True


def owned_blocker(bridge: Bridge) -> Blocker:
    blocker = Blocker()
    bridge.run(bridge.own(blocker), 10)
    return blocker


class Stops:
    """Counts the stops of ``loop`` run by what other threads queue on it
    (``call_soon_threadsafe``: the stop a close_soon() or a close() queues, not the one
    with which the loop thread's own close ends each run), so that a second one shows: the
    loop thread's close runs on through it (run_to_end()), so nothing else would."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.count = 0
        self.queued_running = False
        real_stop, real_queue = loop.stop, loop.call_soon_threadsafe

        def stop() -> None:
            if self.queued_running:
                self.count += 1
            real_stop()

        def call_soon_threadsafe(callback: Any, *args: Any, context: Any = None) -> asyncio.Handle:
            def queued(*args: Any) -> None:
                self.queued_running = True
                try:
                    callback(*args)
                finally:
                    self.queued_running = False

            return real_queue(queued, *args, context=context)

        loop.stop = stop  # type: ignore[method-assign]
        loop.call_soon_threadsafe = call_soon_threadsafe  # type: ignore[method-assign]


def release_on_loop(loop: asyncio.AbstractEventLoop, blocker: Blocker) -> None:
    """Let ``blocker``'s close end, from the loop: only once what was queued on it before ran."""
    with contextlib.suppress(RuntimeError):  # (a loop closed already: its thread ended)
        loop.call_soon_threadsafe(blocker.release.set)


def test_a_dropped_own_bridge_peer_is_closed_when_its_bridge_is_freed_mid_close() -> None:
    """The SyncPeer's finalizer begins its bridge's close; the bridge's own finalizer runs
    once the loop thread is closing what it owns: it stops nothing more, and the peer (and
    all else the bridge owns) is closed."""
    with SyncServer(secret=SECRET) as other:
        peer = SyncPeer("127.0.0.1", other.port, secret=SECRET)
        bridge = peer.bridge
        thread, loop, collected = bridge._thread, bridge.loop, weakref.ref(bridge)
        blocker = owned_blocker(bridge)
        stops = Stops(loop)
        assert until(lambda: connections(other) >= 1)
        try:
            with pytest.warns(ResourceWarning, match=r"unclosed kvwire\.sync\.SyncPeer"):
                del peer
                gc.collect()
            assert blocker.started.wait(30)  # the loop thread left its run: it closes what it owns
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                del (
                    bridge
                )  # its close was begun: its finalizer neither warns nor stops the loop again
                gc.collect()
            assert collected() is None
            assert resource_warnings(seen) == []
            release_on_loop(loop, blocker)  # (after a second stop, had one been queued)
            assert thread_ended(thread)
        finally:
            blocker.release.set()
        assert stops.count == 1  # the peer's finalizer's close_soon(): not the bridge's too
        assert blocker.closed
        assert loop.is_closed()
        assert until(lambda: connections(other) == 0)  # the dropped peer's connection was closed


def test_close_soon_twice_stops_the_loop_once() -> None:
    bridge = Bridge("closed-soon-twice")
    thread = bridge._thread
    blocker = owned_blocker(bridge)
    stops = Stops(bridge.loop)
    try:
        bridge.close_soon()
        assert blocker.started.wait(30)
        bridge.close_soon()  # a close begun: nothing more is queued
        release_on_loop(bridge.loop, blocker)  # (after a second stop, had one been queued)
        assert thread_ended(thread)
    finally:
        blocker.release.set()
    assert stops.count == 1
    assert blocker.closed
    assert bridge.closed and bridge.loop.is_closed()


def test_a_stray_stop_while_the_loop_thread_closes_what_it_owns_does_not_end_that_close() -> None:
    bridge = Bridge("stray-stop")
    thread = bridge._thread
    blocker = owned_blocker(bridge)
    stops = Stops(bridge.loop)
    try:
        bridge.close_soon()
        assert blocker.started.wait(30)
        bridge.loop.call_soon_threadsafe(bridge.loop.stop)  # a stop from elsewhere
        release_on_loop(bridge.loop, blocker)
        assert thread_ended(thread)
    finally:
        blocker.release.set()
    assert stops.count == 2  # close_soon()'s, then the stray one, run while the close ran
    assert blocker.closed
    assert bridge.loop.is_closed()


def test_a_shared_bridge_dropped_with_its_server_and_a_pending_expect_is_collected() -> None:
    bridge = Bridge("shared-pending-expect")
    thread, collected = bridge._thread, weakref.ref(bridge)
    server = SyncServer(secret=SECRET, bridge=bridge)
    port = server.port
    handle = server.expect(
        "never-comes"
    )  # no timeout: it waits on the loop until the server closes
    assert until(lambda: not refused(port))
    with pytest.warns(ResourceWarning, match=bridge_warning("shared-pending-expect")):
        del handle, server, bridge
        gc.collect()
    assert collected() is None
    assert thread_ended(thread)
    assert until(lambda: refused(port))  # no longer listening


def test_the_expect_of_a_collected_bridge_fails_its_waiters() -> None:
    """What the handle's waiters wait on is failed when the dropped bridge closes the server."""
    bridge = Bridge("shared-failed-expect")
    thread, collected = bridge._thread, weakref.ref(bridge)
    server = SyncServer(secret=SECRET, bridge=bridge)
    handle = server.expect("never-comes")
    state = handle._state
    with pytest.warns(ResourceWarning, match=bridge_warning("shared-failed-expect")):
        del handle, server, bridge
        gc.collect()
    assert collected() is None
    assert thread_ended(thread)
    assert state.error is not None and not state.done


def test_a_shared_bridge_dropped_with_a_begun_send_is_collected() -> None:
    with SyncServer(secret=SECRET) as other:
        bridge = Bridge("shared-begun-send")
        thread, collected = bridge._thread, weakref.ref(bridge)
        peer = SyncPeer("127.0.0.1", other.port, secret=SECRET, bridge=bridge)
        send = peer.begin("half-sent", SPEC)
        send.send_layer(*layers()[0])  # one layer of two: the send waits on the loop
        with pytest.warns(ResourceWarning, match=bridge_warning("shared-begun-send")):
            del send, peer, bridge
            gc.collect()
        assert collected() is None
        assert thread_ended(thread)
        assert until(lambda: connections(other) == 0)


def test_a_bridge_freed_on_another_loop_s_thread_does_not_hold_that_loop() -> None:
    """The finalizer begins the close and returns: the thread that freed the bridge (here
    another bridge's loop thread) goes on while the dropped bridge's thread closes what it
    owns (here held until the test lets it go), and never waits for that thread (a join
    from the collector's thread, however bounded, is what held that loop up)."""
    collector = Bridge("collector")
    try:
        bridge = Bridge("freed-elsewhere")
        thread, collected = bridge._thread, weakref.ref(bridge)
        joined_from: list[threading.Thread] = []
        real_join = thread.join

        def join(timeout: float | None = None) -> None:
            joined_from.append(threading.current_thread())
            real_join(timeout)

        thread.join = join  # type: ignore[method-assign]
        blocker = owned_blocker(bridge)
        holder = [bridge]
        del bridge
        went_on = threading.Event()
        with warnings.catch_warnings(
            record=True
        ) as seen:  # (the warning is the collector's thread's)
            warnings.simplefilter("always")
            collector.loop.call_soon_threadsafe(holder.clear)  # the bridge is freed there
            collector.loop.call_soon_threadsafe(went_on.set)
            try:
                assert went_on.wait(30), (
                    "the collector's loop was held up by the dropped bridge's finalizer"
                )
                assert blocker.started.wait(30)
                assert thread.is_alive()  # (still closing what it owns)
            finally:
                blocker.release.set()
            assert thread_ended(thread)
        assert collector._thread not in joined_from
        assert collected() is None
        assert blocker.closed
        assert any(re.search(bridge_warning("freed-elsewhere"), m) for m in resource_warnings(seen))
    finally:
        collector.close()
