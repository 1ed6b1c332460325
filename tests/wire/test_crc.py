"""The compiled CRC32C (kvwire.wire._crc32c) against the ``crc32c`` package, at every level.

Every level this CPU runs (forced with ``_set_level``: VPCLMULQDQ/AVX-512, PCLMULQDQ, the
SSE4.2 crc32 instruction, the portable table) must give the package's value for every
length up to 1100 bytes, the lengths around the folding loops' boundaries, unaligned
views, continuation values, numpy arrays and a 16 MiB buffer, and must refuse (or accept)
the same inputs with the same exception types.  ``kvwire.wire.crc`` is checked both ways:
the extension when built, the package under ``KVWIRE_NO_EXTENSIONS=1``.
"""

from __future__ import annotations

import array
import contextlib
import itertools
import os
import platform
import random
import shlex
import subprocess
import sys
import sysconfig
import threading
from collections.abc import Callable, Iterator
from typing import Any

import crc32c as package
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire._extensions import extensions_disabled
from kvwire.wire import crc
from tests.conftest import needs_extension, require_extension

DISABLED = extensions_disabled()
EXT = "kvwire.wire._crc32c"
needs_ext = needs_extension(crc.ext is not None, EXT)
NAMES = ["table", "sse4.2", "pclmulqdq", "avx512-vpclmulqdq"]
CHECK = 0xE3069283  # CRC32C of b"123456789", the catalogue's check value
P = 0x11EDC6F41  # x^32 + the Castagnoli polynomial, bit d = coefficient of x^d
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _levels() -> list[int]:
    if crc.ext is None:
        return []
    return list(range(len(crc.ext.levels())))


LEVELS = _levels()
BEST = LEVELS[-1] if LEVELS else 0


@contextlib.contextmanager
def _level(level: int) -> Iterator[Callable[..., int]]:
    """The compiled function at ``level``, then the best level again."""
    assert crc.ext is not None
    assert crc.ext._set_level(level) == level
    try:
        yield crc.ext.crc32c
    finally:
        crc.ext._set_level(BEST)


def _random_bytes(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


# ---------------------------------------------------------------------------------------
# The build and the dispatch module.


def test_extension_was_built() -> None:
    """CI fails here, with the reason, when the compiled CRC silently failed to build."""
    if DISABLED:
        assert crc.ext is None and crc.implementation() == "crc32c package"
        assert crc.crc32c is package.crc32c
        return
    require_extension(crc.ext is not None, EXT)
    assert crc.ext is not None
    assert crc.crc32c is crc.ext.crc32c
    assert crc.ext.levels() == NAMES[: len(crc.ext.levels())]
    assert crc.ext.isa() == NAMES[BEST]
    assert crc.implementation() == f"compiled {NAMES[BEST]}"
    compiler = str(sysconfig.get_config_var("CC") or "")
    if platform.machine() in ("x86_64", "AMD64") and "gcc" in compiler:  # all loops are built
        assert crc.ext.LEVEL_BUILT == 3
        flags = _cpu_flags()
        if {"sse4_2", "pclmulqdq"} <= flags:
            assert BEST >= 2
        if {"avx512f", "vpclmulqdq", "sse4_2", "pclmulqdq"} <= flags:
            assert BEST == 3 and crc.implementation() == "compiled avx512-vpclmulqdq"


def _run_python(code: str, **env: str) -> list[str]:
    environ = {k: v for k, v in os.environ.items() if k != "KVWIRE_NO_EXTENSIONS"}
    environ.update(env)
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, environ.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, "-c", code], env=environ, cwd=ROOT, capture_output=True, text=True,
        check=False, timeout=60,
    )
    assert out.returncode == 0, f"{shlex.join([sys.executable, '-c', code])}: {out.stderr}"
    return out.stdout.split()


