"""Receive-buffer pool: reused memory never aliases an array or view someone still holds."""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvwire
from kvwire.aio import _pool
from kvwire.aio._pool import ReceivePool, default_pool, size_class
from tests.conftest import SECRET, make_layers, same_cache

pytestmark = pytest.mark.timeout(60)


def test_size_class_covers_the_request_with_bounded_waste() -> None:
    for n in [1, 4095, 65536, 65537, 1 << 20, (1 << 20) + 1, 3 * (1 << 20) + 7, 1 << 30]:
        c = size_class(n)
        assert c >= n
        assert c <= max(64 * 1024, n * 1.125 + 4096)


def test_a_released_layer_is_reused_and_a_held_one_is_not() -> None:
    pool = ReceivePool(1 << 24)
    a = pool.empty((100, 8, 128), np.float16)
    a_ptr = a.ctypes.data
    b = pool.empty((100, 8, 128), np.float16)
    assert not np.shares_memory(a, b)
    del a
    c = pool.empty((100, 8, 128), np.float16)
    assert c.ctypes.data == a_ptr and pool.hits == 1
    assert not np.shares_memory(b, c)


@pytest.mark.parametrize(
    "make_view",
    [
        lambda a: a[3:],
        lambda a: a.reshape(-1)[10:20],
        lambda a: a.view(np.uint8),
        lambda a: np.asarray(a),
        lambda a: memoryview(a),
        lambda a: np.frombuffer(memoryview(a), np.uint8),
        lambda a: a.T,
        lambda a: np.from_dlpack(a),
    ],
)
def test_a_view_keeps_the_memory_out_of_the_pool(make_view: object) -> None:
    pool = ReceivePool(1 << 24)
    a = pool.empty((16, 2, 64), np.float16)
    a[...] = 7
    view = make_view(a)  # type: ignore[operator]
    del a
    gc.collect()
    assert pool.idle_bytes == 0
    b = pool.empty((16, 2, 64), np.float16)
    b[...] = 0
    held = np.frombuffer(view, np.uint8) if isinstance(view, memoryview) else np.asarray(view)
    assert not np.shares_memory(held, b)
    assert np.all(held.view(np.float16) == 7) if held.dtype == np.uint8 and held.nbytes % 2 == 0 else np.all(held == 7)
    del view, held
    gc.collect()
    assert pool.idle_bytes == size_class(16 * 2 * 64 * 2)


def test_idle_bytes_stay_within_the_bound() -> None:
    pool = ReceivePool(3 * size_class(1 << 20))
    arrays = [pool.empty((1 << 19,), np.float16) for _ in range(6)]
    del arrays
    gc.collect()
    assert pool.idle_bytes == 3 * size_class(1 << 20)
    assert pool.leased_bytes == 0
    assert ReceivePool(0).empty((4,), np.uint8).shape == (4,)


def test_reserve_prefaults_within_the_bound() -> None:
    pool = ReceivePool(2 * size_class(1 << 20))
    pool.reserve(1 << 20, count=5)
    assert pool.idle_bytes == 2 * size_class(1 << 20)
    pool.empty((1 << 20,), np.uint8)
    assert pool.hits == 1


_op = st.one_of(
    st.tuples(st.just("take"), st.integers(1, 40_000)),
    st.tuples(st.just("view"), st.integers(0, 50)),
    st.tuples(st.just("drop_array"), st.integers(0, 50)),
    st.tuples(st.just("drop_view"), st.integers(0, 50)),
)


@settings(max_examples=100, deadline=None)
@given(ops=st.lists(_op, max_size=60), bound=st.sampled_from([0, 200_000, 1 << 22]))
def test_reused_memory_never_aliases_anything_still_held(ops: list[tuple[str, int]], bound: int) -> None:
    pool = ReceivePool(bound)
    arrays: dict[int, np.ndarray] = {}  # pattern -> leased array
    views: list[tuple[int, np.ndarray]] = []  # (pattern, view of a leased array)
    pattern = 0
    for op, arg in ops:
        if op == "take":
            pattern = pattern % 250 + 1
            arr = pool.empty((arg,), np.uint8)
            for held in list(arrays.values()) + [v for _, v in views]:
                assert not np.shares_memory(arr, held)
            arr[...] = pattern
            arrays.pop(pattern, None)
            views = [(p, v) for p, v in views if p != pattern]
            arrays[pattern] = arr
        elif op == "view" and arrays:
            p = sorted(arrays)[arg % len(arrays)]
            a = arrays[p]
            views.append((p, a[arg % max(1, a.size) :]))
        elif op == "drop_array" and arrays:
            del arrays[sorted(arrays)[arg % len(arrays)]]
        elif op == "drop_view" and views:
            views.pop(arg % len(views))
        # No gc.collect(): arrays form no cycles, so refcounting returns memory at once.
        for p, a in arrays.items():
            assert np.all(a == p)
        for p, v in views:
            assert np.all(v == p)
        assert pool.idle_bytes <= bound


