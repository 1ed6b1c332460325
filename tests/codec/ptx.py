"""The kernels' PTX as CuPy would build it, compiled by nvcc (tests that call it carry
``tests.environment.needs_nvcc``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from kvwire.codec.gpu import COMPILE_OPTIONS, CUPY_APPENDED_OPTIONS
from tests.environment import NVCC


def nvcc_ptx(tmp_path: Path, source: str, name: str) -> str:
    """PTX of ``source`` compiled the way CuPy compiles a RawModule for an sm_90 device."""
    assert NVCC is not None
    src = tmp_path / f"{name}.cu"
    src.write_text(source)
    ptx = tmp_path / f"{name}.ptx"
    options = [*COMPILE_OPTIONS, *CUPY_APPENDED_OPTIONS, "-arch=sm_90"]
    subprocess.run([NVCC, "-ptx", *options, str(src), "-o", str(ptx)], check=True, capture_output=True)
    return ptx.read_text()