PROBE = (
    "import crc32c\n"
    "from kvwire.wire import crc\n"
    "print(repr(crc.implementation()).replace(' ', '_'), crc.ext is None,"
    " crc.crc32c is crc32c.crc32c, crc.crc32c(b'123456789'), crc.crc32c(b'6789', crc.crc32c(b'12345')))"
)


@pytest.mark.parametrize("flag", ["1", "yes"])
def test_no_extensions_falls_back_to_the_package(flag: str) -> None:
    assert _run_python(PROBE, KVWIRE_NO_EXTENSIONS=flag) == [
        "'crc32c_package'", "True", "True", str(CHECK), str(CHECK)
    ]


@pytest.mark.parametrize("flag", ["", "0"])
def test_empty_or_zero_flag_keeps_the_extension(flag: str) -> None:
    if not DISABLED:
        require_extension(crc.ext is not None, EXT)
    got = _run_python(PROBE, KVWIRE_NO_EXTENSIONS=flag)
    if crc.ext is None:  # DISABLED in this process, but the subprocess may load it
        assert got[3:] == [str(CHECK), str(CHECK)]
        return
    assert got == [repr(crc.implementation()).replace(" ", "_"), "False", "False", str(CHECK), str(CHECK)]


def test_dispatch_module_gives_the_package_values() -> None:
    data = _random_bytes(70_001, 7)
    for n in (0, 1, 8, 100, 4096, 70_001):
        assert crc.crc32c(data[:n]) == package.crc32c(data[:n])
        assert crc.crc32c(data[:n], 0xDEADBEEF) == package.crc32c(data[:n], 0xDEADBEEF)
    assert crc.crc32c(b"123456789") == CHECK
    assert isinstance(crc.implementation(), str)


# ---------------------------------------------------------------------------------------
# Values at every level.


@needs_ext
def test_levels_api() -> None:
    assert crc.ext is not None
    assert crc.ext.levels()[0] == "table"
    assert crc.ext._set_level(99) == BEST and crc.ext.isa() == NAMES[BEST]
    for level in LEVELS:
        assert crc.ext._set_level(level) == level and crc.ext.isa() == NAMES[level]
    assert crc.ext._set_level(BEST) == BEST
    with pytest.raises(ValueError):
        crc.ext._set_level(-1)
    with pytest.raises(TypeError):
        crc.ext._set_level("3")
    assert crc.ext.isa() == NAMES[BEST]


def _xpow_reference(n: int) -> int:
    """x^n mod P by square-and-multiply over GF(2), then bit-reflected to a CRC register."""

    def mulmod(a: int, b: int) -> int:
        r = 0
        while b:
            if b & 1:
                r ^= a
            b >>= 1
            a <<= 1
            if a >> 32:
                a ^= P
        return r

    result, base = 1, 2  # x^0, x^1
    while n:
        if n & 1:
            result = mulmod(result, base)
        base = mulmod(base, base)
        n >>= 1
    return int(f"{result:032b}"[::-1], 2)


@needs_ext
def test_fold_constants_are_powers_of_x() -> None:
    """The C code's x^n mod P (the fold constants are xpow(D + 63) and xpow(D - 1))."""
    assert crc.ext is not None
    ns = [0, 1, 2, 31, 32, 33, 63, 64, 127, 191, 255, 319, 383, 447, 511, 575, 1023, 1087]
    ns += [2047, 2111, 2815, 2879, 3071, 3135, 8 * 4096, 8 * 512, 8 * 64, (1 << 40) + 12345, (1 << 63) + 1]
    ns += random.Random(3).sample(range(1 << 20), 50)
    for n in ns:
        assert crc.ext._xpow(n) == _xpow_reference(n), n
    # x^32 mod P is P's low 32 bits, reflected: the polynomial 0x82F63B78 itself
    assert crc.ext._xpow(32) == 0x82F63B78


