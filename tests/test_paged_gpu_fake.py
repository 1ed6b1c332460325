"""Paged caches on a GPU other than the current one, over a fake CuPy (tests/fake_cupy.py):
gathering, writing a destination's rows and making a sent tensor contiguous run on the
cache's own device, and a destination's write is complete when it returns.  Runs without
a GPU; tests/test_paged_gpu.py runs the same paths on one."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import kvwire
from kvwire.aio._arrays import as_device_array
from kvwire.codec import numpy_dtype
from kvwire.paged import DROP, PagedDestination, PagedSpec, gather_layer
from tests.fake_cupy import FakeCupy


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCupy]:
    cupy = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", cupy.module)
    yield cupy


def _on_device(fake: FakeCupy, x: np.ndarray[Any, Any], device: int) -> Any:
    x = x.view(np.uint16) if x.dtype == numpy_dtype("bfloat16") else x
    with fake.module.cuda.Device(device):
        out = fake.module.empty(x.shape, x.dtype)
    np.asarray(out)[...] = x
    return out


def _host_cache(spec: PagedSpec, blocks: int, seed: int) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((blocks, *spec.block_shape)).astype(numpy_dtype(spec.dtype))


def _ops(fake: FakeCupy) -> list[tuple[Any, ...]]:
    return [e for e in fake.log if e[0] in ("alloc", "h2d", "take", "setitem", "copy")]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_gather_from_a_cache_on_another_device_runs_there(fake: FakeCupy, dtype: str) -> None:
    spec = PagedSpec(num_layers=1, block_shape=(2, 4, 8), dtype=dtype)
    host = _host_cache(spec, 6, 0)
    cache = _on_device(fake, host, 1)
    fake.log.clear()
    k, v = gather_layer(spec, cache, [5, 0, 3])  # the current device is 0
    hk, hv = gather_layer(spec, host, [5, 0, 3])
    assert fake.problems == []
    assert _ops(fake) and all(e[1] == 1 for e in _ops(fake)), _ops(fake)
    assert k.device.id == v.device.id == 1
    assert np.asarray(k).tobytes() == hk.tobytes() and np.asarray(v).tobytes() == hv.tobytes()


@pytest.mark.parametrize("device", [0, 1])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("ids", [[4, 1, 2], [DROP, 1, 2]])
def test_a_destination_is_written_on_its_device_and_waited_for(
    fake: FakeCupy, dtype: str, ids: list[int], device: int,
) -> None:
    """write() into a cache on the current device or on device 1 while device 0 is
    current: the rows go to the cache's device and are copied on its current stream,
    which is synchronized before write() returns (a layer handed out is in place for
    work on any stream, and the host rows are no longer read)."""
    spec = PagedSpec(num_layers=2, block_shape=(2, 4, 8), dtype=dtype)
    caches = [_on_device(fake, np.zeros((6, *spec.block_shape), numpy_dtype(dtype)), device) for _ in range(2)]
    dest = PagedDestination(spec, caches, ids)
    rows = np.random.default_rng(1).standard_normal((12, 1, spec.row_elems)).astype(numpy_dtype(dtype))
    fake.log.clear()
    dest.write(1, 1, 0, rows, dest.layer_tokens)  # V of layer 1, every block
    assert fake.problems == []
    ops = _ops(fake)
    assert ops and all(e[1] == device for e in ops), ops
    last = max(i for i, e in enumerate(fake.log) if e[0] == "setitem")
    assert ("synchronize", f"null:{device}") in fake.log[last:]
    got = np.asarray(caches[1]).reshape(6, -1)
    half = spec.block_elems // 2
    bits = rows.view(np.uint16) if dtype == "bfloat16" else rows
    for slot, block in enumerate(ids):
        if block != DROP:
            assert got[block, half:].tobytes() == bits[4 * slot : 4 * slot + 4].tobytes()
    assert not np.asarray(caches[0]).any() and not got[:, :half].any()
    # every block of the range dropped: nothing to copy
    fake.log.clear()
    if ids[0] == DROP:
        dest.write(0, 0, 0, rows[:4], dest.layer_tokens)
        assert not [e for e in fake.log if e[0] in ("h2d", "setitem")]


def test_a_strided_tensor_sent_from_another_device_is_made_contiguous_there(fake: FakeCupy) -> None:
    spec = kvwire.KVSpec(num_layers=1, num_kv_heads=2, head_dim=8, dtype="float16")
    whole = _on_device(fake, np.arange(10 * 2 * 16, dtype=np.float16).reshape(10, 2, 16), 1)
    x = whole[:, :, ::2]
    fake.log.clear()
    got = as_device_array(x, spec, "k")
    assert fake.problems == []
    assert got.flags.c_contiguous and got.device.id == 1
    assert [e[1] for e in _ops(fake)] == [1, 1]  # its allocation and the copy, on device 1
    assert np.array_equal(np.asarray(got), np.asarray(x))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_token_rows_gather_and_write_only_kept_blocks_on_another_device(fake: FakeCupy, dtype: str) -> None:
    """Rows of tokens (token_axis=1, a row is one cache token of all its heads) from and
    into caches on device 1 while device 0 is current: the gather has the host's shape
    and bytes, and write() with DROP slots lands only the kept blocks, V in two parts."""
    spec = PagedSpec(num_layers=1, block_shape=(2, 16, 8, 128), dtype=dtype, token_axis=1)
    assert (spec.row_shape, spec.rows_per_block, spec.tokens_are_rows) == ((8, 128), 16, True)
    host = _host_cache(spec, 6, 0)
    cache = _on_device(fake, host, 1)
    fake.log.clear()
    k, v = gather_layer(spec, cache, [5, 0, 3])
    hk, hv = gather_layer(spec, host, [5, 0, 3])
    assert fake.problems == []
    assert _ops(fake) and all(e[1] == 1 for e in _ops(fake)), _ops(fake)
    assert k.shape == v.shape == np.asarray(hk).shape == (48, 8, 128)
    assert np.asarray(k).tobytes() == np.asarray(hk).tobytes() and np.asarray(v).tobytes() == np.asarray(hv).tobytes()

    bits = host.view(np.uint16) if dtype == "bfloat16" else host
    dcache = _on_device(fake, np.zeros_like(host), 1)
    dest = PagedDestination(spec, [dcache], [DROP, 4, 2])
    dest.write(0, 0, 0, hk, dest.layer_tokens)
    dest.write(0, 1, 5, hv[5:], dest.layer_tokens)
    dest.write(0, 1, 0, hv[:5], dest.layer_tokens)
    assert fake.problems == []
    assert _ops(fake) and all(e[1] == 1 for e in _ops(fake)), _ops(fake)
    got = np.asarray(dcache)
    assert got[4].tobytes() == bits[0].tobytes() and got[2].tobytes() == bits[3].tobytes()
    assert not got[[0, 1, 3, 5]].any()  # the dropped slot's block (5) and unnamed ones untouched
