"""kvwire.sync: the thread-safe bridge, used from many threads over real loopback sockets."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import threading
import weakref
from typing import Any

import numpy as np
import pytest

import kvwire
from kvwire.aio import _stream
from kvwire.errors import (
    ConnectionLostError,
    KvwireError,
    TransferAbortedError,
    TransferTimeoutError,
    UsageError,
)
from kvwire.paged import PagedDestination, PagedSpec, gather_layer, layer_rows
from kvwire.sync import Bridge, ReceiveHandle, SendHandle, SyncPeer, SyncServer
from kvwire.testing import FaultPlan, FaultProxy, Faults
from tests.conftest import SECRET, make_layers

pytestmark = pytest.mark.timeout(90)

SPEC = kvwire.KVSpec(num_layers=3, num_kv_heads=2, head_dim=16, dtype="float32")


def run_threads(targets: list[Any]) -> list[BaseException]:
    errors: list[BaseException] = []

    def wrap(fn: Any) -> Any:
        def inner() -> None:
            try:
                fn()
            except BaseException as exc:
                errors.append(exc)
        return inner

    threads = [threading.Thread(target=wrap(t)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a thread is stuck"
    return errors


def test_many_threads_send_and_receive_layer_by_layer() -> None:
    n = 12
    data = {f"r{i}": make_layers(3, 5 + i, 2, 16, "float32", seed=i) for i in range(n)}
    got: dict[str, list[Any]] = {}
    with SyncServer(secret=SECRET) as server, SyncPeer("127.0.0.1", server.port, secret=SECRET, streams=2) as peer:
        handles = {rid: server.expect(rid, timeout=30) for rid in data}

        def producer(rid: str) -> Any:
            def run() -> None:
                h = peer.begin(rid, SPEC)
                for k, v in data[rid]:
                    h.send_layer(k, v)
                receipt = h.wait(30)
                assert receipt.request_id == rid
            return run

        def consumer(rid: str) -> Any:
            def run() -> None:
                layers = [handles[rid].wait_layer(i, timeout=30) for i in (2, 0, 1)]
                handles[rid].wait(30)
                got[rid] = sorted(layers, key=lambda layer: layer.index)
            return run

        errors = run_threads([producer(r) for r in data] + [consumer(r) for r in data])
    assert errors == []
    for rid, layers in data.items():
        assert [(g.k.tobytes(), g.v.tobytes()) for g in got[rid]] == [(k.tobytes(), v.tobytes()) for k, v in layers]


def test_the_server_keeps_no_handle_its_caller_let_go_of() -> None:
    """A handle whose transfer arrived, once its caller lets go of it, is freed with the
    layers it holds: a long-running server (one expect() per request) does not grow."""
    with SyncServer(secret=SECRET) as server, SyncPeer("127.0.0.1", server.port, secret=SECRET) as peer:
        refs = []
        for i in range(3):
            h = server.expect(f"r{i}", timeout=30)
            peer.send(f"r{i}", SPEC, make_layers(3, 4, 2, 16, "float32", seed=i), timeout=30)
            h.wait(30)
            refs.append(weakref.ref(h.wait_layer(0).k))
            del h
        gc.collect()
        assert all(r() is None for r in refs)


def test_wait_times_out_and_then_still_completes() -> None:
    with SyncServer(secret=SECRET) as server, SyncPeer("127.0.0.1", server.port, secret=SECRET) as peer:
        h = server.expect("late")
        with pytest.raises(TransferTimeoutError):
            h.wait_layer(0, timeout=0.05)
        peer.send("late", SPEC, make_layers(3, 4, 2, 16, "float32"), timeout=30)
        h.wait(30)
        assert h.done and h.layers_done() == 3


def test_a_wait_that_runs_out_names_a_serving_engines_id_whole_and_shortens_a_huge_one() -> None:
    engine_id = "never-sent#prompt:" + "0123456789abcdef" * 2 + "-cmpl-" + "f" * 32  # 88 characters
    huge = "x" * 60000
    with SyncServer(secret=SECRET) as server:
        for rid in (engine_id, huge):
            h = server.expect(rid)
            with pytest.raises(TransferTimeoutError) as failed:
                h.wait_layer(0, timeout=0.01)
            h.abort()
            text = str(failed.value)
            assert "not ready after" in text
            if rid is engine_id:
                assert repr(engine_id) in text
            else:
                assert len(text) < 400


def test_send_timeout_bounds_the_send_as_peer_send_does() -> None:
    """SyncPeer.send(timeout=) is Peer.send(timeout=): the send times out and the receiver
    is told of a timeout, not of a sender cancelled by a bridge that gave up waiting."""
    first = make_layers(1, 4, 2, 16, "float32")[0]

    async def stalled() -> Any:
        yield first
        await asyncio.Event().wait()  # the next layer never comes

    with SyncServer(secret=SECRET) as server, SyncPeer("127.0.0.1", server.port, secret=SECRET) as peer:
        h = server.expect("slow")
        with pytest.raises(TransferTimeoutError, match=r"did not complete in 0\.2 s"):
            peer.send("slow", SPEC, stalled(), timeout=0.2)
        with pytest.raises(TransferTimeoutError, match=r"did not complete in 0\.2 s"):
            h.wait(30)


def one_layer_received(server: SyncServer, peer: SyncPeer, request_id: str) -> tuple[ReceiveHandle, SendHandle]:
    """A transfer of ``SPEC`` begun, its first layer sent and received: its receive and send handles."""
    h = server.expect(request_id)
    s = peer.begin(request_id, SPEC)
    k, v = make_layers(1, 4, 2, 16, "float32")[0]
    s.send_layer(k, v)
    h.wait_layer(0, timeout=30)
    return h, s


def test_receiver_abort_fails_waiters_and_sender() -> None:
    with SyncServer(secret=SECRET) as server, SyncPeer("127.0.0.1", server.port, secret=SECRET) as peer:
        h, s = one_layer_received(server, peer, "gone")
        h.abort("request cancelled")
        with pytest.raises(TransferAbortedError):
            h.wait(5)
        k, v = make_layers(1, 4, 2, 16, "float32")[0]
        s.send_layer(k, v)
        s.send_layer(k, v)
        with pytest.raises(KvwireError):
            s.wait(30)


def test_sender_abort() -> None:
    with SyncServer(secret=SECRET) as server, SyncPeer("127.0.0.1", server.port, secret=SECRET) as peer:
        s = peer.begin("never", SPEC)
        s.abort()
        with pytest.raises(TransferAbortedError):
            s.wait(5)
        with pytest.raises(UsageError):
            for _ in range(4):
                s.send_layer(*make_layers(1, 2, 2, 16, "float32")[0])


def test_close_releases_every_waiting_thread() -> None:
    server = SyncServer(secret=SECRET)
    handles = [server.expect(f"x{i}") for i in range(8)]
    seen: list[BaseException] = []
    lock = threading.Lock()

    def waiter(h: Any) -> Any:
        def run() -> None:
            try:
                h.wait()
            except KvwireError as exc:
                with lock:
                    seen.append(exc)
        return run

    threads = [threading.Thread(target=waiter(h)) for h in handles]
    for t in threads:
        t.start()
    server.close()
    server.close()  # idempotent
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    assert len(seen) == 8 and all(isinstance(e, ConnectionLostError | TransferAbortedError) for e in seen)
    assert not server.bridge._thread.is_alive()
    with pytest.raises(ConnectionLostError):
        server.expect("after")


def test_close_lists_its_handles_while_another_thread_expects() -> None:
    """close() lists the handles to fail while expect() may add one on another thread: an
    expect() that comes while the list is being made waits for it, so close() neither
    raises ("Set changed size during iteration") nor leaves a handle waiting."""
    server = SyncServer(secret=SECRET)
    handles = [server.expect(f"x{i}") for i in range(4)]
    late: list[Any] = []

    def expect_late() -> None:
        # the server closed first: told at once (ConnectionLostError), nothing to wait for
        with contextlib.suppress(ConnectionLostError):
            late.append(server.expect("late"))

    class Interrupted(weakref.WeakSet):  # type: ignore[type-arg]
        """Another thread expects while close() is in the middle of listing the set."""

        def __iter__(self) -> Any:
            for i, item in enumerate(super().__iter__()):
                if i == 1:
                    other = threading.Thread(target=expect_late)
                    other.start()
                    other.join(0.5)  # blocked until the list is made
                yield item

    server._handles = Interrupted(handles)
    server.close()
    for h in handles + late:
        with pytest.raises((ConnectionLostError, TransferAbortedError)):
            h.wait(10)


def test_closing_a_bridge_whose_loop_is_stuck_releases_its_waiters() -> None:
    """A shared bridge closed while its loop is stuck (cancelling what runs on it times
    out): a thread waiting on a receive with no timeout is released all the same."""
    import time

    bridge = Bridge("stuck")
    bridge.call_soon(time.sleep, 2)  # the loop is busy for longer than close() waits for it
    h = ReceiveHandle(bridge, "never", None)  # as SyncServer.expect() makes it
    seen: list[BaseException] = []

    def wait() -> None:
        try:
            h.wait()
        except KvwireError as exc:
            seen.append(exc)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    bridge.close(timeout=0.2)
    waiter.join(10)
    assert not waiter.is_alive() and len(seen) == 1 and isinstance(seen[0], ConnectionLostError)
    bridge._thread.join(10)  # the loop, unstuck, ends what it still ran
    assert not bridge._thread.is_alive() and bridge.loop.is_closed()


def _error_of_a_call_blocked_when_the_bridge_closes(bridge: Bridge, call: Any, started: threading.Event) -> BaseException:
    seen: list[BaseException] = []

    def blocked() -> None:
        try:
            call()
        except BaseException as exc:
            seen.append(exc)

    t = threading.Thread(target=blocked)
    t.start()
    assert started.wait(30)
    bridge.close()
    t.join(30)
    assert not t.is_alive() and len(seen) == 1
    return seen[0]


def test_closing_a_bridge_fails_a_blocked_run_with_a_kvwire_error() -> None:
    """A thread blocked in Bridge.run when the bridge closes gets ConnectionLostError, not
    concurrent.futures.CancelledError."""
    bridge = Bridge("shared")
    started = threading.Event()

    async def forever() -> None:
        started.set()
        await asyncio.Event().wait()

    err = _error_of_a_call_blocked_when_the_bridge_closes(bridge, lambda: bridge.run(forever()), started)
    assert isinstance(err, ConnectionLostError), repr(err)


def test_closing_a_bridge_fails_a_blocked_sync_send_with_a_kvwire_error() -> None:
    bridge = Bridge("shared")
    started = threading.Event()
    first = make_layers(1, 4, 2, 16, "float32")[0]

    async def stalled() -> Any:
        yield first
        started.set()
        await asyncio.Event().wait()  # the next layer never comes

    with SyncServer(secret=SECRET) as server:
        peer = SyncPeer("127.0.0.1", server.port, secret=SECRET, bridge=bridge)
        server.expect("stalled")
        err = _error_of_a_call_blocked_when_the_bridge_closes(
            bridge, lambda: peer.send("stalled", SPEC, stalled()), started)
        assert isinstance(err, ConnectionLostError), repr(err)
        assert peer.peer.closed  # closed with the bridge: no socket of it is left open
        peer.close()


def test_a_send_handle_waiting_when_its_bridge_closes_fails_with_connection_lost() -> None:
    """kvwire.sync says close() fails every waiter with ConnectionLostError: a SendHandle's
    wait() said TransferAbortedError when the bridge cancelled its send (one the peer's own
    close did not end first); abort() still says TransferAbortedError."""
    bridge = Bridge("shared")
    started = threading.Event()

    async def forever() -> None:  # a send that nothing but the bridge's close ends
        started.set()
        await asyncio.Event().wait()

    handle = SendHandle(bridge, "r", 1)  # as SyncPeer.begin() makes it
    handle._future = bridge.submit(forever())
    err = _error_of_a_call_blocked_when_the_bridge_closes(bridge, lambda: handle.wait(30), started)
    assert isinstance(err, ConnectionLostError), repr(err)

    other = Bridge("other")
    aborted = SendHandle(other, "a", 1)
    aborted._future = other.submit(forever())
    aborted.abort()
    other.close()
    with pytest.raises(TransferAbortedError):
        aborted.wait(5)


def test_closing_a_shared_bridge_closes_the_servers_and_peers_on_it() -> None:
    """A bridge closed before the SyncServer and SyncPeer on it closes them: their sockets,
    the listening one too, do not outlive it (their close() afterwards has nothing to do)."""
    bridge = Bridge("shared")
    server = SyncServer(secret=SECRET, bridge=bridge)
    peer = SyncPeer("127.0.0.1", server.port, secret=SECRET, bridge=bridge, streams=2)
    h = server.expect("a")
    peer.send("a", SPEC, make_layers(3, 4, 2, 16, "float32"), timeout=30)
    h.wait(30)
    pending = server.expect("never")
    bridge.close()
    assert server.server.closed and peer.peer.closed
    assert not bridge._thread.is_alive()
    with pytest.raises(ConnectionLostError):
        pending.wait(10)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", server.port), timeout=10).close()
    peer.close()
    server.close()


def test_misuse_is_a_usage_error_at_once() -> None:
    """As the async API says it: UsageError when the call is made, not an AttributeError
    or a wait that can only time out."""
    with SyncServer(secret=SECRET) as server, SyncPeer("127.0.0.1", server.port, secret=SECRET) as peer:
        for spec in (None, "spec", SPEC.num_layers):
            with pytest.raises(UsageError, match="spec must be a kvwire"):
                peer.begin("x", spec)  # type: ignore[arg-type]
            with pytest.raises(UsageError, match="spec must be a kvwire"):
                peer.send("x", spec, make_layers(3, 4, 2, 16, "float32"), timeout=30)  # type: ignore[arg-type]
        for request_id in (5, b"x", ""):
            with pytest.raises(UsageError, match="request_id must be a non-empty str"):
                server.expect(request_id, timeout=30)  # type: ignore[arg-type]
        for timeout in (-1, 0, float("nan"), float("inf")):
            with pytest.raises(UsageError, match="timeout"):
                server.expect("x", timeout=timeout)
            with pytest.raises(UsageError, match="timeout"):
                peer.send("x", SPEC, make_layers(3, 4, 2, 16, "float32"), timeout=timeout)


def test_blocking_call_from_the_loop_thread_is_refused() -> None:
    bridge = Bridge()
    try:
        async def inner() -> None:
            bridge.run(_noop())

        with pytest.raises(UsageError, match="loop thread"):
            bridge.run(inner(), 5)
    finally:
        bridge.close()


async def _noop() -> None:
    return None


def test_closing_a_sync_server_or_peer_from_the_bridges_loop_is_refused() -> None:
    """It cannot wait for the loop it runs on: it said nothing and closed nothing, and the
    server went on listening (documented: refused with UsageError)."""
    bridge = Bridge()
    try:
        server = SyncServer(secret=SECRET, bridge=bridge)
        peer = SyncPeer("127.0.0.1", server.port, secret=SECRET, bridge=bridge)

        async def close_both_here() -> list[str]:
            refused = []
            for thing in (peer, server):
                try:
                    thing.close()
                except UsageError:
                    refused.append(type(thing).__name__)
            return refused

        assert bridge.run(close_both_here(), 10) == ["SyncPeer", "SyncServer"]
        assert not server.server.closed
        peer.close()
        server.close()
        assert server.server.closed
    finally:
        bridge.close()


def test_a_receive_aborted_as_soon_as_it_was_made_writes_nothing() -> None:
    """abort() right after expect(), before the loop even began the receive: the transfer
    that comes later is not received into the caller's blocks (the caller gave them up)."""
    spec = PagedSpec(num_layers=2, block_shape=(2, 8, 16), dtype="float16")
    rng = np.random.default_rng(3)
    src = [rng.standard_normal((6, 2, 8, 16)).astype(np.float16) for _ in range(2)]
    dst = [np.zeros((9, 2, 8, 16), np.float16) for _ in range(2)]
    with SyncServer(secret=SECRET) as server, SyncPeer("127.0.0.1", server.port, secret=SECRET) as peer:
        for attempt in range(5):  # the loop may begin the receive before or after abort()
            h = server.expect(f"p{attempt}", into=PagedDestination(spec, dst, [8, 0, 3]))
            h.abort("request cancelled")
            s = peer.begin(f"p{attempt}", spec.wire_spec())
            for layer in range(2):
                s.send_layer(*gather_layer(spec, src[layer], [5, 1, 2]))
            with contextlib.suppress(KvwireError):
                s.wait(0.5)  # unclaimed: taken by nobody (or aborted, if it had been claimed)
            with pytest.raises(TransferAbortedError):
                h.wait(5)
            assert not h.done and h.layers_done() == 0
            assert not any(dst[layer].any() for layer in range(2)), attempt


