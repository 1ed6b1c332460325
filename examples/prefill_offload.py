"""Prefill offload end to end, on one machine: trace -> scheduler -> kvwire -> decode.

One process plays three parts, connected by real kvwire transfers over loopback TCP:

- a *decode* server (``kvwire.serve``) that receives every request's KV cache
  (``server.expect(request_id)``), verifies it layer by layer, and records the prefix
  blocks it now holds in a ``MemoryRegistry`` (the local cluster's prefix cache);
- a *local prefill* worker in the decode's own cluster, connected directly;
- a *remote prefill* worker ("Prefill-as-a-Service") whose connection goes through a
  ``LinkEmulator``: a shared bottleneck rate and a one-way delay in both directions
  (10 Gbit/s and 10 ms by default).

Requests come from a slice of a Mooncake-format trace (``--trace``; by default the public
trace carried in ``tests/data/traces``; a synthetic log-normal workload when the file is
absent). For each request, at its (scaled) arrival time, ``kvwire.scheduler.decide``
places it from the live bandwidth estimate of the remote session
(``peer.statistics()["estimated_gbps"]``, measured by a bulk warm-up transfer before the
first request; the configured rate only with ``--bandwidth configured``), the egress the
offloads already under way put on the link (the remote session's bytes sent over the last
half second: the same units as the estimate), and the prefix hits that
``MemoryRegistry.lookup`` reports for the trace's ``hash_ids`` on each side. The length
threshold comes from the throughput model's optimizer (``kvwire.scheduler.optimize``) for
the trace slice, unless ``--threshold`` is given, over the link as the real model would see
it: the estimate x ``--time-scale`` x (KV bytes the real model ships / KV bytes this demo
ships), because compute runs ``--time-scale`` of real time and the KV is scaled down while
the network is neither.

What is real: the kvwire sessions and transfers (TCP, chunking, striping, CRCs, acks),
the scheduler's decisions, the registries' leases and versions, and the byte-for-byte
verification at the decode side.

What is emulated, and said again in the output:

- prefill compute: no model runs. A prefill sleeps for the latency the profile
  (``--profile``, default hybrid-1t on 8xH200 for the remote instances; the local ones
  have ``--relative-compute`` of its compute) gives for the request's incremental length,
  multiplied by ``--time-scale`` (0.05: 20x faster than real), spread over the layers;
  trace arrival times are scaled by the same factor, so the load keeps its shape;
- the link: a userspace proxy, not a WAN (TCP at the endpoints sees loopback);
- the KV cache: real bytes, but of a small model shape (16 layers x 2 KV heads x 64,
  fp16: 8 KiB per token) and a token count scaled by ``--kv-token-scale`` (1/16) and capped
  at ``--max-kv-tokens`` (2048), so a 40K-token prompt ships 2048 tokens = 16 MiB instead
  of the real model's hundreds of MiB. The values are random (bit patterns that make each
  request's cache unique and checkable), not a model's activations. Network times are not
  scaled; TTFT here = arrival to the whole cache verified at the decode side, in this
  demo's milliseconds (decode steps are not emulated).

    python examples/prefill_offload.py                       # 40 requests, < 1 minute
    python examples/prefill_offload.py --link-gbps 1 --delay-ms 20 --requests 80
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

import kvwire
import kvwire.aio
from kvwire.bench.emulator import LinkEmulator
from kvwire.consistency import MemoryRegistry
from kvwire.scheduler import (
    BLOCK_TOKENS,
    ClusterConfig,
    ClusterView,
    LengthDistribution,
    ModelProfile,
    Offload,
    PolicyRequest,
    SchedulerState,
    TraceRequest,
    decide,
    load_profile,
    load_trace,
    optimize,
    synthetic_trace,
)

SECRET = b"prefill-offload-demo-secret"
SPEC = kvwire.KVSpec(num_layers=16, num_kv_heads=2, head_dim=64, dtype="float16", model="kvwire-demo-small")
DEFAULT_TRACE = Path(__file__).resolve().parents[1] / "tests" / "data" / "traces" / "mooncake_synthetic.jsonl.gz"
DEMAND_WINDOW_S = 0.5
LOSSLESS = {"raw", "raw+zstd", "raw+lz4"}


# -- the KV contents -------------------------------------------------------------------


class KVFactory:
    """Makes each request's (scaled-down) KV cache and checks a received one.

    A fixed random base (standard-normal fp16) per layer, with the low mantissa bits of
    every element XORed by a per-request mask: every request's cache differs, values stay
    finite and KV-like, and making or checking a layer costs one pass over its bytes.
    """

    def __init__(self, max_tokens: int) -> None:
        rng = np.random.default_rng(2024)
        shape = (SPEC.num_layers, 2, max_tokens, SPEC.num_kv_heads, SPEC.head_dim)
        self._base = rng.standard_normal(shape, dtype=np.float32).astype(np.float16).view(np.uint16)

    @staticmethod
    def _mask(seed: int) -> np.uint16:
        return np.uint16(1 + seed % 1023)  # within the 10 mantissa bits

    def layer(self, seed: int, index: int, tokens: int) -> tuple[np.ndarray, np.ndarray]:
        m = self._mask(seed)
        k = (self._base[index, 0, :tokens] ^ m).view(np.float16)
        v = (self._base[index, 1, :tokens] ^ m).view(np.float16)
        return k, v

    def matches(self, seed: int, layer: kvwire.Layer, lossless: bool) -> bool:
        tokens = int(layer.k.shape[0])
        k, v = self.layer(seed, layer.index, tokens)
        if lossless:
            return bool(np.array_equal(k.view(np.uint16), layer.k.view(np.uint16))
                        and np.array_equal(v.view(np.uint16), layer.v.view(np.uint16)))
        # A quantizing codec: a few percent of relative error is its contract, not a fault.
        err = max(_rel_err(k, layer.k), _rel_err(v, layer.v))
        return err < 0.1


def _rel_err(want: np.ndarray, got: np.ndarray) -> float:
    a, b = want.astype(np.float32), got.astype(np.float32)
    return float(np.linalg.norm(a - b)) / max(float(np.linalg.norm(a)), 1e-12)


# -- the emulated link ------------------------------------------------------------------


def _link_process(conn: Connection, target_port: int, rate_bps: float, delay: float, seed: int) -> None:
    """The link runs in a process of its own: the proxy then has a core to itself instead
    of competing with the endpoints' event loop, as a real network would not. It runs on
    the default asyncio loop (under uvloop the proxy loses the first bytes a client sends
    before its upstream connection is up)."""

    async def serve_link() -> None:
        async with LinkEmulator("127.0.0.1", target_port, rate_bps=rate_bps, delay=delay, seed=seed) as link:
            conn.send(link.port)
            await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # until told to stop
            stats = link.statistics()
            conn.send({"bytes_forward": stats.bytes_forward, "bytes_backward": stats.bytes_backward,
                       "connections": stats.connections})

    asyncio.run(serve_link())


class EmulatedLink:
    """A :class:`~kvwire.bench.emulator.LinkEmulator` in a child process, towards ``target_port``."""

    def __init__(self, target_port: int, *, rate_bps: float, delay: float, seed: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_link_process, args=(child, target_port, rate_bps, delay, seed), daemon=True)
        self.port = 0
        self.statistics: dict[str, Any] = {}

    async def __aenter__(self) -> EmulatedLink:
        self._proc.start()
        loop = asyncio.get_running_loop()
        if not await loop.run_in_executor(None, self._conn.poll, 30.0):
            self._proc.kill()
            raise RuntimeError("the link emulator process did not start")
        self.port = self._conn.recv()
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        loop = asyncio.get_running_loop()
        try:
            self._conn.send("stop")
            if await loop.run_in_executor(None, self._conn.poll, 10.0):
                self.statistics = self._conn.recv()
        except (OSError, EOFError):
            pass
        await loop.run_in_executor(None, self._proc.join, 10.0)
        if self._proc.is_alive():
            self._proc.kill()


# -- bookkeeping -------------------------------------------------------------------------


@dataclass
class Outcome:
    request_id: str
    input_length: int
    where: str  # "local" | "remote"
    reason: str
    incremental: int
    local_hit_tokens: int
    remote_hit_tokens: int
    kv_tokens: int = 0
    kv_bytes: int = 0
    wire_bytes: int = 0
    model_kv_bytes: float = 0.0
    compute_s: float = 0.0
    ttft_s: float = math.nan
    verified: bool = False
    goodput_gbps: float | None = None


@dataclass
class Demo:
    args: argparse.Namespace
    remote_profile: ModelProfile
    local_profile: ModelProfile
    threshold: float
    kv: KVFactory
    server: kvwire.Server
    local_peer: kvwire.Peer
    remote_peer: kvwire.Peer
    link: EmulatedLink
    local_registry: MemoryRegistry
    remote_registry: MemoryRegistry
    local_slots: asyncio.Semaphore
    remote_slots: asyncio.Semaphore
    t0: float = 0.0
    sent_samples: list[tuple[float, int]] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)
    last_estimate_gbps: float | None = None

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def link_estimate_bps(self) -> tuple[float, str]:
        est = self.remote_peer.statistics()["estimated_gbps"]
        if est and self.args.bandwidth == "configured":
            self.last_estimate_gbps = est
            return self.args.link_gbps * 1e9, f"configured; kvwire estimate {est:.2f}"
        if est:
            self.last_estimate_gbps = est
            return est * 1e9, "live"
        return self.args.link_gbps * 1e9, "configured"

    def egress_demand_bps(self) -> float:
        """What the offloads already under way put on the link: the remote session's
        bytes sent over the last ``DEMAND_WINDOW_S``, in the same units as the link
        estimate (bytes this link really carries, per real second)."""
        now, sent = self.now(), int(self.remote_peer.statistics()["bytes_sent"])
        self.sent_samples.append((now, sent))
        while len(self.sent_samples) > 2 and self.sent_samples[1][0] <= now - DEMAND_WINDOW_S:
            self.sent_samples.pop(0)
        t0, b0 = self.sent_samples[0]
        return 8.0 * (sent - b0) / max(now - t0, DEMAND_WINDOW_S)

    def kv_tokens_for(self, tokens: int) -> int:
        return int(max(1, min(self.args.max_kv_tokens, math.ceil(tokens * self.args.kv_token_scale))))


# -- one request -------------------------------------------------------------------------


async def prefill_layers(demo: Demo, seed: int, tokens: int, compute_s: float) -> AsyncIterator[tuple[np.ndarray, np.ndarray]]:
    """An emulated prefill: each layer 'takes' its share of the profile's latency."""
    per_layer = compute_s / SPEC.num_layers
    for index in range(SPEC.num_layers):
        await asyncio.sleep(per_layer)
        yield demo.kv.layer(seed, index, tokens)


