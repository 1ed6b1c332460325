"""Load: one server process, one client process, many concurrent transfers.

Run: ``python benchmarks/load.py [--small 1000] [--large 8] [--streams 4]``.

The client process opens one session of ``--streams`` TCP streams to the server process
on 127.0.0.1 and starts every transfer at once: ``--small`` small caches and ``--large``
large ones.  The server process receives them all concurrently (``expect``, then ``async for`` over
the layers, each checked and dropped) against the bytes the client sent (both sides
build the same caches from the same seeds).

Reported: transfers completed and verified, send latency p50/p99 per class (``send()``
until the receipt), and peak RSS of both processes: sampled with psutil from this parent
process, and the kernel's own high-water mark (``ru_maxrss``) reported by each child.

Memory bound.  kvwire bounds the receiver's buffering with credits:

- connection credit: at most ``window`` bytes of CHUNK frames unacknowledged per stream,
  so ``streams x window`` in socket and decoder buffers;
- per-transfer layer credit: at most ``max(one layer, transfer_buffer_bytes)`` of decoded
  layers held per transfer before the application takes them, so
  ``sum over concurrent transfers of min(transfer size, max(layer size, transfer_buffer_bytes))``.

The printed bound is the sum of the two; the server's RSS growth over its idle baseline
is compared with it.  The client holds the caches it sends (application data, built
before the clock starts) plus at most ``streams x window`` of frames in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvwire.units import argument_type, number, whole_number

SECRET = b"load-benchmark-secret"
MiB = 1 << 20


def _specs(args: argparse.Namespace) -> tuple[Any, Any]:
    import kvwire

    small = kvwire.KVSpec(num_layers=args.small_layers, num_kv_heads=2, head_dim=64, dtype="float16")
    large = kvwire.KVSpec(num_layers=args.large_layers, num_kv_heads=8, head_dim=128, dtype="float16")
    return small, large


def _cache(spec: Any, tokens: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    shape = (tokens, spec.num_kv_heads, spec.head_dim)
    return [
        (rng.standard_normal(shape, dtype=np.float32).astype(np.float16),
         rng.standard_normal(shape, dtype=np.float32).astype(np.float16))
        for _ in range(spec.num_layers)
    ]


SMALL_PATTERNS = 8  # distinct small caches (transfer i carries pattern i % 8)


def _caches(args: argparse.Namespace) -> tuple[list[list[tuple[np.ndarray, np.ndarray]]], list[tuple[np.ndarray, np.ndarray]]]:
    small_spec, large_spec = _specs(args)
    smalls = [_cache(small_spec, args.small_tokens, seed=100 + i) for i in range(SMALL_PATTERNS)]
    large = _cache(large_spec, args.large_tokens, seed=7)
    return smalls, large


def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


# -- server process -------------------------------------------------------------------------


async def _server_main(args: argparse.Namespace) -> None:
    import kvwire

    smalls, large = _caches(args)
    expected = args.small + args.large
    results: dict[str, int] = {"identical": 0, "different": 0, "failed": 0}
    done = asyncio.Event()
    async with kvwire.serve(
        "127.0.0.1", 0, secret=SECRET, window=args.window * MiB,
        transfer_buffer_bytes=args.buffer * MiB, max_transfers=expected + 16,
    ) as server:
        baseline = _rss()
        print(json.dumps({"port": server.port, "baseline_rss": baseline}), flush=True)

        async def receive(rid: str) -> None:
            try:
                t = await server.expect(rid, timeout=args.timeout)
                kind, idx = rid.split("-")
                ref = large if kind == "large" else smalls[int(idx) % SMALL_PATTERNS]
                # Layer by layer, each checked and dropped: the application holds one
                # layer, so RSS growth is kvwire's buffering.
                same, seen = True, 0
                async for layer in t:
                    rk, rv = ref[layer.index]
                    same = same and np.array_equal(layer.k, rk) and np.array_equal(layer.v, rv)
                    seen += 1
                same = same and seen == len(ref)
                results["identical" if same else "different"] += 1
            except kvwire.KvwireError:
                results["failed"] += 1
            if sum(results.values()) == expected:
                done.set()

        rids = [f"small-{i}" for i in range(args.small)] + [f"large-{i}" for i in range(args.large)]
        tasks = [asyncio.create_task(receive(r)) for r in rids]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), args.timeout + 30)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        stats = server.statistics()
    print(json.dumps({"server": results, "stats": stats, "maxrss": _maxrss(), "baseline_rss": baseline}), flush=True)


# -- client process -------------------------------------------------------------------------


async def _client_main(args: argparse.Namespace) -> None:
    import kvwire

    smalls, large = _caches(args)
    small_spec, large_spec = _specs(args)
    async with kvwire.connect(
        "127.0.0.1", args.port, secret=SECRET, streams=args.streams, chunk_bytes=args.chunk_kib * 1024,
    ) as peer:
        baseline = _rss()
        print(json.dumps({"baseline_rss": baseline}), flush=True)
        loop = asyncio.get_running_loop()
        lat: dict[str, list[float]] = {"small": [], "large": []}
        failed: dict[str, int] = {}

        async def send(kind: str, i: int) -> None:
            spec, layers = (large_spec, large) if kind == "large" else (small_spec, smalls[i % SMALL_PATTERNS])
            t0 = loop.time()
            try:
                await peer.send(f"{kind}-{i}", spec, layers, timeout=args.timeout)
            except kvwire.KvwireError as exc:
                failed[type(exc).__name__] = failed.get(type(exc).__name__, 0) + 1
                return
            lat[kind].append(loop.time() - t0)

        t0 = loop.time()
        await asyncio.gather(
            *(send("large", i) for i in range(args.large)),
            *(send("small", i) for i in range(args.small)),
        )
        wall = loop.time() - t0
    kv_bytes = (
        args.small * small_spec.num_layers * 2 * args.small_tokens * small_spec.num_kv_heads * small_spec.head_dim * 2
        + args.large * large_spec.num_layers * 2 * args.large_tokens * large_spec.num_kv_heads * large_spec.head_dim * 2
    )
    print(json.dumps({
        "client": {k: len(v) for k, v in lat.items()}, "failed": failed, "wall": wall, "kv_bytes": kv_bytes,
        "p": {k: _percentiles(v) for k, v in lat.items()}, "maxrss": _maxrss(), "baseline_rss": baseline,
    }), flush=True)


def _percentiles(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"p50": None, "p99": None, "max": None}
    a = np.asarray(xs)
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)), "max": float(a.max())}


# -- parent ---------------------------------------------------------------------------------


class _Sampler(threading.Thread):
    """Peak RSS of a set of processes, sampled every ``period`` seconds."""

    def __init__(self, pids: dict[str, int], period: float = 0.02) -> None:
        super().__init__(daemon=True)
        import psutil

        self.procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.peak = dict.fromkeys(pids, 0)
        self.period = period
        self.stop = threading.Event()

    def add(self, name: str, pid: int) -> None:
        import psutil

        self.procs[name] = psutil.Process(pid)
        self.peak[name] = 0

    def run(self) -> None:
        import psutil

        while not self.stop.is_set():
            for name, p in list(self.procs.items()):
                with contextlib.suppress(psutil.Error):
                    self.peak[name] = max(self.peak[name], p.memory_info().rss)
            time.sleep(self.period)


def _child(role: str, args: argparse.Namespace, extra: list[str]) -> subprocess.Popen[str]:
    cmd = [sys.executable, os.path.abspath(__file__), "--role", role, *_forward(args), *extra]
    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)


def _forward(args: argparse.Namespace) -> list[str]:
    out = []
    for name in ("small", "large", "streams", "window", "buffer", "chunk_kib", "small_layers",
                 "small_tokens", "large_layers", "large_tokens", "timeout"):
        out += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return out


def _mib(n: float) -> str:
    return f"{n / MiB:.1f} MiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", type=argument_type(lambda t: whole_number(t, minimum=0), "int"), default=1000, help="concurrent small transfers")
    ap.add_argument("--large", type=argument_type(lambda t: whole_number(t, minimum=0), "int"), default=8, help="concurrent large transfers")
    ap.add_argument("--streams", type=argument_type(whole_number, "int"), default=4)
    ap.add_argument("--window", type=argument_type(whole_number, "int"), default=8, help="server connection credit per stream, MiB")
    ap.add_argument("--buffer", type=argument_type(whole_number, "int"), default=4, help="server transfer_buffer_bytes, MiB")
    ap.add_argument("--chunk-kib", type=argument_type(lambda t: whole_number(t, minimum=4), "int"), default=256, help="client chunk_bytes, KiB")
    ap.add_argument("--small-layers", type=argument_type(whole_number, "int"), default=4)
    ap.add_argument("--small-tokens", type=argument_type(whole_number, "int"), default=32)
    ap.add_argument("--large-layers", type=argument_type(whole_number, "int"), default=8)
    ap.add_argument("--large-tokens", type=argument_type(whole_number, "int"), default=1024)
    ap.add_argument("--timeout", type=argument_type(number, "number"), default=120.0, help="per-transfer deadline, seconds")
    ap.add_argument("--role", choices=["parent", "server", "client"], default="parent", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.small + args.large < 1:
        ap.error("--small and --large: at least one transfer is needed")

    if args.role != "parent":
        from kvwire.aio import run

        run(_server_main(args) if args.role == "server" else _client_main(args))
        return

    small_spec, large_spec = _specs(args)
    small_bytes = small_spec.num_layers * 2 * args.small_tokens * small_spec.num_kv_heads * small_spec.head_dim * 2
    layer_large = 2 * args.large_tokens * large_spec.num_kv_heads * large_spec.head_dim * 2
    large_bytes = large_spec.num_layers * layer_large
    buf = args.buffer * MiB
    held = args.small * min(small_bytes, max(small_bytes // small_spec.num_layers, buf)) + args.large * min(
        large_bytes, max(layer_large, buf)
    )
    bound = args.streams * args.window * MiB + held
    print(f"load: {args.small} small ({_mib(small_bytes)} each) + {args.large} large ({_mib(large_bytes)} each) "
          f"transfers, one session of {args.streams} streams, chunk {args.chunk_kib} KiB, loopback")
    print(f"server credit: window {args.window} MiB/stream, transfer_buffer_bytes {args.buffer} MiB")
    print(f"receiver buffering bound: streams x window = {_mib(args.streams * args.window * MiB)}"
          f" + layers held = {_mib(held)} -> {_mib(bound)}")

    server = _child("server", args, [])
    assert server.stdout is not None
    hello = json.loads(server.stdout.readline())
    sampler = _Sampler({"server": server.pid})
    sampler.start()
    t0 = time.perf_counter()
    client = _child("client", args, ["--port", str(hello["port"])])
    assert client.stdout is not None
    sampler.add("client", client.pid)
    c_hello = json.loads(client.stdout.readline())
    c_out = json.loads(client.stdout.readline())
    client.wait(timeout=60)
    s_out = json.loads(server.stdout.readline())
    server.wait(timeout=60)
    sampler.stop.set()
    sampler.join()
    elapsed = time.perf_counter() - t0

    total = args.small + args.large
    print(f"completed (sender receipts): {sum(c_out['client'].values())}/{total}  failed: {c_out['failed'] or 0}")
    print(f"verified identical at the receiver: {s_out['server']['identical']}/{total}"
          f"  different: {s_out['server']['different']}  failed: {s_out['server']['failed']}")
    for kind in ("small", "large"):
        p = c_out["p"][kind]
        if p["p50"] is not None:
            print(f"{kind:5s} send latency: p50 {p['p50'] * 1e3:8.1f} ms   p99 {p['p99'] * 1e3:8.1f} ms   max {p['max'] * 1e3:8.1f} ms")
    print(f"client wall time for all transfers: {c_out['wall']:.2f} s ({c_out['kv_bytes'] / c_out['wall'] / 1e9:.2f} GB/s of KV)")
    for name, out, first in (("server", s_out, hello), ("client", c_out, c_hello)):
        base = first["baseline_rss"]
        peak = max(sampler.peak[name], out["maxrss"])
        print(f"{name} RSS: baseline {_mib(base)}, peak {_mib(peak)} (sampled {_mib(sampler.peak[name])},"
              f" ru_maxrss {_mib(out['maxrss'])}), growth {_mib(peak - base)}")
    growth = max(sampler.peak["server"], s_out["maxrss"]) - hello["baseline_rss"]
    print(f"server RSS growth / receiver buffering bound: {growth / bound:.2f}")
    print(f"total run {elapsed:.1f} s")


if __name__ == "__main__":
    main()