def test_abort_returns_once_the_transfer_is_stopped() -> None:
    """abort() from the caller's thread returns only once the loop stopped the transfer,
    so the memory it was receiving into may be reused right away."""
    with SyncServer(secret=SECRET) as server, SyncPeer("127.0.0.1", server.port, secret=SECRET) as peer:
        for attempt in range(3):
            h, s = one_layer_received(server, peer, f"live{attempt}")
            assert h.abort("request cancelled") is True
            assert h.transfer._error is not None  # stopped on the loop before abort() returned
            with pytest.raises(KvwireError):
                s.wait(30)


def test_abort_says_when_the_loop_did_not_stop_the_transfer_in_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loop held up elsewhere past abort()'s timeout: abort() returned as if the transfer
    were stopped, and a caller reusing the destination's memory could see late chunks
    written into it. It returns False then."""
    with SyncServer(secret=SECRET) as server, SyncPeer("127.0.0.1", server.port, secret=SECRET) as peer:
        h, s = one_layer_received(server, peer, "held")
        held: list[Any] = []
        monkeypatch.setattr(h._bridge, "call_soon", held.append)  # the loop never gets to it
        assert h.abort("request cancelled", timeout=0.05) is False
        monkeypatch.undo()
        for fn in held:
            h._bridge.call_soon(fn)
        with pytest.raises(KvwireError):
            s.wait(30)


def test_waiting_for_a_layer_past_the_transfers_last_is_an_error_once_it_arrives() -> None:
    """Without num_layers, a wait for layer 3 of what turns out to be a 3-layer transfer
    ends with a UsageError when the transfer arrives, not at its timeout."""
    with SyncServer(secret=SECRET) as server, SyncPeer("127.0.0.1", server.port, secret=SECRET) as peer:
        h = server.expect("three")
        s = peer.begin("three", SPEC)
        for k, v in make_layers(3, 4, 2, 16, "float32"):
            s.send_layer(k, v)
        with pytest.raises(UsageError, match="the transfer has 3 layers"):
            h.wait_layer(3, timeout=20)
        s.wait(30)
        assert h.wait_layer(2, timeout=5).index == 2


def test_paged_receive_into_engine_blocks_from_threads() -> None:
    spec = PagedSpec(num_layers=2, block_shape=(2, 8, 16), dtype="float16")
    rng = np.random.default_rng(0)
    src = [rng.standard_normal((6, 2, 8, 16)).astype(np.float16) for _ in range(2)]
    dst = [np.zeros((9, 2, 8, 16), np.float16) for _ in range(2)]
    with SyncServer(secret=SECRET) as server, SyncPeer("127.0.0.1", server.port, secret=SECRET, chunk_bytes=700) as peer:
        h = server.expect("p", into=PagedDestination(spec, dst, [8, 0, 3]))
        s = peer.begin("p", spec.wire_spec())
        for layer in range(2):
            s.send_layer(*gather_layer(spec, src[layer], [5, 1, 2]))
        for layer in range(2):
            h.wait_layer(layer, timeout=30)
        s.wait(30)
    for layer in range(2):
        assert dst[layer][[8, 0, 3]].tobytes() == src[layer][[5, 1, 2]].tobytes()
        assert not dst[layer][[1, 2, 4, 5, 6, 7]].any()


@pytest.mark.parametrize("compiled_queue", [True, False])
def test_closing_the_peer_lets_go_of_blocks_a_stuck_send_holds(compiled_queue: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Layers sent from the blocks where they lie (``layer_rows``, as the vLLM connector
    sends them) over a path that stalls mid-transfer: the wait times out with the blocks
    still held.  Aborting the send alone leaves what the streams had queued (they would
    still write it); closing the peer lets go of every block (the queues drop what they
    held), so an engine may hand the blocks back: this is what the connector does after a
    send that failed."""
    if not compiled_queue:
        monkeypatch.setattr(_stream, "_sendq", None)
    spec = PagedSpec(num_layers=2, block_shape=(2, 16, 8, 128), dtype="float16")  # 64 KiB blocks, 5 MiB in all
    rng = np.random.default_rng(1)
    caches = [rng.standard_normal((48, 2, 16, 8, 128), dtype=np.float32).astype(np.float16) for _ in range(2)]
    refs = [weakref.ref(c) for c in caches]
    stall = FaultPlan(forward=Faults(stall_at=300_000))
    bridge = Bridge("proxy")
    with SyncServer(secret=SECRET) as server:
        proxy = FaultProxy("127.0.0.1", server.port, plan=lambda i: stall)
        bridge.run(proxy.start(), 10)
        try:
            peer = SyncPeer("127.0.0.1", proxy.port, secret=SECRET, chunk_bytes=64 * 1024)
            server.expect("stuck")
            send = peer.begin("stuck", spec.wire_spec())
            for cache in caches:
                send.send_layer(*layer_rows(spec, cache, np.arange(40)))
            del caches, cache
            with pytest.raises(TransferTimeoutError):
                send.wait(0.5)
            assert proxy.statistics().bytes_forward <= 300_000  # the transfer is stuck
            send.abort()
            del send
            peer.close()
            gc.collect()
            assert [r() for r in refs] == [None, None]
        finally:
            bridge.run(proxy.close(), 10)
            bridge.close()