async def receive_and_verify(demo: Demo, rid: str, seed: int, lossless: bool) -> tuple[bool, float]:
    """The decode side of one request: take the layers as they land and check each."""
    transfer = await demo.server.expect(rid, timeout=120)
    ok = True
    layers = 0
    async for layer in transfer:
        ok = demo.kv.matches(seed, layer, lossless) and ok
        layers += 1
    return ok and layers == SPEC.num_layers, demo.now()


async def handle(demo: Demo, seq: int, req: TraceRequest, arrival: float) -> None:
    rid = f"r{seq:04d}"
    n = req.input_length
    local_hit = tuple(await demo.local_registry.lookup(req.hash_ids))
    remote_hit = tuple(await demo.remote_registry.lookup(req.hash_ids))
    bandwidth, source = demo.link_estimate_bps()
    state = SchedulerState(
        threshold_tokens=demo.threshold,
        bandwidth_bps=bandwidth,
        egress_demand_bps=demo.egress_demand_bps(),
        local_prefix_hit=local_hit,
        remotes=(ClusterView(name="remote", prefix_hit=remote_hit),),
        block_tokens=BLOCK_TOKENS,
    )
    decision = decide(PolicyRequest(request_id=rid, input_length=n, output_length=req.output_length), state)
    local_hit_tokens = min(len(local_hit) * BLOCK_TOKENS, n)
    remote_hit_tokens = min(len(remote_hit) * BLOCK_TOKENS, n)
    where = "remote" if isinstance(decision, Offload) else "local"
    out = Outcome(
        request_id=rid, input_length=n, where=where, reason=decision.reason,
        incremental=decision.incremental_tokens, local_hit_tokens=local_hit_tokens,
        remote_hit_tokens=remote_hit_tokens,
    )
    demo.outcomes.append(out)
    print(
        f"{rid}  t={arrival * 1e3:7.1f}ms  input={n:6d}  prefix hit local={local_hit_tokens:6d} "
        f"remote={remote_hit_tokens:6d}  -> {where:6s} ({decision.reason}, incremental {decision.incremental_tokens})  "
        f"link estimate {bandwidth / 1e9:6.2f} Gbit/s ({source}), egress demand {state.egress_demand_bps / 1e9:5.2f} Gbit/s",
        flush=True,
    )

    # The decode side already holds the prefix it hit, so only the rest of the KV moves.
    ship_tokens = n - local_hit_tokens
    if ship_tokens <= 0:
        out.ttft_s = demo.now() - arrival
        out.verified = True
        print(f"{rid}  whole prompt cached at the decode side: nothing to compute or move")
        return
    out.kv_tokens = demo.kv_tokens_for(ship_tokens)
    out.model_kv_bytes = demo.remote_profile.kv_size_bytes(n) - demo.remote_profile.kv_size_bytes(local_hit_tokens)
    profile = demo.remote_profile if where == "remote" else demo.local_profile
    out.compute_s = profile.prefill_seconds(decision.incremental_tokens) * demo.args.time_scale

    # The decode side's registry: these blocks are on their way (a lease), complete once
    # the cache has landed and been verified (commit).
    lease = await demo.local_registry.begin(req.hash_ids, owner=rid, ttl=120)
    lossless = where == "local" or demo.args.codec in LOSSLESS
    receiving = asyncio.create_task(receive_and_verify(demo, rid, seq, lossless))
    peer = demo.remote_peer if where == "remote" else demo.local_peer
    slots = demo.remote_slots if where == "remote" else demo.local_slots
    layers = prefill_layers(demo, seq, out.kv_tokens, out.compute_s)
    async with slots:  # one prefill instance, held while computing and shipping
        if where == "remote":
            remote_lease = await demo.remote_registry.begin(req.hash_ids, owner=rid, ttl=120)
        receipt = await peer.send(
            rid, SPEC, layers, timeout=120, meta={"input_length": n, "prefilled_on": where},
            codec=demo.args.codec if where == "remote" else "raw",
        )
        if where == "remote":
            # The remote cluster keeps the prefix it computed for later requests.
            await demo.remote_registry.commit(remote_lease)
    out.verified, landed = await receiving
    out.ttft_s = landed - arrival
    out.kv_bytes = receipt.kv_bytes
    out.wire_bytes = receipt.wire_bytes
    out.goodput_gbps = receipt.goodput_gbps
    if out.verified:
        await demo.local_registry.commit(lease)
    else:
        await demo.local_registry.release(lease)
    print(
        f"{rid}  landed at decode: {out.kv_tokens} KV tokens, {out.kv_bytes / 2**20:5.1f} MiB via {where}, "
        f"TTFT {out.ttft_s * 1e3:6.1f} ms, " + ("verified" if out.verified else "VERIFICATION FAILED"),
        flush=True,
    )


