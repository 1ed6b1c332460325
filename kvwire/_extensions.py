"""Loading kvwire's optional compiled extensions (built by ``pip install`` where a C
compiler works; see setup.py)."""

from __future__ import annotations

import importlib
import os
from types import ModuleType


def load_extension(name: str) -> ModuleType | None:
    """The compiled module ``name`` (e.g. ``"kvwire.wire._crc32c"``), or None when it was
    not built or ``KVWIRE_NO_EXTENSIONS`` is set (to anything but ``0``) at import time;
    the caller then uses its pure-Python code."""
    if os.environ.get("KVWIRE_NO_EXTENSIONS", "") not in ("", "0"):
        return None
    try:
        return importlib.import_module(name)
    except ImportError:
        return None
