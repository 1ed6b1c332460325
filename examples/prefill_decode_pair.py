"""The smallest real kvwire use: a decode server receives one request's KV cache from a
prefill client.

The cache has the layout of Llama-3-8B (32 layers x 8 KV heads x 128 head_dim, fp16:
128 KiB per token) and a small token count by default, filled with random values (there is
no model here: the point is moving the bytes). The receiver checks the cache it got is
bit-identical to the one sent.

Run both sides in one process (two tasks on one event loop)::

    python examples/prefill_decode_pair.py --tokens 256

or as two processes::

    python examples/prefill_decode_pair.py --role server --port 7070
    python examples/prefill_decode_pair.py --role client --port 7070 --tokens 2048
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib

import numpy as np

import kvwire
import kvwire.aio

SECRET = b"example-shared-secret"
REQUEST_ID = "req-1"
SPEC = kvwire.KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16", model="llama-3-8b")

Layers = list[tuple[np.ndarray, np.ndarray]]


def make_cache(spec: kvwire.KVSpec, tokens: int, seed: int = 0) -> Layers:
    """A stand-in for a prefill's output: one (k, v) pair per layer, [tokens, heads, dim]."""
    rng = np.random.default_rng(seed)
    shape = (tokens, spec.num_kv_heads, spec.head_dim)
    return [
        (
            rng.standard_normal(shape, dtype=np.float32).astype(np.float16),
            rng.standard_normal(shape, dtype=np.float32).astype(np.float16),
        )
        for _ in range(spec.num_layers)
    ]


def digest(layers: Layers) -> str:
    """A short content hash, so two processes can compare what was sent and received."""
    h = hashlib.sha256()
    for k, v in layers:
        h.update(np.ascontiguousarray(k).tobytes())
        h.update(np.ascontiguousarray(v).tobytes())
    return h.hexdigest()[:16]


def check(layers: Layers, sent: Layers | None, meta: dict[str, object]) -> bool:
    """Bit-identical for the lossless codec; a relative error for the quantizing ones."""
    if meta.get("codec") == "raw":
        got = digest(layers)
        ok = got == meta.get("digest")
        print(f"decode: digest {got} vs sender's {meta.get('digest')}: " + ("verified bit-identical" if ok else "MISMATCH"))
        return ok
    if sent is None:
        print(f"decode: codec {meta.get('codec')} is lossy and the original is in another process: not compared")
        return True
    num = sum(float(np.sum((a.astype(np.float32) - b.astype(np.float32)) ** 2)) for (a, _), (b, _) in zip(layers, sent, strict=True))
    den = sum(float(np.sum(b.astype(np.float32) ** 2)) for _, (b, _) in zip(layers, sent, strict=True))
    rel = (num / den) ** 0.5
    print(f"decode: codec {meta.get('codec')} is lossy: keys' relative L2 error {rel:.4f} (verified within 0.2)")
    return bool(rel < 0.2)


async def decode_side(server: kvwire.Server, sent: Layers | None) -> None:
    """Wait for the request's cache, take it whole, and check it."""
    transfer = await server.expect(REQUEST_ID, timeout=120)
    cache = await transfer.collect(timeout=120)
    print(
        f"decode: received {transfer.request_id!r}: {cache.num_tokens} tokens x "
        f"{transfer.spec.num_layers} layers, {cache.nbytes / 2**20:.1f} MiB"
    )
    if not check(cache.layers, sent, transfer.meta):
        raise SystemExit(1)


async def prefill_side(host: str, port: int, layers: Layers, streams: int, codec: str) -> None:
    """Send the cache and print what the receipt says about it."""
    meta = {"prompt_tokens": int(layers[0][0].shape[0]), "digest": digest(layers), "codec": codec}
    async with kvwire.connect(host, port, secret=SECRET, streams=streams, codec=codec) as peer:
        receipt = await peer.send(REQUEST_ID, SPEC, layers, meta=meta)
    print_receipt(receipt)


def print_receipt(r: kvwire.Receipt) -> None:
    ttfl = f"{r.time_to_first_layer * 1e3:.1f} ms" if r.time_to_first_layer is not None else "n/a"
    est = f"{r.estimated_gbps:.2f} Gbit/s" if r.estimated_gbps is not None else "none yet"
    rtt = f"{r.rtt_ms:.2f} ms" if r.rtt_ms is not None else "n/a"
    print("receipt:")
    print(f"  request_id          {r.request_id}")
    print(f"  codec               {r.codec}")
    print(f"  kv_bytes            {r.kv_bytes:,}")
    print(f"  wire_bytes          {r.wire_bytes:,}  ({r.wire_bytes / r.kv_bytes:.4f} x kv)")
    print(f"  chunks              {r.chunks}")
    print(f"  seconds             {r.seconds * 1e3:.1f} ms (until every chunk was acknowledged)")
    print(f"  time_to_first_layer {ttfl}")
    print(f"  goodput             {r.goodput_gbps:.2f} Gbit/s")
    print(f"  bandwidth estimate  {est}, min RTT {rtt}")


async def main(args: argparse.Namespace) -> None:
    if args.role == "client":
        await prefill_side(args.host, args.port, make_cache(SPEC, args.tokens), args.streams, args.codec)
        return
    async with kvwire.serve(args.host, args.port, secret=SECRET, spec=SPEC) as server:
        print(f"decode: listening on {args.host}:{server.port}", flush=True)
        if args.role == "server":
            await decode_side(server, None)
            return
        # Both sides in one process: start waiting first, then send.  The order does not
        # matter: expect() also finds a transfer that arrived before it was called.
        layers = make_cache(SPEC, args.tokens)
        receiver = asyncio.create_task(decode_side(server, layers))
        await prefill_side("127.0.0.1", server.port, layers, args.streams, args.codec)
        await receiver


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--role", choices=["both", "server", "client"], default="both")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (role both/server)")
    p.add_argument("--tokens", type=int, default=256, help="tokens in the cache (128 KiB each)")
    p.add_argument("--streams", type=int, default=2, help="TCP streams to stripe chunks over")
    p.add_argument("--codec", default="raw", help="raw keeps the cache bit-identical")
    args = p.parse_args()
    if args.role == "client" and args.port == 0:
        p.error("--role client needs --port")
    return args


if __name__ == "__main__":
    kvwire.aio.run(main(parse_args()))
