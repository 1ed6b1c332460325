"""kvwire.sync: closing a bridge, a SyncServer or a SyncPeer (short or bad timeouts, several
threads, a stuck loop, a start given up on) and the timeouts the blocking waits accept.
Real loopback sockets."""

from __future__ import annotations

import asyncio
import inspect
import socket
import threading
import time
import traceback
import weakref
from typing import Any

import numpy as np
import pytest

import kvwire
import kvwire.aio.client as client_mod
import kvwire.aio.server as server_mod
from kvwire.errors import (
    ConnectionLostError,
    KvwireError,
    TransferAbortedError,
    TransferTimeoutError,
    UsageError,
)
from kvwire.sync import Bridge, PendingPeer, ReceiveHandle, SendHandle, SyncPeer, SyncServer
from tests.conftest import SECRET
from tests.sync_helpers import call_in_thread, refused, until

pytestmark = pytest.mark.timeout(90)

SPEC = kvwire.KVSpec(num_layers=3, num_kv_heads=2, head_dim=16, dtype="float32")

BAD_TIMEOUTS = [float("inf"), float("nan"), -1.0]


async def forever() -> None:
    await asyncio.Event().wait()


# -- 1. close() given None (or another timeout it cannot use) -------------------------------

@pytest.mark.parametrize("timeout", [None, *BAD_TIMEOUTS])
def test_bridge_close_refuses_a_bad_timeout_before_anything_changes(timeout: Any) -> None:
    """close(timeout=None) raised TypeError after marking the bridge closed: the loop kept
    running, and close() again returned at once.  Now UsageError, and nothing changed."""
    bridge = Bridge("bad-close")
    with pytest.raises(UsageError, match="timeout"):
        bridge.close(timeout)
    assert not bridge.closed and bridge._thread.is_alive()
    assert bridge.run(asyncio.sleep(0, "still runs"), 10) == "still runs"
    bridge.close()
    assert bridge.closed and not bridge._thread.is_alive() and bridge.loop.is_closed()


@pytest.mark.parametrize("timeout", [None, *BAD_TIMEOUTS])
def test_server_and_peer_close_refuse_a_bad_timeout_and_can_be_called_again(timeout: Any) -> None:
    server = SyncServer(secret=SECRET)
    peer = SyncPeer("127.0.0.1", server.port, secret=SECRET)
    for thing in (peer, server):
        with pytest.raises(UsageError, match="timeout"):
            thing.close(timeout=timeout)
        assert not thing.bridge.closed and thing.bridge._thread.is_alive()
    assert not server.server.closed and not peer.peer.closed
    peer.close()
    server.close()
    for thing in (peer, server):
        assert not thing.bridge._thread.is_alive() and thing.bridge.loop.is_closed()
    assert server.server.closed and peer.peer.closed and refused(server.port)


# -- 2. the blocking waits given inf / nan --------------------------------------------------

@pytest.mark.parametrize("timeout", BAD_TIMEOUTS)
def test_the_blocking_waits_refuse_a_non_finite_timeout(timeout: float) -> None:
    """As expect() and send() do: UsageError, not OverflowError (inf) or a wait that spins
    without end (nan)."""
    with SyncServer(secret=SECRET) as server, SyncPeer("127.0.0.1", server.port, secret=SECRET) as peer:
        h = server.expect("r")
        s = peer.begin("r", SPEC)
        pending = PendingPeer(server.bridge, "127.0.0.1", server.port, secret=SECRET)
        assert pending.wait(30)
        calls = {
            "ReceiveHandle.wait": lambda: h.wait(timeout),
            "ReceiveHandle.wait_layer": lambda: h.wait_layer(0, timeout),
            "SendHandle.wait": lambda: s.wait(timeout),
            "PendingPeer.wait": lambda: pending.wait(timeout),
        }
        for name, call in calls.items():
            err = call_in_thread(call)
            assert isinstance(err, UsageError) and "timeout" in str(err), (name, err)
        coro = forever()
        err = call_in_thread(lambda: server.bridge.run(coro, timeout))
        assert isinstance(err, UsageError) and "timeout" in str(err), err
        # nothing of it left running on the loop
        assert inspect.getcoroutinestate(coro) == inspect.CORO_CLOSED
        s.abort()
        h.abort()
        pending.result().close()


