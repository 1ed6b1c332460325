"""``int4``: KIVI-style asymmetric 4-bit codes, two per byte.

Keys (``TensorKind.K``) are grouped per channel over blocks of ``group`` tokens (outlier
channels then get their own range); values (``TensorKind.V``) per token over runs of
``group`` channels inside each head.  The last block or run may be shorter.  Per group:
``lo = min``, ``scale = (max - lo) / 15``, ``code = clamp(rint((x - lo) / scale), 0, 15)``,
decoded as ``code * scale + lo``.  Params: one byte, ``group``.  Payload: float32 scales,
float32 minimums (both little-endian, group order below), then the codes of the elements
in ``[tokens, heads, head_dim]`` order, element ``2i`` in the low nibble of byte ``i``.
Group order: K ``[token_block, head, channel]``, V ``[token, head, channel_run]``.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from kvwire.codec import _host
from kvwire.codec import _numeric as nm
from kvwire.codec.base import Codec, EncodedChunk, TensorKind
from kvwire.errors import ProtocolError, UnrepresentableValuesError, UsageError

INT4_MAX = np.float32(15.0)
DEFAULT_GROUP = 32


def group_count(shape: tuple[int, int, int], kind: TensorKind, group: int) -> int:
    tokens, heads, dim = shape
    if kind == TensorKind.K:
        return math.ceil(tokens / group) * heads * dim
    return tokens * heads * math.ceil(dim / group)


def _expand(per_group: nm.F32, kind: TensorKind, shape: tuple[int, int, int], group: int) -> nm.F32:
    """Per-group values repeated to one per element."""
    tokens, heads, dim = shape
    if kind == TensorKind.K:
        blocks = per_group.reshape(-1, heads, dim)
        return np.repeat(blocks, group, axis=0)[:tokens]
    runs = per_group.reshape(tokens, heads, -1)
    return np.repeat(runs, group, axis=2)[:, :, :dim]


class Int4Codec(Codec):
    name = "int4"
    codec_id = 0x03

    def __init__(self, group: int = DEFAULT_GROUP) -> None:
        if not isinstance(group, numbers.Integral) or isinstance(group, bool) or not 1 <= group <= 255:
            raise UsageError(f"int4 group size must be an int in [1, 255], got {group!r}")
        self.group: int = int(group)

    def payload_size(self, params: bytes, shape: tuple[int, int, int], dtype: str, kind: TensorKind = TensorKind.K) -> int:
        group = _group_from_params(params)
        n = shape[0] * shape[1] * shape[2]
        return 8 * group_count(shape, kind, group) + (n + 1) // 2

    def encode(self, x: Any, kind: TensorKind) -> EncodedChunk:
        if _host.ext is None:
            return self.encode_numpy(x, kind)
        arr, name = nm.as_chunk(x)
        kind = TensorKind(kind)
        ngroups = group_count(arr.shape, kind, self.group)
        payload = _host.int4_encode(arr, name, self.group, kind == TensorKind.V, ngroups)
        return EncodedChunk(self.codec_id, bytes([self.group]), payload.data)

    def encode_ranges(
        self, base: memoryview, spans: Any, shape: tuple[int, int, int], dtype: str, kind: TensorKind
    ) -> EncodedChunk | None:
        kind = TensorKind(kind)
        shape = _host.check_encode_ranges(base, spans, shape, dtype, self.name)
        if _host.ext is None:
            return None
        payload = _host.int4_encode_at(
            base, spans, shape, dtype, self.group, kind == TensorKind.V, group_count(shape, kind, self.group))
        return None if payload is None else EncodedChunk(self.codec_id, bytes([self.group]), payload.data)

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
        group, shape, kind, bufs = self._payload(params, payload, shape, kind)
        return _host.int4_decode_at(bufs, shape, group, kind == TensorKind.V, dtype, base, spans)

    def encode_numpy(self, x: Any, kind: TensorKind) -> EncodedChunk:
        """The numpy reference encoder (what :meth:`encode` runs without the extension)."""
        arr, name = nm.as_chunk(x)
        kind = TensorKind(kind)
        shape: tuple[int, int, int] = arr.shape
        _tokens, _heads, _dim = shape
        group = self.group
        nm.check_finite_magnitudes(nm.magnitude_bits(arr, name).reshape(-1), name, self.name)
        xf = nm.to_f32(arr, name)
        axis = 0 if kind == TensorKind.K else 2
        starts = np.arange(0, shape[axis], group)
        lo = np.minimum.reduceat(xf, starts, axis=axis)
        hi = np.maximum.reduceat(xf, starts, axis=axis)
        # a group's -0 and +0 tie: which one reduceat keeps depends on its SIMD path, so
        # both are stored as +0 (adding +0 turns -0 into +0 and changes nothing else)
        np.add(lo, np.float32(0), out=lo)
        np.add(hi, np.float32(0), out=hi)
        with np.errstate(over="ignore"):
            scale = np.subtract(hi, lo)
        if not np.all(np.isfinite(scale)):
            raise UnrepresentableValuesError("int4: a group's value range exceeds float32; use fp8, int8 or raw")
        np.divide(scale, INT4_MAX, out=scale)
        nm.fit_int4_scale(scale, lo)
        ngroups = scale.size
        n = xf.size
        payload = np.empty(8 * ngroups + (n + 1) // 2, np.uint8)
        payload[: 4 * ngroups].view("<f4")[:] = scale.reshape(-1)
        payload[4 * ngroups : 8 * ngroups].view("<f4")[:] = lo.reshape(-1)
        divisor = np.where(scale == 0, np.float32(1), scale)
        q = np.subtract(xf, _expand(lo, kind, shape, group))
        np.divide(q, _expand(divisor, kind, shape, group), out=q)
        np.rint(q, out=q)
        np.clip(q, np.float32(0), INT4_MAX, out=q)
        codes = np.zeros(n + (n & 1), np.uint8)
        np.copyto(codes[:n], q.reshape(-1), casting="unsafe")
        packed = payload[8 * ngroups :]
        np.left_shift(codes[1::2], 4, out=packed)
        np.bitwise_or(packed, codes[0::2], out=packed)
        return EncodedChunk(self.codec_id, bytes([group]), payload.data)

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
        return self._decode(params, payload, shape, dtype, kind, out, reference=False)

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
        return self._decode(params, payload, shape, dtype, kind, out, reference=True)

    def _decode(
        self,
        params: bytes,
        payload: Any,
        shape: tuple[int, int, int],
        dtype: str,
        kind: TensorKind,
        out: np.ndarray[Any, Any] | None,
        *,
        reference: bool,
    ) -> np.ndarray[Any, Any]:
        group, shape, kind, bufs = self._payload(nm.check_params(params, self.name), payload, shape, kind)
        result = nm.output_array(out, shape, dtype)
        n = shape[0] * shape[1] * shape[2]
        ngroups = group_count(shape, kind, group)
        if _host.ext is not None and not reference:
            _host.int4_decode(bufs, shape, group, kind == TensorKind.V, dtype, result)
            return result
        scale_buf, lo_buf, code_buf = bufs
        scale = nm.read_scales(scale_buf, ngroups, self.name)
        lo = np.frombuffer(lo_buf, "<f4").astype(np.float32)
        if not np.all(np.isfinite(lo)):
            raise ProtocolError("int4 payload carries a NaN or infinite minimum")
        packed = np.frombuffer(code_buf, np.uint8)
        if n & 1 and packed[-1] >> 4:
            raise ProtocolError("int4 payload has a non-zero padding nibble")
        codes = np.empty(n + (n & 1), np.float32)
        np.bitwise_and(packed, np.uint8(15), out=codes[0::2], casting="unsafe")
        np.right_shift(packed, np.uint8(4), out=codes[1::2], casting="unsafe")
        vals = codes[:n].reshape(shape)
        # scales, minimums and codes are all copied out of the payload above, so an `out`
        # over the payload (decoding in place in a receive buffer) can be written directly
        target = result if result.flags.c_contiguous else np.empty(shape, result.dtype)
        nm.scale_and_store(
            vals,
            _expand(scale, kind, shape, group),
            _expand(lo, kind, shape, group),
            target,
            dtype,
            self.name,
        )
        if target is not result:
            result[...] = target
        return result

    def _payload(
        self, params: bytes, payload: Any, shape: tuple[int, int, int], kind: TensorKind
    ) -> tuple[int, tuple[int, int, int], TensorKind, list[memoryview]]:
        """The group size, the checked shape and kind, and the payload's scales, minimums
        and codes (``params`` as :func:`~kvwire.codec._numeric.check_params` gives them)."""
        group = _group_from_params(params)
        shape = nm.check_shape(shape, self.name)
        try:
            kind = TensorKind(kind)
        except ValueError:
            raise UsageError(f"int4: unknown tensor kind {kind!r}") from None
        n = shape[0] * shape[1] * shape[2]
        ngroups = group_count(shape, kind, group)
        return group, shape, kind, nm.split_payload(payload, [4 * ngroups, 4 * ngroups, (n + 1) // 2], self.name)

    def encoded_size_ratio(self, shape: tuple[int, int, int], dtype: str) -> float:
        """The mean over a K and a V chunk of ``shape`` (a layer sends one of each): their
        group counts differ where ``head_dim`` or the token count is not a multiple of the
        group."""
        n = shape[0] * shape[1] * shape[2]
        groups = group_count(shape, TensorKind.K, self.group) + group_count(shape, TensorKind.V, self.group)
        size = 4 * groups + (n + 1) // 2
        return size / (2.0 * n)


def _group_from_params(params: bytes) -> int:
    if len(params) != 1 or params[0] == 0:
        raise ProtocolError("int4 params must be one non-zero byte (the group size)")
    return params[0]
