"""``int8``: symmetric 8-bit integers with one float32 scale per (token, head).

``scale = absmax / 127``; ``code = clamp(rint(x / scale), -127, 127)`` (half to even);
a row of zeros has scale 0.  Payload: ``tokens*heads`` float32 scales (little-endian),
then one int8 code per element.  The code -128 is never produced and is rejected.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvwire.codec import _host
from kvwire.codec import _numeric as nm
from kvwire.codec.base import Codec, EncodedChunk, TensorKind
from kvwire.errors import ProtocolError

INT8_MAX = np.float32(127.0)


class Int8Codec(Codec):
    name = "int8"
    codec_id = 0x02

    def payload_size(self, params: bytes, shape: tuple[int, int, int], dtype: str) -> int:
        rows = shape[0] * shape[1]
        return rows * 4 + rows * shape[2]

    def encode(self, x: Any, kind: TensorKind) -> EncodedChunk:
        if _host.ext is None:
            return self.encode_numpy(x, kind)
        arr, name = nm.as_chunk(x)
        payload = _host.encode_rows(_host.INT8, arr, name, self.name)
        return EncodedChunk(self.codec_id, b"", payload.data)

    def encode_numpy(self, x: Any, kind: TensorKind) -> EncodedChunk:
        """The numpy reference encoder (what :meth:`encode` runs without the extension)."""
        arr, name = nm.as_chunk(x)
        tokens, heads, dim = arr.shape
        rows = tokens * heads
        payload = np.empty(rows * 4 + rows * dim, np.uint8)
        scales_out = payload[: rows * 4].view("<f4")
        codes = payload[rows * 4 :].view(np.int8).reshape(rows, dim)
        flat = arr.reshape(rows, dim)
        limit = np.full(nm.BLOCK_ELEMS + dim, INT8_MAX, np.float32)
        for r0, r1 in nm.row_blocks(rows, dim):
            n = (r1 - r0) * dim
            block = flat[r0:r1]
            amax_bits = nm.magnitude_bits(block, name).max(axis=1)
            nm.check_finite_magnitudes(amax_bits, name, self.name)
            scale = nm.magnitude_to_f32(amax_bits, name, np.empty(r1 - r0, np.float32))
            np.divide(scale, INT8_MAX, out=scale)
            scales_out[r0:r1] = scale
            scale[scale == 0] = 1
            q = nm.to_f32(block, name)
            np.divide(q, scale[:, None], out=q)
            np.rint(q, out=q)
            lim = limit[:n].reshape(r1 - r0, dim)
            np.minimum(q, lim, out=q)
            np.negative(lim, out=lim)
            np.maximum(q, lim, out=q)
            np.negative(lim, out=lim)
            np.copyto(codes[r0:r1], q, casting="unsafe")
        return EncodedChunk(self.codec_id, b"", payload.data)

    def decode(
        self,
        params: bytes,
        payload: Any,
        *,
        shape: tuple[int, int, int],
        dtype: str,
        kind: TensorKind,
        out: np.ndarray[Any, Any] | None = None,
    ) -> np.ndarray[Any, Any]:
        if _host.ext is None:
            return self.decode_numpy(params, payload, shape=shape, dtype=dtype, kind=kind, out=out)
        if params:
            raise ProtocolError("int8 codec takes no parameters")
        shape = nm.check_shape(shape, self.name)
        result = nm.output_array(out, shape, dtype)
        rows, dim = shape[0] * shape[1], shape[2]
        scale_buf, code_buf = nm.split_payload(payload, [rows * 4, rows * dim], self.name)
        _host.decode_rows(_host.INT8, scale_buf, code_buf, shape, dtype, result, self.name)
        return result

    def decode_numpy(
        self,
        params: bytes,
        payload: Any,
        *,
        shape: tuple[int, int, int],
        dtype: str,
        kind: TensorKind,
        out: np.ndarray[Any, Any] | None = None,
    ) -> np.ndarray[Any, Any]:
        """The numpy reference decoder (what :meth:`decode` runs without the extension)."""
        if params:
            raise ProtocolError("int8 codec takes no parameters")
        shape = nm.check_shape(shape, self.name)
        result = nm.output_array(out, shape, dtype)
        rows, dim = shape[0] * shape[1], shape[2]
        scale_buf, code_buf = nm.split_payload(payload, [rows * 4, rows * dim], self.name)
        scales = nm.read_scales(scale_buf, rows, self.name)
        codes = np.frombuffer(code_buf, np.int8).reshape(rows, dim)
        target = result if result.flags.c_contiguous else np.empty(shape, result.dtype)
        flat = target.reshape(rows, dim)
        for r0, r1 in nm.row_blocks(rows, dim):
            block = codes[r0:r1]
            if int(np.min(block)) == -128:
                raise ProtocolError("int8 payload carries the code -128")
            v = block.astype(np.float32)
            nm.scale_and_store(v, scales[r0:r1, None], None, flat[r0:r1], dtype, self.name)
        if target is not result:
            result[...] = target
        return result

    def encoded_size_ratio(self, shape: tuple[int, int, int], dtype: str) -> float:
        return self.payload_size(b"", shape, dtype) / (2.0 * shape[0] * shape[1] * shape[2])
