"""Optional compiled extensions (all metadata lives in pyproject.toml).

Each entry of ``OPTIONAL_EXTENSIONS`` is built with the system C compiler when one works;
one that does not compile is left out with a ``WARNING: could not build`` line (pip shows
the build's output only with ``pip install -v``), the others are still installed (by
``pip install -e .`` too), and kvwire uses its pure-Python (numpy) code for what is missing;
``kvwire.extensions()`` says which compiled parts a process uses.  An extension that loads
another at import (``_NEEDS``) is not built without it.  ``KVWIRE_NO_EXTENSIONS=1`` at build
time skips them all (and at run time makes kvwire ignore any that were built).  A new
extension is one more entry.
"""

from __future__ import annotations

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# No fast-math and no FMA contraction: the codec loops must round exactly like numpy.
_STRICT_FP = [
    "-O3",
    "-std=c11",
    "-ffp-contract=off",
    "-fno-fast-math",
    "-fno-math-errno",
    "-fno-trapping-math",  # lets branches become selects; no FP exception is relied on
]

OPTIONAL_EXTENSIONS = [
    Extension(
        "kvwire.codec._hostcodec",
        sources=["kvwire/codec/_hostcodec.c"],
        depends=["kvwire/codec/kernels/kvquant.cuh"],
        extra_compile_args=_STRICT_FP,
    ),
    Extension(
        "kvwire.wire._crc32c",
        sources=["kvwire/wire/_crc32c.c"],
        extra_compile_args=["-O3", "-std=c11"],  # SIMD loops pick their ISA per function
    ),
    Extension(  # needs _crc32c at import (its CRC loop, through a capsule): see _NEEDS
        "kvwire.aio._sendq",
        sources=["kvwire/aio/_sendq.c"],
        extra_compile_args=["-O3", "-std=gnu11"],  # sendmsg, struct iovec: POSIX
    ),
]

#: Extensions that import another one when they load: built only after it was (it comes
#: first in OPTIONAL_EXTENSIONS), left out when it was not.
_NEEDS = {"kvwire.aio._sendq": ("kvwire.wire._crc32c",)}


class OptionalBuildExt(build_ext):  # type: ignore[misc]  # setuptools ships no stubs here
    """build_ext that leaves out, with a warning, an extension that does not compile."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # no compiler at all, or a broken toolchain
            self._warn("the compiled extensions", exc)

    def build_extensions(self) -> None:
        """One after another (an extension in ``_NEEDS`` after what it needs); then only
        the extensions that were built stay listed, so that an in-place or editable build
        (``pip install -e .``) copies those and does not stop at the first one missing."""
        self.check_extensions_list(self.extensions)
        failed: set[str] = set()
        for ext in self.extensions:
            missing = [name for name in _NEEDS.get(ext.name, ()) if name in failed]
            if missing:
                failed.add(ext.name)
                self._warn(ext.name, f"it needs {', '.join(missing)}")
                continue
            try:
                self.build_extension(ext)
            except Exception as exc:
                failed.add(ext.name)
                self._warn(ext.name, exc)
        self.extensions = [ext for ext in self.extensions if ext.name not in failed]

    @staticmethod
    def _warn(what: str, why: object) -> None:
        print(
            f"WARNING: could not build {what} ({why}); kvwire will use its pure-Python code",
            file=sys.stderr,
        )


def _extensions() -> list[Extension]:
    if os.environ.get("KVWIRE_NO_EXTENSIONS", "") not in ("", "0"):
        return []
    if os.name == "nt":  # the flags above are GCC/Clang flags
        return []
    return OPTIONAL_EXTENSIONS


setup(ext_modules=_extensions(), cmdclass={"build_ext": OptionalBuildExt})