def test_the_blocking_waits_still_take_none_and_zero() -> None:
    with SyncServer(secret=SECRET) as server:
        h = server.expect("r")
        with pytest.raises(TransferTimeoutError):
            h.wait(0)
        with pytest.raises(TransferTimeoutError):
            h.wait_layer(0, 0)
        assert server.bridge.run(asyncio.sleep(0, 5), None) == 5
        h.abort()


# -- 3. SendHandle.wait() raising the send's error again and again ---------------------------

def test_send_handle_wait_keeps_none_of_its_callers_frames() -> None:
    """The send's error, raised again at every wait(), gathered every caller's frames (its
    traceback grew with each call): the callers' locals stayed alive with it."""
    bridge = Bridge("shared")

    async def fails() -> None:
        raise TransferAbortedError("receiver aborted 'r'")

    handle = SendHandle(bridge, "r", 1)  # as SyncPeer.begin() makes it
    handle._future = bridge.submit(fails())
    refs: list[weakref.ref[Any]] = []
    lengths: list[int] = []

    def step() -> None:
        buffer = np.zeros(1000)  # a caller's local
        refs.append(weakref.ref(buffer))
        try:
            handle.wait(30)
        except KvwireError as exc:
            lengths.append(len(traceback.extract_tb(exc.__traceback__)))

    for _ in range(5):
        step()
    assert len(lengths) == 5 and len(set(lengths)) == 1, lengths
    assert sum(r() is not None for r in refs) <= 1  # (at most the last caller's, until the next wait)
    bridge.close()


# -- 4. close(timeout=0) of a server / peer on its own bridge ---------------------------------

def test_a_server_closed_with_no_time_to_wait_still_closes_its_socket() -> None:
    """close(timeout=0): the server's close was cancelled before it ran, then dropped from
    the bridge's list, so the bridge's close skipped it: the listening socket stayed open."""
    server = SyncServer(secret=SECRET)
    server.close(timeout=0)
    server.bridge._thread.join(30)
    assert not server.bridge._thread.is_alive()
    assert server.server.closed and refused(server.port)


def test_a_peer_closed_with_no_time_to_wait_still_closes_its_connection() -> None:
    with SyncServer(secret=SECRET) as server:
        peer = SyncPeer("127.0.0.1", server.port, secret=SECRET)
        streams = list(peer.peer.streams)
        assert streams and all(s.transport is not None for s in streams)
        peer.close(timeout=0)
        peer.bridge._thread.join(30)
        assert not peer.bridge._thread.is_alive()
        assert all(s.transport is None or s.transport.is_closing() for s in streams)
        # the server sees the connection go
        assert until(lambda: server.bridge.run(_connections(server), 10) == 0)


async def _connections(server: SyncServer) -> int:
    return len(server.server._by_cid)


# -- 5. two threads closing the same bridge --------------------------------------------------

def test_a_second_close_waits_for_the_first_to_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """The second close() returned at once, while the first was still closing: the
    server's socket open and the loop thread running when it returned."""
    closing = threading.Event()
    real_close = server_mod.Server.close

    async def slow_close(self: Any) -> None:  # a close that takes a while (draining streams)
        closing.set()
        await asyncio.sleep(0.5)
        await real_close(self)

    monkeypatch.setattr(server_mod.Server, "close", slow_close)
    bridge = Bridge("shared")
    server = SyncServer(secret=SECRET, bridge=bridge)
    first = threading.Thread(target=bridge.close, kwargs={"timeout": 30})
    first.start()
    assert closing.wait(30)
    bridge.close(timeout=30)
    assert not bridge._thread.is_alive() and server.server.closed and refused(server.port)
    first.join(30)
    assert not first.is_alive()


# -- 6. close() on a stuck loop, with threads waiting on what runs there -----------------------

