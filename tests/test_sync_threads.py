"""kvwire.sync: what the blocking API does around a bridge's loop thread: a receive aborted
while the bridge closes, a caller interrupted while it waits, a forked child, closes racing
each other, and arguments it refuses at once.  Real loopback sockets."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import select
import signal
import socket
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import kvwire
from kvwire.aio import _sync
from kvwire.errors import ConnectionLostError, KvwireError, UsageError
from kvwire.paged import PagedDestination, PagedSpec, gather_layer
from kvwire.sync import Bridge, PendingPeer, SyncPeer, SyncServer
from tests.conftest import SECRET
from tests.sync_helpers import call_in_thread, until

pytestmark = pytest.mark.timeout(90)

SPEC = kvwire.KVSpec(num_layers=3, num_kv_heads=2, head_dim=16, dtype="float32")


@contextlib.contextmanager
def held(bridge: Bridge) -> Iterator[threading.Event]:
    """``bridge``'s loop held up by a callback until the block ends (or the event is set)."""
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        release.wait(60)

    bridge.loop.call_soon_threadsafe(hold)
    assert entered.wait(30)
    try:
        yield release
    finally:
        release.set()


# -- 1. ReceiveHandle.abort() on a bridge that is closing ------------------------------------

PAGED = PagedSpec(num_layers=3, block_shape=(2, 8, 16), dtype="float32")
IDS = list(range(16))


def _receive_held_up(bridge: Bridge, peer: SyncPeer, server: SyncServer,
                     dst: list[np.ndarray]) -> tuple[Any, threading.Event, contextlib.ExitStack]:
    """A paged receive into ``dst`` whose layer 0 arrived and whose layers 1 and 2 wait in
    the socket while ``bridge``'s loop is held up: (its handle, the hold's release, the
    stack that releases it)."""
    rng = np.random.default_rng(0)
    src = [rng.standard_normal((16, 2, 8, 16)).astype(np.float32) + 10 for _ in range(3)]
    h = server.expect("r", into=PagedDestination(PAGED, dst, IDS), timeout=60)
    s = peer.begin("r", PAGED.wire_spec())
    s.send_layer(*gather_layer(PAGED, src[0], IDS))
    h.wait_layer(0, 30)
    stack = contextlib.ExitStack()
    release = stack.enter_context(held(bridge))
    s.send_layer(*gather_layer(PAGED, src[1], IDS))
    s.send_layer(*gather_layer(PAGED, src[2], IDS))
    return h, release, stack


@pytest.mark.parametrize("closing", ["under way", "given up"])
def test_abort_on_a_closing_bridge_returns_true_only_once_nothing_writes(closing: str) -> None:
    """abort() returned True as soon as the bridge was marked closed, while its loop (held
    up, its close under way in another thread or given up on) still ran and then wrote the
    chunks waiting in the socket into the destination the caller had been told to reuse."""
    bridge = Bridge("shared")
    server = SyncServer(secret=SECRET, bridge=bridge)
    dst = [np.zeros((16, 2, 8, 16), np.float32) for _ in range(3)]
    with SyncPeer("127.0.0.1", server.port, secret=SECRET) as peer:
        h, release, stack = _receive_held_up(bridge, peer, server, dst)
        with stack:
            closer = threading.Thread(target=bridge.close, kwargs={"timeout": 30 if closing == "under way" else 0})
            closer.start()
            if closing == "given up":
                closer.join(30)
                assert not closer.is_alive() and bridge._thread.is_alive()
            assert until(lambda: bridge.closed, within=30)
            assert h.abort("reuse the blocks", timeout=0.05) is False  # the loop is held: it may still write
            release.set()
            assert h.abort("reuse the blocks", timeout=30) is True
        for d in dst:
            d[:] = 0  # reused
        closer.join(30)
        bridge._thread.join(30)
        assert not bridge._thread.is_alive()
        assert not any(d.any() for d in dst)


def test_abort_after_the_loop_ended_returns_true_at_once() -> None:
    bridge = Bridge("shared")
    server = SyncServer(secret=SECRET, bridge=bridge)
    h = server.expect("r")
    bridge.close()
    assert not bridge._thread.is_alive()
    assert h.abort(timeout=0) is True


# -- 2. a caller interrupted while it waits --------------------------------------------------

