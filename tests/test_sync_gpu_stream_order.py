"""kvwire.sync and CUDA stream order, over a fake CuPy (tests/fake_cupy.py) whose current
stream is per thread, as CuPy's is.

The blocking API runs the transfer on its bridge's loop thread, whose current stream is
not the caller's: a producer that wrote its layers on a stream of its own and then calls
a blocking send must still have them read after that write, a GPU cache named by
``expect(into=)`` must be written after what the caller had queued on it, and a GPU
layer handed to the caller must be ordered before the caller's stream's next work.

The ordering tests run under each way the fake mixes ``stream.use()`` with ``with
stream:`` (its ``streams=``): CuPy 13 forgets a ``use()``d stream when a ``with`` block of
another ends (cupy/cupy#8377); ``"cupy14"`` keeps it (``use()`` inside a ``with`` block
overwrites that block's entry, which its end drops); ``"refuse"`` refuses ``use()`` inside
a ``with`` block (RuntimeError), so kvwire.codec.gpu.on_stream falls back to a ``with``
block there."""

from __future__ import annotations

import contextlib
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import kvwire
from kvwire.aio import _gpu, _sync
from kvwire.codec import gpu as g
from kvwire.paged import PagedDestination, PagedSource, PagedSpec, gather_layer
from kvwire.sync import Bridge, SyncPeer, SyncServer
from tests.fake_cupy import FakeCupy

SECRET = b"gpu-stream-order-secret"
SPEC = kvwire.KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16")


@pytest.fixture(params=FakeCupy.STREAM_SEMANTICS)
def semantics(request: pytest.FixtureRequest) -> str:
    """How the fake mixes ``use()`` and ``with``: ``"cupy13"``, ``"cupy14"`` or
    ``"refuse"`` (FakeCupy.STREAM_SEMANTICS)."""
    return str(request.param)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, semantics: str) -> Iterator[FakeCupy]:
    cupy = FakeCupy(streams=semantics)
    monkeypatch.setitem(sys.modules, "cupy", cupy.module)
    # the transfer streams are cached per process: none of the fake's may outlive the test
    monkeypatch.setattr(_gpu, "_STREAMS", {})
    monkeypatch.setattr(g, "gpu_available", lambda: True)
    yield cupy


def _host(seed: int) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).standard_normal((8, 2, 16)).astype(np.float16)


def _written_on(fake: FakeCupy, host: np.ndarray[Any, Any], stream: Any) -> Any:
    """``host`` on device 0: allocated on the (shared) null stream, its values written by
    the producer on ``stream`` (ordered after the allocation)."""
    x = fake.module.empty(host.shape, host.dtype)
    stream.wait_event(fake.module.cuda.get_current_stream().record())
    with stream:
        x[...] = host
    return x


def _take_and_read_on(fake: FakeCupy, stream: Any, rx: Any, index: int) -> tuple[Any, Any]:
    """On ``stream`` (the caller's): takes layer ``index`` from ``rx`` and reads its K into
    a new array; the layer and that copy."""
    with stream:
        layer = rx.wait_layer(index)
        out = fake.module.empty(layer.k.shape, layer.k.dtype)
        out[...] = layer.k  # read on the caller's stream
    return layer, out


def test_a_blocking_send_reads_layers_after_the_callers_stream_wrote_them(fake: FakeCupy) -> None:
    mine = fake.module.cuda.Stream(non_blocking=True)
    hosts = [(_host(2 * i), _host(2 * i + 1)) for i in range(SPEC.num_layers)]
    layers = [(_written_on(fake, k, mine), _written_on(fake, v, mine)) for k, v in hosts]
    with SyncServer(secret=SECRET) as server, \
            SyncPeer("127.0.0.1", server.port, secret=SECRET, codec="raw") as peer:
        rx = server.expect("req")
        with mine:  # the caller's current stream while it sends
            peer.send("req", SPEC, layers, timeout=30)
        rx.wait(timeout=30)
        got = [rx.wait_layer(i) for i in range(SPEC.num_layers)]
    assert fake.problems == []
    reads = [e for e in fake.log if e[0] == "d2h"]
    assert reads and all(e[2] != mine.name for e in reads), reads  # on the transfer stream
    for (hk, hv), layer in zip(hosts, got, strict=True):
        assert np.asarray(layer.k).tobytes() == hk.tobytes() and np.asarray(layer.v).tobytes() == hv.tobytes()