def test_closing_a_stuck_bridge_releases_every_waiter() -> None:
    """Documented: close() fails every waiter with ConnectionLostError.  A thread in
    SendHandle.wait() or Bridge.run() with no timeout stayed blocked until the loop
    unstuck (forever, if it never does)."""
    bridge = Bridge("stuck")
    receive = ReceiveHandle(bridge, "never", None)  # as SyncServer.expect() makes it
    send = SendHandle(bridge, "r", 1)  # as SyncPeer.begin() makes it
    send._future = bridge.submit(forever())
    unstick = threading.Event()
    errors: dict[str, BaseException | str] = {}
    calls = {"receive": lambda: receive.wait(), "send": lambda: send.wait(), "run": lambda: bridge.run(forever())}
    threads = [threading.Thread(target=lambda n=n, c=c: errors.__setitem__(n, call_in_thread(c, 60)), daemon=True)
               for n, c in calls.items()]
    try:
        for t in threads:
            t.start()
        time.sleep(0.2)  # (they wait)
        bridge.call_soon(unstick.wait, 60)  # the loop is stuck until the test lets it go
        bridge.close(timeout=0.2)
        for t in threads:
            t.join(30)  # while the loop is still stuck
        assert not any(t.is_alive() for t in threads), errors
        assert all(isinstance(e, ConnectionLostError) for e in errors.values()), errors
    finally:
        unstick.set()
    bridge._thread.join(30)
    assert not bridge._thread.is_alive() and bridge.loop.is_closed()


# -- 7. a start given up on (start_timeout) that completes afterwards --------------------------

def test_a_server_started_after_its_start_timed_out_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a shared bridge whose loop is busy once the start completed (past start_timeout):
    the caller got TransferTimeoutError and the server, listening and owned by the bridge,
    stayed open until the bridge closed."""
    bridge = Bridge("shared")
    gate = threading.Event()
    made: list[Any] = []
    real_start = server_mod.Server.start

    async def start_then_loop_busy(self: Any, *a: Any, **kw: Any) -> Any:
        made.append(self)
        r = await real_start(self, *a, **kw)
        asyncio.get_running_loop().call_soon(gate.wait, 30)  # the loop's next work holds it up
        return r

    monkeypatch.setattr(server_mod.Server, "start", start_then_loop_busy)
    try:
        with pytest.raises(TransferTimeoutError):
            SyncServer(secret=SECRET, bridge=bridge, start_timeout=0.3)
    finally:
        gate.set()
    assert len(made) == 1
    assert until(lambda: made[0].closed)
    assert refused(made[0].port) and id(made[0]) not in bridge._owned
    bridge.close()


def test_a_peer_connected_after_its_start_timed_out_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    with SyncServer(secret=SECRET) as server:
        bridge = Bridge("shared")
        gate = threading.Event()
        made: list[Any] = []
        real_aenter = client_mod.Peer.__aenter__

        async def aenter_then_loop_busy(self: Any) -> Any:
            made.append(self)
            r = await real_aenter(self)
            asyncio.get_running_loop().call_soon(gate.wait, 30)
            return r

        monkeypatch.setattr(client_mod.Peer, "__aenter__", aenter_then_loop_busy)
        try:
            with pytest.raises(TransferTimeoutError):
                SyncPeer("127.0.0.1", server.port, secret=SECRET, bridge=bridge, start_timeout=0.3)
        finally:
            gate.set()
        assert len(made) == 1
        assert until(lambda: server.bridge.run(_connections(server), 10) == 0)
        assert made[0].closed and id(made[0]) not in bridge._owned
        bridge.close()


# -- the rest of the timeouts, and the connect's error --------------------------------------

@pytest.mark.parametrize("timeout", BAD_TIMEOUTS)
def test_abort_and_cancel_refuse_a_bad_timeout_before_anything_changes(timeout: float) -> None:
    """ReceiveHandle.abort(inf) raised OverflowError after failing the receive;
    PendingPeer.cancel(inf) did nothing, silently."""
    bridge = Bridge("shared")
    try:
        receive = ReceiveHandle(bridge, "r", None)  # as SyncServer.expect() makes it
        with pytest.raises(UsageError, match="timeout"):
            receive.abort("no", timeout=timeout)
        assert receive.error is None  # not failed: nothing changed
        pending = PendingPeer(bridge, "127.0.0.1", 9, secret=SECRET)
        with pytest.raises(UsageError, match="timeout"):
            pending.cancel(timeout)
    finally:
        bridge.close()


def test_a_failed_connect_keeps_none_of_its_callers_frames() -> None:
    """PendingPeer.result() raised the connect's stored error again at every call, its
    traceback growing with each (every caller's frames kept alive)."""
    bridge = Bridge("shared")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pending = PendingPeer(bridge, "127.0.0.1", port, secret=SECRET)
    assert pending.wait(30)
    lengths = []
    for _ in range(4):
        try:
            pending.result()
        except KvwireError as exc:
            lengths.append(len(traceback.extract_tb(exc.__traceback__)))
    assert len(lengths) == 4 and len(set(lengths)) == 1, lengths
    bridge.close()