@needs_ext
@pytest.mark.parametrize("level", LEVELS)
def test_check_value_and_empty(level: int) -> None:
    with _level(level) as f:
        assert f(b"123456789") == CHECK
        assert f(b"") == 0 and f(bytearray()) == 0 and f(memoryview(b"")) == 0
        for value in (0, 1, 0xDEADBEEF, 0xFFFFFFFF):
            assert f(b"", value) == value == package.crc32c(b"", value)
        assert f(bytes(32)) == package.crc32c(bytes(32)) == 0x8A9136AA
        assert f(b"\xff" * 32) == package.crc32c(b"\xff" * 32) == 0x62A8AB43


@needs_ext
@pytest.mark.parametrize("level", LEVELS)
def test_every_length_to_1100(level: int) -> None:
    data = _random_bytes(1100 + 64, level)
    value = random.Random(level).getrandbits(32)
    with _level(level) as f:
        for n in range(1101):
            piece = data[:n]
            assert f(piece) == package.crc32c(piece), n
            assert f(piece, value) == package.crc32c(piece, value), n


BOUNDARIES = [255, 256, 257, 511, 512, 513, 1023, 1024, 1025, 4095, 4096, 4097]
BOUNDARIES += [65535, 65536, 65537, 131071, 131072, 131073, 1 << 20, (1 << 20) + 7]


@needs_ext
@pytest.mark.parametrize("level", LEVELS)
def test_lengths_around_the_loop_boundaries(level: int) -> None:
    data = bytearray(_random_bytes((1 << 20) + 200, 11))
    # level 3 aligns to 64 bytes, then loops over 256 + 128 byte windows from 4096 bytes on
    # (level 2 over 128 + 128): sweep every length across those thresholds too
    lengths = [*BOUNDARIES, *range(3800, 5400), *range(8000, 9000, 7)]
    with _level(level) as f:
        for n in lengths:
            for offset in (0, 17) if n < 5400 else (0, 1, 31, 63):
                view = memoryview(data)[offset : offset + n]
                assert f(view) == package.crc32c(view), (n, offset)


@needs_ext
@pytest.mark.parametrize("level", LEVELS)
def test_unaligned_views(level: int) -> None:
    data = bytearray(_random_bytes(70_000 + 64, 5))
    lengths = [0, 1, 7, 8, 15, 16, 17, 63, 64, 65, 255, 300, 511, 512, 777, 1000, 5000, 70_000]
    with _level(level) as f:
        for offset in range(1, 64):
            for n in lengths:
                view = memoryview(data)[offset : offset + n]
                assert f(view) == package.crc32c(view), (offset, n)
                assert f(view, offset * 0x01010101) == package.crc32c(view, offset * 0x01010101)


@needs_ext
@pytest.mark.parametrize("level", LEVELS)
@settings(max_examples=150, deadline=None)
@given(data=st.binary(max_size=6000), value=st.integers(0, 2**32 - 1))
def test_hypothesis_short(level: int, data: bytes, value: int) -> None:
    with _level(level) as f:
        assert f(data, value) == package.crc32c(data, value)
        assert f(bytearray(data), value) == package.crc32c(data, value)


@needs_ext
@pytest.mark.parametrize("level", LEVELS)
@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(0, 300_000),
    offset=st.integers(0, 63),
    seed=st.integers(0, 2**32),
    value=st.integers(0, 2**32 - 1),
)
def test_hypothesis_long(level: int, n: int, offset: int, seed: int, value: int) -> None:
    data = memoryview(bytearray(_random_bytes(n + offset, seed)))[offset:]
    with _level(level) as f:
        assert f(data, value) == package.crc32c(data, value)


@needs_ext
@pytest.mark.parametrize("level", LEVELS)
@settings(max_examples=100, deadline=None)
@given(a=st.binary(max_size=3000), b=st.binary(max_size=3000), value=st.integers(0, 2**32 - 1))
def test_continuation(level: int, a: bytes, b: bytes, value: int) -> None:
    with _level(level) as f:
        whole = package.crc32c(a + b, value)
        assert f(b, f(a, value)) == whole
        assert f(a + b, value) == whole


