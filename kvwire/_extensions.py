"""Loading kvwire's optional compiled extensions (built by ``pip install`` where a C
compiler works; see setup.py), and :func:`extensions`, which says which ones this process
uses."""

from __future__ import annotations

import importlib
import os
from types import ModuleType


def extensions_disabled() -> bool:
    """Whether ``KVWIRE_NO_EXTENSIONS`` is set (to anything but ``0``): the compiled
    extensions are not loaded, every caller uses its pure-Python code."""
    return os.environ.get("KVWIRE_NO_EXTENSIONS", "") not in ("", "0")


def load_extension(name: str) -> ModuleType | None:
    """The compiled module ``name`` (e.g. ``"kvwire.wire._crc32c"``), or None when it was
    not built, cannot be loaded, or :func:`extensions_disabled` at import time; the caller
    then uses its pure-Python code.

    Loading never fails: an ImportError (not built, or a file built for another Python,
    or missing a symbol) and an AttributeError (``kvwire.aio._sendq`` looks up the CRC
    loop of ``kvwire.wire._crc32c`` through a capsule, an attribute of a module that is
    absent when that one was not built) both mean "not available"; anything else is a bug
    in the extension and propagates."""
    if extensions_disabled():
        return None
    try:
        return importlib.import_module(name)
    except (ImportError, AttributeError):
        return None


def extensions() -> dict[str, str | None]:
    """Which compiled parts this process uses, by name: ``"crc32c"`` (the frames'
    checksum), ``"host_codec"`` (the CPU fp8/int8/int4 loops) and ``"send_queue"`` (each
    stream's ``sendmsg`` queue).  Each value says what runs, in words (the CRC loop, the
    codec loops, ``"sendmsg"``), or is None where the pure-Python code runs instead (the
    ``crc32c`` package, the numpy codecs, the transports' write buffers; same bytes):
    the part was not built (no working C compiler at install time: ``pip install -v``
    shows the reason), could not be loaded, or ``KVWIRE_NO_EXTENSIONS`` is set.

    >>> import kvwire
    >>> sorted(kvwire.extensions())
    ['crc32c', 'host_codec', 'send_queue']
    """
    # Imported here: those modules load their extension through this one.
    from kvwire.aio import _stream
    from kvwire.codec import _host
    from kvwire.wire import crc

    return {
        "crc32c": None if crc.ext is None else str(crc.ext.isa()),
        "host_codec": _host.isa(),
        "send_queue": None if _stream._sendq is None else "sendmsg",
    }
