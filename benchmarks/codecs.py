"""Codec speed (vs. a memcpy of the same bytes, same run) and quality on real and synthetic KV.

Run: ``python benchmarks/codecs.py [--quick]``.  Speed is GB/s of float16 input, for one
core; the ratio to ``np.copyto`` of the same bytes is the figure to compare across
machines.  Quality: relative L2 error ``||x^ - x|| / ||x||`` and wire bytes (params +
payload) / float16 bytes, per codec and layer, on ``../shared/data/minilm_kv.npz`` and on
Llama-like synthetic tensors with outlier key channels.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvwire.codec import TensorKind, available_codecs, get_codec

SAMPLE = Path(__file__).resolve().parents[1].parent / "shared/data/minilm_kv.npz"


def _best(fn: Any, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def speed(reps: int) -> None:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((2048, 8, 128)) * 2).astype(np.float16)  # 4 MiB, one Llama-8B layer chunk
    dst = np.empty_like(x)
    memcpy = x.nbytes / _best(lambda: np.copyto(dst, x), reps) / 1e9
    print(f"speed: [2048, 8, 128] float16 chunk ({x.nbytes >> 20} MiB), best of {reps}; memcpy {memcpy:.2f} GB/s")
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
    args = parser.parse_args()
    speed(3 if args.quick else 10)
    real_sample()
    synthetic()


if __name__ == "__main__":
    main()
