"""What ``fp8`` and ``int8`` share: one float32 scale per (token, head) row, one code byte
per element, no params, and the same compiled dispatch.

Payload: ``tokens*heads`` little-endian float32 scales, then ``tokens*heads*head_dim`` codes.
A subclass gives its numpy reference encoder and the numpy decode of one block of rows.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, ClassVar

import numpy as np

from kvwire.codec import _host
from kvwire.codec import _numeric as nm
from kvwire.codec.base import Codec, EncodedChunk, TensorKind
from kvwire.errors import ProtocolError


class RowScaledCodec(Codec):
    #: which of the compiled row loops (``_host.FP8`` or ``_host.INT8``)
    host_loop: ClassVar[int]

    def payload_size(self, params: bytes, shape: tuple[int, int, int], dtype: str) -> int:
        rows = shape[0] * shape[1]
        return rows * 4 + rows * shape[2]

    def encoded_size_ratio(self, shape: tuple[int, int, int], dtype: str) -> float:
        return self.payload_size(b"", shape, dtype) / (2.0 * shape[0] * shape[1] * shape[2])

    def encode(self, x: Any, kind: TensorKind) -> EncodedChunk:
        TensorKind(kind)  # only K and V are defined, though both encode alike
        if _host.ext is None:
            return self.encode_numpy(x, kind)
        arr, name = nm.as_chunk(x)
        payload = _host.encode_rows(self.host_loop, arr, name, self.name)
        return EncodedChunk(self.codec_id, b"", payload.data)

    def encode_ranges(
        self, base: memoryview, spans: Any, shape: tuple[int, int, int], dtype: str, kind: TensorKind
    ) -> EncodedChunk | None:
        TensorKind(kind)
        shape = _host.check_encode_ranges(base, spans, shape, dtype, self.name)
        if _host.ext is None:
            return None
        payload = _host.encode_rows_at(self.host_loop, base, spans, shape, dtype, self.name)
        return None if payload is None else EncodedChunk(self.codec_id, b"", payload.data)

    def decode_ranges(
        self, params: bytes, payload: Any, base: memoryview, spans: Any, *,
        shape: tuple[int, int, int], dtype: str, kind: TensorKind,
    ) -> bool:
        params = nm.check_params(params, self.name)
        nm.check_base(base, self.name)
        nm.check_spans(spans, self.name)
        _host.check_span_items(spans, self.name)
        TensorKind(kind)
        if _host.ext is None:
            return False
        shape, scale_buf, code_buf = self._payload(params, payload, shape)
        return _host.decode_rows_at(self.host_loop, scale_buf, code_buf, shape, dtype, base, spans, self.name)

    @abstractmethod
    def encode_numpy(self, x: Any, kind: TensorKind) -> EncodedChunk:
        """The numpy reference encoder (what :meth:`encode` runs without the extension)."""

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
        TensorKind(kind)
        if _host.ext is None:
            return self.decode_numpy(params, payload, shape=shape, dtype=dtype, kind=kind, out=out)
        shape, result, scale_buf, code_buf = self._split(params, payload, shape, dtype, out)
        _host.decode_rows(self.host_loop, scale_buf, code_buf, shape, dtype, result, self.name)
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
        TensorKind(kind)
        shape, result, scale_buf, code_buf = self._split(params, payload, shape, dtype, out)
        rows, dim = shape[0] * shape[1], shape[2]
        scales = nm.read_scales(scale_buf, rows, self.name)
        # the codes are read a block at a time while earlier blocks are stored: an `out`
        # over the payload (decoding in place in a receive buffer) is written through a
        # fresh array, or it would overwrite codes not read yet
        overlaps = any(np.may_share_memory(result, np.frombuffer(b, np.uint8)) for b in (scale_buf, code_buf))
        target = result if result.flags.c_contiguous and not overlaps else np.empty(shape, result.dtype)
        flat = target.reshape(rows, dim)
        codes = np.frombuffer(code_buf, np.uint8).reshape(rows, dim)
        vals = np.empty(nm.BLOCK_ELEMS + dim, np.float32)
        for r0, r1 in nm.row_blocks(rows, dim):
            v = vals[: (r1 - r0) * dim].reshape(r1 - r0, dim)
            self._codes_to_f32(codes[r0:r1], v)
            nm.scale_and_store(v, scales[r0:r1, None], None, flat[r0:r1], dtype, self.name)
        if target is not result:
            result[...] = target
        return result

    @abstractmethod
    def _codes_to_f32(self, codes: np.ndarray[Any, Any], out: np.ndarray[Any, Any]) -> None:
        """Unscaled float32 values of a block of code bytes, into ``out``; a
        :class:`~kvwire.ProtocolError` for a code the encoder never produces."""

    def _split(
        self,
        params: bytes,
        payload: Any,
        shape: tuple[int, int, int],
        dtype: str,
        out: np.ndarray[Any, Any] | None,
    ) -> tuple[tuple[int, int, int], np.ndarray[Any, Any], memoryview, memoryview]:
        shape, scale_buf, code_buf = self._payload(nm.check_params(params, self.name), payload, shape)
        return shape, nm.output_array(out, shape, dtype), scale_buf, code_buf

    def _payload(
        self, params: bytes, payload: Any, shape: tuple[int, int, int]
    ) -> tuple[tuple[int, int, int], memoryview, memoryview]:
        """The checked shape and the payload's scales and codes (``params`` as
        :func:`~kvwire.codec._numeric.check_params` gives them)."""
        if params:
            raise ProtocolError(f"{self.name} codec takes no parameters")
        shape = nm.check_shape(shape, self.name)
        rows, dim = shape[0] * shape[1], shape[2]
        scale_buf, code_buf = nm.split_payload(payload, [rows * 4, rows * dim], self.name)
        return shape, scale_buf, code_buf
