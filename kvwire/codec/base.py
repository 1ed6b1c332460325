"""The codec interface and the registry of codecs by name and by wire id.

A codec turns one chunk of a K or V tensor, shaped ``[tokens, heads, head_dim]``, into
``(params, payload)`` bytes for a CHUNK frame and back.  The wire layer never looks
inside either; it only carries the codec id, ``params`` and ``payload`` and checks their
CRC.  Codecs are sans-IO and pure: the same input gives the same bytes.
"""

from __future__ import annotations

import operator
from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import EnumType, IntEnum
from typing import Any, ClassVar, TypeVar

import numpy as np

from kvwire.errors import ProtocolError, UsageError

_Kind = TypeVar("_Kind")


def _bad_kind(value: object) -> UsageError:
    return UsageError(f"kind must be TensorKind.K or TensorKind.V (0 or 1), got {value!r}")


class _KindType(EnumType):
    """:class:`TensorKind`'s metaclass: ``TensorKind(value)``, where every codec converts
    its ``kind``, takes a TensorKind or an int (a numpy integer too) that is not a bool.
    A float, a bool or anything else is the caller's UsageError: the enum's own lookup
    is by hash and equality, so 0.0, 1.0, True and np.float64(1.0) were K or V."""

    def __call__(cls: type[_Kind], value: object, *args: Any, **kwargs: Any) -> _Kind:
        if not args and not kwargs and not isinstance(value, cls):  # (else: the functional API)
            if isinstance(value, (bool, np.bool_)):
                raise _bad_kind(value)
            try:
                value = operator.index(value)  # type: ignore[arg-type]
            except TypeError:
                raise _bad_kind(value) from None
        result: _Kind = super().__call__(value, *args, **kwargs)  # type: ignore[misc]
        return result


class TensorKind(IntEnum, metaclass=_KindType):
    """Which half of a layer a chunk carries (wire values)."""

    K = 0
    V = 1

    @classmethod
    def _missing_(cls, value: object) -> TensorKind:
        raise _bad_kind(value)


@dataclass(frozen=True, slots=True)
class EncodedChunk:
    """What a codec produced for one chunk: its wire id, parameters and payload."""

    codec_id: int
    params: bytes
    payload: Any  # bytes-like (bytes, bytearray, memoryview, or a contiguous array)


class Codec(ABC):
    """One way of putting a ``[tokens, heads, head_dim]`` tensor on the wire."""

    #: registry name, e.g. ``"fp8"`` or ``"fp8+zstd"``
    name: ClassVar[str]
    #: wire id (u8) carried by every CHUNK frame encoded with this codec
    codec_id: ClassVar[int]
    #: True when decode(encode(x)) == x bit for bit
    lossless: ClassVar[bool] = False

    @abstractmethod
    def encode(self, x: Any, kind: TensorKind) -> EncodedChunk:
        """Encode ``x`` (``[tokens, heads, head_dim]``, float16/bfloat16/float32)."""

    @abstractmethod
    def decode(
        self,
        params: bytes,
        payload: Any,
        *,
        shape: tuple[int, int, int],
        dtype: str,
        kind: TensorKind,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """Decode into an array of ``shape`` and ``dtype`` (into ``out`` when given).

        Raises :class:`~kvwire.ProtocolError` for a payload or params that cannot have
        come from :meth:`encode` for that shape (truncated, wrong length, bad parameters).
        """

    def encode_ranges(
        self, base: memoryview, spans: Any, shape: tuple[int, int, int], dtype: str, kind: TensorKind
    ) -> EncodedChunk | None:
        """Encode a chunk of ``shape`` whose rows (``shape[2]`` elements each) lie at byte
        ranges of ``base``, reading them where they lie: the rows of a paged cache's blocks.
        ``spans`` is a buffer of int64 ``(start, size)`` pairs, in order, each a whole
        number of rows.  Gives the bytes :meth:`encode` gives for the rows gathered, or None
        when this codec reads only one array, or cannot read these ranges (int4: ranges
        that cut a token; the caller then gathers and calls :meth:`encode`)."""
        return None

    def decode_ranges(
        self, params: bytes, payload: Any, base: memoryview, spans: Any, *,
        shape: tuple[int, int, int], dtype: str, kind: TensorKind,
    ) -> bool:
        """Decode a chunk of ``shape`` straight into the byte ranges of ``base`` where its
        rows go (``spans`` as for :meth:`encode_ranges`; a range starting at -1 is rows
        written nowhere, a block the receiver drops).  True when done; False, with nothing
        written, when this codec decodes only into one array, or cannot skip rows (the
        caller then decodes and scatters).  Raises as :meth:`decode` does (skipped rows are
        not decoded: a value there that ``dtype`` cannot hold raises nothing)."""
        return False

    def encoded_size_ratio(self, shape: tuple[int, int, int], dtype: str) -> float:
        """Wire bytes / fp16 bytes expected for a chunk of ``shape`` (before entropy coding)."""
        return 1.0

    def __repr__(self) -> str:
        return f"<codec {self.name} id=0x{self.codec_id:02x}>"


_BY_NAME: dict[str, Codec] = {}
_BY_ID: dict[int, Codec] = {}


def register(codec: Codec) -> Codec:
    """Add ``codec`` to the registry (name and wire id must be new)."""
    if codec.name in _BY_NAME or codec.codec_id in _BY_ID:
        raise UsageError(f"codec {codec.name!r} / id 0x{codec.codec_id:02x} already registered")
    if not 0 <= codec.codec_id <= 0xFF:
        raise UsageError("codec ids are u8")
    _BY_NAME[codec.name] = codec
    _BY_ID[codec.codec_id] = codec
    return codec


def get_codec(name: str) -> Codec:
    """The codec registered as ``name``; :class:`~kvwire.UsageError` if there is none."""
    if not isinstance(name, str):
        raise UsageError(f"a codec name is a str, got {type(name).__name__}")
    try:
        return _BY_NAME[name]
    except KeyError:
        raise UsageError(f"unknown codec {name!r}; known: {', '.join(sorted(_BY_NAME))}") from None


def codec_by_id(codec_id: int) -> Codec:
    """The codec with wire id ``codec_id``; :class:`~kvwire.ProtocolError` if unknown,
    :class:`~kvwire.UsageError` if ``codec_id`` is not an int."""
    try:
        if isinstance(codec_id, bool):
            raise TypeError
        codec_id = operator.index(codec_id)
    except TypeError:
        raise UsageError(f"a codec id is an int, got {type(codec_id).__name__}") from None
    try:
        return _BY_ID[codec_id]
    except KeyError:
        raise ProtocolError(f"unknown codec id 0x{codec_id:02x}") from None


def available_codecs() -> list[str]:
    """Names of every registered codec, sorted."""
    return sorted(_BY_NAME)


def numpy_dtype(name: str) -> np.dtype[Any]:
    """The numpy dtype for a KVSpec dtype name (bfloat16 through ml_dtypes)."""
    if name == "bfloat16":
        import ml_dtypes

        bf16: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)
        return bf16
    if name in ("float16", "float32"):
        return np.dtype(name)
    raise UsageError(f"unsupported dtype {name!r}")
