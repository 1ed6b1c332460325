"""A paged transfer into a destination that drops some of its blocks (``kvwire.paged.DROP``:
blocks the receiver's prefix cache already holds), against the same transfer with every
block kept, measured in the same run.

Two processes over loopback, ``--codec`` (``raw`` by default): the sender sends ``--blocks`` blocks per
layer out of a paged cache (``PagedSource``) and the receiver receives them into its own
(``PagedDestination``) at random block ids, the first ``--drop`` of them named ``DROP``.
Caches shaped like vLLM's CPU backend for Llama-3-8B (32 layers, blocks of ``[8 heads,
128 tokens, 2 x 128]`` bfloat16, 512 KiB); 16 blocks (2,048 tokens, 256 MiB) per transfer.
Rounds alternate the two variants; each reports Gbit/s of KV sent (every block is on the
wire either way; KV, not wire bytes, for a quantizing codec) and each process's CPU
seconds per GB of KV.  Medians over ``--rounds``::

    python benchmarks/paged_drop.py [--codec raw] [--blocks 16] [--drop 8] [--transfers 12] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import resource
import statistics
import time
from typing import Any

import ml_dtypes
import numpy as np

import kvwire
from kvwire.paged import DROP, PagedDestination, PagedSource, PagedSpec

SECRET = b"paged-drop-benchmark-secret-0123"
LAYERS = 32
CACHE_BLOCKS = 40


def _caches(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = (CACHE_BLOCKS, 8, 128, 256)
    return [rng.standard_normal(shape, dtype=np.float32).astype(ml_dtypes.bfloat16) for _ in range(LAYERS)]


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _receive(ports: Any, results: Any, blocks: int, drop: int, transfers: int) -> None:
    caches = _caches(1)
    spec = PagedSpec.of(caches[0], num_layers=LAYERS)
    rng = np.random.default_rng(5)

    async def main() -> None:
        async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
            ports.put(server.port)
            started = 0.0
            for i in range(transfers + 1):  # the first one warms up
                ids = [int(x) for x in rng.choice(CACHE_BLOCKS, blocks, replace=False)]
                ids[:drop] = [DROP] * drop
                transfer = await server.expect(f"r{i}", into=PagedDestination(spec, caches, ids))
                if i == 1:
                    started = _cpu()
                async for _ in transfer:
                    pass
            results.put(_cpu() - started)

    asyncio.run(main())


def _send(port: int, blocks: int, transfers: int, codec: str) -> tuple[float, float]:
    caches = _caches(2)
    spec = PagedSpec.of(caches[0], num_layers=LAYERS)
    rng = np.random.default_rng(6)

    async def main() -> tuple[float, float]:
        async with kvwire.connect("127.0.0.1", port, secret=SECRET, codec=codec) as peer:
            wall = cpu = 0.0
            for i in range(transfers + 1):
                if i == 1:
                    wall, cpu = time.perf_counter(), _cpu()
                ids = rng.choice(CACHE_BLOCKS, blocks, replace=False)
                await peer.send(f"r{i}", spec.wire_spec(), PagedSource(spec, caches, ids))
            return time.perf_counter() - wall, _cpu() - cpu

    return asyncio.run(main())


def _round(blocks: int, drop: int, transfers: int, codec: str) -> tuple[float, float, float]:
    ctx = mp.get_context("spawn")
    ports, results = ctx.Queue(), ctx.Queue()
    receiver = ctx.Process(target=_receive, args=(ports, results, blocks, drop, transfers))
    receiver.start()
    try:
        seconds, sender_cpu = _send(ports.get(timeout=60), blocks, transfers, codec)
        receiver_cpu = results.get(timeout=120)
    finally:
        receiver.join(30)
    gb = transfers * LAYERS * blocks * 512 * 1024 / 1e9
    return gb * 8 / seconds, sender_cpu / gb, receiver_cpu / gb


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--codec", default="raw")
    ap.add_argument("--blocks", type=int, default=16, help="blocks per layer per transfer")
    ap.add_argument("--drop", type=int, default=8, help="of them, dropped by the receiver")
    ap.add_argument("--transfers", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not 0 < args.drop <= args.blocks <= CACHE_BLOCKS:
        ap.error(f"need 0 < --drop <= --blocks <= {CACHE_BLOCKS}")
    runs: dict[int, list[tuple[float, float, float]]] = {0: [], args.drop: []}
    for _ in range(args.rounds):
        for drop in runs:
            runs[drop].append(_round(args.blocks, drop, args.transfers, args.codec))
    print(f"{args.transfers} x {LAYERS * args.blocks * 512 // 1024} MiB, {args.codec}, loopback; "
          f"medians of {args.rounds} rounds")
    print("| blocks dropped | Gbit/s of KV sent | sender CPU s/GB | receiver CPU s/GB |")
    print("|---|---|---|---|")
    for drop, samples in runs.items():
        gbps, snd, rcv = (statistics.median(col) for col in zip(*samples, strict=True))
        print(f"| {drop} of {args.blocks} | {gbps:.1f} | {snd:.3f} | {rcv:.3f} |")


if __name__ == "__main__":
    main()
