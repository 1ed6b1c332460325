"""The lossless entropy stage: ``<codec>+zstd`` (id bit 0x10) and ``<codec>+lz4`` (0x20).

Params: one flag byte (bit 0: the payload is compressed; other bits zero), then the inner
codec's params.  Payload: the inner payload, compressed (zstd frame, level 1; or an lz4
block without a size prefix) only when that makes it smaller.  For ``raw`` of 16- and
32-bit data, the bytes are shuffled first (all first bytes of the elements, then all
second bytes, ...), which groups the exponent bytes that compress well.

Neither stage expands more than :data:`ZSTD_MAX_RATIO` (= :data:`LZ4_MAX_RATIO`, 255)
times: an lz4 block cannot, and a zstd frame that would (a run of zeros, 32,000 times at
level 1) is made with its tail stored (:func:`bounded_zstd_frame`); a decoder refuses a
payload past the ratio before opening it, so a few bytes cannot make a receiver
decompress megabytes.
"""

from __future__ import annotations

from typing import Any, ClassVar

import lz4.block
import numpy as np
import zstandard

from kvwire.codec import _host
from kvwire.codec import _numeric as nm
from kvwire.codec.base import Codec, EncodedChunk, TensorKind, numpy_dtype
from kvwire.errors import ProtocolError

FLAG_COMPRESSED = 0x01
ZSTD_LEVEL = 1
#: python-lz4 takes the size of a block's output as a C int
LZ4_MAX_SIZE = 2**31 - 1
#: An lz4 block's output is at most 255 times its size: a sequence's literals are copied
#: one for one, and its match length grows by at most 255 per byte that encodes it (the
#: token and the two offset bytes more than cover the first 19).
LZ4_MAX_RATIO = 255
#: A zstd frame's content is at most this many times its length, plus ZSTD_RATIO_SLACK:
#: a decoder refuses a larger one before decompressing anything (a 2 KB frame of RLE
#: blocks declares 64 MiB), and the encoder never makes one (:func:`bounded_zstd_frame`).
#: As much as an lz4 block can expand: the entropy stage as a whole costs a receiver
#: at most this much decompression a byte, whichever stage the peer picks.  Real KV data
#: compresses 1.05-1.26 times at level 1 (MiniLM, every inner codec, tests/data): only
#: near-constant chunks (zero padding) come near it, and they go out at this ratio.
ZSTD_MAX_RATIO = LZ4_MAX_RATIO
#: Bytes a zstd payload may decompress to beyond ZSTD_MAX_RATIO times its length: every
#: CHUNK frame carries at least 39 bytes besides its payload (frame header 8, chunk fields
#: 26, params 1, CRC 4), and 255 x 39 > 8192, so a CHUNK frame still makes a receiver
#: decompress at most 255 times its size; a payload of up to 8 KiB is never held to it.
ZSTD_RATIO_SLACK = 8192
#: The largest zstd block (and its largest raw block): 128 KiB
ZSTD_BLOCK_MAX = 128 << 10
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def zstd_within_ratio(compressed: int, size: int) -> bool:
    """Whether a zstd payload of ``compressed`` bytes may decompress to ``size`` bytes: the
    decoder's check, before anything is decompressed, and the encoder's before it sends
    a frame (so it never sends one a decoder refuses)."""
    return size <= ZSTD_MAX_RATIO * compressed + ZSTD_RATIO_SLACK