class Interrupted(BaseException):
    """Raised into a waiting thread, as a KeyboardInterrupt is."""


def test_an_interrupted_send_does_not_go_on_in_the_background(monkeypatch: pytest.MonkeyPatch) -> None:
    """SyncPeer.send() interrupted while it waited (a KeyboardInterrupt) went on sending: the
    receiver completed a transfer holding the arrays the caller had taken back."""
    layers = [(np.full((4, 2, 16), i, np.float32), np.full((4, 2, 16), i, np.float32)) for i in range(3)]
    with SyncServer(secret=SECRET) as server, SyncPeer("127.0.0.1", server.port, secret=SECRET) as peer:
        h = server.expect("r", timeout=60)
        more = asyncio.Event()

        async def produce() -> Any:
            yield layers[0]
            await more.wait()  # the rest comes after the caller was interrupted
            for layer in layers[1:]:
                yield layer

        def interrupted_wait(fut: Any, timeout: float | None) -> bool:
            h.wait_layer(0, 30)  # the send is under way
            raise Interrupted

        monkeypatch.setattr(_sync, "wait_done", interrupted_wait)
        with pytest.raises(Interrupted):
            peer.send("r", SPEC, produce(), timeout=60)
        monkeypatch.undo()
        peer.bridge.loop.call_soon_threadsafe(more.set)
        with pytest.raises(KvwireError):
            h.wait(30)
        assert not h.done
        # the peer goes on
        h2 = server.expect("r2", timeout=60)
        assert peer.send("r2", SPEC, layers, timeout=60).request_id == "r2"
        h2.wait(30)


def test_an_interrupted_run_cancels_what_it_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    bridge = Bridge("shared")
    try:
        started, ended = threading.Event(), []

        async def work() -> None:
            started.set()
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                ended.append("cancelled")
                raise

        def interrupted_wait(fut: Any, timeout: float | None) -> bool:
            assert started.wait(30)
            raise Interrupted

        monkeypatch.setattr(_sync, "wait_done", interrupted_wait)
        with pytest.raises(Interrupted):
            bridge.run(work())
        monkeypatch.undo()
        assert until(lambda: ended == ["cancelled"], within=30)
    finally:
        bridge.close()


# -- 3. a forked child ------------------------------------------------------------------------

def _in_a_forked_child(calls: dict[str, Any], within: float = 30.0) -> dict[str, str]:
    """Run ``calls`` in a child made by fork(): what each raised ("Type: message") or
    "returned".  A child still blocked after ``within`` s is killed (its results so far)."""
    r, w = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # (fork() in a process with threads)
        pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(r)
            for name, call in calls.items():
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    try:
                        call()
                        out = "returned"
                    except BaseException as exc:
                        out = f"{type(exc).__name__}: {exc}"
                    gc.collect()  # a coroutine left never awaited says so now
                out += "".join(f" [warning: {m.message}]" for m in caught)
                os.write(w, f"{name}\t{out}".replace("\n", " ").encode() + b"\n")
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    end = time.monotonic() + within
    try:
        while True:
            ready, _, _ = select.select([r], [], [], max(0.0, end - time.monotonic()))
            if not ready:
                break
            chunk = os.read(r, 65536)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(r)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    return dict(line.split("\t", 1) for line in data.decode().splitlines())


