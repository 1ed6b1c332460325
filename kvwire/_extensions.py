"""Loading kvwire's optional compiled extensions (built by ``pip install`` where a C
compiler works; see setup.py)."""

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
    not built or :func:`extensions_disabled` at import time; the caller then uses its
    pure-Python code."""
    if extensions_disabled():
        return None
    try:
        return importlib.import_module(name)
    except ImportError:
        return None
