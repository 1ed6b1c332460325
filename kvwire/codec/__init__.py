"""Tensor codecs for KV chunks (sans-IO): a registry by name and wire id.

``raw`` is always present; the quantizing codecs (``fp8``, ``int8``, ``int4``) and the
entropy stage (``+zstd``, ``+lz4``) register themselves on import of this package.
The byte layouts are specified in docs/codecs.md.
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
from kvwire.codec.entropy import EntropyCodec, Lz4Codec, ZstdCodec
from kvwire.codec.fp8 import Fp8Codec
from kvwire.codec.int4 import Int4Codec
from kvwire.codec.int8 import Int8Codec
from kvwire.codec.raw import RawCodec

for _base in (RawCodec(), Fp8Codec(), Int8Codec(), Int4Codec()):
    register(_base)
    register(ZstdCodec(_base))
    register(Lz4Codec(_base))
del _base

__all__ = [
    "Codec",
    "EncodedChunk",
    "EntropyCodec",
    "Fp8Codec",
    "Int4Codec",
    "Int8Codec",
    "Lz4Codec",
    "RawCodec",
    "TensorKind",
    "ZstdCodec",
    "available_codecs",
    "codec_by_id",
    "get_codec",
    "numpy_dtype",
    "register",
]
