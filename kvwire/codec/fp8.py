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
from kvwire.codec._rowscaled import RowScaledCodec
from kvwire.codec.base import EncodedChunk, TensorKind
from kvwire.errors import ProtocolError


class Fp8Codec(RowScaledCodec):
    name = "fp8"
    codec_id = 0x01
    host_loop = _host.FP8

    def encode_numpy(self, x: Any, kind: TensorKind) -> EncodedChunk:
        """The numpy reference encoder (what :meth:`encode` runs without the extension)."""
        TensorKind(kind)
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
            nm.fit_scale(scale, nm.FP8_MAX)
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

    def _codes_to_f32(self, codes: np.ndarray[Any, Any], out: np.ndarray[Any, Any]) -> None:
        if int(np.max(codes & np.uint8(0x7F))) == 0x7F:
            raise ProtocolError("fp8 payload carries a NaN code")
        np.take(nm.E4M3_TO_F32, codes, out=out)


def _sign_bits(block: np.ndarray[Any, Any], name: str) -> np.ndarray[Any, Any]:
    if name == "float32":
        return (block.view(np.uint32) >> np.uint32(24)) & np.uint32(0x80)
    return (block.view(np.uint16) >> np.uint16(8)) & np.uint16(0x80)