def test_in_a_forked_child_every_call_is_refused_naming_the_fork() -> None:
    """A SyncPeer or SyncServer used in a child made by fork() hung there for good (the loop
    thread runs in the parent only), whatever timeout it was given."""
    layers = [(np.zeros((4, 2, 16), np.float32), np.zeros((4, 2, 16), np.float32))] * 3
    with SyncServer(secret=SECRET) as server, SyncPeer("127.0.0.1", server.port, secret=SECRET) as peer:
        h = server.expect("parent's", timeout=60)
        s = peer.begin("parent's", SPEC)
        pending = PendingPeer(server.bridge, "127.0.0.1", server.port, secret=SECRET)
        calls = {
            "SyncPeer.send": lambda: peer.send("child's", SPEC, layers, timeout=2),
            "SyncPeer.begin": lambda: peer.begin("child's", SPEC),
            "SyncPeer.write_marks": lambda: peer.write_marks(2),
            "SyncServer.expect": lambda: server.expect("child's", timeout=2),
            "ReceiveHandle.wait": lambda: h.wait(None),
            "ReceiveHandle.wait_layer": lambda: h.wait_layer(0, None),
            "ReceiveHandle.abort": lambda: h.abort(timeout=2),
            "SendHandle.send_layer": lambda: s.send_layer(*layers[0]),
            "SendHandle.wait": lambda: s.wait(None),
            "SendHandle.abort": lambda: s.abort(),
            "PendingPeer.wait": lambda: pending.wait(None),
            "PendingPeer.cancel": lambda: pending.cancel(2),
            "Bridge.run": lambda: server.bridge.run(asyncio.sleep(0), 2),
            "SyncPeer.close": lambda: peer.close(2),
            "SyncServer.close": lambda: server.close(2),
            "SyncPeer(bridge=)": lambda: SyncPeer("127.0.0.1", server.port, secret=SECRET, bridge=server.bridge),
            "SyncServer(bridge=)": lambda: SyncServer(secret=SECRET, bridge=server.bridge),
        }
        got = _in_a_forked_child(calls)
        assert set(got) == set(calls), got
        for name, out in got.items():
            assert out.startswith("UsageError: ") and "fork()" in out and "warning" not in out, (name, out)
        # the parent's go on
        for k, v in layers:
            s.send_layer(k, v)
        s.wait(30)
        h.wait(30)
        assert pending.wait(30)
        pending.result().close()


# -- 4. SyncPeer.close() on a shared bridge held up elsewhere ---------------------------------


def test_closing_a_peer_on_a_held_up_shared_bridge_fails_its_waiters() -> None:
    """Documented: close() fails every waiter with ConnectionLostError, a loop held up
    elsewhere too.  SyncServer.close() did; SyncPeer.close() left the threads waiting in
    SendHandle.wait() and SyncPeer.send() waiting until the loop was free again."""
    layer = (np.zeros((4, 2, 16), np.float32), np.zeros((4, 2, 16), np.float32))
    bridge = Bridge("shared")
    try:
        with SyncServer(secret=SECRET) as server:
            peer = SyncPeer("127.0.0.1", server.port, secret=SECRET, bridge=bridge)
            h1 = server.expect("handle", timeout=60)
            s = peer.begin("handle", SPEC)
            s.send_layer(*layer)
            h1.wait_layer(0, 30)
            h2 = server.expect("call", timeout=60)
            more = asyncio.Event()

            async def produce() -> Any:
                yield layer
                await more.wait()

            waiters: dict[str, list[BaseException | str]] = {"SendHandle.wait": [], "SyncPeer.send": []}
            calls = {"SendHandle.wait": lambda: s.wait(None),
                     "SyncPeer.send": lambda: peer.send("call", SPEC, produce(), timeout=60)}
            threads = [threading.Thread(target=lambda n=n: waiters[n].append(call_in_thread(calls[n], 60)),
                                        daemon=True) for n in calls]
            for t in threads:
                t.start()
            h2.wait_layer(0, 30)
            with held(bridge):
                peer.close(timeout=0.05)
                for t in threads:
                    t.join(10)
                got = {n: w[0] if w else "blocked" for n, w in waiters.items()}
                for name, err in got.items():
                    assert isinstance(err, ConnectionLostError), (name, err)
            assert until(lambda: peer.peer.closed, within=30)
    finally:
        bridge.close()


# -- 5. PendingPeer.cancel() on the bridge's loop thread --------------------------------------

def test_pending_peer_cancel_from_the_loop_thread_is_refused() -> None:
    """It did nothing there, silently: the connect went on, though cancel() returned."""
    listener = socket.socket()  # accepts, never answers the handshake
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    bridge = Bridge("shared")
    try:
        pending = PendingPeer(bridge, "127.0.0.1", listener.getsockname()[1], secret=SECRET)
        out: list[BaseException | str] = []
        ran = threading.Event()

        def on_loop() -> None:
            try:
                pending.cancel()
                out.append("returned")
            except BaseException as exc:
                out.append(exc)
            ran.set()

        bridge.loop.call_soon_threadsafe(on_loop)
        assert ran.wait(30)
        assert isinstance(out[0], UsageError) and "loop thread" in str(out[0]), out
        assert not pending.done()  # still under way: cancel() there changed nothing
        pending.cancel(30)  # from this thread it does
        assert pending.done()
    finally:
        bridge.close()
        listener.close()