def test_send_layer_reads_each_layer_after_the_callers_stream_wrote_it(fake: FakeCupy) -> None:
    mine = fake.module.cuda.Stream(non_blocking=True)
    with SyncServer(secret=SECRET) as server, \
            SyncPeer("127.0.0.1", server.port, secret=SECRET, codec="raw") as peer:
        rx = server.expect("req")
        handle = peer.begin("req", SPEC)
        for i in range(SPEC.num_layers):
            k, v = _written_on(fake, _host(2 * i), mine), _written_on(fake, _host(2 * i + 1), mine)
            with mine:
                handle.send_layer(k, v)
        handle.wait(timeout=30)
        rx.wait(timeout=30)
    assert fake.problems == []


def test_a_gpu_layer_handed_over_is_ordered_before_the_callers_stream(fake: FakeCupy) -> None:
    """A GPU server's layer is allocated and decoded on the loop thread's streams; the
    caller that takes it uses it on its own current stream, which waits for them."""
    mine = fake.module.cuda.Stream(non_blocking=True)
    k, v = _host(0), _host(1)
    with SyncServer(secret=SECRET, device="gpu:0") as server, \
            SyncPeer("127.0.0.1", server.port, secret=SECRET, codec="raw") as peer:
        rx = server.expect("req")
        peer.send("req", SPEC, [(k, v), (v, k)], timeout=30)
        _layer, out = _take_and_read_on(fake, mine, rx, 1)
    assert fake.problems == []
    assert np.asarray(out).tobytes() == v.tobytes()


