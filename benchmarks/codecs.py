"""Codec speed (vs. a memcpy of the same bytes, same run) and quality on real and synthetic KV.

Run: ``python benchmarks/codecs.py [--quick] [--cpu N] [--threads T] [--cpu-time]``.  Speed is
GB/s of float16 input (encode) or output (decode) on one core (``--cpu`` pins the process to
that core), the median of the repetitions; the ratio to ``np.copyto`` of the same bytes,
measured in the same run, is the figure to compare across machines.  ``--cpu-time`` times
with the thread's CPU clock instead of the wall clock (on a machine shared with other jobs
the wall clock also counts the time other processes held the core; the threads table always
uses the wall clock).  The quantizers are timed
through the codec (the compiled loops when ``kvwire.codec._hostcodec`` is built, at the
best SIMD level the CPU has and at the generic level), and through their numpy reference
(``encode_numpy``/``decode_numpy``), on a 1 MiB and a 4 MiB ``[tokens, 8, 128]`` chunk.
``--levels`` times only every SIMD level of the compiled loops the CPU runs, in
interleaved rounds, in cache and on a 256 MiB cache read from memory.
``--threads`` also times T threads encoding and decoding at once (the compiled loops
release the GIL).  Quality: relative L2 error ``||x^ - x|| / ||x||`` and wire bytes (params +
payload) / float16 bytes, per codec and layer, on ``tests/data/minilm_kv.npz`` and on
Llama-like synthetic tensors with outlier key channels.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvwire.codec import TensorKind, _host, available_codecs, get_codec

SAMPLE = Path(__file__).resolve().parents[1] / "tests/data/minilm_kv.npz"
QUANTIZERS = ("fp8", "int8", "int4")
CALLS = 8


CLOCK: Callable[[], float] = time.perf_counter


def _best(fn: Any, reps: int, clock: Callable[[], float] | None = None) -> float:
    """Median seconds of ``reps`` calls (after one warm-up call)."""
    tick = clock or CLOCK
    fn()
    times: list[float] = []
    for _ in range(reps):
        t0 = tick()
        fn()
        times.append(tick() - t0)
    return statistics.median(times)


def speed(reps: int) -> float:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((2048, 8, 128)) * 2).astype(np.float16)  # 4 MiB, one Llama-8B layer chunk
    dst = np.empty_like(x)
    memcpy = x.nbytes / _best(lambda: np.copyto(dst, x), reps) / 1e9
    print(f"speed: [2048, 8, 128] float16 chunk ({x.nbytes >> 20} MiB), median of {reps}; memcpy {memcpy:.2f} GB/s")
    print(f"compiled codec loops: {_host.isa() or 'not built (numpy path)'}")
    print("| codec | encode GB/s | encode / memcpy | decode GB/s | decode / memcpy |")
    print("|---|---|---|---|---|")
    for name in available_codecs():
        codec = get_codec(name)
        chunk = codec.encode(x, TensorKind.K)
        enc = x.nbytes / _best(lambda c=codec: c.encode(x, TensorKind.K), reps) / 1e9
        dec = x.nbytes / _best(
            lambda c=codec, ch=chunk: c.decode(ch.params, ch.payload, shape=x.shape, dtype="float16", kind=TensorKind.K, out=dst),
            reps,
        ) / 1e9
        print(f"| {name} | {enc:.3f} | {enc / memcpy:.4f} | {dec:.3f} | {dec / memcpy:.4f} |")
    return memcpy


def compiled_vs_numpy(reps: int) -> None:
    """The quantizers through the compiled loops (best and generic level) and through the
    numpy reference, on a 1 MiB and a 4 MiB chunk, each against memcpy of the same bytes."""
    if _host.ext is None:
        print("\ncompiled vs numpy: the compiled codecs are not built here (or KVWIRE_NO_EXTENSIONS is set)")
        return
    best = _host.simd(_host.SIMD_BEST)
    assert best is not None
    _host.simd(_host.SIMD_GENERIC)
    generic = _host.isa()
    _host.simd(_host.SIMD_BEST)
    print(f"\ncompiled ({_host.isa()}; generic: {generic}) vs numpy reference, GB/s of float16 per core, median of {reps}")
    print("| chunk | codec | kind | encode | generic | numpy | decode | generic | numpy | encode / memcpy | decode / memcpy |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for tokens in (512, 2048):
        x = (rng.standard_normal((tokens, 8, 128)) * 2).astype(np.float16)
        dst = np.empty_like(x)
        memcpy = x.nbytes / _best(lambda d=dst, v=x: np.copyto(d, v), reps) / 1e9
        size = f"{x.nbytes >> 20} MiB (memcpy {memcpy:.2f})"
        for name in QUANTIZERS:
            codec: Any = get_codec(name)
            for kind in (TensorKind.K, TensorKind.V) if name == "int4" else (TensorKind.K,):
                ch = codec.encode(x, kind)
                args = {"shape": x.shape, "dtype": "float16", "kind": kind, "out": dst}
                row = []
                for level in (best, _host.SIMD_GENERIC):
                    _host.simd(level)
                    enc = x.nbytes / _best(lambda c=codec, k=kind, v=x: c.encode(v, k), reps) / 1e9
                    dec = x.nbytes / _best(lambda c=codec, ch=ch, a=args: c.decode(ch.params, ch.payload, **a), reps) / 1e9
                    row.append((enc, dec))
                _host.simd(_host.SIMD_BEST)
                few = max(2, reps // 3)
                enc_np = x.nbytes / _best(lambda c=codec, k=kind, v=x: c.encode_numpy(v, k), few) / 1e9
                dec_np = x.nbytes / _best(lambda c=codec, ch=ch, a=args: c.decode_numpy(ch.params, ch.payload, **a), few) / 1e9
                (enc, dec), (enc_g, dec_g) = row
                print(
                    f"| {size} | {name} | {kind.name} | {enc:.3f} | {enc_g:.3f} | {enc_np:.3f} | {dec:.3f} | {dec_g:.3f} "
                    f"| {dec_np:.3f} | {enc / memcpy:.4f} | {dec / memcpy:.4f} |"
                )


def levels(reps: int) -> None:
    """Every SIMD level of the compiled loops this CPU runs, in interleaved rounds (each
    round times every level once, so a drift of the host lands on all of them): encode and
    decode of a 4 MiB chunk in cache, and encode of a 256 MiB cache read in 4 MiB chunks,
    which is not in the CPU's caches (what a sender encodes)."""
    if _host.ext is None:
        print("\nSIMD levels: the compiled codecs are not built here (or KVWIRE_NO_EXTENSIONS is set)")
        return
    found = [level for level in range(_host.SIMD_BEST + 1) if _host.simd(level) == level]
    names = {}
    for level in found:
        _host.simd(level)
        names[level] = _host.isa()
    _host.simd(_host.SIMD_BEST)
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((2048, 8, 128)) * 2).astype(np.float16)
    big = (rng.standard_normal((64 * 2048, 8, 128)) * 2).astype(np.float16)
    dst = np.empty_like(x)
    memcpy = x.nbytes / _best(lambda: np.copyto(dst, x), reps) / 1e9
    print(f"\nSIMD levels, GB/s of float16 per core, median of {reps} interleaved rounds; memcpy of the 4 MiB chunk {memcpy:.2f}")
    for level in found:
        print(f"- level {level}: {names[level]}")
    print("| codec | kind | level | encode, in cache | encode, from memory | decode, in cache | encode / memcpy |")
    print("|---|---|---|---|---|---|---|")
    for name in QUANTIZERS:
        codec: Any = get_codec(name)
        for kind in (TensorKind.K, TensorKind.V) if name == "int4" else (TensorKind.K,):
            ch = codec.encode(x, kind)
            args = {"shape": x.shape, "dtype": "float16", "kind": kind, "out": dst}
            times: dict[int, list[list[float]]] = {level: [[], [], []] for level in found}

            def stream(c: Any = codec, k: TensorKind = kind) -> None:
                for i in range(0, big.shape[0], 2048):
                    c.encode(big[i : i + 2048], k)

            for _ in range(reps):
                for level in found:
                    _host.simd(level)
                    for slot, fn in ((1, stream), (0, lambda c=codec, k=kind: c.encode(x, k)),
                                     (2, lambda c=codec, ch=ch, a=args: c.decode(ch.params, ch.payload, **a))):
                        if slot != 1:
                            fn()  # the stream evicted the chunk: in cache again
                        t0 = CLOCK()
                        fn()
                        times[level][slot].append(CLOCK() - t0)
            _host.simd(_host.SIMD_BEST)
            for level in found:
                enc, enc_mem, dec = (n / statistics.median(t) / 1e9 for n, t in zip((x.nbytes, big.nbytes, x.nbytes), times[level], strict=True))
                print(f"| {name} | {kind.name} | {level} | {enc:.2f} | {enc_mem:.2f} | {dec:.2f} | {enc / memcpy:.3f} |")


