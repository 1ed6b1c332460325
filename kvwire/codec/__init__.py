"""Tensor codecs for KV chunks (sans-IO): a registry by name and wire id.

``raw`` is always present; the quantizing codecs (``fp8``, ``int8``, ``int4``) and the
entropy stage (``+zstd``, ``+lz4``) register themselves on import of this package.
"""

from kvwire.codec.base import (
    Codec,
    EncodedChunk,
    TensorKind,
    available_codecs,
    codec_by_id,
    get_codec,
    numpy_dtype,
    register,
)
from kvwire.codec.raw import RawCodec

register(RawCodec())

__all__ = [
    "Codec",
    "EncodedChunk",
    "RawCodec",
    "TensorKind",
    "available_codecs",
    "codec_by_id",
    "get_codec",
    "numpy_dtype",
    "register",
]