def test_a_lease_collected_while_the_pool_holds_its_lock_is_given_back() -> None:
    """A lease in a reference cycle is collected when a garbage collection runs, which may
    be inside an allocation the pool makes under its own lock: its finalizer must not wait
    for that lock (it would wait forever), and its slab still comes back."""
    pool = ReceivePool(1 << 24)
    cycle: list[object] = [pool.empty((1000,), np.uint8)]
    cycle.append(cycle)
    del cycle
    finished = threading.Event()

    def collect_under_the_lock() -> None:
        with pool._lock:  # as if the collection began inside the pool's own critical section
            gc.collect()
        finished.set()

    worker = threading.Thread(target=collect_under_the_lock, daemon=True)
    worker.start()
    worker.join(10)
    assert finished.is_set(), "the finalizer waited for the lock its own thread held"
    assert pool.leased_bytes == 0 and pool.idle_bytes == size_class(1000)
    again = pool.empty((1000,), np.uint8)
    assert pool.hits == 1 and again.size == 1000


def test_a_lease_alive_at_exit_is_not_handed_out_again() -> None:
    """At interpreter exit a lease still referenced stays leased: what runs at exit (an
    atexit hook, a daemon thread) gets other memory, not memory that is still in use."""
    script = textwrap.dedent("""
        import atexit
        import numpy as np
        from kvwire.aio._pool import ReceivePool

        pool = ReceivePool(1 << 24)

        def late():
            b = pool.empty((1000,), np.uint8)
            b[:] = 7
            print("shared" if np.shares_memory(A, b) else "apart", int(A[0]))

        atexit.register(late)
        A = pool.empty((1000,), np.uint8)
        A[:] = 1
    """)
    got = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == ["apart", "1"]


async def _receive(server: kvwire.Server, peer: kvwire.Peer, name: str, spec: kvwire.KVSpec, layers: list[tuple[np.ndarray, np.ndarray]]) -> kvwire.KVCache:
    recv = asyncio.create_task(server.expect(name))
    await peer.send(name, spec, layers)
    return await (await recv).collect(timeout=10)


async def test_received_layers_come_from_the_pool_and_are_never_reused_while_held() -> None:
    spec = kvwire.KVSpec(num_layers=4, num_kv_heads=8, head_dim=128, dtype="float16")
    first = make_layers(4, 200, 8, 128, seed=1)
    second = make_layers(4, 200, 8, 128, seed=2)
    pool = default_pool()
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, streams=2, chunk_bytes=64 * 1024) as peer:
            held = await _receive(server, peer, "a", spec, first)
            views = [k[50:] for k, _ in held.layers]  # the application keeps views only
            k0 = held.layers[0][0].copy()
            del held
            gc.collect()
            again = await _receive(server, peer, "b", spec, second)
            for k, v in again.layers:
                for view in views:
                    assert not np.shares_memory(view, k) and not np.shares_memory(view, v)
            assert same_cache(again.layers, second)
            assert all(np.array_equal(view, k[50:]) for view, (k, _) in zip(views, first, strict=True))
            assert np.array_equal(views[0], k0[50:])
            hits = pool.hits
            del again
            gc.collect()
            third = await _receive(server, peer, "c", spec, first)
            assert pool.hits > hits  # released layers were reused
            assert same_cache(third.layers, first)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_leases_keep_every_spec_dtype(dtype: str) -> None:
    from kvwire.codec import numpy_dtype

    dt = numpy_dtype(dtype)
    a = ReceivePool(1 << 20).empty((5, 2, 8), dt)
    assert a.dtype == dt and a.shape == (5, 2, 8) and a.flags.c_contiguous and a.flags.writeable


@pytest.mark.parametrize("value", ["abc", "-1", "1.5", "1e3", "-0x1"])
def test_an_invalid_pool_size_is_a_usage_error_naming_it(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    # it was silently replaced by the default (or, negative, by 0)
    monkeypatch.setenv("KVWIRE_RECV_POOL_MB", value)
    monkeypatch.setattr(_pool, "_default", None)  # the process-wide pool is made on first use
    message = f"KVWIRE_RECV_POOL_MB must be a whole number of MiB.*not {value!r}"
    with pytest.raises(kvwire.UsageError, match=message):
        default_pool()
    with pytest.raises(kvwire.UsageError, match=message):  # before it listens, not at each transfer
        kvwire.serve("127.0.0.1", 0, secret=SECRET)
    assert _pool._default is None


@pytest.mark.parametrize("value, max_bytes", [("", 1 << 30), (" ", 1 << 30), ("0", 0), ("512", 512 << 20), (" 64 ", 64 << 20)])
def test_a_valid_pool_size_sets_the_bound(monkeypatch: pytest.MonkeyPatch, value: str, max_bytes: int) -> None:
    monkeypatch.setenv("KVWIRE_RECV_POOL_MB", value)
    monkeypatch.setattr(_pool, "_default", None)
    assert default_pool().max_bytes == max_bytes
