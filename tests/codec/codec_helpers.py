"""Shared helpers for the codec tests: element-wise error bounds stated in docs/codecs.md."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvwire.codec import TensorKind
from kvwire.codec.int4 import _expand, group_count

QUANTIZERS = ("fp8", "int8", "int4")
DTYPES = ("float16", "bfloat16", "float32")
TINY = 2.0**-140


def group_params(base: str, params: bytes, payload: Any, shape: tuple[int, int, int], kind: TensorKind) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Per-element (scale, minimum) of a plain (non-entropy) payload."""
    raw = np.frombuffer(memoryview(payload).cast("B"), np.uint8)
    if base == "int4":
        g = group_count(shape, kind, params[0])
        scale = raw[: 4 * g].view("<f4").astype(np.float64)
        lo = raw[4 * g : 8 * g].view("<f4").astype(np.float64)
        return _expand(scale, kind, shape, params[0]), _expand(lo, kind, shape, params[0])
    rows = shape[0] * shape[1]
    scale = raw[: 4 * rows].view("<f4").astype(np.float64).reshape(shape[0], shape[1], 1)
    return np.broadcast_to(scale, shape), np.zeros(shape)


def error_bound(base: str, x: np.ndarray[Any, Any], scale: np.ndarray[Any, Any], lo: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The largest |decode(encode(x)) - x| each element may show (float32 decode)."""
    ax = np.abs(x.astype(np.float64))
    if base == "fp8":
        return 2.0**-4 * ax + 2.0**-10 * scale + 2.0**-21 * ax + TINY
    if base == "int8":
        return 0.5 * scale + 2.0**-21 * ax + TINY
    hi = np.abs(lo) + 15 * scale
    return 0.5 * scale + 2.0**-20 * np.maximum(np.abs(lo), hi) + TINY


#: Half an ulp of each decode dtype: (relative to |x^|, absolute: half the subnormal step).
HALF_ULP = {"float16": (2.0**-11, 2.0**-25), "bfloat16": (2.0**-8, 2.0**-134), "float32": (0.0, 0.0)}


def output_rounding(dtype: str, xhat: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The most that rounding the f32 decode ``xhat`` to ``dtype`` moves an element
    (docs/codecs.md: what a float16 or bfloat16 decode adds to the f32 bound)."""
    rel, absolute = HALF_ULP[dtype]
    return rel * np.abs(xhat.astype(np.float64)) + absolute