async def warm_up(demo: Demo, mib: int) -> None:
    """Probe the link with one bulk cache before the first request, so the scheduler's
    first decisions already have a measured estimate (layer-wise transfers smaller than
    the link's bandwidth-delay product never fill the pipe, so they cannot show its
    capacity)."""
    tokens = max(1, mib * 2**20 // SPEC.bytes_per_token())
    layers = [(np.zeros((tokens, SPEC.num_kv_heads, SPEC.head_dim), np.float16),) * 2 for _ in range(SPEC.num_layers)]
    receiving = asyncio.create_task(demo.server.expect("warm-up", timeout=60))
    receipt = await demo.remote_peer.send("warm-up", SPEC, layers, timeout=60)
    await (await receiving).collect(timeout=60)
    est = demo.remote_peer.statistics()["estimated_gbps"]
    print(f"warm-up: {receipt.kv_bytes / 2**20:.0f} MiB over the emulated link in {receipt.seconds * 1e3:.0f} ms "
          f"({receipt.goodput_gbps:.2f} Gbit/s); kvwire estimate now {est or 0:.2f} Gbit/s", flush=True)


# -- workload and setup ------------------------------------------------------------------


def load_requests(args: argparse.Namespace) -> tuple[list[TraceRequest], str]:
    path = Path(args.trace)
    if path.is_file():
        reqs = list(load_trace(path, limit=args.start + args.requests))[args.start:]
        t_first = reqs[0].arrival_s
        reqs = [TraceRequest(arrival_s=r.arrival_s - t_first, input_length=r.input_length,
                             output_length=r.output_length, hash_ids=r.hash_ids) for r in reqs]
        return reqs, f"trace {path} (requests {args.start}..{args.start + len(reqs) - 1})"
    rng = np.random.default_rng(args.seed)
    reqs = list(synthetic_trace(rng, requests=args.requests, rate_rps=2.0, output_tokens=150))
    return reqs, f"synthetic log-normal workload ({path} not found; no shared prefixes)"


def model_link_scale(args: argparse.Namespace, reqs: Sequence[TraceRequest], profile: ModelProfile) -> float:
    """How much faster the demo's link is than it looks, for the real model: KV bytes the
    real model would ship over bytes this demo ships (over the slice), times the time
    scale (compute runs ``time_scale`` of real time; the network is not scaled)."""
    real = sum(profile.kv_size_bytes(r.input_length) for r in reqs)
    shipped = sum(
        max(1, min(args.max_kv_tokens, math.ceil(r.input_length * args.kv_token_scale))) * SPEC.bytes_per_token()
        for r in reqs
    )
    return args.time_scale * real / max(shipped, 1)


def pick_threshold(args: argparse.Namespace, reqs: Sequence[TraceRequest], profile: ModelProfile,
                   link_bps: float) -> tuple[float, str]:
    """The optimizer's threshold for the trace slice over a link of ``link_bps`` (the
    kvwire estimate of the link this demo runs on, once it has one)."""
    if args.threshold is not None:
        return float(args.threshold), "--threshold"
    config = ClusterConfig(
        remote_profile=profile,
        remote_instances=args.remote_instances,
        local_instances=args.local_instances + 1,  # + one decode instance
        egress_bps=link_bps,
        relative_compute=args.relative_compute,
        mean_output_tokens=max(1.0, float(np.mean([r.output_length for r in reqs]))),
    )
    result = optimize(LengthDistribution.from_trace(reqs), config, step_tokens=512,
                      prefill_instances=args.local_instances)
    return result.threshold_tokens, f"optimizer for {link_bps / 1e9:.2f} Gbit/s (bound: {result.binding.value})"


async def run_demo(args: argparse.Namespace) -> None:
    console = Console(width=120)
    reqs, source = load_requests(args)
    remote_profile = load_profile(args.profile)
    local_profile = remote_profile.scaled(args.relative_compute, name=f"{remote_profile.name} x{args.relative_compute:g}")
    print("== kvwire prefill offload demo ==")
    print(f"workload: {source}, {len(reqs)} requests")
    print(f"emulated: prefill compute (sleep; profile {remote_profile.name!r} remote, x{args.relative_compute:g} compute "
          f"local; time scale {args.time_scale:g}), link (userspace proxy {args.link_gbps:g} Gbit/s, "
          f"{args.delay_ms:g} ms one-way), KV contents (random, {SPEC.num_layers}x{SPEC.num_kv_heads}x{SPEC.head_dim} fp16, "
          f"tokens x{args.kv_token_scale:g} capped at {args.max_kv_tokens})")
    print("real: kvwire sessions and transfers over TCP, scheduler decisions, registry leases, verification")

    kv = KVFactory(args.max_kv_tokens)
    async with (
        kvwire.serve("127.0.0.1", 0, secret=SECRET, spec=SPEC) as server,
        EmulatedLink(server.port, rate_bps=args.link_gbps * 1e9, delay=args.delay_ms / 1e3, seed=args.seed) as link,
        kvwire.connect("127.0.0.1", server.port, secret=SECRET, spec=SPEC) as local_peer,
        kvwire.connect("127.0.0.1", link.port, secret=SECRET, spec=SPEC, streams=args.streams,
                       codec=args.codec, connect_timeout=30) as remote_peer,
        MemoryRegistry() as local_registry,
        MemoryRegistry() as remote_registry,
    ):
        demo = Demo(
            args=args, remote_profile=remote_profile, local_profile=local_profile, threshold=math.inf, kv=kv,
            server=server, local_peer=local_peer, remote_peer=remote_peer, link=link,
            local_registry=local_registry, remote_registry=remote_registry,
            local_slots=asyncio.Semaphore(args.local_instances), remote_slots=asyncio.Semaphore(args.remote_instances),
        )
        if args.warmup_mib > 0:
            await warm_up(demo, args.warmup_mib)
        link_bps, link_source = demo.link_estimate_bps()
        # The optimizer reasons about the real model: its KV sizes and prefill times. This
        # link carries scaled-down KV, and compute runs time_scale faster while the network
        # does not, so for the real model the link is worth est x time_scale x (real bytes
        # / shipped bytes).
        scale = model_link_scale(args, reqs, remote_profile)
        demo.threshold, why = pick_threshold(args, reqs, remote_profile, link_bps * scale)
        print(f"link: {link_bps / 1e9:.2f} Gbit/s ({link_source}), worth {link_bps * scale / 1e9:.2f} Gbit/s "
              f"to the real model at this byte and time scale (x{scale:.3g})")
        print(f"threshold: {demo.threshold:.0f} tokens ({why}); instances: "
              f"{args.remote_instances} remote, {args.local_instances} local prefill; remote codec {args.codec}, "
              f"{args.streams} streams", flush=True)
        demo.t0 = time.perf_counter()
        tasks = []
        for seq, req in enumerate(reqs):
            arrival = req.arrival_s * args.time_scale
            delay = arrival - demo.now()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(handle(demo, seq, req, arrival)))
        await asyncio.gather(*tasks)
        elapsed = demo.now()
        final_est = remote_peer.statistics()["estimated_gbps"] or demo.last_estimate_gbps
    report(console, demo, elapsed, final_est, int(link.statistics.get("bytes_forward", 0)))
    if not all(o.verified for o in demo.outcomes):
        raise SystemExit("some caches failed verification")


