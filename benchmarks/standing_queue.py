"""The queue a busy session keeps on an emulated link: back-to-back sends (two in flight at
once) for a while, the session's minimum RTT, smoothed RTT and in-flight target sampled
every two seconds, against the link's own round trip and bandwidth-delay product.

The sender's window is about twice the bandwidth times the minimum RTT, and the minimum RTT
is remembered for 10 s. A session that never runs out of data samples no RTT without its
own queue in it once the first samples expire; this shows what the window does then.

Run::

    python benchmarks/standing_queue.py --seconds 45 --rate 1gbps --rtt 20ms
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np

import kvwire
from kvwire.bench.emulator import LinkEmulator
from kvwire.units import parse_duration, parse_rate

SECRET = b"standing-queue-benchmark"


async def run(seconds: float, rate_bps: float, rtt: float, every: float) -> list[dict[str, float]]:
    spec = kvwire.KVSpec(num_layers=8, num_kv_heads=8, head_dim=128)
    layer = np.ones((2048, 8, 128), np.float16)
    layers = [(layer, layer)] * spec.num_layers  # 64 MiB a transfer
    rows: list[dict[str, float]] = []
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:

        async def take() -> None:
            while True:
                async for _ in await server.accept():
                    pass

        taking = asyncio.ensure_future(take())
        async with LinkEmulator("127.0.0.1", server.port, rate_bps=rate_bps, delay=rtt / 2) as link, \
                kvwire.connect("127.0.0.1", link.port, secret=SECRET) as peer:
            stop = time.monotonic() + seconds
            count = 0

            async def sender() -> None:
                nonlocal count
                while time.monotonic() < stop:
                    count += 1
                    await peer.send(f"q{count}", spec, layers, timeout=120)

            senders = [asyncio.ensure_future(sender()) for _ in range(2)]
            start = time.monotonic()
            while time.monotonic() < stop:
                await asyncio.sleep(every)
                st = peer.statistics()
                rows.append({"t": time.monotonic() - start, "min_rtt_ms": st["min_rtt_ms"] or 0.0,
                             "srtt_ms": st["srtt_ms"] or 0.0, "target_mb": st["inflight_target"] / 1e6,
                             "in_flight_mb": st["bytes_in_flight"] / 1e6})
            await asyncio.gather(*senders)
        taking.cancel()
        await asyncio.gather(taking, return_exceptions=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=45.0)
    ap.add_argument("--rate", default="1gbps")
    ap.add_argument("--rtt", default="20ms")
    ap.add_argument("--every", type=float, default=2.0, help="seconds between samples")
    args = ap.parse_args()
    rate, rtt = parse_rate(args.rate), parse_duration(args.rtt)
    rows = asyncio.run(run(args.seconds, rate, rtt, args.every))
    bdp_mb = rate / 8 * rtt / 1e6
    print(f"link {rate / 1e9:g} Gbit/s, RTT {rtt * 1e3:g} ms, bandwidth-delay product {bdp_mb:.1f} MB\n")
    print("| s | min RTT ms (x link RTT) | smoothed RTT ms (x link RTT) | in-flight target MB (x BDP) | in flight MB |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['t']:.0f} | {r['min_rtt_ms']:.0f} ({r['min_rtt_ms'] / (rtt * 1e3):.1f}) "
              f"| {r['srtt_ms']:.0f} ({r['srtt_ms'] / (rtt * 1e3):.1f}) "
              f"| {r['target_mb']:.1f} ({r['target_mb'] / bdp_mb:.1f}) | {r['in_flight_mb']:.1f} |")


if __name__ == "__main__":
    main()
