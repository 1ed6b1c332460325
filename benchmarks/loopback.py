"""kvwire against a raw socket over loopback: the same KV bytes, sender and receiver in
two processes.

Three variants, each run ``--repeat`` times (medians reported):

a. raw: a plain ``sendall`` loop and a ``recv_into`` loop, no protocol at all;
b. kvwire ``codec="raw"``, 1 stream;
c. kvwire ``codec="raw"``, 4 streams.

Each sends ``--transfers`` copies of one model's KV cache (default llama3-8b, 8192
tokens: 1 GiB). Reported: Gbit/s of KV (receiver's first byte to last for a, the
sender's first ``send()`` to last receipt for b/c), CPU seconds per GB of KV of both
processes together (``getrusage``), and the ratio to the baseline. Run::

    python benchmarks/loopback.py
    python benchmarks/loopback.py --model tiny --tokens 4096 --transfers 20 --repeat 5
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import statistics
import time
from multiprocessing.connection import Connection
from typing import Any

from kvwire.bench.models import MODELS, bench_cache, get_model
from kvwire.bench.runner import raw_socket_run
from kvwire.units import argument_type, whole_number

_SECRET = b"loopback-bench-secret"


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _receiver(conn: Connection, transfers: int) -> None:
    import kvwire
    from kvwire.aio import run

    async def main() -> float:
        async with kvwire.serve("127.0.0.1", 0, secret=_SECRET) as server:
            conn.send(server.port)
            cpu0 = _cpu()
            for _ in range(transfers):
                transfer = await server.accept(timeout=120)
                # Layers are handed on and dropped, as a receiver feeding a GPU would.
                async for _layer in transfer:
                    pass
            return _cpu() - cpu0

    conn.send(run(main()))


def _sender(conn: Connection, port: int, model: str, tokens: int, transfers: int, streams: int) -> None:
    import kvwire
    from kvwire.aio import run

    shape = get_model(model)
    layers = bench_cache(shape, tokens, 0)

    async def main() -> tuple[float, float, int]:
        async with kvwire.connect("127.0.0.1", port, secret=_SECRET, streams=streams, codec="raw") as peer:
            cpu0 = _cpu()
            start = time.monotonic()
            kv = 0
            for i in range(transfers):
                receipt = await peer.send(f"r{i}", shape.spec(), layers)
                kv += receipt.kv_bytes
            return time.monotonic() - start, _cpu() - cpu0, kv

    conn.send(run(main()))


def kvwire_run(model: str, tokens: int, transfers: int, streams: int) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    rparent, rchild = ctx.Pipe()
    receiver = ctx.Process(target=_receiver, args=(rchild, transfers))
    receiver.start()
    port = rparent.recv()
    sparent, schild = ctx.Pipe()
    sender = ctx.Process(target=_sender, args=(schild, port, model, tokens, transfers, streams))
    sender.start()
    seconds, sender_cpu, kv = sparent.recv()
    receiver_cpu = rparent.recv()
    sender.join()
    receiver.join()
    return {
        "gbps": kv * 8 / seconds / 1e9,
        "bytes": float(kv),
        "sender_cpu_s": sender_cpu,
        "receiver_cpu_s": receiver_cpu,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="llama3-8b")
    ap.add_argument("--tokens", type=argument_type(whole_number, "int"), default=8192)
    ap.add_argument("--transfers", type=argument_type(whole_number, "int"), default=3, help="caches sent per run")
    ap.add_argument("--repeat", type=argument_type(whole_number, "int"), default=3)
    args = ap.parse_args()

    cache_bytes = args.tokens * get_model(args.model).bytes_per_token()
    print(
        f"{args.model}, {args.tokens} tokens = {cache_bytes / 2**20:.0f} MiB per cache, "
        f"{args.transfers} caches per run, {args.repeat} runs per variant (interleaved)"
    )
    variants: dict[str, list[dict[str, float]]] = {"raw socket": [], "kvwire 1 stream": [], "kvwire 4 streams": []}
    for _ in range(args.repeat):
        # Interleaved, so that a machine getting slower or faster affects all variants.
        variants["raw socket"].append(raw_socket_run(args.model, args.tokens, transfers=args.transfers))
        variants["kvwire 1 stream"].append(kvwire_run(args.model, args.tokens, args.transfers, 1))
        variants["kvwire 4 streams"].append(kvwire_run(args.model, args.tokens, args.transfers, 4))

    def med(runs: list[dict[str, float]], key: Any) -> float:
        return statistics.median(key(r) for r in runs)

    base = med(variants["raw socket"], lambda r: r["gbps"])
    print(f"{'variant':<18} {'Gbit/s':>8} {'runs (Gbit/s)':>22} {'CPU s/GB':>9} {'snd':>6} {'rcv':>6} {'x baseline':>10}")
    for name, runs in variants.items():
        gbps = med(runs, lambda r: r["gbps"])
        per_gb = med(runs, lambda r: (r["sender_cpu_s"] + r["receiver_cpu_s"]) / (r["bytes"] / 1e9))
        snd = med(runs, lambda r: r["sender_cpu_s"] / (r["bytes"] / 1e9))
        rcv = med(runs, lambda r: r["receiver_cpu_s"] / (r["bytes"] / 1e9))
        each = " ".join(f"{r['gbps']:.1f}" for r in runs)
        print(f"{name:<18} {gbps:>8.2f} {each:>22} {per_gb:>9.3f} {snd:>6.3f} {rcv:>6.3f} {gbps / base:>10.2f}")


if __name__ == "__main__":
    main()