def threads(count: int, reps: int) -> None:
    """Aggregate GB/s of ``count`` threads each encoding (then decoding) its own chunk."""
    rng = np.random.default_rng(1)
    xs = [(rng.standard_normal((1024, 8, 128)) * 2).astype(np.float16) for _ in range(count)]
    outs = [np.empty_like(x) for x in xs]
    cores = len(os.sched_getaffinity(0))
    print(
        f"\nthreads: {count} threads on {cores} cores, one [1024, 8, 128] float16 chunk each coded {CALLS} times, "
        f"aggregate GB/s (median of {reps})"
    )
    print("| codec | encode 1 thread | encode threads | x | decode 1 thread | decode threads | x |")
    print("|---|---|---|---|---|---|---|")
    for name in QUANTIZERS:
        codec = get_codec(name)
        chunks = [codec.encode(x, TensorKind.K) for x in xs]

        # each thread codes its chunk CALLS times, so that starting threads is not timed
        def enc(i: int, c: Any = codec) -> None:
            for _ in range(CALLS):
                c.encode(xs[i], TensorKind.K)

        def dec(i: int, c: Any = codec, chs: Any = chunks) -> None:
            for _ in range(CALLS):
                c.decode(chs[i].params, chs[i].payload, shape=xs[i].shape, dtype="float16", kind=TensorKind.K, out=outs[i])

        row = [name]
        for fn in (enc, dec):
            # wall clock here: the threads' time is not the calling thread's CPU time
            work = CALLS * xs[0].nbytes
            one = work / _best(lambda f=fn: f(0), reps, time.perf_counter) / 1e9
            many = count * work / _best(lambda f=fn: _in_threads(f, count), reps, time.perf_counter) / 1e9
            row += [f"{one:.3f}", f"{many:.3f}", f"{many / one:.2f}"]
        print("| " + " | ".join(row) + " |")


