"""kvwire.codec.gpu, the GPU receiver and the device benchmark's exactness step run whole
over a fake CuPy (tests/fake_cupy.py) whose kernels are the CPU emulation of
tests/codec/emulation.py: device arrays at the addresses CuPy would give them,
streams that check every use of memory comes after its allocation in that stream's order,
and kernels that count misaligned accesses."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvwire.aio import _gpu
from kvwire.codec import TensorKind, get_codec, numpy_dtype
from kvwire.codec import gpu as g
from tests.codec.emulation import as_reference, tricky_values, value_bits
from tests.fake_cupy import FakeCupy

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def emulation(kernel_emulation: Any) -> Any:
    return kernel_emulation


@pytest.fixture
def fake(emulation: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCupy]:
    cupy = FakeCupy(emulation)
    monkeypatch.setitem(sys.modules, "cupy", cupy.module)
    # kernels, the module and the transfer streams are cached per process: none of the
    # fake's may outlive the test, nor a real one be used in it
    monkeypatch.setattr(g, "_FUNCTIONS", {})
    monkeypatch.setattr(_gpu, "_STREAMS", {})
    monkeypatch.setattr(g, "gpu_available", lambda: True)
    g._raw_module.cache_clear()
    yield cupy
    g._raw_module.cache_clear()


def _device(cupy: FakeCupy, x: np.ndarray[Any, Any]) -> Any:
    """``x`` on the device, as CuPy holds it (bfloat16 as its uint16 bits)."""
    x = x.view(np.uint16) if x.dtype == numpy_dtype("bfloat16") else x
    out = cupy.module.empty(x.shape, x.dtype)
    np.asarray(out)[...] = x
    return out


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("name", ["fp8", "int8", "int4"])
@pytest.mark.parametrize(("shape", "step"), [((5, 1, 8), 3), ((20, 2, 16), 6), ((9, 3, 8), 4)])
def test_launch_decode_of_each_chunk_where_it_lies_in_the_device_buffer(
    fake: FakeCupy, dtype: str, name: str, shape: tuple[int, int, int], step: int,
) -> None:
    """Every chunk of encode_tensor's buffer decoded by launch_decode straight from its
    offset there (chunk 1 of a (5, 1, 8) fp8 tensor in chunks of 3 tokens lies at byte
    36: 4 past an 8-byte boundary, where the vector kernel's 8-byte code loads fault):
    the kernel launch_decode picks reads the payload at its real alignment, and the
    values are numpy's."""
    cupy = fake.module
    codec = get_codec(name)
    x = tricky_values(dtype, (max(shape[0], 6), *shape[1:]), 3)[: shape[0]]
    enc = g.encode_tensor(codec, _device(fake, x), TensorKind.K, step, dtype=dtype)
    enc.check()
    assert fake.problems == []
    if shape == (5, 1, 8) and name != "int4":
        assert enc.offsets[1] == 36 and enc.buffer.data.ptr % 256 == 0
    out = _device(fake, np.full(x.nbytes, 0xFF, np.uint8).view(x.dtype).reshape(shape))
    flags = cupy.zeros(1, cupy.uint32)
    for off, size, s in zip(enc.offsets, enc.sizes, range(0, shape[0], step), strict=True):
        part = x[s : s + step]
        g.launch_decode(name, enc.params, enc.buffer[off : off + size], out[s : s + part.shape[0]],
                        dtype=dtype, kind=TensorKind.K, flags=flags)
        want = as_reference(codec).decode_numpy(enc.params, as_reference(codec).encode_numpy(part, TensorKind.K).payload,
                                        shape=part.shape, dtype=dtype, kind=TensorKind.K)
        assert np.asarray(out[s : s + part.shape[0]]).tobytes() == value_bits(want).tobytes(), s
    assert fake.problems == []
    assert int(flags.get()[0]) == 0
    kernels = {e[1] for e in fake.log if e[0] == "launch" and "_decode_" in e[1]}
    if name != "int4" and shape == (20, 2, 16) and dtype != "float32":
        # chunks of 240 bytes at 0, 240, 480: the aligned ones still take the vector kernel
        assert kernels == {f"kv_{name}_decode_vec_{g._SUFFIX[dtype]}"}


@pytest.mark.parametrize("elsewhere", [False, True])
@pytest.mark.parametrize("codec_name", ["fp8", "int4", "raw"])
def test_gpu_receiver_writes_a_layer_after_its_allocation_in_the_allocating_stream(
    fake: FakeCupy, codec_name: str, elsewhere: bool,
) -> None:
    """A layer is allocated on the current stream (CuPy's pool reuses a block freed there
    at once, ordered only in that stream), and decoded into on the transfer stream: that
    stream waits for the allocating one first (also when another stream is current as a
    chunk is decoded: a task of the application inside ``with stream:``), and the chunk
    is in the layer once decode() returns."""
    rx = _gpu.GpuReceiver("gpu:0")
    layer = rx.empty((2, 16, 4, 64), "float16")
    assert ("alloc", 0, "null:0", (2, 16, 4, 64)) in fake.log
    codec = get_codec(codec_name)
    x = np.random.default_rng(0).standard_normal((8, 4, 64)).astype(np.float16)
    enc = codec.encode(x, TensorKind.V)
    with fake.module.cuda.Stream() if elsewhere else contextlib.nullcontext():
        rx.decode(codec, enc.params, enc.payload, layer[1][8:16], "float16", TensorKind.V)
    assert fake.problems == []
    writes = [e for e in fake.log if e[0] in ("launch", "h2d") and "encode" not in str(e[1])]
    assert writes and all(e[-1] == "stream1:0" for e in writes), writes  # on the transfer stream
    assert fake.log[-1] == ("synchronize", "stream1:0")
    want = codec.decode(enc.params, enc.payload, shape=x.shape, dtype="float16", kind=TensorKind.V)
    assert np.asarray(layer[1][8:16]).tobytes() == np.asarray(want).tobytes()


@pytest.mark.parametrize("codec_name", ["int8", "raw"])
def test_decode_into_on_another_stream_waits_for_the_current_one(fake: FakeCupy, codec_name: str) -> None:
    """decode_into(stream=...) writes ``out``, made on the current stream, only after that
    stream's work: its writes on the given stream wait for an event recorded there."""
    cupy = fake.module
    out = cupy.empty((8, 2, 16), cupy.float32)  # on the null stream
    other = cupy.cuda.Stream(non_blocking=True)
    codec = get_codec(codec_name)
    x = np.random.default_rng(1).standard_normal((8, 2, 16)).astype(np.float32)
    enc = codec.encode(x, TensorKind.K)
    g.decode_into(codec, enc.params, enc.payload, out, dtype="float32", kind=TensorKind.K, stream=other)
    assert fake.problems == []
    assert ("wait", other.name, "null:0") in fake.log
    want = codec.decode(enc.params, enc.payload, shape=x.shape, dtype="float32", kind=TensorKind.K)
    assert np.asarray(out).tobytes() == np.asarray(want).tobytes()
    # on the current stream itself: nothing to wait for
    fake.log.clear()
    g.decode_into(codec, enc.params, enc.payload, out, dtype="float32", kind=TensorKind.K)
    assert fake.problems == [] and not [e for e in fake.log if e[0] == "wait"]


def _benchmark(monkeypatch: pytest.MonkeyPatch) -> Any:
    """benchmarks/gpu_device.py imported (its sys.path and environment changes undone)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("KVWIRE_NO_EXTENSIONS", "1")
    spec = importlib.util.spec_from_file_location("gpu_device_under_test", ROOT / "benchmarks" / "gpu_device.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


class _Pool:
    """multiprocessing.Pool's map_async, run here."""

    def map_async(self, fn: Any, jobs: list[Any]) -> Any:
        results = [fn(job) for job in jobs]

        class Done:
            def get(self, timeout: float | None = None) -> list[Any]:
                return results

        return Done()


def test_the_benchmark_exactness_step_finds_no_difference(fake: FakeCupy, monkeypatch: pytest.MonkeyPatch) -> None:
    """The device run's bit-exactness step (benchmarks/gpu_device.py), on a small cache: every
    chunk encoded by the kernels is numpy's and every tensor decoded into the poisoned
    destination is numpy's decode, for each dtype the run covers.  (Its destination was
    uint16 for every dtype, refused for float16 chunks: the step failed on every GPU.)"""
    bench = _benchmark(monkeypatch)
    monkeypatch.setattr(bench, "LAYERS", 1)
    monkeypatch.setattr(bench, "HEADS", 2)
    monkeypatch.setattr(bench, "DIM", 16)
    monkeypatch.setattr(bench, "CHUNK_BYTES", 32 * 2 * 16 * 2)  # 32 tokens a chunk
    tokens = 80
    f32 = bench.make_cache(tokens)
    monkeypatch.setattr(bench, "_HOST", {d: [(k.astype(numpy_dtype(d)), v.astype(numpy_dtype(d))) for k, v in f32]
                                         for d in bench.DTYPES})
    assert len(bench._plan(tokens)) == 3
    results = bench.exactness(_Pool(), tokens)
    assert set(results) == {f"{c}/{d}" for c in bench.CODECS for d in bench.DTYPES}
    for key, r in results.items():
        assert (r["chunks"], r["chunks_differing"], r["tensors"], r["decoded_tensors_differing"]) == (6, 0, 2, 0), key
    assert fake.problems == []


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_the_benchmark_poisons_a_destination_decode_into_takes(
    fake: FakeCupy, monkeypatch: pytest.MonkeyPatch, dtype: str,
) -> None:
    bench = _benchmark(monkeypatch)
    out = bench.poisoned((4, 2, 8), dtype)
    assert g.check_destination(out, dtype) == (4, 2, 8)
    assert set(np.asarray(out).view(np.uint8).reshape(-1).tolist()) == {0xFF}
