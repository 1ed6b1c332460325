"""What the GPU decode writes into: ``decode_into`` takes only a destination the kernel of
the chunk's dtype fits (a float32 kernel writing into a float16 array would write past its
end), and refuses any other before CuPy is touched.  Run without a GPU: numpy arrays stand
for CuPy ones (same ``dtype``, ``ndim``, ``shape`` and ``flags``), and a ``cupy`` module
that fails on any use shows nothing reached the device."""

from __future__ import annotations

import sys
import types
from typing import Any

import numpy as np
import pytest

from kvwire.codec import TensorKind, get_codec, gpu, numpy_dtype
from kvwire.errors import UsageError

SHAPE = (4, 2, 8)


@pytest.mark.parametrize(("dtype", "out_dtype"), [
    ("float16", np.float16), ("float32", np.float32),
    ("bfloat16", numpy_dtype("bfloat16")), ("bfloat16", np.uint16), ("bfloat16", np.int16),
])
def test_destinations_the_kernel_fits(dtype: str, out_dtype: Any) -> None:
    assert gpu.check_destination(np.empty(SHAPE, out_dtype), dtype) == SHAPE


@pytest.mark.parametrize(("dtype", "out", "match"), [
    ("float32", np.empty(SHAPE, np.float16), "float32 destination, got float16"),  # the f32 kernel: past the end
    ("float16", np.empty(SHAPE, np.float32), "float16 destination, got float32"),
    ("bfloat16", np.empty(SHAPE, np.float32), "bfloat16"),
    ("float16", np.empty(SHAPE, np.uint16), "float16 destination, got uint16"),
    ("float16", np.empty(SHAPE, numpy_dtype("bfloat16")), "float16 destination, got bfloat16"),
    ("float32", np.empty(SHAPE, np.float64), "float32 destination, got float64"),
    ("float32", np.empty(SHAPE, np.int32), "float32 destination, got int32"),
    ("float64", np.empty(SHAPE, np.float64), "unsupported dtype"),
    ("float16", np.empty((*SHAPE, 1), np.float16), "destination, got shape"),
    ("float16", np.empty(SHAPE[:2], np.float16), "destination, got shape"),
    ("float16", np.empty((4, 2, 16), np.float16)[:, :, ::2], "C-contiguous"),
])
def test_destinations_refused(dtype: str, out: np.ndarray[Any, Any], match: str) -> None:
    with pytest.raises(UsageError, match=match):
        gpu.check_destination(out, dtype)


@pytest.fixture
def no_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``cupy`` whose every use fails the test."""
    cupy = types.ModuleType("cupy")

    def touched(name: str) -> Any:
        raise AssertionError(f"cupy.{name} used before the destination was checked")

    cupy.__getattr__ = touched  # type: ignore[method-assign]
    monkeypatch.setitem(sys.modules, "cupy", cupy)


@pytest.mark.parametrize("name", ["raw", "fp8", "int8", "int4", "int8+zstd"])
@pytest.mark.parametrize(("dtype", "out_dtype"), [("float32", np.float16), ("float16", np.float32),
                                                  ("float16", np.uint16)])
def test_decode_into_refuses_a_mismatched_destination_before_any_device_work(
    no_device: None, name: str, dtype: str, out_dtype: Any,
) -> None:
    codec = get_codec(name)
    x = np.random.default_rng(0).standard_normal(SHAPE).astype(numpy_dtype(dtype))
    chunk = codec.encode(x, TensorKind.K)
    with pytest.raises(UsageError, match="destination"):
        gpu.decode_into(codec, chunk.params, chunk.payload, np.empty(SHAPE, out_dtype), dtype=dtype,
                        kind=TensorKind.K)


def test_decode_on_device_refuses_an_unknown_dtype(no_device: None) -> None:
    codec = get_codec("fp8")
    chunk = codec.encode(np.ones(SHAPE, np.float32), TensorKind.K)
    with pytest.raises(UsageError, match="unsupported dtype"):
        gpu.decode_on_device(codec, chunk.params, chunk.payload, shape=SHAPE, dtype="float64", kind=TensorKind.K)


@pytest.mark.parametrize("shape", [(4, -1, 8), (4, 2), (4, 2.5, 8), (0, 2, 8)])
def test_decode_on_device_checks_the_shape_before_it_allocates(no_device: None, shape: Any) -> None:
    """A shape that is no [tokens, heads, head_dim] of positive ints is refused before the
    output array is allocated on the device."""
    codec = get_codec("fp8")
    chunk = codec.encode(np.ones(SHAPE, np.float32), TensorKind.K)
    with pytest.raises(UsageError):
        gpu.decode_on_device(codec, chunk.params, chunk.payload, shape=shape, dtype="float32", kind=TensorKind.K)
