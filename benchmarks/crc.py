"""CRC32C speed: the compiled ``kvwire.wire._crc32c`` at each level vs the ``crc32c`` package,
with a memcpy of the same bytes (``np.copyto``) measured in the same run.

Run: ``python benchmarks/crc.py [--reps N] [--cold-mib M] [--cpu N]``.  Buffers: 64 KiB and
1 MiB checksummed over and over (hot: in L2), and one 1 GiB buffer (cold: far above the last
level cache, so every pass streams it from memory; its pages are written before any timing,
so no page fault is timed).  Each figure is the median of ``--reps`` timed samples after one
warm-up sample, in GB/s (1e9 bytes/s) of buffer checksummed (or copied, for memcpy); the
ratio is to the package in the same column.  ``--cpu`` pins the process to one core.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import crc32c as crc32c_package
import numpy as np

from kvwire.units import argument_type, whole_number
from kvwire.wire import crc

HOT_BYTES_PER_SAMPLE = 256 << 20  # a hot sample repeats the call over this many bytes


def _median_seconds(fn: Callable[[], Any], reps: int) -> float:
    fn()
    times: list[float] = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _gbps(fn: Callable[[Any], Any], buf: np.ndarray[Any, Any], reps: int, calls: int) -> float:
    def sample() -> None:
        for _ in range(calls):
            fn(buf)

    return buf.nbytes * calls / _median_seconds(sample, reps) / 1e9


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=argument_type(whole_number, "int"), default=7, help="timed samples per figure (median)")
    ap.add_argument("--cold-mib", type=argument_type(whole_number, "int"), default=1024, help="size of the cold buffer in MiB")
    ap.add_argument("--cpu", type=int, default=None, help="pin to this core")
    args = ap.parse_args()
    print("$ " + " ".join([os.path.basename(sys.executable), *sys.argv]))
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    ext = crc.ext
    print(f"cpu: {_cpu_model()}; python {platform.python_version()}; numpy {np.__version__}; "
          f"crc32c package {getattr(crc32c_package, '__version__', '?')} "
          f"(hardware_based={getattr(crc32c_package, 'hardware_based', '?')})")
    print(f"kvwire.wire.crc: {crc.implementation()}; median of {args.reps} samples\n")

    rng = np.random.default_rng(0)
    pattern = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    cases: list[tuple[str, np.ndarray[Any, Any], int]] = []
    for label, size in (("64 KiB hot", 64 << 10), ("1 MiB hot", 1 << 20)):
        cases.append((label, pattern[:size].copy(), max(1, HOT_BYTES_PER_SAMPLE // size)))
    cold_size = args.cold_mib << 20
    cold = np.empty(cold_size, np.uint8)
    cold.reshape(-1, 1 << 20)[:] = pattern  # touches (writes) every page before timing
    cold_label = f"{args.cold_mib >> 10} GiB cold" if args.cold_mib % 1024 == 0 else f"{args.cold_mib} MiB cold"
    cases.append((cold_label, cold, 1))

    impls: list[tuple[str, Callable[[Any], Any], int | None]] = []
    if ext is not None:
        for level, name in reversed(list(enumerate(ext.levels()))):
            impls.append((f"compiled {name} (level {level})", ext.crc32c, level))
    impls.append(("crc32c package", crc32c_package.crc32c, None))

    results: dict[str, list[float]] = {name: [] for name, _, _ in impls}
    memcpy: list[float] = []
    for _label, buf, calls in cases:
        want = crc32c_package.crc32c(buf)
        for name, fn, level in impls:
            if level is not None:
                assert ext is not None and ext._set_level(level) == level
            assert fn(buf) == want, name
            results[name].append(_gbps(fn, buf, args.reps, calls))
        dst = np.empty_like(buf)
        dst[:] = 1  # touch the destination's pages too
        memcpy.append(_gbps(lambda b, d=dst: np.copyto(d, b), buf, args.reps, calls))
        del dst
    if ext is not None:
        ext._set_level(len(ext.levels()) - 1)

    package = results["crc32c package"]
    print("| implementation | " + " | ".join(label for label, _, _ in cases) + " |")
    print("|---|" + "---:|" * len(cases))
    for name, speeds in results.items():
        cells = [f"{s:.1f} GB/s ({s / p:.2f}x)" for s, p in zip(speeds, package, strict=True)]
        print(f"| {name} | " + " | ".join(cells) + " |")
    cells = [f"{s:.1f} GB/s ({s / p:.2f}x)" for s, p in zip(memcpy, package, strict=True)]
    print("| numpy memcpy (np.copyto) | " + " | ".join(cells) + " |")
    print("\nGB/s = 1e9 bytes of buffer per second; (Nx) = ratio to the crc32c package's speed.")


if __name__ == "__main__":
    main()