# -- 6. closing a server or peer while another thread closes their shared bridge ---------------

class _SignallingLock:
    """A lock that tells when a given thread begins to acquire it."""

    def __init__(self, lock: Any, thread: threading.Thread) -> None:
        self._lock, self._thread, self.waiting = lock, thread, threading.Event()

    def acquire(self, *args: Any, **kwargs: Any) -> bool:
        if threading.current_thread() is self._thread:
            self.waiting.set()
        return bool(self._lock.acquire(*args, **kwargs))

    def release(self) -> None:
        self._lock.release()


@pytest.mark.parametrize("what", ["server", "peer"])
def test_close_waits_for_the_bridges_close_under_way_in_another_thread(what: str) -> None:
    """Documented: a second close() waits for the first.  SyncServer.close() and
    SyncPeer.close() on a shared bridge another thread was closing (its loop held up)
    returned at once, the listening socket or the connection still open."""
    bridge = Bridge("shared")
    server = SyncServer(secret=SECRET, bridge=bridge if what == "server" else None)
    peer = SyncPeer("127.0.0.1", server.port, secret=SECRET, bridge=bridge) if what == "peer" else None
    thing: Any = server if peer is None else peer
    lock = bridge._close_lock = _SignallingLock(bridge._close_lock, threading.current_thread())  # type: ignore[assignment]
    try:
        with held(bridge) as release:
            first = threading.Thread(target=bridge.close, kwargs={"timeout": 30})
            first.start()
            assert until(lambda: bridge.closed, within=30)
            # once this thread waits in close(), the loop goes on (bounded: an old close never waits)
            def release_once_waiting() -> None:
                lock.waiting.wait(10)
                release.set()

            threading.Thread(target=release_once_waiting, daemon=True).start()
            thing.close(timeout=30)
            if peer is None:
                assert server.server.closed
                with pytest.raises(ConnectionRefusedError):
                    socket.create_connection(("127.0.0.1", server.port), timeout=10).close()
            else:
                assert peer.peer.closed
        first.join(30)
        assert not first.is_alive() and not bridge._thread.is_alive()
    finally:
        bridge.close()
        server.close()


# -- 7. send options: begin() checks them as it is called --------------------------------------

@pytest.mark.parametrize("options", [{"timeout": 0}, {"timeout": float("nan")}, {"bogus": 1}, {"layers": []},
                                     {"codec": "nope"}, {"codec": 3}, {"deadline": 1.0, "codec": "raw"},
                                     {"meta": "x"}, {"blocks": "ab"}, {"blocks": [(1,)]}])
def test_begin_and_send_refuse_bad_send_options_at_once(options: dict[str, Any]) -> None:
    """begin(timeout=0) or begin(bogus=1) returned a handle and raised only at wait(), after
    every layer was queued (bogus=1: a raw TypeError, from send() too)."""
    with SyncServer(secret=SECRET) as server, SyncPeer("127.0.0.1", server.port, secret=SECRET) as peer:
        with pytest.raises(UsageError):
            peer.begin("r", SPEC, **options)
        if not {"timeout", "layers"} & set(options):  # (its own arguments)
            with pytest.raises(UsageError):
                peer.send("r", SPEC, [], **options)
        assert peer.peer.core.transfers == 0


def test_begin_reads_a_blocks_iterator_once() -> None:
    """begin() checks blocks= as it is called: an iterator it read is not sent empty."""
    layers = [(np.zeros((4, 2, 16), np.float32), np.zeros((4, 2, 16), np.float32))] * 3
    with SyncServer(secret=SECRET) as server, SyncPeer("127.0.0.1", server.port, secret=SECRET) as peer:
        h = server.expect("r", timeout=60)
        s = peer.begin("r", SPEC, blocks=iter([(7, 1), (8, 2)]), meta={"a": 1}, timeout=60)
        for k, v in layers:
            s.send_layer(k, v)
        s.wait(30)
        h.wait(30)
        assert h.transfer.blocks == [(7, 1), (8, 2)]


# -- 8. layer indexes, layer counts and bridges that are not ----------------------------------

