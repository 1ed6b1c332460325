"""``fp8``: OCP E4M3 ("fn") codes with one float32 scale per (token, head).

``scale = absmax / 448``; ``code = E4M3(x / scale)`` rounded half to even and saturated
at +-448; a row of zeros has scale 0 and codes 0 (decoded as exact zeros).
Payload: ``tokens*heads`` float32 scales (little-endian), then one code byte per element.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvwire.codec import _host
from kvwire.codec import _numeric as nm
from kvwire.codec.base import Codec, EncodedChunk, TensorKind
from kvwire.errors import ProtocolError


class Fp8Codec(Codec):
    name = "fp8"
    codec_id = 0x01

    def payload_size(self, params: bytes, shape: tuple[int, int, int], dtype: str) -> int:
        rows = shape[0] * shape[1]
        return rows * 4 + rows * shape[2]

    def encode(self, x: Any, kind: TensorKind) -> EncodedChunk:
        if _host.ext is None:
            return self.encode_numpy(x, kind)
        arr, name = nm.as_chunk(x)
        payload = _host.encode_rows(_host.FP8, arr, name, self.name)
        return EncodedChunk(self.codec_id, b"", payload.data)

    def encode_numpy(self, x: Any, kind: TensorKind) -> EncodedChunk:
        """The numpy reference encoder (what :meth:`encode` runs without the extension)."""
        arr, name = nm.as_chunk(x)
        tokens, heads, dim = arr.shape
        rows = tokens * heads
        payload = np.empty(rows * 4 + rows * dim, np.uint8)
        scales_out = payload[: rows * 4].view("<f4")
        codes = payload[rows * 4 :].reshape(rows, dim)
        flat = arr.reshape(rows, dim)
        q = np.empty(nm.BLOCK_ELEMS + dim, np.float32)
        work = np.empty_like(q)
        work2 = np.empty(q.size, np.int32)
        for r0, r1 in nm.row_blocks(rows, dim):
            n = (r1 - r0) * dim
            block = flat[r0:r1]
            mag = nm.magnitude_bits(block, name)
            amax_bits = mag.max(axis=1)
            nm.check_finite_magnitudes(amax_bits, name, self.name)
            scale = nm.magnitude_to_f32(amax_bits, name, np.empty(r1 - r0, np.float32))
            np.divide(scale, nm.FP8_MAX, out=scale)
            scales_out[r0:r1] = scale
            # a zero scale means an all-zero row: dividing by 1 keeps its codes 0
            scale[scale == 0] = 1
            qb = nm.magnitude_to_f32(mag, name, q[:n].reshape(r1 - r0, dim))
            np.divide(qb, scale[:, None], out=qb)
            out = codes[r0:r1]
            nm.f32_mag_to_e4m3(q[:n], work[:n], work2[:n], out.reshape(-1))
            sign = _sign_bits(block, name)
            np.bitwise_or(out, sign, out=out, casting="unsafe")
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
            raise ProtocolError("fp8 codec takes no parameters")
        shape = nm.check_shape(shape, self.name)
        result = nm.output_array(out, shape, dtype)
        rows, dim = shape[0] * shape[1], shape[2]
        scale_buf, code_buf = nm.split_payload(payload, [rows * 4, rows * dim], self.name)
        _host.decode_rows(_host.FP8, scale_buf, code_buf, shape, dtype, result, self.name)
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
            raise ProtocolError("fp8 codec takes no parameters")
        shape = nm.check_shape(shape, self.name)
        result = nm.output_array(out, shape, dtype)
        rows, dim = shape[0] * shape[1], shape[2]
        scale_buf, code_buf = nm.split_payload(payload, [rows * 4, rows * dim], self.name)
        scales = nm.read_scales(scale_buf, rows, self.name)
        codes = np.frombuffer(code_buf, np.uint8).reshape(rows, dim)
        target = result if result.flags.c_contiguous else np.empty(shape, result.dtype)
        flat = target.reshape(rows, dim)
        vals = np.empty(nm.BLOCK_ELEMS + dim, np.float32)
        for r0, r1 in nm.row_blocks(rows, dim):
            block = codes[r0:r1]
            if int(np.max(block & np.uint8(0x7F))) == 0x7F:
                raise ProtocolError("fp8 payload carries a NaN code")
            v = vals[: (r1 - r0) * dim].reshape(r1 - r0, dim)
            np.take(nm.E4M3_TO_F32, block, out=v)
            nm.scale_and_store(v, scales[r0:r1, None], None, flat[r0:r1], dtype, self.name)
        if target is not result:
            result[...] = target
        return result

    def encoded_size_ratio(self, shape: tuple[int, int, int], dtype: str) -> float:
        return self.payload_size(b"", shape, dtype) / (2.0 * shape[0] * shape[1] * shape[2])


def _sign_bits(block: np.ndarray[Any, Any], name: str) -> np.ndarray[Any, Any]:
    if name == "float32":
        return (block.view(np.uint32) >> np.uint32(24)) & np.uint32(0x80)
    return (block.view(np.uint16) >> np.uint16(8)) & np.uint16(0x80)