def test_a_gpu_destination_is_written_after_the_callers_stream(fake: FakeCupy) -> None:
    """The caller cleared its cache blocks on its own stream, then expected a transfer into
    them: the loop writes the rows after that clear, not racing it."""
    mine = fake.module.cuda.Stream(non_blocking=True)
    paged = PagedSpec(num_layers=1, block_shape=(2, 4, 2, 16), dtype="float16")
    spec = paged.wire_spec()
    cache = _written_on(fake, np.zeros((3, *paged.block_shape), np.float16), mine)  # its last work on them
    rows = 2 * (paged.block_elems // 2) // (spec.num_kv_heads * spec.head_dim)  # two blocks' tokens
    rng = np.random.default_rng(0)
    k, v = (rng.standard_normal((rows, spec.num_kv_heads, spec.head_dim)).astype(np.float16) for _ in "kv")
    with SyncServer(secret=SECRET) as server, \
            SyncPeer("127.0.0.1", server.port, secret=SECRET, codec="raw") as peer:
        with mine:
            rx = server.expect("req", into=PagedDestination(paged, [cache], [2, 0]))
        peer.send("req", spec, [(k, v)], timeout=30)
        rx.wait(timeout=30)
    assert fake.problems == []


def test_host_layers_never_touch_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sending and receiving host arrays through the bridge records no stream position:
    CuPy (installed or not) is neither imported nor used."""
    touched: list[str] = []

    class Untouchable(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            touched.append(name)
            raise AttributeError(name)

    monkeypatch.setitem(sys.modules, "cupy", Untouchable("cupy"))
    k, v = _host(0), _host(1)
    with SyncServer(secret=SECRET) as server, SyncPeer("127.0.0.1", server.port, secret=SECRET) as peer:
        rx = server.expect("a")
        peer.send("a", SPEC, [(k, v), (v, k)], timeout=30)
        assert np.asarray(rx.wait_layer(1).k).tobytes() == v.tobytes()
        rx = server.expect("b")
        handle = peer.begin("b", SPEC)
        handle.send_layer(k, v)
        handle.send_layer(v, k)
        handle.wait(timeout=30)
        rx.wait(timeout=30)
    assert touched == []


def test_a_paged_source_is_gathered_after_the_callers_stream_wrote_its_caches(fake: FakeCupy) -> None:
    """A PagedSource's GPU caches are gathered on the loop thread, one layer at a time:
    the gathers come after what the caller had queued on them when it sent."""
    mine = fake.module.cuda.Stream(non_blocking=True)
    paged = PagedSpec(num_layers=2, block_shape=(2, 4, 2, 16), dtype="float16")
    hosts = [np.random.default_rng(i).standard_normal((3, *paged.block_shape)).astype(np.float16) for i in range(2)]
    caches = [_written_on(fake, h, mine) for h in hosts]
    with SyncServer(secret=SECRET) as server, \
            SyncPeer("127.0.0.1", server.port, secret=SECRET, codec="raw") as peer:
        rx = server.expect("req")
        with mine:
            peer.send("req", paged.wire_spec(), PagedSource(paged, caches, [2, 0]), timeout=30)
        rx.wait(timeout=30)
        got = [rx.wait_layer(i) for i in range(2)]
    assert fake.problems == []
    assert any(e[0] == "take" for e in fake.log)  # (gathered on the device)
    for h, layer in zip(hosts, got, strict=True):
        k, v = gather_layer(paged, h, [2, 0])
        assert np.asarray(layer.k).tobytes() == np.asarray(k).tobytes()
        assert np.asarray(layer.v).tobytes() == np.asarray(v).tobytes()


def test_the_loop_waits_for_the_caller_on_a_stream_of_its_own(fake: FakeCupy) -> None:
    """The loop thread's stream that waits for the caller's mark is its own non-blocking
    one (current there from then on), not the shared legacy null stream: work queued
    there by anyone else does not wait behind the caller's queued work."""
    mine = fake.module.cuda.Stream(non_blocking=True)
    hosts = [(_host(2 * i), _host(2 * i + 1)) for i in range(SPEC.num_layers)]
    layers = [(_written_on(fake, k, mine), _written_on(fake, v, mine)) for k, v in hosts]
    null = fake.module.cuda.get_current_stream()
    assert null.ptr == 0
    with SyncServer(secret=SECRET) as server, \
            SyncPeer("127.0.0.1", server.port, secret=SECRET, codec="raw") as peer:
        rx = server.expect("req")
        for request in ("req", "again"):  # the second send reuses the loop's stream
            if request == "again":
                rx = server.expect(request)
            with mine:
                peer.send(request, SPEC, layers, timeout=30)
            rx.wait(timeout=30)
    assert fake.problems == []
    assert id(mine) not in null.waited  # the null stream never waited for the caller
    waiters = [e[1] for e in fake.log if e[0] == "wait" and e[2] == mine.name and e[1] != mine.name]
    assert len(waiters) == 2 and len(set(waiters)) == 1 and not waiters[0].startswith("null"), waiters
    made = [e[1] for e in fake.log if e[0] == "use"]
    assert made and made[0] == waiters[0]  # made current before its first wait
    assert next(s for s in fake.streams() if s.name == waiters[0]).non_blocking


def test_gpu_layers_on_two_devices_are_each_read_after_the_callers_stream_there(semantics: str) -> None:
    """Each device's layers wait for the caller's current stream on that device (CuPy's
    current stream is per device, too)."""
    cupy = FakeCupy(devices=2, streams=semantics)
    cp = cupy.module
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "cupy", cp)
        mp.setattr(_gpu, "_STREAMS", {})
        mp.setattr(g, "gpu_available", lambda: True)
        mine, layers = {}, []
        for d in range(2):
            with cp.cuda.Device(d):
                s = mine[d] = cp.cuda.Stream(non_blocking=True)
                layers.append((_written_on(cupy, _host(2 * d), s), _written_on(cupy, _host(2 * d + 1), s)))
        with SyncServer(secret=SECRET) as server, \
                SyncPeer("127.0.0.1", server.port, secret=SECRET, codec="raw") as peer:
            rx = server.expect("req")
            with cp.cuda.Device(0), mine[0], cp.cuda.Device(1), mine[1]:
                peer.send("req", SPEC, layers, timeout=30)
            rx.wait(timeout=30)
    assert cupy.problems == []


