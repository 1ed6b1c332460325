"""What handing one layer of a paged cache to a send costs the calling thread (a serving
engine's, in ``save_kv_layer``): ``gather_layer`` (the request's blocks copied into two new
arrays) against ``layer_rows`` (the blocks where they lie, no copy), with a copy of the
same bytes into a kept buffer (``np.copyto``) measured in the same run as the baseline.

    python benchmarks/paged_layer.py [--blocks 64] [--cache-blocks 160] [--layers 4] [--reps 5]

Caches shaped like vLLM's CPU backend for Llama-3-8B: ``[num_blocks, 8 heads, 128 tokens,
2 x 128]`` bfloat16, 512 KiB per block; ``--blocks`` of them at random ids per request
(64: 8192 tokens, 32 MiB per layer).  Medians over ``--reps`` passes over ``--layers``
caches (larger than the CPU's caches together, so each layer is read from memory).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from kvwire.paged import PagedSpec, gather_layer, layer_rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=64, help="blocks per request")
    ap.add_argument("--cache-blocks", type=int, default=160, help="blocks per layer's cache")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    shape = (args.cache_blocks, 8, 128, 256)
    caches = [rng.standard_normal(shape, dtype=np.float32).astype(ml_dtypes.bfloat16) for _ in range(args.layers)]
    spec = PagedSpec.of(caches[0], num_layers=args.layers)
    ids = rng.choice(args.cache_blocks, args.blocks, replace=False)
    layer_bytes = args.blocks * spec.block_bytes
    kept = np.empty(layer_bytes, np.uint8)

    def copy(cache: Any) -> None:
        np.copyto(kept, cache[: args.blocks].reshape(-1).view(np.uint8))

    timed: dict[str, Callable[[Any], Any]] = {
        "np.copyto of the same bytes (baseline)": copy,
        "gather_layer": lambda c: gather_layer(spec, c, ids),
        "layer_rows": lambda c: layer_rows(spec, c, ids),
    }
    seconds: dict[str, list[float]] = {name: [] for name in timed}
    for _ in range(args.reps):
        for name, fn in timed.items():  # interleaved: each pass times every way in turn
            for cache in caches:
                t0 = time.perf_counter()
                out = fn(cache)
                seconds[name].append(time.perf_counter() - t0)
                del out
    base = statistics.median(seconds["np.copyto of the same bytes (baseline)"])
    print(f"{args.blocks} blocks of {spec.block_bytes // 1024} KiB per layer ({layer_bytes / 2**20:.0f} MiB), "
          f"medians of {args.reps} x {args.layers} layers\n")
    print("| way | ms per layer (min-max) | vs copy | engine-thread s per GiB of cache |")
    print("|---|---|---|---|")
    for name, ts in seconds.items():
        med = statistics.median(ts)
        print(f"| {name} | {med * 1e3:.3f} ({min(ts) * 1e3:.3f}-{max(ts) * 1e3:.3f}) | {med / base:.3f} | "
              f"{med * 2**30 / layer_bytes:.3f} |")


if __name__ == "__main__":
    main()
