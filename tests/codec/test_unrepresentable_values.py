"""A quantizer refuses a tensor for its values (NaN, infinity; int4: a group whose range
exceeds float32) with ``UnrepresentableValuesError``, a ``UsageError``: on the numpy
reference, the compiled host path (``encode`` and ``encode_ranges``) and the GPU flag
check alike, with or without an entropy stage.  ``codec="auto"`` catches exactly this
class to send such a chunk raw (docs/codecs.md, Input rules), so no other refusal of an
encode may be one, and every refusal of values must be."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import kvwire
from kvwire.codec import TensorKind, _host, get_codec, numpy_dtype
from kvwire.codec import gpu as g
from kvwire.codec.base import Codec
from kvwire.errors import ProtocolError, UnrepresentableValuesError, UsageError
from tests.conftest import needs_extension

QUANTIZERS = ["fp8", "int8", "int4"]
CODECS = [*QUANTIZERS, *(f"{q}+{e}" for q in QUANTIZERS for e in ("zstd", "lz4"))]
DTYPES = ["float16", "bfloat16", "float32"]
KINDS = [TensorKind.K, TensorKind.V]
SHAPE = (40, 2, 64)
needs_ext = needs_extension(_host.ext is not None, "kvwire.codec._hostcodec")


def _base(codec: Codec) -> Any:
    return getattr(codec, "inner", codec)


def _array(dtype: str, poison: float | None = None) -> np.ndarray[Any, Any]:
    x = np.random.default_rng(4).standard_normal(SHAPE).astype(np.float32)
    if poison is not None:
        x[17, 1, 33] = poison
    return x.astype(numpy_dtype(dtype))


def _wide_range() -> np.ndarray[Any, Any]:
    """Finite float32 values whose max - min overflows in int4's group of (token 0, head 0,
    channel 0) for K (a channel over 32 tokens) and for V (32 channels of a token)."""
    x = _array("float32")
    x[0, 0, 0], x[1, 0, 0], x[0, 0, 1] = 3e38, -3e38, -3e38
    return x


def _paths() -> list[str]:
    return ["numpy", "encode", "encode_ranges"] if _host.ext is not None else ["numpy", "encode"]


def _encode(name: str, path: str, x: np.ndarray[Any, Any], kind: TensorKind) -> Any:
    codec = get_codec(name)
    if path == "numpy":
        return _base(codec).encode_numpy(x, kind)
    if path == "encode":
        return codec.encode(x, kind)
    # rows where they lie, split in two ranges (a paged cache's blocks), compiled
    row = SHAPE[2] * x.itemsize
    whole = SHAPE[0] * SHAPE[1] * row
    spans = np.array([[0, 24 * row], [24 * row, whole - 24 * row]], np.int64)
    return codec.encode_ranges(x.reshape(-1).view(np.uint8).data, spans.data, SHAPE, x.dtype.name, kind)


def test_the_class_is_a_usage_error_exported_with_the_others() -> None:
    assert issubclass(UnrepresentableValuesError, UsageError)
    assert issubclass(UnrepresentableValuesError, ValueError)
    assert kvwire.UnrepresentableValuesError is UnrepresentableValuesError
    assert "UnrepresentableValuesError" in kvwire.__all__
    assert UnrepresentableValuesError.code == UsageError.code


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("kind", KINDS)
def test_nan_and_infinity_are_refused_with_the_class(name: str, dtype: str, value: float, kind: TensorKind) -> None:
    x = _array(dtype, value)
    base = name.split("+")[0]
    for path in _paths():
        with pytest.raises(UnrepresentableValuesError, match=f"codec '{base}' cannot carry NaN or infinity"):
            _encode(name, path, x, kind)


@pytest.mark.parametrize("name", ["int4", "int4+zstd", "int4+lz4"])
@pytest.mark.parametrize("kind", KINDS)
def test_an_int4_group_range_past_float32_is_refused_with_the_class(name: str, kind: TensorKind) -> None:
    x = _wide_range()
    for path in _paths():
        with pytest.raises(UnrepresentableValuesError, match="value range exceeds float32"):
            _encode(name, path, x, kind)
    for other in ("fp8", "int8"):  # finite values: the row-scaled quantizers take them
        get_codec(other).encode(x, kind)


@pytest.mark.parametrize("name", ["raw", "raw+zstd", "raw+lz4"])
def test_raw_carries_them(name: str) -> None:
    for x in (_array("float16", np.nan), _array("float32", -np.inf), _wide_range()):
        codec = get_codec(name)
        enc = codec.encode(x, TensorKind.K)
        y = codec.decode(enc.params, enc.payload, shape=SHAPE, dtype=x.dtype.name, kind=TensorKind.K)
        assert y.tobytes() == x.tobytes()


@needs_ext
@pytest.mark.parametrize("name", QUANTIZERS)
def test_the_compiled_and_numpy_paths_agree(name: str) -> None:
    x = _array("float16", np.inf)
    errors = []
    for path in _paths():
        try:
            _encode(name, path, x, TensorKind.V)
        except UsageError as exc:
            errors.append((type(exc), str(exc)))
    assert len(errors) == 3 and len(set(errors)) == 1 and errors[0][0] is UnrepresentableValuesError


@pytest.mark.parametrize("name", QUANTIZERS)
def test_the_gpu_flags_for_values_raise_the_class(name: str) -> None:
    with pytest.raises(UnrepresentableValuesError, match=f"codec '{name}' cannot carry NaN or infinity"):
        g._check_flags(g.FLAG_NONFINITE, name)
    with pytest.raises(UnrepresentableValuesError, match="value range exceeds float32"):
        g._check_flags(g.FLAG_RANGE, name)
    for flag in (g.FLAG_BADCODE, g.FLAG_OVERFLOW, g.FLAG_OUTSIDE):  # the peer's bytes, not values
        with pytest.raises(ProtocolError):
            g._check_flags(flag, name)
    g._check_flags(0, name)


@pytest.mark.parametrize("name", CODECS)
def test_other_refusals_of_an_encode_are_not_the_class(name: str) -> None:
    """The caller's mistakes stay plain UsageErrors: ``auto`` must not send them raw."""
    codec = get_codec(name)
    for bad in (np.zeros(SHAPE, np.float64), np.zeros((4, 64), np.float16), np.zeros((0, 2, 64), np.float16)):
        with pytest.raises(UsageError) as info:
            codec.encode(bad, TensorKind.K)
        assert type(info.value) is UsageError
    with pytest.raises(UsageError) as info:
        codec.encode(_array("float16", np.nan), 0.0)  # type: ignore[arg-type]
    assert type(info.value) is UsageError