def _mean_ms(values: Sequence[float]) -> str:
    return f"{1e3 * float(np.mean(values)):.1f}" if values else "-"


def report(console: Console, demo: Demo, elapsed: float, final_est: float | None, link_bytes: int) -> None:
    args = demo.args
    outs = demo.outcomes
    remote = [o for o in outs if o.where == "remote"]
    local = [o for o in outs if o.where == "local"]
    hits = [o for o in outs if o.local_hit_tokens or o.remote_hit_tokens]
    t = Table(title="prefill offload summary (compute and link emulated; KV bytes real, scaled down)")
    t.add_column("metric")
    t.add_column("local prefill", justify="right")
    t.add_column("remote prefill", justify="right")
    t.add_column("all", justify="right")
    t.add_row("requests", str(len(local)), str(len(remote)), str(len(outs)))
    t.add_row("offloaded fraction", "", "", f"{len(remote) / max(1, len(outs)):.2f}")
    t.add_row("mean input tokens", *(_mean_tokens(x) for x in (local, remote, outs)))
    t.add_row("requests with a prefix hit", str(sum(1 for o in hits if o.where == "local")),
              str(sum(1 for o in hits if o.where == "remote")), str(len(hits)))
    t.add_row("mean emulated compute (ms)", _mean_ms([o.compute_s for o in local]),
              _mean_ms([o.compute_s for o in remote]), "")
    t.add_row("mean TTFT (ms)", _mean_ms([o.ttft_s for o in local]), _mean_ms([o.ttft_s for o in remote]),
              _mean_ms([o.ttft_s for o in outs]))
    t.add_row("p90 TTFT (ms)", *(_p90_ms(x) for x in (local, remote, outs)))
    t.add_row("KV bytes moved (MiB, real)", _mib(sum(o.kv_bytes for o in local)), _mib(sum(o.kv_bytes for o in remote)),
              _mib(sum(o.kv_bytes for o in outs)))
    t.add_row("wire bytes (MiB)", _mib(sum(o.wire_bytes for o in local)), _mib(sum(o.wire_bytes for o in remote)),
              _mib(sum(o.wire_bytes for o in outs)))
    t.add_row(f"KV the real model ships (MiB, {demo.remote_profile.name.split(' ')[0]})",
              _mib(sum(o.model_kv_bytes for o in local)), _mib(sum(o.model_kv_bytes for o in remote)), "")
    t.add_row("verified caches", f"{sum(o.verified for o in local)}/{len(local)}",
              f"{sum(o.verified for o in remote)}/{len(remote)}", f"{sum(o.verified for o in outs)}/{len(outs)}")
    gps = [o.goodput_gbps for o in remote if o.goodput_gbps]
    t.add_row("link: configured rate / one-way delay", "", f"{args.link_gbps:g} Gbit/s / {args.delay_ms:g} ms", "")
    t.add_row("link: final kvwire estimate", "", f"{final_est:.2f} Gbit/s" if final_est else "none", "")
    t.add_row("link: mean per-transfer goodput", "", f"{np.mean(gps):.2f} Gbit/s" if gps else "-", "")
    t.add_row("link: bytes through the emulator (MiB)", "", _mib(link_bytes), "")
    t.add_row("wall time (s)", "", "", f"{elapsed:.2f}")
    console.print(t)
    print(f"threshold {demo.threshold:.0f} tokens; TTFT = arrival to the whole cache verified at the decode side "
          f"(demo ms: compute x{args.time_scale:g}, network not scaled)")
    print(f"all {sum(o.verified for o in outs)} of {len(outs)} caches verified" if all(o.verified for o in outs)
          else "VERIFICATION FAILURES")


