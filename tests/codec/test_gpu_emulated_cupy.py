"""kvwire.codec.gpu run whole over a fake CuPy (tests/fake_cupy.py) whose kernels are the CPU emulation of tests/codec/test_gpu_emulated.py: device arrays at
the addresses CuPy would give them, streams that check every use of memory comes after
its allocation in that stream's order, and kernels that count misaligned accesses."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvwire.aio import _gpu
from kvwire.codec import TensorKind, get_codec, numpy_dtype
from kvwire.codec import gpu as g
from tests.codec.test_gpu_emulated import _bits, _ref, _tricky, build_emulation
from tests.fake_cupy import FakeCupy


@pytest.fixture(scope="module")
def emulation(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return build_emulation(tmp_path_factory.mktemp("kvquant_emu_cupy"))


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
    x = _tricky(dtype, (max(shape[0], 6), *shape[1:]), 3)[: shape[0]]
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
        want = _ref(codec).decode_numpy(enc.params, _ref(codec).encode_numpy(part, TensorKind.K).payload,
                                        shape=part.shape, dtype=dtype, kind=TensorKind.K)
        assert np.asarray(out[s : s + part.shape[0]]).tobytes() == _bits(want).tobytes(), s
    assert fake.problems == []
    assert int(flags.get()[0]) == 0
    kernels = {e[1] for e in fake.log if e[0] == "launch" and "_decode_" in e[1]}
    if name != "int4" and shape == (20, 2, 16) and dtype != "float32":
        # chunks of 240 bytes at 0, 240, 480: the aligned ones still take the vector kernel
        assert kernels == {f"kv_{name}_decode_vec_{g._SUFFIX[dtype]}"}