@needs_ext
@pytest.mark.parametrize("level", LEVELS)
def test_continuation_over_long_pieces(level: int) -> None:
    data = _random_bytes(3 * 65536 + 5, 9)
    cuts = [0, 1, 4095, 65536, 100_000, 3 * 65536 + 5]
    with _level(level) as f:
        value = 0x12345678
        for lo, hi in itertools.pairwise(cuts):
            value = f(data[lo:hi], value)
        assert value == package.crc32c(data, 0x12345678)


DTYPES = ["uint8", "int8", "int16", "uint32", "float16", "float32", "float64", "complex64", "bool"]


@needs_ext
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_numpy_arrays(level: int, dtype: str) -> None:
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, 8 * 3 * 17 * 129, dtype=np.uint8)
    arr = raw[: raw.size // np.dtype(dtype).itemsize * np.dtype(dtype).itemsize].view(dtype)
    if dtype == "bool":
        arr = raw.astype(bool)
    shaped = arr[: (arr.size // 51) * 51].reshape(-1, 3, 17)
    with _level(level) as f:
        for a in (arr, shaped, shaped[1:4], arr[:0], np.ascontiguousarray(shaped[:, 1])):
            assert a.flags.c_contiguous
            assert f(a) == package.crc32c(a) == package.crc32c(a.tobytes())
            assert f(a, 77) == package.crc32c(a, 77)


@needs_ext
@pytest.mark.parametrize("level", LEVELS)
def test_16_mib(level: int) -> None:
    rng = np.random.default_rng(2)
    buf = rng.integers(0, 256, (16 << 20) + 3, dtype=np.uint8)
    with _level(level) as f:
        assert f(buf[:16 << 20]) == package.crc32c(buf[:16 << 20])
        assert f(buf[3:], 0xCAFEF00D) == package.crc32c(buf[3:], 0xCAFEF00D)


@needs_ext
def test_threads_share_the_function() -> None:
    """Large buffers run without the GIL: several threads at once still get the right values."""
    assert crc.ext is not None
    bufs = [_random_bytes((4 << 20) + i, i) for i in range(4)]
    want = [package.crc32c(b) for b in bufs]
    got: list[int] = [0] * len(bufs)

    def work(i: int) -> None:
        for _ in range(3):
            got[i] = crc.ext.crc32c(bufs[i]) if crc.ext is not None else 0

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(bufs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want


@needs_ext
def test_other_buffer_exporters() -> None:
    assert crc.ext is not None
    f = crc.ext.crc32c
    a = array.array("d", [1.5, -2.0, 3.25] * 100)
    cases: list[Any] = [a, memoryview(a), memoryview(bytes(range(256)) * 4).cast("I"), b"x" * 9000]
    for obj in cases:
        assert f(obj) == package.crc32c(obj)


# ---------------------------------------------------------------------------------------
# The same refusals as the package.


def _outcome(fn: Callable[[], int]) -> tuple[str, Any]:
    try:
        return "ok", fn()
    except Exception as exc:
        return "raises", type(exc)


def _fortran() -> np.ndarray[Any, Any]:
    return np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4))


BAD_DATA: list[Callable[[], Any]] = [
    lambda: "abc",
    lambda: 5,
    lambda: None,
    lambda: [1, 2, 3],
    lambda: 1.5,
    lambda: memoryview(bytearray(100))[::2],
    lambda: memoryview(np.zeros((4, 4), np.uint8))[:, 1],
    lambda: np.arange(20, dtype=np.uint8)[::2],
    lambda: np.zeros((4, 6), np.uint16)[:, :3],
    _fortran,
]

VALUES: list[Any] = [
    0, 1, 2**31, 2**32 - 1, 2**32, 2**32 + 5, 2**63, 2**64, 2**64 + 3, 2**100 + 7, -1, -2, -(2**32),
    -(2**63), -(2**100), True, False, np.uint32(7), np.int64(-3),
    1.0, "1", None, b"1", 2.5j,
]


@needs_ext
@pytest.mark.parametrize("make", BAD_DATA)
def test_bad_data_raises_like_the_package(make: Callable[[], Any]) -> None:
    assert crc.ext is not None
    ours = _outcome(lambda: crc.ext.crc32c(make()) if crc.ext is not None else 0)
    theirs = _outcome(lambda: package.crc32c(make()))
    assert ours[0] == "raises"
    assert ours == theirs
    assert _outcome(lambda: crc.ext.crc32c(make(), 5) if crc.ext is not None else 0) == _outcome(
        lambda: package.crc32c(make(), 5)
    )


@needs_ext
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_values_are_taken_like_the_package(level: int, value: Any) -> None:
    """Any int (or __index__) is reduced modulo 2**32, as the package does; others raise."""
    data = _random_bytes(9000, 4)
    with _level(level) as f:
        for piece in (data[:0], data[:5], data):
            assert _outcome(lambda p=piece: f(p, value)) == _outcome(lambda p=piece: package.crc32c(p, value))
    if isinstance(value, int | np.integer):
        assert crc.ext is not None and crc.ext.crc32c(data, value) == package.crc32c(data, int(value) % 2**32)


@needs_ext
def test_bad_argument_counts() -> None:
    assert crc.ext is not None
    with pytest.raises(TypeError):
        crc.ext.crc32c()
    with pytest.raises(TypeError):
        crc.ext.crc32c(b"", 0, 0)
    with pytest.raises(TypeError):
        crc.ext.crc32c(b"", value=0)  # positional-only
    with pytest.raises(TypeError):
        package.crc32c()


# -- crc32c_scatter: one call over the buffers a scatter read filled -------------------------


def _scatter_impls() -> list[Callable[..., tuple[int, int, int]]]:
    impls: list[Callable[..., tuple[int, int, int]]] = [crc._crc32c_scatter]
    if crc.ext is not None:
        impls.append(crc.ext.crc32c_scatter)
    return impls


@pytest.mark.parametrize("impl", _scatter_impls(), ids=lambda f: f.__module__)
@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 20_000), max_size=12), seed=st.integers(0, 2**32),
    cut=st.floats(0, 1), value=st.integers(0, 2**32 - 1),
)
def test_crc32c_scatter_is_the_crc_of_the_bytes_in_order(
    impl: Callable[..., tuple[int, int, int]], sizes: list[int], seed: int, cut: float, value: int,
) -> None:
    data = _random_bytes(sum(sizes), seed)
    bufs, at = [], 0
    for n in sizes:
        bufs.append(bytearray(data[at : at + n]))
        at += n
    nbytes = int(cut * len(data))
    crc_value, index, offset = impl(bufs, nbytes, value)
    assert crc_value == package.crc32c(data[:nbytes], value)
    # where the next byte lies: past every buffer taken whole, ``offset`` into the next
    assert sum(sizes[:index]) + offset == nbytes
    assert offset == 0 or offset < sizes[index]  # a buffer the bytes end in, not one they fill
    if crc.ext is not None:
        assert impl(bufs, nbytes, value) == crc._crc32c_scatter(bufs, nbytes, value)


@pytest.mark.parametrize("impl", _scatter_impls(), ids=lambda f: f.__module__)
def test_crc32c_scatter_refuses_more_bytes_than_the_buffers_hold(impl: Callable[..., tuple[int, int, int]]) -> None:
    with pytest.raises(ValueError, match="fewer than 11 bytes"):
        impl([b"abc", bytearray(7)], 11)
    with pytest.raises(ValueError, match="negative"):
        impl([b"abc"], -1)
    assert impl([], 0, 7) == (7, 0, 0)
    assert impl([b"", b"ab", b""], 2) == (package.crc32c(b"ab"), 2, 0)
