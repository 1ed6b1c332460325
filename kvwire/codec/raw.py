"""``raw``: the tensor's bytes as they are (bit-exact, NaN and inf included)."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvwire.codec.base import Codec, EncodedChunk, TensorKind, numpy_dtype
from kvwire.errors import ProtocolError


class RawCodec(Codec):
    name = "raw"
    codec_id = 0x00
    lossless = True

    def encode(self, x: Any, kind: TensorKind) -> EncodedChunk:
        arr = np.ascontiguousarray(x)
        return EncodedChunk(self.codec_id, b"", arr.reshape(-1).view(np.uint8).data)

    def decode(
        self,
        params: bytes,
        payload: Any,
        *,
        shape: tuple[int, int, int],
        dtype: str,
        kind: TensorKind,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        if params:
            raise ProtocolError("raw codec takes no parameters")
        dt = numpy_dtype(dtype)
        expected = shape[0] * shape[1] * shape[2] * dt.itemsize
        if len(payload) != expected:
            raise ProtocolError(f"raw payload is {len(payload)} bytes, expected {expected}")
        src = np.frombuffer(payload, dtype=dt).reshape(shape)
        if out is not None:
            out[...] = src
            return out
        return src.copy()

    def encoded_size_ratio(self, shape: tuple[int, int, int], dtype: str) -> float:
        return numpy_dtype(dtype).itemsize / 2.0
