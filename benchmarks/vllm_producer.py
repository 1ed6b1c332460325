"""A vLLM prefill (producer) instance sending KV over a slow link: the engine's time per
prompt when it goes on while KV is on the wire (``kvwire_async_save``, the default)
against waiting for each send in ``wait_for_save`` (``kvwire_async_save: false``).

Needs vLLM (``pip install 'kvwire[vllm]'``, or the environment ``.ci/vllm`` builds); the
engine runs through ``tests/integration/vllm_run.py``:

    python benchmarks/vllm_producer.py [--rate 1e9] [--prompt-tokens 2048] [--prompts 6]
                                       [--layers 8] [--hidden 1024] [--rounds 2]

This process runs a kvwire server that takes every transfer (the decode side), behind a
proxy capping the producer-to-server direction at ``--rate`` bit/s
(:class:`kvwire.testing.FaultProxy`).  Per round, one producer process per mode, in turn,
prefills the same prompts one ``generate(max_tokens=1)`` at a time (the first is a warm-up
and not counted).  Reported per mode, medians over rounds: the engine's seconds per prompt
(what ``generate()`` took: prefill, plus the wait for the send when it waits) and the
seconds from the first counted prompt's start to the last one's KV acknowledged.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from vllm_ttft import _run, make_model  # this script's folder is on sys.path when run

import kvwire
from kvwire.sync import Bridge
from kvwire.testing import FaultPlan, FaultProxy, Faults

SECRET = b"integration-test-secret"  # vllm_run.py's


class Receiver:
    """A kvwire server that takes every transfer and notes when each was acknowledged."""

    def __init__(self, bridge: Bridge) -> None:
        self.bridge = bridge
        self.done: dict[str, float] = {}

        async def start() -> Any:
            server = kvwire.serve("127.0.0.1", 0, secret=SECRET)
            await server.start()
            return server

        self.server = bridge.run(start(), 30)
        self.port: int = self.server.port
        self._loop = bridge.submit(self._take())

    async def _take(self) -> None:
        while True:
            transfer = await self.server.accept()
            asyncio.get_running_loop().create_task(self._drain(transfer))

    async def _drain(self, transfer: Any) -> None:
        async for _ in transfer:
            pass
        self.done[transfer.request_id] = time.time()

    def close(self) -> None:
        self._loop.cancel()
        self.bridge.run(self.server.close(), 30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=1e9, help="link rate, bit/s")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()

    bridge = Bridge("kvwire-bench")
    receiver = Receiver(bridge)
    proxy = FaultProxy("127.0.0.1", receiver.port, plan=lambda i: FaultPlan(forward=Faults(rate_bps=args.rate)))
    bridge.run(proxy.start(), 10)
    engine_s: dict[str, list[float]] = {"async": [], "wait": []}
    through_s: dict[str, list[float]] = {"async": [], "wait": []}
    kv_bytes = 0
    try:
        with tempfile.TemporaryDirectory(prefix="kvwire-producer-") as d:
            tmp = Path(d)
            model = make_model(tmp, args.dtype, args.layers, args.hidden)
            rng = random.Random(5)
            prompts = [[rng.randrange(512) for _ in range(args.prompt_tokens)] for _ in range(args.prompts + 1)]
            for r in range(args.rounds):
                for mode in ("async", "wait"):
                    name = f"{mode}{r}"
                    job = [{"prompt": p, "kvwire_id": f"{name}-{i}", "max_tokens": 1} for i, p in enumerate(prompts)]
                    (tmp / f"{name}.json").write_text(json.dumps(job))
                    extra = ["--sync-save"] if mode == "wait" else []
                    _run(["producer", "--job", str(tmp / f"{name}.json"), "--out", str(tmp / f"{name}.out"),
                          "--dir", str(model), "--dtype", args.dtype, "--port", str(proxy.port), *extra],
                         tmp / f"{name}.log")
                    results = json.loads((tmp / f"{name}.out").read_text())[1:]
                    ids = [f"{name}-{i}" for i in range(1, len(prompts))]
                    missing = [i for i in ids if i not in receiver.done]
                    if missing:
                        raise SystemExit(f"{name}: no KV arrived for {missing}, see {tmp}/{name}.log")
                    engine_s[mode].append(statistics.median(x["seconds"] for x in results))
                    through_s[mode].append(max(receiver.done[i] for i in ids) - results[0]["started"])
                    t0 = results[0]["started"]
                    starts = " ".join(f"{x['started'] - t0:.1f}" for x in results)
                    ends = " ".join(f"{receiver.done[i] - t0:.1f}" for i in ids)
                    print(f"round {r} {mode}: {engine_s[mode][-1] * 1e3:.0f} ms per prompt, "
                          f"all KV through in {through_s[mode][-1]:.2f} s (prompts started at {starts} s, "
                          f"their KV acknowledged at {ends} s)", flush=True)
                    kv_bytes = kv_bytes or _kv_bytes(tmp / f"{name}.log")
    finally:
        bridge.run(proxy.close(), 10)
        receiver.close()
        bridge.close()
    med = statistics.median
    print(f"\nmodel: {args.layers} layers, hidden {args.hidden}, head_dim 64, {args.dtype}; {args.prompts} prompts "
          f"of {args.prompt_tokens} tokens ({kv_bytes / 2**20:.1f} MiB of KV each) over {args.rate / 1e9:g} Gbit/s; "
          f"medians of {args.rounds} rounds\n")
    print("| producer | engine ms per prompt | s until all KV acknowledged |")
    print("|---|---|---|")
    for mode, label in (("wait", "waits in wait_for_save"), ("async", "goes on (kvwire_async_save)")):
        print(f"| {label} | {med(engine_s[mode]) * 1e3:.0f} | {med(through_s[mode]):.2f} |")
    print(f"\nengine time, going on / waiting: {med(engine_s['async']) / med(engine_s['wait']):.3f}")


def _kv_bytes(log: Path) -> int:
    for line in log.read_text().splitlines():
        if "kvwire: sent KV of request" in line:
            return int(line.split(": ")[-1].split(" bytes")[0])
    return 0


if __name__ == "__main__":
    main()