def _in_threads(fn: Any, count: int) -> None:
    workers = [threading.Thread(target=fn, args=(i,)) for i in range(count)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def _measure(name: str, x: np.ndarray[Any, Any], kind: TensorKind) -> tuple[float, float, int, int]:
    codec = get_codec(name)
    chunk = codec.encode(x, kind)
    y = codec.decode(chunk.params, chunk.payload, shape=x.shape, dtype=str(x.dtype), kind=kind)
    xf = x.astype(np.float64)
    err2 = float(((y.astype(np.float64) - xf) ** 2).sum())
    return err2, float((xf**2).sum()), len(chunk.params) + memoryview(chunk.payload).nbytes, x.size * 2


def _table(title: str, tensors: dict[str, list[np.ndarray[Any, Any]]], layers: int) -> None:
    names = [n for n in available_codecs()]
    print(f"\n{title}: rel L2 error / wire ratio, per layer (K and V together), then whole cache")
    print("| codec | " + " | ".join(f"L{i}" for i in range(layers)) + " | all |")
    print("|---|" + "---|" * (layers + 1))
    for name in names:
        cells = []
        tot = [0.0, 0.0, 0, 0]
        for layer in range(layers):
            acc = [0.0, 0.0, 0, 0]
            for key, kind in (("k", TensorKind.K), ("v", TensorKind.V)):
                for x in tensors[key][layer::layers]:
                    for i, v in enumerate(_measure(name, x, kind)):
                        acc[i] += v
            cells.append(f"{(acc[0] / acc[1]) ** 0.5:.4f} / {acc[2] / acc[3]:.3f}")
            tot = [a + b for a, b in zip(tot, acc, strict=True)]
        cells.append(f"{(tot[0] / tot[1]) ** 0.5:.4f} / {tot[2] / tot[3]:.3f}")
        print(f"| {name} | " + " | ".join(cells) + " |")


def real_sample() -> None:
    with np.load(SAMPLE) as data:
        k, v = data["k"], data["v"]
    tensors = {
        "k": [k[layer, seq] for seq in range(2) for layer in range(6)],
        "v": [v[layer, seq] for seq in range(2) for layer in range(6)],
    }
    _table("real sample minilm_kv.npz ([512, 12, 32] per layer and sequence)", tensors, 6)


def synthetic() -> None:
    rng = np.random.default_rng(42)
    ks, vs = [], []
    for _ in range(4):
        k = rng.standard_normal((512, 8, 128)) * 1.2
        for h in range(8):
            chans = rng.choice(128, 4, replace=False)
            k[:, h, chans] *= rng.uniform(8, 20, 4)  # Llama-style outlier key channels
        pos = np.arange(512)[:, None, None] / 10000 ** (np.arange(64)[None, None, :] / 64)
        k[:, :, :64] *= 1 + 0.3 * np.cos(pos)  # RoPE-like rotation modulating the channels
        ks.append(k.astype(np.float16))
        vs.append((rng.standard_normal((512, 8, 128)) * 0.6).astype(np.float16))
    _table("synthetic Llama-like ([512, 8, 128], 4 outlier key channels per head at 8-20x)", {"k": ks, "v": vs}, 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer timing repetitions")
    parser.add_argument("--cpu", type=int, default=None, help="pin the process to this core")
    parser.add_argument("--threads", type=int, default=0, help="also time this many threads at once")
    parser.add_argument("--speed-only", action="store_true", help="skip the quality tables")
    parser.add_argument("--cpu-time", action="store_true", help="time with the thread's CPU clock")
    parser.add_argument("--levels", action="store_true",
                        help="only the table of every SIMD level the CPU runs (interleaved rounds, in cache and from memory)")
    args = parser.parse_args()
    global CLOCK
    if args.cpu_time:
        CLOCK = time.thread_time
    everywhere = os.sched_getaffinity(0)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    reps = 5 if args.quick else 15
    if args.levels:
        levels(reps)
        return
    speed(reps)
    compiled_vs_numpy(reps)
    if args.threads > 1:
        os.sched_setaffinity(0, everywhere)  # the threads need cores of their own
        threads(args.threads, reps)
    if args.speed_only:
        return
    real_sample()
    synthetic()


if __name__ == "__main__":
    main()