def test_a_paged_gather_after_a_transfer_stream_s_block_is_still_after_the_callers_stream(
        fake: FakeCupy, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the loop thread does for a GPU PagedSource send, here on this thread: it waits
    for the caller's mark, gathers layer 0, runs a chunk on the transfer stream (encode,
    decode), gathers layer 1.  The second gather is still on the loop's own stream, after
    the caller's: under CuPy 13 a `with transfer_stream:` block there would leave the null
    stream current, which never waited for the caller."""
    monkeypatch.setattr(_sync, "_loop_streams", threading.local())
    monkeypatch.setattr(_gpu, "_LAYER_STREAMS", threading.local())
    cp = fake.module
    mine = cp.cuda.Stream(non_blocking=True)
    paged = PagedSpec(num_layers=2, block_shape=(2, 4, 2, 16), dtype="float16")
    hosts = [np.random.default_rng(i).standard_normal((3, *paged.block_shape)).astype(np.float16) for i in range(2)]
    caches = [_written_on(fake, h, mine) for h in hosts]
    with mine:
        marks = _sync.caller_marks(caches)
    _sync.order_after(marks)
    own = cp.cuda.get_current_stream()
    assert own.non_blocking and own is not mine
    gather_layer(paged, caches[0], [2, 0])
    # a raw chunk decoded on the transfer stream, as a GPU server does
    out = _gpu.GpuReceiver("gpu:0").empty((4, 2, 16), "float16")
    _gpu.GpuReceiver("gpu:0").decode(kvwire.codec.get_codec("raw"), b"", np.zeros((4, 2, 16), np.float16).tobytes(),
                                     out, "float16", kvwire.codec.TensorKind.K)
    assert cp.cuda.get_current_stream() is own
    k, _v = gather_layer(paged, caches[1], [2, 0])
    assert fake.problems == []
    assert np.asarray(k).tobytes() == np.asarray(gather_layer(paged, hosts[1], [2, 0])[0]).tobytes()


def test_a_loop_stream_forgotten_is_made_current_again_for_the_next_mark(
        fake: FakeCupy, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream made current elsewhere on the loop thread (or CuPy 13 forgetting the loop's
    own after someone's `with` block) does not take the caller's marks: each one is waited
    for on the loop's own stream, made current again, after what was queued meanwhile."""
    monkeypatch.setattr(_sync, "_loop_streams", threading.local())
    monkeypatch.setattr(_gpu, "_LAYER_STREAMS", threading.local())
    cp = fake.module
    mine = cp.cuda.Stream(non_blocking=True)
    x = _written_on(fake, _host(0), mine)
    with mine:
        marks = _sync.caller_marks([x])
    _sync.order_after(marks)
    own = cp.cuda.get_current_stream()
    with mine:
        x[...] = 2  # more of the caller's work, marked again
        marks = _sync.caller_marks([x])
    assert own.waited[id(mine)] < marks[0][1].seq
    other = cp.cuda.Stream(non_blocking=True)
    other.use()
    y = cp.empty((4,), np.float16)  # allocated on `other`, then used on the loop's stream
    _sync.order_after(marks)
    assert cp.cuda.get_current_stream() is own
    assert own.waited[id(mine)] == marks[0][1].seq and id(mine) not in other.waited
    y[...] = 1  # (an item assignment on the current stream: after y's allocation)
    assert fake.problems == []


def test_a_failed_mark_leaves_no_receive_handle_behind(fake: FakeCupy, monkeypatch: pytest.MonkeyPatch) -> None:
    paged = PagedSpec(num_layers=1, block_shape=(2, 4, 2, 16), dtype="float16")
    cache = fake.module.zeros((3, *paged.block_shape), np.float16)

    def broken(arrays: Any) -> Any:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(_sync, "caller_marks", broken)
    with SyncServer(secret=SECRET) as server:
        with pytest.raises(RuntimeError, match="illegal memory access") as failed:
            server.expect("req", into=PagedDestination(paged, [cache], [2, 0]))
        # (the handles are held weakly: the traceback, still held, would keep one alive)
        assert failed.tb is not None and not list(server._handles)


# -- the fake itself ----------------------------------------------------------------------


