"""CRC32C of frames: the compiled ``kvwire.wire._crc32c`` where built, else the ``crc32c`` package.

Both compute the same function, ``crc32c(data, value=0) -> int`` (Castagnoli, reflected
polynomial 0x82F63B78) over any C-contiguous buffer, with continuation:
``crc32c(b, crc32c(a)) == crc32c(a + b)``; ``value`` is taken modulo 2**32.  The extension
picks its fastest loop at import (VPCLMULQDQ on AVX-512, PCLMULQDQ, the SSE4.2 crc32
instruction, or a portable table) and releases the GIL for buffers of 8 KiB and more.
``ext`` is None when the extension was not built (no compiler at install time) or when
``KVWIRE_NO_EXTENSIONS=1`` is set at import; then the package's function is used.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any, Protocol

import crc32c as _package

from kvwire._extensions import load_extension


class Crc32c(Protocol):
    """The signature both implementations share (``data``: any C-contiguous buffer; the
    package also takes ``value`` as a keyword)."""

    def __call__(self, data: Any, value: int = 0, /) -> int: ...


#: the compiled module, or None (then the crc32c package runs)
ext: ModuleType | None = load_extension("kvwire.wire._crc32c")

#: ``crc32c(data, value=0) -> int``: the compiled function itself, or the package's (no
#: Python frame in between, the frames call it on every header and body part)
crc32c: Crc32c = ext.crc32c if ext is not None else _package.crc32c


def implementation() -> str:
    """What :func:`crc32c` runs, in words: ``"compiled <loop>"`` or ``"crc32c package"``."""
    if ext is None:
        return "crc32c package"
    return f"compiled {ext.isa()}"


class Crc32cScatter(Protocol):
    def __call__(self, buffers: Sequence[Any], nbytes: int, value: int = 0, /) -> tuple[int, int, int]: ...


def _crc32c_scatter(buffers: Sequence[Any], nbytes: int, value: int = 0, /) -> tuple[int, int, int]:
    """What the compiled ``crc32c_scatter`` computes, with :func:`crc32c` per buffer, and
    what it refuses, with the same exception types: ``nbytes`` an index-sized integer
    (not a float), ``value`` any integer taken modulo 2**32, ``buffers`` any iterable of
    C-contiguous buffers."""
    nbytes = operator.index(nbytes)
    if not -sys.maxsize - 1 <= nbytes <= sys.maxsize:
        raise OverflowError("cannot fit 'int' into an index-sized integer")
    if nbytes < 0:
        raise ValueError("crc32c_scatter(): nbytes must not be negative")
    crc = operator.index(value) & 0xFFFFFFFF
    buffers = tuple(buffers)  # the buffers given, whatever a __buffer__ does to the caller's list
    left, index = nbytes, 0
    while left > 0 and index < len(buffers):
        view = memoryview(buffers[index])
        if not view.c_contiguous:
            crc32c(buffers[index])  # raises the exporter's own error, as the compiled function does
            raise BufferError("crc32c_scatter() needs C-contiguous buffers")
        view = view.cast("B")
        if view.nbytes > left:
            return crc32c(view[:left], crc), index, left
        crc = crc32c(view, crc)
        left -= view.nbytes
        index += 1
    if left > 0:
        raise ValueError(f"crc32c_scatter(): the buffers hold fewer than {nbytes} bytes")
    return crc, index, 0


#: ``crc32c_scatter(buffers, nbytes, value=0) -> (crc, index, offset)``: the CRC32C of
#: the first ``nbytes`` of ``buffers`` one after the other, continuing from ``value``, and
#: where the byte after them lies (``buffers[index]`` at ``offset``; a buffer taken whole
#: moves ``index`` past it).  One call for a read scattered over many buffers.
crc32c_scatter: Crc32cScatter = ext.crc32c_scatter if ext is not None else _crc32c_scatter
