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
from kvwire.codec._rowscaled import RowScaledCodec
from kvwire.codec.base import EncodedChunk, TensorKind
from kvwire.errors import ProtocolError

INT8_MAX = np.float32(127.0)


class Int8Codec(RowScaledCodec):
    name = "int8"
    codec_id = 0x02
    host_loop = _host.INT8

    def encode_numpy(self, x: Any, kind: TensorKind) -> EncodedChunk:
        """The numpy reference encoder (what :meth:`encode` runs without the extension)."""
        TensorKind(kind)
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
            nm.fit_scale(scale, INT8_MAX)
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

    def _codes_to_f32(self, codes: np.ndarray[Any, Any], out: np.ndarray[Any, Any]) -> None:
        signed = codes.view(np.int8)
        if int(np.min(signed)) == -128:
            raise ProtocolError("int8 payload carries the code -128")
        out[...] = signed
