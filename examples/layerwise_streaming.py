"""Layer-wise streaming: the decode side starts receiving while the prefill still computes.

A transformer's prefill produces the KV cache one layer at a time. ``peer.send()`` accepts
an async generator of ``(k, v)`` pairs and puts each layer on the wire as soon as it is
yielded; the receiver's ``async for layer in transfer`` hands out each layer as soon as
every chunk of it has arrived and been verified. Transfer thus overlaps compute: the first
layer lands long before the last one is computed.

The prefill compute is emulated by sleeping ``--compute-ms`` per layer (no model runs);
the KV values are random, in the layout of Llama-3-8B (32 x 8 x 128, fp16). Both sides run
as tasks of one process over loopback TCP.

    python examples/layerwise_streaming.py --tokens 512 --compute-ms 20
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator

import numpy as np

import kvwire
import kvwire.aio

SECRET = b"example-shared-secret"
SPEC = kvwire.KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16", model="llama-3-8b")


def layer_values(index: int, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Random KV-like values of one layer."""
    rng = np.random.default_rng(index)
    shape = (tokens, SPEC.num_kv_heads, SPEC.head_dim)
    k = rng.standard_normal(shape, dtype=np.float32).astype(np.float16)
    v = rng.standard_normal(shape, dtype=np.float32).astype(np.float16)
    return k, v


async def prefill(
    layers: list[tuple[np.ndarray, np.ndarray]], compute_s: float, t0: float, produced: list[float]
) -> AsyncIterator[tuple[np.ndarray, np.ndarray]]:
    """Emulated prefill: 'compute' a layer, hand it to kvwire, go on with the next."""
    for kv in layers:
        await asyncio.sleep(compute_s)  # stands in for one layer's forward pass
        produced.append(time.perf_counter() - t0)
        yield kv


async def main(args: argparse.Namespace) -> None:
    # Values are made up front so the per-layer timing is the emulated compute alone.
    layers = [layer_values(i, args.tokens) for i in range(SPEC.num_layers)]
    produced: list[float] = []
    arrived: list[tuple[int, float]] = []
    async with (
        kvwire.serve("127.0.0.1", 0, secret=SECRET, spec=SPEC) as server,
        kvwire.connect("127.0.0.1", server.port, secret=SECRET, streams=args.streams) as peer,
    ):
        t0 = time.perf_counter()
        sending = asyncio.create_task(
            peer.send("stream-1", SPEC, prefill(layers, args.compute_ms / 1e3, t0, produced))
        )
        transfer = await server.expect("stream-1", timeout=30)
        mismatched = 0
        async for layer in transfer:
            arrived.append((layer.index, time.perf_counter() - t0))
            k, v = layers[layer.index]
            if not (np.array_equal(k.view(np.uint16), layer.k.view(np.uint16))
                    and np.array_equal(v.view(np.uint16), layer.v.view(np.uint16))):
                mismatched += 1
        receipt = await sending
    total = arrived[-1][1]
    compute_total = produced[-1]
    layer_mib = 2 * args.tokens * SPEC.num_kv_heads * SPEC.head_dim * SPEC.itemsize / 2**20
    print(f"{SPEC.num_layers} layers x {args.tokens} tokens ({layer_mib:.1f} MiB per layer), "
          f"emulated compute {args.compute_ms:g} ms per layer")
    print(" layer   produced_ms   arrived_ms   lag_ms")
    for index, at in arrived:
        print(f"  {index:4d}   {produced[index] * 1e3:11.1f}   {at * 1e3:10.1f}   {(at - produced[index]) * 1e3:6.1f}")
    first = arrived[0][1]
    print(f"time to first layer: {first * 1e3:.1f} ms; all layers: {total * 1e3:.1f} ms "
          f"(first/total = {first / total:.2f}); compute alone: {compute_total * 1e3:.1f} ms")
    # With no overlap the last layer would land a whole transfer time after compute ends.
    print(f"last layer landed {(total - compute_total) * 1e3:.1f} ms after the last layer was computed")
    print(f"receipt: {receipt.kv_bytes / 2**20:.1f} MiB in {receipt.chunks} chunks, codec {receipt.codec}")
    if mismatched:
        raise SystemExit(f"{mismatched} layers differ from what was sent")
    print(f"all {len(arrived)} layers verified bit-identical")
    if first >= total / 2:
        raise SystemExit("no overlap: the first layer arrived in the second half of the transfer")
    print("overlap: yes (the first layer arrived long before the last was computed)")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=512, help="tokens in the cache (4 KiB per token per layer)")
    p.add_argument("--compute-ms", type=float, default=20.0, help="emulated compute per layer")
    p.add_argument("--streams", type=int, default=2)
    return p.parse_args()


if __name__ == "__main__":
    kvwire.aio.run(main(parse_args()))
