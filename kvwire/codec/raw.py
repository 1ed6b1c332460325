"""``raw``: the tensor's bytes as they are (bit-exact, NaN and inf included)."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvwire.codec import _numeric as nm
from kvwire.codec.base import Codec, EncodedChunk, TensorKind, numpy_dtype
from kvwire.errors import ProtocolError


class RawCodec(Codec):
    name = "raw"
    codec_id = 0x00
    lossless = True

    def encode(self, x: Any, kind: TensorKind) -> EncodedChunk:
        # the input rules of every codec: a non-empty [tokens, heads, head_dim] array of
        # float16, bfloat16 or float32 in little-endian order (the wire's); a valid
        # C-contiguous array is not copied (the payload is a view of it); a kind of K or V
        TensorKind(kind)
        arr, _name = nm.as_chunk(x)
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
        TensorKind(kind)
        if nm.check_params(params, self.name):
            raise ProtocolError("raw codec takes no parameters")
        shape = nm.check_shape(shape, self.name)
        dt = numpy_dtype(dtype)
        (buf,) = nm.split_payload(payload, [shape[0] * shape[1] * shape[2] * dt.itemsize], self.name)
        result = nm.output_array(out, shape, dtype)
        src = np.frombuffer(buf, dtype=dt).reshape(shape)
        if out is not None:
            result[...] = src
            return result
        return src.copy()

    def encoded_size_ratio(self, shape: tuple[int, int, int], dtype: str) -> float:
        return numpy_dtype(dtype).itemsize / 2.0
