"""kvwire.sync and CUDA stream order, over a fake CuPy (tests/fake_cupy.py) whose current
stream is per thread, as CuPy's is.

The blocking API runs the transfer on its bridge's loop thread, whose current stream is
not the caller's: a producer that wrote its layers on a stream of its own and then calls
a blocking send must still have them read after that write, a GPU cache named by
``expect(into=)`` must be written after what the caller had queued on it, and a GPU
layer handed to the caller must be ordered before the caller's stream's next work."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import kvwire
from kvwire.aio import _gpu
from kvwire.codec import gpu as g
from kvwire.paged import PagedDestination, PagedSpec
from kvwire.sync import SyncPeer, SyncServer
from tests.fake_cupy import FakeCupy

SECRET = b"gpu-stream-order-secret"
SPEC = kvwire.KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16")


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCupy]:
    cupy = FakeCupy()
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
        with mine:
            layer = rx.wait_layer(1)
            out = fake.module.empty(layer.k.shape, layer.k.dtype)
            out[...] = layer.k  # read on the caller's stream
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