def test_the_fake_orders_by_what_an_event_s_stream_waited_for_when_it_was_recorded() -> None:
    """Stream A records an event, then waits for B's write; C waits for the event only:
    C is not ordered after B's write (a wait queued after the record is not before it)."""
    fake = FakeCupy()
    cp = fake.module
    a, b, c = (cp.cuda.Stream(non_blocking=True) for _ in "abc")
    x = cp.empty((4,), np.float32)
    for s in (a, b, c):
        s.wait_event(cp.cuda.get_current_stream().record())  # after the allocation
    event = a.record()
    with b:
        x[...] = 1
    a.wait_event(b.record())
    c.wait_event(event)
    with c:
        cp.ascontiguousarray(x[::2])  # reads x on c
    assert any("without waiting for the write" in p for p in fake.problems), fake.problems


def test_the_fake_counts_a_kernel_s_non_const_arguments_as_written_on_its_stream() -> None:
    fake = FakeCupy(emulation=types.SimpleNamespace(emu_kv_fp8_decode_vec_f16=lambda *a: None, emu_errors=lambda: 0))
    cp = fake.module
    kernel = cp.RawModule(code=g.kernel_source(), options=()).get_function("kv_fp8_decode_vec_f16")
    mine = cp.cuda.Stream(non_blocking=True)
    payload, out, flags = cp.zeros((64,), np.uint8), cp.empty((16,), np.float16), cp.zeros((1,), np.uint32)
    mine.wait_event(cp.cuda.get_current_stream().record())
    with mine:
        kernel((1,), (32,), (payload, np.uint32(1), np.uint32(16), out, flags))
    assert fake.problems == []
    cp.ascontiguousarray(out[::2])  # read on the null stream, which never waited for the kernel
    cp.ascontiguousarray(payload[::2])  # (only read by it: fine)
    assert len(fake.problems) == 1 and "without waiting for the write" in fake.problems[0], fake.problems


def test_a_gpu_layer_is_allocated_on_the_stream_current_before_the_loops_own(fake: FakeCupy) -> None:
    """Once the loop thread's own stream is its current one (a GPU send on the same bridge
    waited for the caller there), a GPU server's layers are still allocated on the stream
    that was current before it, the shared null stream: a layer the caller drops goes back
    to CuPy's pool in that stream's order, which the caller's blocking streams are ordered
    with, not the loop's own stream's.  The transfer stream that decodes into it waits for
    that allocation, and the caller's stream waits for the allocation and the decode before
    it uses it."""
    mine = fake.module.cuda.Stream(non_blocking=True)
    k, v = _host(0), _host(1)
    bridge = Bridge("stream-order")
    with contextlib.closing(bridge), \
            SyncServer(secret=SECRET, device="gpu:0", bridge=bridge) as server, \
            SyncPeer("127.0.0.1", server.port, secret=SECRET, codec="raw", bridge=bridge) as peer:
        rx = server.expect("first")
        layers = [(_written_on(fake, k, mine), _written_on(fake, v, mine))] * 2
        with mine:
            peer.send("first", SPEC, layers, timeout=30)  # the loop's own stream: current from now on
        rx.wait(timeout=30)
        own = [e[1] for e in fake.log if e[0] == "use"]
        assert own and not own[0].startswith("null")  # (the first made current)
        before = len(fake.log)
        rx = server.expect("second")
        peer.send("second", SPEC, [(k, v), (v, k)], timeout=30)
        layer, out = _take_and_read_on(fake, mine, rx, 1)
    assert fake.problems == []
    allocation = fake.allocation(layer.k.data.ptr)
    assert allocation is not None and allocation.stream.name == "null:0", allocation
    assert not [e for e in fake.log[before:] if e[0] == "alloc" and e[2] == own[0]]  # none on the loop's own
    assert np.asarray(out).tobytes() == v.tobytes()


def test_the_async_api_allocates_a_gpu_servers_layers_on_its_current_stream(fake: FakeCupy) -> None:
    """Without kvwire.sync's loop stream (the async API: the caller's thread is the loop
    thread), a GPU server's layers are allocated on the thread's current stream."""
    mine = fake.module.cuda.Stream(non_blocking=True)
    receiver = _gpu.GpuReceiver("gpu:0")
    with mine:
        x = receiver.empty((4, 2, 16), "float16")
    allocation = fake.allocation(x.data.ptr)
    assert allocation is not None and allocation.stream is mine
    assert _gpu.stream_for(0).waited.get(id(mine), -1) >= allocation.seq  # the decode comes after it


