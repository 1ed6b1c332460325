"""Optional compiled extensions (all metadata lives in pyproject.toml).

Each entry of ``OPTIONAL_EXTENSIONS`` is built with the system C compiler when one works;
if it does not, the install still succeeds with a warning and kvwire uses its pure-Python
(numpy) code for that part.  ``KVWIRE_NO_EXTENSIONS=1`` at build time skips them all (and
at run time makes kvwire ignore any that were built).  A new extension is one more entry.
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
    Extension(  # needs _crc32c at import (its CRC loop, through a capsule)
        "kvwire.aio._sendq",
        sources=["kvwire/aio/_sendq.c"],
        extra_compile_args=["-O3", "-std=gnu11"],  # sendmsg, struct iovec: POSIX
    ),
]


class OptionalBuildExt(build_ext):  # type: ignore[misc]  # setuptools ships no stubs here
    """build_ext that warns instead of failing when an extension does not compile."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # no compiler at all, or a broken toolchain
            self._warn("the compiled extensions", exc)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:
            self._warn(ext.name, exc)

    @staticmethod
    def _warn(what: str, exc: BaseException) -> None:
        print(
            f"WARNING: could not build {what} ({exc}); kvwire will use its pure-Python code",
            file=sys.stderr,
        )


def _extensions() -> list[Extension]:
    if os.environ.get("KVWIRE_NO_EXTENSIONS", "") not in ("", "0"):
        return []
    if os.name == "nt":  # the flags above are GCC/Clang flags
        return []
    return OPTIONAL_EXTENSIONS


setup(ext_modules=_extensions(), cmdclass={"build_ext": OptionalBuildExt})