def _mean_tokens(xs: Sequence[Outcome]) -> str:
    return f"{np.mean([o.input_length for o in xs]):.0f}" if xs else "-"


def _p90_ms(xs: Sequence[Outcome]) -> str:
    return f"{1e3 * float(np.percentile([o.ttft_s for o in xs], 90)):.1f}" if xs else "-"


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default=str(DEFAULT_TRACE), help="Mooncake-format JSONL (relative to the cwd)")
    p.add_argument("--start", type=int, default=0, help="first trace request of the slice")
    p.add_argument("--requests", type=int, default=40, help="requests in the slice")
    p.add_argument("--link-gbps", type=float, default=10.0, help="emulated link rate")
    p.add_argument("--delay-ms", type=float, default=10.0, help="emulated one-way delay")
    p.add_argument("--streams", type=int, default=4, help="TCP streams of the remote session")
    p.add_argument("--codec", default="raw", help="codec on the remote link (raw, fp8, int8, auto, ...)")
    p.add_argument("--time-scale", type=float, default=0.05, help="compute and arrival times x this")
    p.add_argument("--profile", default="hybrid-1t", help="remote instance profile: built-in name or file")
    p.add_argument("--relative-compute", type=float, default=0.15, help="local instance compute vs remote")
    p.add_argument("--remote-instances", type=int, default=2)
    p.add_argument("--local-instances", type=int, default=2, help="local prefill instances")
    p.add_argument("--threshold", type=float, default=None, help="offload threshold, tokens (default: optimizer)")
    p.add_argument("--kv-token-scale", type=float, default=1 / 16, help="KV tokens shipped per prompt token")
    p.add_argument("--max-kv-tokens", type=int, default=2048, help="cap on KV tokens shipped per request")
    p.add_argument("--bandwidth", choices=["estimate", "configured"], default="estimate",
                   help="what the scheduler takes as link bandwidth: kvwire's live estimate, or --link-gbps")
    p.add_argument("--warmup-mib", type=int, default=64, help="bulk probe of the link before the trace (0: none)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.requests < 1 or args.time_scale <= 0 or args.link_gbps <= 0 or args.max_kv_tokens < 1:
        p.error("--requests, --time-scale, --link-gbps and --max-kv-tokens must be positive")
    return args


if __name__ == "__main__":
    kvwire.aio.run(run_demo(parse_args()))
