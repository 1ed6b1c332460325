"""A vLLM prefill (producer) instance sending KV over a slow link: the engine's time per
prompt when it goes on while KV is on the wire (``kvwire_async_save``, the default)
against waiting for each send in ``wait_for_save`` (``kvwire_async_save: false``).

Needs vLLM (``pip install 'kvwire[vllm]'``, or the environment ``.ci/vllm`` builds); the
engine runs through ``tests/integration/vllm_run.py``:

    python benchmarks/vllm_producer.py [--rate 1e9] [--link proxy|veth] [--prompt-tokens 2048]
                                       [--prompts 6] [--layers 8] [--hidden 1024] [--rounds 2]

A kvwire server in a process of its own takes every transfer (the decode side) and notes
when each was acknowledged.  The link to it is capped at ``--rate`` bit/s: by a proxy in
this process (``--link proxy``, :class:`kvwire.testing.FaultProxy`: Python, so it shares
the CPU with the engine), or by the kernel (``--link veth``, root: producer and server in
two network namespaces joined by a veth pair shaped by ``tc tbf``,
:class:`kvwire.bench.netns.NetnsLink`).  Per round, one producer process per mode, in
turn, prefills the same prompts one ``generate(max_tokens=1)`` at a time.  Reported per mode,
medians over rounds: the engine's seconds per prompt (what ``generate()`` took: prefill,
plus the wait for the send when it waits; the first prompt, a warm-up, not counted) and
the seconds from the first prompt's start to the last one's KV acknowledged (all
prompts, the warm-up's KV included).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from vllm_ttft import RUN, make_model  # this script's folder is on sys.path when run

from kvwire.sync import Bridge
from kvwire.testing import FaultPlan, FaultProxy, Faults

SECRET = "integration-test-secret"  # vllm_run.py's


_RECEIVER = """
import asyncio, json, sys, time
import kvwire

async def main(host, log, secret):
    async with kvwire.serve(host, 0, secret=secret.encode()) as server:
        print(server.port, flush=True)

        async def drain(transfer):
            async for _ in transfer:
                pass
            with open(log, "a") as f:
                f.write(json.dumps([transfer.request_id, time.time()]) + "\\n")

        while True:
            transfer = await server.accept()
            asyncio.get_running_loop().create_task(drain(transfer))

asyncio.run(main(*sys.argv[1:4]))
"""


class Receiver:
    """A kvwire server in its own process (``prefix`` runs it, e.g. in a namespace) that
    takes every transfer and notes when each was acknowledged."""

    def __init__(self, host: str, prefix: list[str], log: Path) -> None:
        self.log = log
        self.proc = subprocess.Popen([*prefix, sys.executable, "-c", _RECEIVER, host, str(log), SECRET],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())

    @property
    def done(self) -> dict[str, float]:
        if not self.log.exists():
            return {}
        return {rid: t for rid, t in (json.loads(line) for line in self.log.read_text().splitlines())}

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=1e9, help="link rate, bit/s")
    ap.add_argument("--link", choices=["proxy", "veth"], default="proxy",
                    help="proxy: a rate-capping proxy in this process; veth: a veth pair shaped by tbf (root)")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="kvwire-producer-") as d, contextlib.ExitStack() as stack:
        tmp = Path(d)
        if args.link == "veth":
            from kvwire.bench.netns import NetnsLink

            link = stack.enter_context(NetnsLink(rate_bps=args.rate))
            receiver = Receiver(link.receiver_addr, ["ip", "netns", "exec", link.receiver_ns], tmp / "done.jsonl")
            stack.callback(receiver.close)
            where = ["ip", "netns", "exec", link.sender_ns]
            peer = ["--peer-host", link.receiver_addr, "--port", str(receiver.port)]
        else:
            receiver = Receiver("127.0.0.1", [], tmp / "done.jsonl")
            stack.callback(receiver.close)
            bridge = Bridge("kvwire-bench")
            stack.callback(bridge.close)
            proxy = FaultProxy("127.0.0.1", receiver.port,
                               plan=lambda i: FaultPlan(forward=Faults(rate_bps=args.rate)))
            bridge.run(proxy.start(), 10)
            stack.callback(lambda: bridge.run(proxy.close(), 10))
            where = []
            peer = ["--port", str(proxy.port)]
        report(args, tmp, receiver, where, peer)


def report(args: argparse.Namespace, tmp: Path, receiver: Receiver, where: list[str], peer: list[str]) -> None:
    """Run the rounds and print the table."""
    engine_s: dict[str, list[float]] = {"async": [], "wait": []}
    through_s: dict[str, list[float]] = {"async": [], "wait": []}
    kv_bytes = 0
    model = make_model(tmp, args.dtype, args.layers, args.hidden)
    rng = random.Random(5)
    prompts = [[rng.randrange(512) for _ in range(args.prompt_tokens)] for _ in range(args.prompts + 1)]
    for r in range(args.rounds):
        for mode in ("async", "wait"):
            name = f"{mode}{r}"
            job = [{"prompt": p, "kvwire_id": f"{name}-{i}", "max_tokens": 1} for i, p in enumerate(prompts)]
            (tmp / f"{name}.json").write_text(json.dumps(job))
            extra = ["--sync-save"] if mode == "wait" else []
            log = tmp / f"{name}.log"
            with log.open("w") as f:
                rc = subprocess.run(
                    [*where, sys.executable, str(RUN), "producer", "--job", str(tmp / f"{name}.json"),
                     "--out", str(tmp / f"{name}.out"), "--dir", str(model), "--dtype", args.dtype, *peer, *extra],
                    stdout=f, stderr=subprocess.STDOUT, check=False,
                ).returncode
            if rc != 0:
                raise SystemExit(f"producer failed:\n{log.read_text()[-3000:]}")
            results = json.loads((tmp / f"{name}.out").read_text())
            ids = [f"{name}-{i}" for i in range(len(prompts))]
            done = receiver.done
            missing = [i for i in ids if i not in done]
            if missing:
                raise SystemExit(f"{name}: no KV arrived for {missing}:\n{log.read_text()[-3000:]}")
            engine_s[mode].append(statistics.median(x["seconds"] for x in results[1:]))
            # From the warm-up's start: going on, the warm-up's KV is still on the wire when
            # the first counted prompt starts (waiting, it is not), and the link is FIFO.
            t0 = results[0]["started"]
            through_s[mode].append(max(done[i] for i in ids) - t0)
            starts = " ".join(f"{x['started'] - t0:.1f}" for x in results)
            ends = " ".join(f"{done[i] - t0:.1f}" for i in ids)
            print(f"round {r} {mode}: {engine_s[mode][-1] * 1e3:.0f} ms per prompt, "
                  f"all KV through in {through_s[mode][-1]:.2f} s (prompts started at {starts} s, "
                  f"their KV acknowledged at {ends} s)", flush=True)
            kv_bytes = kv_bytes or _kv_bytes(log)
    med = statistics.median
    print(f"\nmodel: {args.layers} layers, hidden {args.hidden}, head_dim 64, {args.dtype}; {args.prompts} prompts "
          f"of {args.prompt_tokens} tokens ({kv_bytes / 2**20:.1f} MiB of KV each) over {args.rate / 1e9:g} Gbit/s "
          f"({args.link}); medians of {args.rounds} rounds\n")
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
