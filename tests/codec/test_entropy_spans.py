"""The entropy stages (``+zstd``, ``+lz4``) check the element type of ``spans`` as the
codecs they wrap do, before any decompressing, and name themselves: int32 pairs were
refused by the inner codec after a wasted decompress ('fp8: spans must be int64'), or
taken without a word by ``raw+zstd``."""

from __future__ import annotations

import numpy as np
import pytest

from kvwire.codec import TensorKind, get_codec
from kvwire.errors import UsageError

SHAPE = (4, 2, 8)


@pytest.mark.parametrize("name", ["fp8+zstd", "int8+lz4", "raw+zstd", "raw+lz4"])
def test_int32_spans_are_refused_naming_the_stage(name: str) -> None:
    codec = get_codec(name)
    rows = np.arange(4 * 2 * 8, dtype=np.float16).reshape(SHAPE)
    chunk = codec.encode(rows, TensorKind.K)
    base = bytearray(rows.nbytes)
    spans32 = np.array([0, rows.nbytes, 0, 0], dtype=np.int32)  # 16 bytes: one int64 pair's length
    with pytest.raises(UsageError, match=rf"^{name.replace('+', '[+]')}: spans must be int64"):
        codec.decode_ranges(chunk.params, chunk.payload, memoryview(base), spans32,
                            shape=SHAPE, dtype="float16", kind=TensorKind.K)
    with pytest.raises(UsageError, match=rf"^{name.replace('+', '[+]')}: spans must be int64"):
        codec.encode_ranges(memoryview(rows.tobytes()), spans32, SHAPE, "float16", TensorKind.K)