def bounded_zstd_frame(data: bytes | memoryview) -> bytes:
    """One zstd frame of ``data`` within :data:`ZSTD_MAX_RATIO` (RFC 8878): its head
    compressed at :data:`ZSTD_LEVEL`, its last ``ceil(n / ZSTD_MAX_RATIO)`` bytes stored
    in raw blocks, so the frame is at least ``n / ZSTD_MAX_RATIO`` bytes long.  For data
    that level 1 compresses further (a run of zeros: 64 MiB into 2 KB), at 255 times.

    The head's blocks are those of a frame zstd made of it (their last-block bit
    cleared), behind a header of our own: the whole content size (8 bytes) and a window
    at least as large as that frame's and at least 128 KiB, the largest block."""
    view = memoryview(data).cast("B")
    n = view.nbytes
    stored = -(-n // ZSTD_MAX_RATIO)
    frame = bytearray(_ZSTD_MAGIC)
    blocks = b""
    window = ZSTD_BLOCK_MAX
    if stored < n:
        head = zstandard.ZstdCompressor(
            level=ZSTD_LEVEL, write_checksum=False, write_content_size=True, write_dict_id=False,
        ).compress(view[: n - stored])
        window = max(window, zstandard.get_frame_parameters(head).window_size)
        blocks = _without_last_flag(head[zstandard.frame_header_size(head):])
    window_log = max(17, (window - 1).bit_length())
    # descriptor: content size in 8 bytes, not single-segment, no checksum, no dictionary;
    # then the window (exponent only: 2**window_log)
    frame += bytes([0xC0, (window_log - 10) << 3]) + n.to_bytes(8, "little")
    frame += blocks
    for start in range(n - stored, n, ZSTD_BLOCK_MAX):
        part = view[start : min(n, start + ZSTD_BLOCK_MAX)]
        last = start + ZSTD_BLOCK_MAX >= n
        frame += (int(last) | part.nbytes << 3).to_bytes(3, "little")  # a raw block
        frame += part
    return bytes(frame)


def _without_last_flag(blocks: bytes) -> bytes:
    """A frame's blocks (what follows its header, no checksum after them) with the
    last-block bit of the last one cleared, so that more blocks can follow."""
    out = bytearray(blocks)
    pos = 0
    while True:
        header = int.from_bytes(out[pos : pos + 3], "little")
        kind, size = (header >> 1) & 3, header >> 3
        end = pos + 3 + (1 if kind == 1 else size)  # an RLE block holds one byte
        if header & 1:
            if end != len(out):
                raise AssertionError("zstd frame has bytes after its last block")
            out[pos] &= 0xFE
            return bytes(out)
        pos = end


def check_sizing_args(shape: Any, dtype: str, kind: Any, codec: str) -> tuple[tuple[int, int, int], TensorKind]:
    """The caller's ``shape``, ``dtype`` and ``kind`` checked (UsageError naming ``codec``),
    as a decode must before :func:`inner_payload_size` works a size out from them."""
    shape = nm.check_shape(shape, codec)
    numpy_dtype(dtype)
    return shape, TensorKind(kind)


def inner_payload_size(codec: Codec, params: bytes, shape: tuple[int, int, int], dtype: str, kind: TensorKind) -> int:
    """Exact payload size the inner codec decodes for ``shape`` (ProtocolError if unknowable);
    ``shape``, ``dtype`` and ``kind`` as :func:`check_sizing_args` gives them."""
    n = shape[0] * shape[1] * shape[2]
    if codec.name == "raw":
        return n * numpy_dtype(dtype).itemsize
    size = getattr(codec, "payload_size", None)
    if size is None:
        raise ProtocolError(f"codec {codec.name} cannot be wrapped by an entropy stage")
    if codec.name == "int4":
        return int(size(params, shape, dtype, kind))
    return int(size(params, shape, dtype))


def decompressed_size(codec: Codec, params: bytes, shape: Any, dtype: str, kind: Any) -> int:
    """Bytes that decoding a chunk of ``shape`` with ``codec`` and ``params`` decompresses
    into before the inner codec reads them: the inner payload size where ``codec`` is an
    entropy stage and ``params`` flag the payload compressed, else 0.  It is not the decoded
    size: int4's scales and minimums (8 bytes a group, of a size the params choose) make
    its payload up to 8.5 bytes an element.  A receiver bounds it before decoding
    (``max_chunk_bytes``).  Raises ProtocolError for params the decode refuses before
    decompressing anything (the flag byte, the inner params), UsageError as a decode does
    for bad arguments."""
    if not isinstance(codec, EntropyCodec):
        return 0
    params = nm.check_params(params, codec.name)
    shape, kind = check_sizing_args(shape, dtype, kind, codec.name)
    if not _compressed(params, codec.name):
        return 0
    return inner_payload_size(codec.inner, bytes(params[1:]), shape, dtype, kind)


def _compressed(params: bytes, name: str) -> bool:
    """Whether checked entropy-stage ``params`` flag the payload compressed."""
    if not params or params[0] & ~FLAG_COMPRESSED:
        raise ProtocolError(f"{name} params must start with a flag byte of 0 or 1")
    return bool(params[0] & FLAG_COMPRESSED)


class EntropyCodec(Codec):
    """An inner codec followed by a lossless compressor."""

    method: ClassVar[str] = ""
    id_bit: ClassVar[int] = 0

    def __init__(self, inner: Codec) -> None:
        self.inner = inner
        self.name = f"{inner.name}+{self.method}"  # type: ignore[misc]
        self.codec_id = inner.codec_id | self.id_bit  # type: ignore[misc]
        self.lossless = inner.lossless  # type: ignore[misc]

    def _compress(self, data: bytes | memoryview) -> bytes:
        raise NotImplementedError

    def _decompress(self, data: bytes | memoryview, size: int) -> bytes:
        raise NotImplementedError

    def _within_ratio(self, compressed: int, size: int) -> bool:
        """Whether a payload of ``compressed`` bytes may decompress to ``size`` bytes (what
        the decoder checks before decompressing)."""
        raise NotImplementedError

    def packed(self, plain: bytes | memoryview) -> bytes | None:
        """``plain`` (the inner payload, shuffled where it is) compressed, or None where
        that is not smaller, or would be more than a decoder takes: sent as it is then."""
        size = memoryview(plain).nbytes
        packed = self._compress(plain)
        if len(packed) < size and self._within_ratio(len(packed), size):
            return packed
        return None

    def _shuffle_width(self, dtype: str) -> int:
        return numpy_dtype(dtype).itemsize if self.inner.name == "raw" else 1

    def encode(self, x: Any, kind: TensorKind) -> EncodedChunk:
        chunk = self.inner.encode(x, kind)
        return self._pack(chunk, np.asarray(x).dtype.itemsize if self.inner.name == "raw" else 1)

    def encode_ranges(
        self, base: memoryview, spans: Any, shape: tuple[int, int, int], dtype: str, kind: TensorKind
    ) -> EncodedChunk | None:
        """The inner codec's payload of rows where they lie (when it can read them so),
        compressed as :meth:`encode` does; ``raw`` is gathered (its bytes are shuffled)."""
        nm.check_spans(spans, self.name)
        _host.check_span_items(spans, self.name)
        if self.inner.name == "raw":
            return None
        chunk = self.inner.encode_ranges(base, spans, shape, dtype, kind)
        return None if chunk is None else self._pack(chunk, 1)

    def _pack(self, chunk: EncodedChunk, width: int) -> EncodedChunk:
        """The inner chunk compressed (its bytes shuffled by ``width`` first) when that is
        smaller, else as it is."""
        data = memoryview(chunk.payload).cast("B")
        packed = self.packed(_shuffle(data, width) if width > 1 else data)
        if packed is not None:
            return EncodedChunk(self.codec_id, bytes([FLAG_COMPRESSED]) + chunk.params, packed)
        return EncodedChunk(self.codec_id, b"\x00" + chunk.params, chunk.payload)

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
        params = nm.check_params(params, self.name)
        shape, kind = check_sizing_args(shape, dtype, kind, self.name)
        inner_params, plain = self._unpack(params, payload, shape, dtype, kind)
        return self.inner.decode(inner_params, plain, shape=shape, dtype=dtype, kind=kind, out=out)

    def decode_ranges(
        self, params: bytes, payload: Any, base: memoryview, spans: Any, *,
        shape: tuple[int, int, int], dtype: str, kind: TensorKind,
    ) -> bool:
        """Decompress, then let the inner codec decode into the ranges where it can.  False
        at once where it never can (``raw``, no compiled loops); a False from the inner
        codec after decompressing (a misaligned buffer) costs the caller a second
        decompress."""
        params = nm.check_params(params, self.name)
        nm.check_base(base, self.name)
        nm.check_spans(spans, self.name)
        _host.check_span_items(spans, self.name)
        shape, kind = check_sizing_args(shape, dtype, kind, self.name)
        if self.inner.name == "raw" or _host.ext is None:
            return False
        inner_params, plain = self._unpack(params, payload, shape, dtype, kind)
        return self.inner.decode_ranges(inner_params, plain, base, spans, shape=shape, dtype=dtype, kind=kind)

    def _unpack(
        self, params: bytes, payload: Any, shape: tuple[int, int, int], dtype: str, kind: TensorKind
    ) -> tuple[bytes, Any]:
        """The inner codec's params and payload (decompressed and unshuffled when it was
        compressed), from checked ``params`` and arguments (:func:`check_sizing_args`)."""
        inner_params = bytes(params[1:])
        if _compressed(params, self.name):
            size = inner_payload_size(self.inner, inner_params, shape, dtype, kind)
            try:
                view = memoryview(payload).cast("B")
            except (TypeError, ValueError) as exc:
                raise ProtocolError(f"{self.name} payload is not a byte buffer") from exc
            plain = self._decompress(view, size)
            if len(plain) != size:
                raise ProtocolError(f"{self.name} payload decompressed to {len(plain)} bytes, expected {size}")
            width = self._shuffle_width(dtype)
            payload = _unshuffle(plain, width) if width > 1 else plain
        return inner_params, payload

    def encoded_size_ratio(self, shape: tuple[int, int, int], dtype: str) -> float:
        return self.inner.encoded_size_ratio(shape, dtype)


class ZstdCodec(EntropyCodec):
    method = "zstd"
    id_bit = 0x10

    def _compress(self, data: bytes | memoryview) -> bytes:
        """A level-1 frame of ``data``; where that expands more than a decoder takes, a
        frame with its tail stored (:func:`bounded_zstd_frame`)."""
        frame = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(data)
        size = memoryview(data).nbytes
        if zstd_within_ratio(len(frame), size):
            return frame
        return bounded_zstd_frame(data)

    def _within_ratio(self, compressed: int, size: int) -> bool:
        return zstd_within_ratio(compressed, size)

    def _decompress(self, data: bytes | memoryview, size: int) -> bytes:
        """Exactly ``size`` bytes from exactly one zstd frame, never more.

        A frame of ``size`` bytes more than :data:`ZSTD_MAX_RATIO` times its length (plus
        :data:`ZSTD_RATIO_SLACK`) is refused before anything is read or allocated: a few
        RLE blocks would make megabytes of a few bytes, and kvwire's encoder never sends
        such a frame.  The frame header's content size is only a claim: the blocks after
        it may produce far more (an RLE block is 128 KiB for 4 bytes), and zstd notices
        the difference only at the end of the frame.  So the frame is decompressed in one
        call into an output of ``size`` bytes (the header must say ``size``, and
        ``decompress`` sizes its output by the header), which fails as soon as a block
        would go past it.
        """
        if not zstd_within_ratio(len(data), size):
            raise ProtocolError(
                f"{self.name} payload of {len(data)} bytes cannot decompress to {size} bytes "
                f"(kvwire's zstd frames expand at most {ZSTD_MAX_RATIO} times, plus {ZSTD_RATIO_SLACK} bytes)"
            )
        try:
            params = zstandard.get_frame_parameters(data)
            if params.content_size != size:
                raise ProtocolError(f"{self.name} frame announces {params.content_size} bytes, expected {size}")
            return zstandard.ZstdDecompressor().decompress(data, max_output_size=size, allow_extra_data=False)
        except zstandard.ZstdError as exc:
            raise ProtocolError(f"{self.name} payload is not a valid zstd frame: {exc}") from None


class Lz4Codec(EntropyCodec):
    method = "lz4"
    id_bit = 0x20

    def _compress(self, data: bytes | memoryview) -> bytes:
        return bytes(lz4.block.compress(data, store_size=False))

    def _within_ratio(self, compressed: int, size: int) -> bool:
        return size <= LZ4_MAX_SIZE and size <= LZ4_MAX_RATIO * compressed

    def _decompress(self, data: bytes | memoryview, size: int) -> bytes:
        # Into an output of exactly ``size`` bytes: a block that would produce more fails.
        # That output is allocated first, so a size no block of this length can reach is
        # refused before it is.
        if size > LZ4_MAX_SIZE:
            raise ProtocolError(f"{self.name} payload would decompress to {size} bytes, more than an lz4 block holds")
        if size > LZ4_MAX_RATIO * len(data):
            raise ProtocolError(
                f"{self.name} payload of {len(data)} bytes cannot decompress to {size} bytes "
                f"(an lz4 block expands at most {LZ4_MAX_RATIO} times)"
            )
        try:
            return bytes(lz4.block.decompress(data, uncompressed_size=size))
        except (lz4.block.LZ4BlockError, ValueError) as exc:
            raise ProtocolError(f"{self.name} payload is not a valid lz4 block: {exc}") from None


def _shuffle(data: memoryview, width: int) -> bytes:
    return np.frombuffer(data, np.uint8).reshape(-1, width).T.tobytes()


def _unshuffle(data: bytes, width: int) -> bytes:
    return np.frombuffer(data, np.uint8).reshape(width, -1).T.tobytes()