def test_paged_sends_to_a_gpu_server_on_one_bridge_gather_each_layer_after_the_callers_stream(fake: FakeCupy) -> None:
    """One bridge runs a GPU server and a peer: every received layer is decoded on the
    transfer stream, and every layer of a GPU PagedSource is gathered on the loop thread in
    between, each one after what the caller had queued on its caches, send after send."""
    mine = fake.module.cuda.Stream(non_blocking=True)
    paged = PagedSpec(num_layers=6, block_shape=(2, 4, 2, 16), dtype="float16")
    hosts = [np.random.default_rng(i).standard_normal((3, *paged.block_shape)).astype(np.float16) for i in range(6)]
    caches = [_written_on(fake, h, mine) for h in hosts]
    bridge = Bridge("stream-order-paged")
    with contextlib.closing(bridge), \
            SyncServer(secret=SECRET, device="gpu:0", bridge=bridge) as server, \
            SyncPeer("127.0.0.1", server.port, secret=SECRET, codec="raw", bridge=bridge) as peer:
        for request in ("first", "second"):
            rx = server.expect(request)
            with mine:
                peer.send(request, paged.wire_spec(), PagedSource(paged, caches, [2, 0]), timeout=30)
            rx.wait(timeout=30)
            with mine:
                got = [rx.wait_layer(i) for i in range(6)]
                outs = [fake.module.empty(layer.k.shape, layer.k.dtype) for layer in got]
                for out, layer in zip(outs, got, strict=True):
                    out[...] = layer.k  # read on the caller's stream
            for h, out in zip(hosts, outs, strict=True):
                assert np.asarray(out).tobytes() == np.asarray(gather_layer(paged, h, [2, 0])[0]).tobytes()
    assert fake.problems == []


def test_on_stream_uses_a_with_block_where_cupy_refuses_use_inside_one(
    fake: FakeCupy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CuPy release may refuse ``use()`` inside a ``with`` block (RuntimeError); that
    release restores a ``use()``d stream at a with block's end, so on_stream falls back to
    one, and the stream current before is current again afterwards."""
    cuda = fake.module.cuda
    mine, theirs = cuda.Stream(non_blocking=True), cuda.Stream(non_blocking=True)
    stream_type = type(mine)
    real_use = stream_type.use
    refusing = [True]

    def use(self: Any) -> Any:
        if refusing[0]:
            raise RuntimeError("use() inside a with block")
        return real_use(self)

    with mine:
        monkeypatch.setattr(stream_type, "use", use)
        with g.on_stream(theirs) as s:
            assert s is theirs and cuda.get_current_stream() is theirs
        assert cuda.get_current_stream() is mine
        refusing[0] = False
        with g.on_stream(theirs):
            assert cuda.get_current_stream() is theirs
        assert cuda.get_current_stream() is mine


def test_the_fake_refuses_a_stream_of_another_device_and_keeps_each_semantics(semantics: str) -> None:
    """The fake as the tests above rely on it: a stream made current on another device
    than its own is refused (RuntimeError, as CuPy's message says), and each semantics
    mixes ``use()`` and ``with`` as its docstring says."""
    cp = FakeCupy(devices=2, streams=semantics).module
    with cp.cuda.Device(1):
        far = cp.cuda.Stream(non_blocking=True)
    for enter in (far.use, far.__enter__):
        with pytest.raises(RuntimeError, match=r"The device that the stream is created on \(1\) "
                                               r"does not match with the current device \(0\)"):
            enter()
    null = cp.cuda.get_current_stream()
    with cp.cuda.Device(1):
        assert cp.cuda.get_current_stream() is not null
        null.use()  # the null stream belongs to no device
    a, b = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    a.use()
    with b:
        if semantics == "refuse":
            with pytest.raises(RuntimeError, match="use"):
                a.use()
        else:
            a.use()
        assert cp.cuda.get_current_stream() is (b if semantics == "refuse" else a)
    # the end of the block: CuPy 13 falls back to the null stream; the others restore `a`
    assert cp.cuda.get_current_stream() is (null if semantics == "cupy13" else a)