@pytest.mark.parametrize("index", ["0", None, 1.5, True, -1])
def test_wait_layer_refuses_an_index_not_an_int_at_once(index: Any) -> None:
    """wait_layer('0') and wait_layer(None) raised a raw TypeError, wait_layer(1.5) waited
    for its timeout."""
    with SyncServer(secret=SECRET) as server:
        h = server.expect("r")
        with pytest.raises(UsageError, match="layer index must be an int"):
            h.wait_layer(index, timeout=30)
        h.abort()


@pytest.mark.parametrize("num_layers", ["3", -1, 0, 2.0, True, 70000])
def test_expect_refuses_a_layer_count_not_an_int_at_once(num_layers: Any) -> None:
    """expect(num_layers='3') made a handle whose wait_layer() raised a raw TypeError;
    num_layers=-1 was taken (each wait_layer() then out of range)."""
    with SyncServer(secret=SECRET) as server:
        with pytest.raises(UsageError, match="num_layers must be an int"):
            server.expect("r", num_layers=num_layers)


def test_a_layer_index_or_count_may_be_a_numpy_int() -> None:
    layers = [(np.full((4, 2, 16), i, np.float32), np.full((4, 2, 16), i, np.float32)) for i in range(3)]
    with SyncServer(secret=SECRET) as server, SyncPeer("127.0.0.1", server.port, secret=SECRET) as peer:
        h = server.expect("r", num_layers=np.int64(3), timeout=60)
        with pytest.raises(UsageError, match="out of range"):
            h.wait_layer(np.int32(3), 30)
        peer.send("r", SPEC, layers, timeout=60)
        assert h.wait_layer(np.int64(2), 30).index == 2


def test_a_bridge_that_is_not_one_is_refused_at_once() -> None:
    """SyncPeer(bridge='x') raised AttributeError and left a coroutine never awaited (a
    RuntimeWarning, an error under this suite's filterwarnings)."""
    with SyncServer(secret=SECRET) as server:
        for make in (lambda: SyncPeer("127.0.0.1", server.port, secret=SECRET, bridge="x"),  # type: ignore[arg-type]
                     lambda: SyncServer(secret=SECRET, bridge="x"),  # type: ignore[arg-type]
                     lambda: PendingPeer("x", "127.0.0.1", server.port, secret=SECRET)):  # type: ignore[arg-type]
            with pytest.raises(UsageError, match=r"bridge must be a kvwire\.sync\.Bridge"):
                make()


# -- 9. write marks and destinations that are not -----------------------------------------------

@pytest.mark.parametrize("marks", [object(), None, "x", "", [1], [(1, 2)], [("s", 3)], ((None, 0),)])
def test_written_past_refuses_marks_not_from_write_marks_at_once(marks: Any) -> None:
    """written_past(object()) raised a raw TypeError from the loop (written_past([(1, 2)])
    an AttributeError, written_past('x') a ValueError), and written_past('') said True."""
    with SyncServer(secret=SECRET) as server, SyncPeer("127.0.0.1", server.port, secret=SECRET) as peer:
        with pytest.raises(UsageError, match="marks must be what write_marks"):
            peer.written_past(marks)
        assert peer.written_past(peer.write_marks(10), 10) is True  # (the peer goes on: nothing to write)


class _NotQuiteADestination:
    """Three of a destination's four methods (no ``layer()``)."""

    def check(self, spec: Any, layer_tokens: Any = None) -> None:
        pass

    def view(self, *args: Any) -> None:
        return None

    def write(self, *args: Any) -> None:
        pass


@pytest.mark.parametrize("into", [object(), np.zeros(4), _NotQuiteADestination()])
def test_expect_refuses_an_into_that_is_not_a_destination_at_once(into: Any) -> None:
    """SyncServer.expect(into=object()) returned a handle whose wait ran until the
    transfer's timeout (kvwire.aio's Server.expect took it too, and failed only once a
    transfer came); both refuse it as they are called, naming what it lacks."""
    with SyncServer(secret=SECRET) as server:
        with pytest.raises(UsageError, match=r"into= must be a destination.*without .*layer\(\)"):
            server.expect("r", into=into, timeout=60)


@pytest.mark.parametrize("into", [object(), _NotQuiteADestination()])
async def test_aio_expect_refuses_an_into_that_is_not_a_destination_at_once(into: Any) -> None:
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        with pytest.raises(UsageError, match=r"into= must be a destination.*without .*layer\(\)"):
            await asyncio.wait_for(server.expect("r", into=into, timeout=60), 10)
