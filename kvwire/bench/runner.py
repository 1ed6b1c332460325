"""The bench: send a model's KV cache again and again over loopback, an emulated link, a
kernel-shaped link or to a remote ``kvwire serve``, and measure what arrives.

Sender, receiver and link emulator run in separate processes so that none of them
steals the others' event loop: on a small machine one process doing all three measures
the Python scheduler, not the transport. The sender runs in the calling process so
that progress can be shown live.

Every timestamp is ``time.monotonic()``, which is one clock for all processes of a
machine; sample times are reported in seconds from the link's start (``t0``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing as mp
import os
import re
import resource
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import numpy as np

from kvwire.aio._logtext import address, printable
from kvwire.bench import EMULATOR_PUMPS
from kvwire.bench._splice import AVAILABLE as SPLICE_AVAILABLE
from kvwire.bench.emulator import MAX_MTU, MIN_MTU, payload_share
from kvwire.bench.models import ModelShape, bench_cache, bench_cache_bytes, get_model, layer_error
from kvwire.bench.report import (
    codec_shares,
    diagnose,
    folds_into_previous,
    intervals,
    machine_cpu_times,
    one_interval,
    start_block,
    trust_note,
)
from kvwire.codec.base import available_codecs
from kvwire.errors import ConnectionLostError, KvwireError, TransferTimeoutError, UsageError
from kvwire.options import ServeOptions
from kvwire.scheduler.link import MIN_RATE_BPS
from kvwire.session.options import AUTO_CODEC_MODES, ClientOptions, ServerOptions
from kvwire.spec import KVSpec
from kvwire.units import format_duration, format_rate, format_size
from kvwire.wire.frames import DEFAULT_CHUNK_BYTES, DEFAULT_MAX_FRAME_SIZE, DEFAULT_WINDOW

__all__ = [
    "DEV_SECRET",
    "BenchConfig",
    "BenchReceiver",
    "load_secret",
    "mean_rate",
    "raw_socket_run",
    "run_bench",
    "serve_benches",
]

#: The secret both ``kvwire serve`` and ``kvwire bench --peer`` fall back to when neither
#: ``--secret-file`` nor ``KVWIRE_SECRET`` is given. Public, so it authenticates nothing:
#: ``kvwire serve`` accepts it on loopback addresses only.
DEV_SECRET = b"kvwire-development-secret"

#: Key in a transfer's ``meta`` that marks it as part of a bench.
META_KEY = "kvwire_bench"

#: A lossy layer's relative error is measured over this share of its tokens (see BenchReceiver).
CHECK_PARTS = 8

#: The run's closing message waits behind whatever the sender still holds of an abandoned
#: transfer, minutes on a slow link; it fails only once nothing moved for this long (s).
END_STALL = 30.0
#: A transfer still running when --duration ends may finish; one that takes longer than
#: this past the end (or twice the duration, if that is longer) is abandoned (s).
ABANDON_AFTER = 30.0
EMULATOR_SAMPLE_S = 0.01
"""How often the emulator process samples its byte counter (the per-sample wire rate)."""
_READY_TIMEOUT = 60.0  # spawning a child imports numpy and kvwire: seconds on a slow box

#: A server drops the state of a bench (its reference cache: up to 512 MiB) that saw no
#: transfer begin or layer arrive for this long (s): its sender ended without the run's
#: end message. Generous: the end message may queue minutes behind an abandoned transfer.
BENCH_IDLE = 900.0
#: Benches a server keeps the state of at once; a new one drops the least recently active.
MAX_BENCHES = 16
#: Seconds between a server's checks for benches whose sender went away.
PRUNE_INTERVAL = 5.0


def load_secret(path: str | None) -> tuple[bytes, str | None]:
    """The shared secret and, when it is the development default, a warning to print.

    Order: the file's bytes less one line ending at the end
    (:func:`kvwire.aio.read_secret_file`), else ``$KVWIRE_SECRET`` (surrounding
    whitespace stripped), else :data:`DEV_SECRET`.
    """
    if path is not None:
        from kvwire.aio import read_secret_file

        try:
            data = read_secret_file(path)
        except OSError as exc:
            raise UsageError(f"cannot read secret file {path!r}: {exc.strerror}") from None
        if len(data) < 8:
            raise UsageError(f"secret file {path!r} holds fewer than 8 bytes")
        return data, None
    env = os.environ.get("KVWIRE_SECRET")
    if env:
        data = os.fsencode(env).strip()  # the variable's bytes, whatever their encoding
        if len(data) < 8:
            raise UsageError("KVWIRE_SECRET holds fewer than 8 bytes")
        return data, None
    return DEV_SECRET, (
        "warning: no --secret-file or KVWIRE_SECRET; using the public development secret "
        f"{DEV_SECRET.decode()!r}, which protects nothing"
    )


# -- configuration --------------------------------------------------------------------------


def check_codec(name: str) -> str:
    """``name`` if it is ``auto`` or a registered codec, else a UsageError naming them."""
    known = available_codecs()
    if name != "auto" and name not in known:
        raise UsageError(f"unknown codec {name!r} (known: auto, {', '.join(known)})")
    return name


#: The runner's sample period (s), and so the shortest --interval: an interval groups
#: samples, and one shorter than a sample period was reported as a sample period anyway.
MIN_INTERVAL = 0.1
#: Largest --tokens: a kvwire server's default ``max_tokens`` per layer.
MAX_TOKENS = ServerOptions().max_tokens
#: Largest ``--seed`` (and seed a server takes in a bench's meta): 64 bits.
MAX_SEED = 2**64 - 1
#: Longest --rtt and --jitter (seconds): no link delays a byte longer.
MAX_RTT = 60.0
#: Seconds a connection of the bench has for its kvwire handshake: the sender's
#: ``connect_timeout`` and the bench receiver's ``handshake_timeout`` (defaults both).  The
#: handshake takes two round trips of the link, so a longer --rtt (or --jitter) is refused.
HANDSHAKE_LIMIT = min(ClientOptions().connect_timeout, ServerOptions().handshake_timeout)
#: Slowest link rate (bit/s): slower, the handshakes of a session's streams (hundreds of
#: bytes each, up to 64 streams) do not cross the link within the server's 10 s.  The
#: simulator takes the same floor.
MIN_LINK_BPS = MIN_RATE_BPS
#: Fastest link rate (bit/s): 1.6 Tbit/s, the fastest Ethernet. A faster one is a typo
#: (``1e30gbps``), and no host forwards it.
MAX_LINK_BPS = 1.6e12
#: Version of the report's layout (its ``schema`` field; docs/bench.md lists its fields).
REPORT_SCHEMA = 1


#: What ``--link`` counts (``BenchConfig.link_layer``).
LINK_LAYERS = ("ethernet", "payload")


def kernel_burst(steps: Sequence[tuple[float, float]]) -> int:
    """``--kernel``'s tbf bucket (bytes): one for every step of a schedule, and never
    smaller than a full segmentation-offload packet plus headers: tbf drops a packet
    larger than its bucket, and the 64 KiB default stalls a connection whose segments
    grew at a higher rate."""
    peak = max(rate for _, rate in steps)
    return max(256 * 1024, int(peak / 8 * 0.001))


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchConfig:
    """One bench run. Rates are bits/s, times seconds."""

    model: str = "llama3-8b"
    tokens: int = 8192
    codec: str = "raw"
    auto_codec: str = "model"
    """How ``codec="auto"`` chooses (``ClientOptions.auto_codec``: ``model`` or ``measured``)."""
    streams: int | str = 4
    duration: float = 10.0
    link_bps: float | None = None
    schedule: tuple[tuple[float, float], ...] = ()
    """``((t, rate_bps), ...)`` from t = 0; replaces ``link_bps`` when given."""
    rtt: float = 0.0
    jitter: float = 0.0
    emulator: str = "auto"
    """The userspace emulator's pump: ``splice`` (splice(2) through kernel pipes, Linux),
    ``copy`` (the bytes read into Python and written out again) or ``auto`` (splice where
    available; with an emulator the config then holds the pump chosen)."""
    kernel: bool = False
    peer: tuple[str, int] | None = None
    secret: bytes = DEV_SECRET
    """Used with ``peer``; local runs make a fresh one."""
    baseline: bool = True
    """Measure a raw-socket baseline first (plain loopback only)."""
    seed: int = 0
    sample_interval: float = MIN_INTERVAL
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    """Target size of one chunk of K or V before encoding (``ClientOptions.chunk_bytes``)."""
    interval: float = 1.0
    """Seconds between the per-interval reports (``intervals`` in the report)."""
    link_layer: str = "ethernet"
    """What the link's rates count: ``ethernet`` (line rates: the frames that carry TCP
    segments of ``mtu``, headers, preamble and gap included) or ``payload`` (TCP payload
    bytes)."""
    mtu: int = 1500
    """The link's MTU (bytes of IP packet per frame): 9000 for jumbo frames."""

    def __post_init__(self) -> None:
        get_model(self.model)
        if not 1 <= self.tokens <= MAX_TOKENS:
            raise UsageError(f"--tokens must be in [1, {MAX_TOKENS}] (what a kvwire server accepts per layer)")
        if self.seed < 0:
            raise UsageError(f"--seed must be >= 0, not {self.seed}")
        if self.seed > MAX_SEED:  # what a kvwire serve takes (bench_meta)
            raise UsageError(f"--seed must be at most 2**64 - 1, not {self.seed}")
        if not self.duration > 0:
            raise UsageError("--duration must be > 0")
        if not (0 <= self.rtt <= MAX_RTT and 0 <= self.jitter <= MAX_RTT):
            raise UsageError(f"--rtt and --jitter must be between 0 and {MAX_RTT:.0f} s")
        # The handshake's two round trips, each one-way delay at its longest (--jitter's +).
        limit = f"the bench's connections do their handshakes (two round trips) within {HANDSHAKE_LIMIT:g} s"
        if 2 * self.rtt >= HANDSHAKE_LIMIT:
            raise UsageError(f"--rtt {format_duration(self.rtt)} is too long: {limit}; "
                             f"a bare number is seconds: {self.rtt:g}ms?")
        if 2 * (self.rtt + 2 * self.jitter) >= HANDSHAKE_LIMIT:
            raise UsageError(f"--jitter {format_duration(self.jitter)} is too long with --rtt "
                             f"{format_duration(self.rtt)}: {limit}; a bare number is seconds: {self.jitter:g}ms?")
        if not 4096 <= self.chunk_bytes <= 64 << 20:
            raise UsageError("--chunk-size must be between 4 KiB and 64 MiB")
        if not self.sample_interval > 0:
            raise UsageError("sample_interval must be > 0")
        if not self.interval >= self.sample_interval - 1e-9:
            raise UsageError(
                f"--interval must be at least {self.sample_interval * 1e3:.0f} ms "
                "(the bench samples its counters that often)"
            )
        check_codec(self.codec)
        if self.link_layer not in LINK_LAYERS:
            raise UsageError(f"--link-layer must be one of {', '.join(LINK_LAYERS)}")
        if not MIN_MTU <= self.mtu <= MAX_MTU:
            raise UsageError(f"--mtu must be between {MIN_MTU} and {MAX_MTU} bytes, not {self.mtu}")
        slowest = format_rate(MIN_LINK_BPS)
        why = "(slower, the connections' handshakes do not cross the link in time)"
        if self.link_bps is not None and not self.link_bps >= MIN_LINK_BPS:
            raise UsageError(f"--link must be at least {slowest}, not {format_rate(self.link_bps)} {why}")
        if any(not rate >= MIN_LINK_BPS for _, rate in self.schedule):
            raise UsageError(f"every rate of --link-schedule must be at least {slowest} {why}")
        fastest = format_rate(MAX_LINK_BPS)
        why = "(the fastest Ethernet; a faster rate is a typo)"
        if self.link_bps is not None and self.link_bps > MAX_LINK_BPS:
            raise UsageError(f"--link must be at most {fastest}, not {format_rate(self.link_bps)} {why}")
        if any(rate > MAX_LINK_BPS for _, rate in self.schedule):
            raise UsageError(f"every rate of --link-schedule must be at most {fastest} {why}")
        if self.auto_codec not in AUTO_CODEC_MODES:
            raise UsageError(f"--auto-codec must be one of {', '.join(AUTO_CODEC_MODES)}")
        if self.emulator not in EMULATOR_PUMPS:
            raise UsageError(f"--emulator must be one of {', '.join(EMULATOR_PUMPS)}")
        if self.emulator != "auto" and self.mode != "emulated":
            raise UsageError("--emulator is for the userspace emulator (--link/--rtt/--jitter without --kernel)")
        if self.emulator == "splice" and not SPLICE_AVAILABLE:
            raise UsageError("--emulator splice needs splice(2) (Linux); use copy")
        if self.emulator == "auto" and self.mode == "emulated":  # the report shows the pump that runs
            object.__setattr__(self, "emulator", "splice" if SPLICE_AVAILABLE else "copy")
        if self.peer is not None and (self.shaped or self.rtt or self.jitter or self.kernel):
            raise UsageError("--peer sends over the real network: drop --link/--rtt/--jitter/--kernel")
        if self.kernel and not self.shaped:
            raise UsageError("--kernel needs --link or --link-schedule")
        if self.kernel and (self.rtt or self.jitter):
            raise UsageError(
                "--kernel shapes the rate only (tbf; netem is not assumed): "
                "for --rtt/--jitter use the userspace emulator (drop --kernel)"
            )
        if self.kernel:  # tbf's queue has room for its 50 ms at the fastest step
            from kvwire.bench.netns import DEFAULT_QUEUE_LATENCY, check_tbf, tbf_rate

            peak = max(rate for _, rate in self.steps)
            shaped = tbf_rate(peak, self.mtu, self.link_layer)
            try:
                check_tbf(shaped, kernel_burst(self.steps), DEFAULT_QUEUE_LATENCY, per_link=shaped / peak)
            except UsageError as exc:
                raise UsageError(f"--kernel: {exc}") from None

    @property
    def steps(self) -> tuple[tuple[float, float], ...]:
        if self.schedule:
            return self.schedule
        if self.link_bps is not None:
            return ((0.0, self.link_bps),)
        return ()

    @property
    def payload_share(self) -> float:
        """The share of the link's rate that can be TCP payload (:func:`payload_share`)."""
        return payload_share(self.mtu if self.link_layer == "ethernet" else None)

    @property
    def shaped(self) -> bool:
        return bool(self.steps)

    @property
    def mode(self) -> str:
        if self.peer is not None:
            return "peer"
        if self.kernel:
            return "kernel"
        if self.shaped or self.rtt or self.jitter:
            return "emulated"
        return "loopback"


def receiver_options(chunk_bytes: int) -> ServeOptions:
    """``max_frame_size`` and ``window`` of the bench's own receiver: frames that hold a
    chunk of ``chunk_bytes`` whole (the sender cuts chunks to fit the server's frame limit,
    less its header room and 1/256 for an entropy stage that cannot shrink it), and credit
    for at least two of them per stream."""
    frame = max(DEFAULT_MAX_FRAME_SIZE, chunk_bytes + -(-chunk_bytes // 255) + 64 * 1024)
    return ServeOptions(max_frame_size=frame, window=max(DEFAULT_WINDOW, 2 * frame))


def rate_at(steps: Sequence[tuple[float, float]], t: float) -> float | None:
    """The rate of a step schedule at ``t`` (``None`` without a schedule)."""
    rate: float | None = None
    for start, r in steps:
        if t >= start or rate is None:
            rate = r
    return rate


def mean_rate(steps: Sequence[tuple[float, float]], a: float, b: float) -> float | None:
    """Time-averaged rate of a step schedule over ``[a, b]``."""
    if not steps:
        return None
    if b <= a:
        return rate_at(steps, a)
    edges = sorted({a, b, *(s for s, _ in steps if a < s < b)})
    total = 0.0
    for lo, hi in itertools.pairwise(edges):
        total += (rate_at(steps, lo) or 0.0) * (hi - lo)
    return total / (b - a)


# -- the receiving side -----------------------------------------------------------------------


#: Longest bench id a server takes (``kvwire bench`` sends 12 hex digits): printable
#: ASCII without spaces, as it goes into the server's log lines.
MAX_BENCH_ID = 64
#: Transfers a server receives (and checks) at once; it accepts no more until one ends.
#: Each runs on its own, so a sender that stalls holds up only its own.
MAX_RECEIVING = 16
#: A checked layer's reference (:func:`~kvwire.bench.models.bench_cache`'s pool) may be at
#: most this many bytes larger than the transfer brought: the pool has about 1,000
#: elements per tensor of the model whatever its size (about 320 KiB more than the
#: transfer for one token of llama3-70b), so a spec of many tiny layers would have the
#: server build and keep hundreds of MB for a transfer of a few KB.
REFERENCE_SLACK = 4 << 20
_BENCH_ID = re.compile(rf"[!-~]{{1,{MAX_BENCH_ID}}}")


@dataclass(frozen=True, slots=True)
class BenchMeta:
    """The bench fields of a transfer's ``meta[META_KEY]``, checked (:func:`bench_meta`)."""

    id: str
    seed: int = 0
    end: bool = False


def bench_meta(meta: Any) -> BenchMeta | None:
    """The bench a transfer's ``meta`` says it is part of; None for a transfer of no bench
    (no :data:`META_KEY`). Everything of it the receiver uses is checked, as a peer sent
    it: ValueError naming the field when ``id`` is not a str of 1 to
    :data:`MAX_BENCH_ID` printable ASCII characters without spaces, ``seed`` (0 when
    absent) not a whole number in ``[0, MAX_SEED]``, or ``end`` (false when absent) not a
    bool. Other fields are ignored."""
    if not isinstance(meta, dict) or META_KEY not in meta:
        return None
    bench = meta[META_KEY]
    if not isinstance(bench, dict):
        raise ValueError(f"{META_KEY} must be an object")
    bench_id, seed, end = bench.get("id"), bench.get("seed", 0), bench.get("end", False)
    if not isinstance(bench_id, str) or _BENCH_ID.fullmatch(bench_id) is None:
        raise ValueError(
            f"{META_KEY}.id must be 1 to {MAX_BENCH_ID} printable ASCII characters without spaces"
        )
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"{META_KEY}.seed must be a whole number in [0, 2**64 - 1]")
    if not isinstance(end, bool):
        raise ValueError(f"{META_KEY}.end must be true or false")
    return BenchMeta(bench_id, seed, end)


@dataclass(slots=True)
class _BenchState:
    bench_id: str
    transfers: int = 0
    """Transfers of the bench received (and checked) so far: running totals, not a list,
    as a sender that never ends its bench may send for up to :data:`BENCH_IDLE` between
    transfers, for ever."""
    kv_bytes: int = 0
    wire_bytes: int = 0
    failed: int = 0
    max_rel_error: float | None = None
    checked_layers: int = 0
    reference: tuple[tuple[Any, ...], list[tuple[np.ndarray, np.ndarray]]] | None = None
    building: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Held while the reference is built: the bench's transfers build it once."""
    active: float = field(default_factory=time.monotonic)
    """When a transfer of the bench last began or brought a layer."""
    begun: int = 0
    """Transfers of the bench begun so far: the ``i`` whose layer ``i mod num_layers`` a
    transfer has checked."""
    busy: int = 0
    """Transfers of the bench being received or checked now."""
    settled: asyncio.Event = field(default_factory=asyncio.Event)
    """Set whenever one of them ends (the end transfer waits for the others)."""

    async def sent(self, spec: KVSpec, tokens: int, seed: int, received: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """The cache the sender sent, regenerated from its seed in a worker thread (kept:
        it is about one tensor). ValueError when it would be more than
        :data:`REFERENCE_SLACK` bytes larger than the ``received`` bytes of the transfer
        to check."""
        key = (spec, tokens, seed)
        async with self.building:
            if self.reference is None or self.reference[0] != key:
                shape = ModelShape(spec.model, spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype)
                need = bench_cache_bytes(shape, tokens)
                if need > received + REFERENCE_SLACK:
                    raise ValueError(
                        f"its reference would take {format_size(need)} for the "
                        f"{format_size(received)} the transfer brought"
                    )
                self.reference = None  # never two at once
                self.reference = (key, await asyncio.to_thread(bench_cache, shape, tokens, seed))
            return self.reference[1]


class BenchReceiver:
    """Receives bench transfers on a server and checks what arrived.

    A bench's transfers carry ``meta[META_KEY] = {"id", "seed"}``; the bench ends with
    a one-token transfer whose meta says ``"end": true``. The ``i``-th transfer of a
    bench to begin has its layer ``i mod num_layers`` compared with the same layer
    regenerated from the seed, so a
    run checks every transfer and, given as many transfers as layers, every layer: bit
    for bit over all its tokens, and where they differ (a lossy codec), the relative
    error over an eighth of its tokens, the eighth moving on with each pass over the
    layers (:func:`~kvwire.bench.models.layer_error`: converting a whole layer to float32
    cost the receiver 0.15-0.2 of a core); ``max_rel_error`` is the worst of these.
    Layers are dropped as they arrive:
    holding whole caches (a GiB each) would make the receiver, not the transport,
    what the bench measures.

    Each transfer is received in a task of its own, up to :data:`MAX_RECEIVING` at once,
    so that one sender that stalls holds up no other; a bench's end is reported once
    its other transfers being received have ended. The meta is the peer's: one whose
    bench fields are wrong (:func:`bench_meta`) has its transfer aborted with a log
    line, and a transfer whose layer cannot be checked (a reference much larger than the
    transfer, a layer of another shape) counts as failed in its bench; the server goes
    on either way.

    A bench whose sender ended without the end message (interrupted, crashed, cut off)
    has its state dropped, with a log line: when a transfer of it fails because its
    session was lost, when no client session is left, after :data:`BENCH_IDLE` seconds
    without activity, or to keep at most :data:`MAX_BENCHES`.
    """

    def __init__(self, server: Any, log: Callable[[str], None] | None = None) -> None:
        self.server = server
        self.log = log or (lambda _line: None)
        self._benches: dict[str, _BenchState] = {}

    async def run(self, *, once: bool = False) -> list[dict[str, Any]]:
        """Receive until a bench ends (``once``: returns its report, and those of any
        other bench that ended meanwhile) or forever (until cancelled, or the server's
        close error, raised; each bench's report is logged as it ends and not kept: a
        server that runs for months would hold them all).  Every transfer still being
        received when it returns (or is cancelled) is cancelled, and waited for."""
        reports: list[dict[str, Any]] = []
        ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        slots = asyncio.Semaphore(MAX_RECEIVING)
        receiving: set[asyncio.Task[dict[str, Any] | None]] = set()

        def done(task: asyncio.Task[dict[str, Any] | None]) -> None:
            receiving.discard(task)
            slots.release()
            if task.cancelled():
                return
            report = task.result()  # (_receive_one raises nothing but cancellation)
            if report is not None and once:
                reports.append(report)
                if not ended.done():
                    ended.set_result(None)

        async def accepting() -> None:
            while True:
                await slots.acquire()
                try:
                    transfer = await self.server.accept()
                except BaseException:
                    slots.release()
                    raise
                task = asyncio.create_task(self._receive_one(transfer))
                receiving.add(task)
                task.add_done_callback(done)
                # Not held here while the next transfer is awaited: once ended, the task
                # holds its result (a bench's report, which forever mode does not keep).
                del task, transfer

        acceptor = asyncio.create_task(accepting())
        pruner = asyncio.create_task(self._prune_every(PRUNE_INTERVAL))
        try:
            await asyncio.wait({acceptor, ended}, return_when=asyncio.FIRST_COMPLETED)
            if not ended.done():
                acceptor.result()  # what ended the accepting (the server closed)
            return reports
        finally:
            ended.cancel()
            for task in (acceptor, pruner, *receiving):
                task.cancel()
            await asyncio.gather(acceptor, pruner, *receiving, return_exceptions=True)

    async def _receive_one(self, transfer: Any) -> dict[str, Any] | None:
        """:meth:`handle`, any error of it that transfer's alone (logged)."""
        try:
            return await self.handle(transfer)
        except Exception as exc:
            self.log(f"{printable(transfer.request_id)}: failed: {type(exc).__name__}: {printable(str(exc))}")
            return None

    async def _prune_every(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            self.prune()

    def prune(self, now: float | None = None) -> None:
        """Drop the benches whose sender is gone: all of them when no client session is
        left, else those idle for :data:`BENCH_IDLE` seconds (none being received)."""
        now = time.monotonic() if now is None else now
        no_sessions = not self.server.statistics().get("sessions", 0)
        for state in list(self._benches.values()):
            if state.busy:
                continue
            if no_sessions:
                self._drop(state, "its client is gone")
            elif now - state.active >= BENCH_IDLE:
                self._drop(state, f"nothing of it arrived for {now - state.active:.0f} s")

    def _drop(self, state: _BenchState, why: str) -> None:
        if self._benches.get(state.bench_id) is state:
            del self._benches[state.bench_id]
            self.log(f"bench {state.bench_id}: dropped without its end ({why}): "
                     f"{state.transfers} transfers received, {state.failed} failed")

    def _state(self, bench_id: str) -> _BenchState:
        state = self._benches.get(bench_id)
        if state is None:
            idle = sorted((s for s in self._benches.values() if not s.busy), key=lambda s: s.active)
            for old in idle[: max(0, len(self._benches) + 1 - MAX_BENCHES)]:
                self._drop(old, f"{MAX_BENCHES} benches kept at most")
            state = self._benches[bench_id] = _BenchState(bench_id)
        state.active = time.monotonic()
        return state

    async def handle(self, transfer: Any) -> dict[str, Any] | None:
        """Receive one transfer and check it; the bench's report when it was its end."""
        try:
            bench = bench_meta(transfer.meta)
        except ValueError as exc:
            self.log(f"{printable(transfer.request_id)}: refused: {printable(str(exc))}")
            transfer.abort(f"kvwire serve: {exc}")
            return None
        if bench is None:
            return await self._receive(transfer, None, None, -1, 0)
        state = self._state(bench.id)
        layers = transfer.spec.num_layers
        check, part = state.begun % layers, (state.begun // layers) % CHECK_PARTS
        state.begun += 1
        state.busy += 1  # until its check is done: a prune keeps the bench meanwhile
        try:
            return await self._receive(transfer, bench, state, check, part)
        finally:
            state.busy -= 1
            state.active = time.monotonic()
            state.settled.set()

    async def _receive(
        self, transfer: Any, bench: BenchMeta | None, state: _BenchState | None, check: int, part: int,
    ) -> dict[str, Any] | None:
        kept: tuple[Any, Any] | None = None
        tokens = kv_bytes = 0
        try:
            async for layer in transfer:
                tokens = int(layer.k.shape[0])
                kv_bytes += int(layer.k.nbytes) + int(layer.v.nbytes)
                if layer.index == check:
                    kept = (layer.k, layer.v)
                if state is not None:
                    state.active = time.monotonic()
        except KvwireError as exc:
            self.log(f"{printable(transfer.request_id)}: failed: {printable(str(exc))}")
            if state is not None:
                state.failed += 1
                if isinstance(exc, ConnectionLostError):  # its session is gone: no end will come
                    self._drop(state, "its session was lost")
            return None
        seconds = (transfer.finished or transfer.started) - transfer.started
        entry: dict[str, Any] = {
            "request_id": transfer.request_id,
            "tokens": tokens,
            "kv_bytes": kv_bytes,
            "wire_bytes": transfer.wire_bytes,
            "seconds": seconds,
        }
        if state is None or bench is None:
            self.log(_transfer_line(entry))
            return None
        if bench.end:
            while state.busy > 1:  # the bench's other transfers being received (or checked)
                state.settled.clear()
                await state.settled.wait()
            if self._benches.get(state.bench_id) is state:
                del self._benches[state.bench_id]
            return self._finish(state)
        if kept is not None:
            try:
                sent = await state.sent(transfer.spec, tokens, bench.seed, kv_bytes)
                error = await asyncio.to_thread(layer_error, kept, sent[check], part, CHECK_PARTS)
            except Exception as exc:  # the peer's spec, tokens or layers: this transfer fails
                state.failed += 1
                self.log(f"{printable(transfer.request_id)}: failed: layer {check} could not be checked: "
                         f"{printable(str(exc))}")
                return None
            entry["checked_layer"] = check
            entry["rel_error"] = error
            state.checked_layers += 1
            state.max_rel_error = max(error, state.max_rel_error or 0.0)
        state.transfers += 1
        state.kv_bytes += kv_bytes
        state.wire_bytes += entry["wire_bytes"]
        self.log(_transfer_line(entry))
        return None

    def _finish(self, state: _BenchState) -> dict[str, Any]:
        kv, wire = state.kv_bytes, state.wire_bytes
        report = {
            "bench_id": state.bench_id,
            "transfers": state.transfers,
            "failed": state.failed,
            "kv_bytes": kv,
            "wire_bytes": wire,
            "max_rel_error": state.max_rel_error,
            "checked_layers": state.checked_layers,
        }
        err = "n/a" if state.max_rel_error is None else f"{state.max_rel_error:.3g}"
        self.log(
            f"bench {state.bench_id}: {state.transfers} transfers, {kv / 1e9:.3f} GB of KV, "
            f"{wire / 1e9:.3f} GB on the wire, {state.failed} failed, max_rel_error {err} "
            f"({state.checked_layers} layers checked)"
        )
        return report


def _transfer_line(entry: dict[str, Any]) -> str:
    secs = entry["seconds"]
    rate = entry["kv_bytes"] * 8 / secs / 1e9 if secs > 0 else 0.0
    line = (
        f"{printable(entry['request_id'])}: {entry['tokens']} tokens, {entry['kv_bytes'] / 1e6:.1f} MB KV, "
        f"{entry['wire_bytes'] / 1e6:.1f} MB wire, {secs * 1e3:.1f} ms, {rate:.2f} Gbit/s of KV"
    )
    if "rel_error" in entry:
        line += f", layer {entry['checked_layer']} rel. error {entry['rel_error']:.3g}"
    return line


async def serve_benches(
    host: str, port: int, *, secret: bytes, once: bool = False,
    log: Callable[[str], None] = print, ready: Callable[[int], None] | None = None,
    listening: Callable[[tuple[tuple[str, int], ...]], None] | None = None,
    chunk_bytes: int | None = None, stop_signals: Sequence[int] = (),
) -> list[dict[str, Any]]:
    """``kvwire serve``: receive bench (and any other) transfers, logging each one, and
    each bench's report as it ends.  With ``once``, return the report of the first bench
    to end (in a list, with any other that ended meanwhile); without, receive until
    stopped (a signal, an error): reports are logged, not kept (:meth:`BenchReceiver.run`).
    Once it listens, ``ready`` is given its port and ``listening`` every ``(host, port)``
    it listens on (:attr:`kvwire.Server.addresses`: each address ``host`` names, all on
    that port).

    ``chunk_bytes``: accept chunks that large (:func:`receiver_options`; default: the
    server's default frame limit). ``stop_signals`` (``kvwire serve``: SIGINT, SIGTERM,
    SIGHUP; main thread only, a signal the process ignores stays ignored): the first one
    closes the server before anything else stops, so every sender with a transfer in
    progress is told that the server is shutting down (stopped first, the receiving
    loop's abandoned transfer told it "the application stopped taking layers"); then
    the signal is raised again with the process's own handler (Ctrl-C's
    KeyboardInterrupt). A second one stops at once."""
    from kvwire.aio import serve

    options = receiver_options(chunk_bytes) if chunk_bytes is not None else ServeOptions()
    async with serve(host, port, secret=secret, **options) as server:
        if ready is not None:
            ready(server.port)
        if listening is not None:
            listening(server.addresses)
        receiving = asyncio.ensure_future(BenchReceiver(server, log).run(once=once))
        with _stopping_on(stop_signals, server, receiving) as stopped:
            try:
                await asyncio.wait({receiving})
            finally:
                if not receiving.done():
                    receiving.cancel()
                    await asyncio.gather(receiving, return_exceptions=True)
        if stopped:
            if not receiving.cancelled():
                receiving.exception()  # retrieved: what ended it is the shutdown's doing
            stopped[0].raise_again()
        reports = receiving.result()
        # The end transfer is complete here, but its last acknowledgements may still be
        # on their way: closing now would fail the sender's send(). Wait for the sender
        # to hang up (briefly: a sender that stays connected is not waited for).
        deadline = asyncio.get_running_loop().time() + 5.0
        while server.statistics().get("sessions", 0) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        return reports


class _Stop:
    """A signal that stopped :func:`serve_benches`, and the handler it had before."""

    def __init__(self, signum: int, previous: Any) -> None:
        self.signum, self.previous = signum, previous

    def raise_again(self) -> None:
        """What the signal does without :func:`serve_benches`' handling: Ctrl-C raises
        KeyboardInterrupt, a handler of the program's own runs (``kvwire``'s raises for
        SIGTERM and SIGHUP), else the default action ends the process."""
        if self.signum != signal.SIGINT and callable(self.previous):
            self.previous(self.signum, None)
        if self.signum == signal.SIGINT or callable(self.previous):
            raise KeyboardInterrupt
        signal.signal(self.signum, self.previous)
        signal.raise_signal(self.signum)
        raise KeyboardInterrupt  # a default action that does not end the process


@contextlib.contextmanager
def _stopping_on(
    signums: Sequence[int], server: Any, receiving: asyncio.Future[Any]
) -> Iterator[list[_Stop]]:
    """While inside: the first of ``signums`` closes ``server`` (its senders told why),
    then cancels ``receiving``; the list it yields then holds that signal. A second
    stops at once, with the handler the signal had."""
    loop = asyncio.get_running_loop()
    previous: dict[int, Any] = {}
    stopped: list[_Stop] = []

    def restore() -> None:
        # One swap per signal, back to the handler it had: never the default action in
        # between, whatever thread a signal is delivered to.
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        previous.clear()

    def handle(signum: int, frame: object) -> None:
        # A plain handler (the loop's own would leave the default action for a moment when
        # removed): it runs in the main thread between two bytecodes and only queues the
        # work on the loop, which its wakeup wakes.
        loop.call_soon_threadsafe(on_signal, signum)

    def on_signal(signum: int) -> None:
        if stopped:  # a second one: no more waiting
            handler = previous.get(signum, signal.SIG_DFL)
            restore()
            _Stop(signum, handler).raise_again()
            return
        stopped.append(_Stop(signum, previous[signum]))
        closing = asyncio.ensure_future(server.close())
        closing.add_done_callback(lambda _: receiving.cancel())

    for signum in signums:
        handler = signal.getsignal(signum)
        if handler is signal.SIG_IGN or handler is None:
            continue
        try:
            signal.signal(signum, handle)
        except ValueError:  # not the main thread
            continue
        previous[signum] = handler
    try:
        yield stopped
    finally:
        restore()


def _tc_error(exc: BaseException) -> str:
    """What a failed ``ip``/``tc`` command said, or the exception."""
    if isinstance(exc, subprocess.CalledProcessError):
        said = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else str(exc.stderr or "")
        return f"{' '.join(map(str, exc.cmd))}: {said.strip() or f'exit {exc.returncode}'}"
    return str(exc)


def _die_with_parent() -> None:
    """A child process ends when the bench process does, however that ends (a signal
    that leaves it no cleanup included): Linux's parent-death signal."""
    if sys.platform != "linux":
        return
    import ctypes
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    # The parent already ended before this was set (init or a subreaper took this one):
    # the parent's pid as multiprocessing recorded it, so a bench run as the PID 1 of a
    # container (whose children's parent is 1 all along) keeps its children.
    parent = mp.parent_process()
    if parent is not None and parent.pid is not None and os.getppid() != parent.pid:
        os._exit(1)


def _enter_netns(name: str) -> None:
    from kvwire.bench.netns import _setns

    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        _setns(fd)
    finally:
        os.close(fd)


def _receiver_main(conn: Connection, secret: bytes, host: str, netns: str | None, chunk_bytes: int) -> None:
    """Child process: a server that receives one bench and reports it. A ``("cpu",)``
    the parent sends is answered at once with this process's CPU seconds so far, so the
    run's share of a core is counted over the sender's window: over the child's whole
    life it took in the check of the run's last transfers (the first builds the
    reference cache) after the window's end, divided by the window's seconds."""
    from kvwire.aio import run

    async def receive() -> list[dict[str, Any]]:
        loop = asyncio.get_running_loop()

        def answer() -> None:
            try:
                while conn.poll():
                    if conn.recv()[0] == "cpu":
                        conn.send(("cpu", _cpu()))
            except (EOFError, OSError):  # the parent is gone: nothing to answer
                loop.remove_reader(conn.fileno())

        loop.add_reader(conn.fileno(), answer)
        try:
            return await serve_benches(host, 0, secret=secret, once=True, log=lambda _l: None,
                                       ready=lambda port: conn.send(("ready", port)), chunk_bytes=chunk_bytes)
        finally:
            loop.remove_reader(conn.fileno())

    _die_with_parent()
    try:
        if netns is not None:
            _enter_netns(netns)
        cpu0 = _cpu()
        reports = run(receive())
        conn.send(("done", reports[0], _cpu() - cpu0))
    except BaseException as exc:  # reported to the parent, which raises it
        with contextlib.suppress(OSError):
            conn.send(("error", f"receiver: {exc!r}"))


def _emulator_main(
    conn: Connection, steps: tuple[tuple[float, float], ...], delay: float, jitter: float,
    interval: float, splice: bool, mtu: int | None = None,
) -> None:
    """Child process: a LinkEmulator in front of the receiver, sampling its byte count.

    It runs on the standard asyncio loop: under uvloop (millisecond timers) the
    emulator's sub-millisecond release times never come due and nothing is forwarded.
    """
    from kvwire.bench.emulator import LinkEmulator

    async def main() -> list[tuple[float, int]]:
        _, target = conn.recv()
        loop = asyncio.get_running_loop()
        link = LinkEmulator(
            "127.0.0.1", target, schedule=list(steps) or None, delay=delay, jitter=jitter, seed=0,
            splice=splice, mtu=mtu,
        )
        async with link:
            # Translate the start to time.monotonic(), the clock shared with the other processes.
            start = link.start_time + (time.monotonic() - loop.time())
            conn.send(("ready", link.port, start))
            samples: list[tuple[float, int]] = []
            cpu0 = _cpu()
            # A request wakes the loop at once: ("count",) is answered with the byte count
            # and this process's CPU seconds of that moment (the run's exact start and
            # end); anything else stops it.
            wake = asyncio.Event()
            loop.add_reader(conn.fileno(), wake.set)
            try:
                while True:
                    stop = False
                    while not stop and conn.poll():
                        if conn.recv()[0] == "count":
                            conn.send(("count", link.statistics().bytes_forward, _cpu()))
                        else:
                            stop = True
                    samples.append((time.monotonic(), link.statistics().bytes_forward))
                    if stop:
                        break
                    wake.clear()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(interval):
                            await wake.wait()
            finally:
                loop.remove_reader(conn.fileno())
            cpu_used[0] = _cpu() - cpu0
            return samples

    cpu_used = [0.0]
    _die_with_parent()
    try:
        samples = asyncio.run(main())
        conn.send(("done", samples, cpu_used[0]))
    except BaseException as exc:
        with contextlib.suppress(OSError):
            conn.send(("error", f"emulator: {exc!r}"))


def _expect(conn: Connection, what: str, proc: BaseProcess, timeout: float) -> tuple[Any, ...]:
    deadline = time.monotonic() + timeout
    while not conn.poll(0.1):
        if not proc.is_alive():
            raise KvwireError(f"the {what} process exited (code {proc.exitcode})")
        if time.monotonic() > deadline:
            raise KvwireError(f"the {what} process did not answer within {timeout:.0f} s")
    try:
        msg: tuple[Any, ...] = conn.recv()
    except EOFError:  # it ended without a word (killed, or crashed)
        proc.join(1)
        raise KvwireError(f"the {what} process exited (code {proc.exitcode})") from None
    if msg[0] == "error":
        raise KvwireError(str(msg[1]))
    return msg


@contextlib.contextmanager
def _child(target: Callable[..., None], *args: Any) -> Iterator[tuple[BaseProcess, Connection]]:
    ctx = mp.get_context("spawn")  # never fork a process that may run threads
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    child.close()
    try:
        yield proc, parent
    except BaseException:  # the run failed or was interrupted: nothing to wait for
        proc.terminate()
        raise
    finally:
        proc.join(5)
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
        parent.close()


# -- the sending side -------------------------------------------------------------------------

Progress = Callable[[dict[str, Any]], None]


@dataclass(slots=True)
class _SendResult:
    receipts: list[Any] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    started: float = 0.0
    ended: float = 0.0
    incomplete: int = 0
    estimated_gbps: float | None = None
    min_rtt_ms: float | None = None
    cpu_s: float = 0.0
    """CPU seconds of the sending process while it sent."""
    machine: tuple[float, float] | None = None
    """Busy and total CPU seconds of the whole machine while it sent."""
    retransmits: int | None = None
    spurious_retransmits: int | None = None
    """Of ``retransmits``, those the receiver's kernel reported as duplicates (D-SACK)."""
    initial: dict[str, Any] = field(default_factory=dict)
    """The sampled counters at the start (``t`` from the link's start)."""
    acked_kv_bytes: int = 0
    """fp16 KV the receiver acknowledged from start to end: the completed transfers' and
    the acknowledged chunks of an abandoned one (what the intervals credit)."""
    acked_bytes: int = 0
    """CHUNK wire bytes the receiver acknowledged from start to end, those of an
    abandoned transfer included."""
    link_samples: list[tuple[float, int]] = field(default_factory=list)
    """``(time.monotonic(), bytes)`` the shaped link transmitted (kernel mode)."""
    carried: int | None = None
    """Bytes the link (emulator or shaped veth) carried from start to end, read from its
    counter at both; None without a link."""
    chunk_bytes: int = 0
    """The chunk size the sender used: the one asked for, or less where the server's
    frame limit holds no chunk that large."""


def _tcp_count(stats: dict[str, Any], counter: str = "total_retrans") -> int | None:
    """A TCP_INFO counter of ``peer.statistics()`` summed over the session's streams:
    segments the kernel retransmitted (``total_retrans``), or of them those the peer
    reported receiving twice (``dsack_dups``)."""
    counts = [s["tcp"][counter] for s in stats.get("streams", ())
              if isinstance(s.get("tcp"), dict) and s["tcp"].get(counter) is not None]
    return sum(counts) if counts else None


def _moved(peer: Any) -> tuple[int, int | None]:
    """What shows the sender's bytes moving: chunks sent, and the bytes TCP had
    acknowledged on the session's streams (None where TCP_INFO does not say)."""
    return peer.bytes_sent, _tcp_count(peer.statistics(), "bytes_acked")


def _acked(peer: Any) -> int:
    """CHUNK wire bytes the receiver acknowledged on every stream of the session so far."""
    return sum(peer.core.acked_bytes(s.key) for s in peer.streams)


async def _send_end(peer: Any, request_id: str, spec: KVSpec, layers: Any, meta: dict[str, Any]) -> None:
    """Send the run's closing message.  On a slow link it may queue behind minutes of an
    abandoned transfer's bytes, so it has no deadline of its own: it fails once nothing
    moved for :data:`END_STALL` seconds."""
    send = asyncio.ensure_future(peer.send(request_id, spec, layers, meta=meta, timeout=None))
    try:
        moved, since = _moved(peer), time.monotonic()
        while not send.done():
            await asyncio.wait({send}, timeout=min(1.0, END_STALL))
            now_moved = _moved(peer)
            if now_moved != moved:
                moved, since = now_moved, time.monotonic()
            elif time.monotonic() - since >= END_STALL and not send.done():
                raise KvwireError(f"the run's end did not reach the receiver: nothing moved for {END_STALL:.0f} s")
        send.result()
    finally:
        send.cancel()
        await asyncio.gather(send, return_exceptions=True)


async def _send_loop(
    cfg: BenchConfig, host: str, port: int, secret: bytes, bench_id: str, t0: float | None,
    on_progress: Progress | None, set_rate: Callable[[float], None] | None = None,
    on_interval: Progress | None = None, link_bytes: Callable[[], int] | None = None,
    log: Callable[[str], None] | None = None, link_count: Callable[[], int] | None = None,
    at_edge: Callable[[], None] | None = None,
) -> _SendResult:
    """Send for ``cfg.duration``. ``link_bytes``: the shaped link's byte counter, read at
    every sample (kernel mode); ``link_count``: a counter read only at the run's start
    and end (the emulator's, asked across a pipe); either makes ``carried_bytes`` what
    the link carried between the two, exactly. ``at_edge`` is called at the run's start
    and at its end, as ``link_count`` is (the other processes' CPU read there)."""
    from kvwire.aio import connect

    model = get_model(cfg.model)
    spec = model.spec()
    layers = bench_cache(model, cfg.tokens, cfg.seed)
    end_layers = bench_cache(model, 1, cfg.seed)
    meta = {META_KEY: {"id": bench_id, "seed": cfg.seed}}
    res = _SendResult()
    kv_done = 0
    streams: Any = cfg.streams
    chunks_by_codec: dict[str, int] = {}
    async with connect(host, port, secret=secret, streams=streams, codec=cfg.codec,
                       auto_codec=cfg.auto_codec, chunk_bytes=cfg.chunk_bytes) as peer:
        res.chunk_bytes = peer.core.chunk_target(cfg.chunk_bytes)
        if res.chunk_bytes < cfg.chunk_bytes and log is not None:
            log(f"warning: the receiver accepts frames of at most {format_size(peer.core.peer_max_frame_size)}: "
                f"chunks of {format_size(res.chunk_bytes)}, not the {format_size(cfg.chunk_bytes)} asked for")
        counter = link_count or link_bytes
        if at_edge is not None:
            at_edge()
        count0 = counter() if counter is not None else 0  # before the first byte of the run
        start = time.monotonic()
        base = t0 if t0 is not None else start
        res.started = start
        cpu0 = _cpu()
        machine0 = machine_cpu_times()
        stats0 = peer.statistics()
        retr0, dup0 = _tcp_count(stats0), _tcp_count(stats0, "dsack_dups")
        acked0 = _acked(peer)
        if link_bytes is not None:
            res.link_samples.append((start, link_bytes()))

        res.initial = {
            "t": start - base, "bytes_sent": peer.bytes_sent, "kv_bytes_done": 0,
            "transfers": 0, "cpu_s": 0.0, "retransmits": retr0, "chunks_by_codec": {},
        }

        sampler = {"last_t": time.monotonic(), "last_b": peer.bytes_sent,
                   "edge": start - base + cfg.interval, "kv": 0}
        pending: list[dict[str, Any]] = []  # samples of the interval in progress
        reported = [res.initial]  # the sample that ended the last reported interval

        def kv_acknowledged() -> int:
            """fp16 KV the receiver has acknowledged: the completed transfers', and the
            chunks of those in flight as their ACKs come (a transfer's KV is credited as
            it arrives, not all in the interval it ends in). Never decreasing: a transfer
            that just completed (or was abandoned) may have left the session before its
            receipt is counted."""
            in_flight = 0
            for tid in list(peer.sends):
                transfer = peer.core.transfer(tid)
                if transfer is not None:
                    in_flight += transfer.kv_bytes_acked
            credited = max(int(sampler["kv"]), kv_done + in_flight)
            sampler["kv"] = credited
            return credited

        # An interval ending within an interval of the run's end is held back until the
        # next one: a last interval shorter than half an interval is folded into it, as
        # the report's intervals are (report.intervals).
        held: list[tuple[dict[str, Any], list[dict[str, Any]]]] = []
        near_end = res.initial["t"] + cfg.duration - cfg.interval

        def report_interval(point: dict[str, Any], final: bool) -> None:
            assert on_interval is not None
            if held:
                prev, group = held.pop()
                if final and folds_into_previous(reported[0], point, cfg.interval):
                    on_interval(one_interval(prev, [*group, *pending]))
                    return
                on_interval(one_interval(prev, group))
            if not final and point["t"] >= near_end:
                held.append((reported[0], list(pending)))
            else:
                on_interval(one_interval(reported[0], pending))

        def take_sample(final: bool = False) -> None:
            now, sent = time.monotonic(), peer.bytes_sent
            stats = peer.statistics()
            link = rate_at(cfg.steps, now - base)
            point: dict[str, Any] = {
                "t": now - base,
                "wire_gbps": (sent - sampler["last_b"]) * 8 / max(now - sampler["last_t"], 1e-9) / 1e9,
                "estimated_gbps": stats.get("estimated_gbps"),
                "link_gbps": link / 1e9 if link is not None else None,
                "bytes_sent": sent,
                "kv_bytes_done": kv_acknowledged(),
                "transfers": len(res.receipts),
                "streams": peer.active_streams,
                "bytes_in_flight": stats.get("bytes_in_flight"),
                "inflight_target": stats.get("inflight_target"),
                "retransmits": _tcp_count(stats),
                "cpu_s": _cpu() - cpu0,
                "chunks_by_codec": dict(chunks_by_codec),
            }
            sampler["last_t"], sampler["last_b"] = now, sent
            if link_bytes is not None:
                res.link_samples.append((now, link_bytes()))
            res.samples.append(point)
            pending.append(point)
            if on_progress is not None:
                on_progress({**point, "elapsed": now - start, "duration": cfg.duration})
            if point["t"] >= sampler["edge"] - 1e-9 or final:
                if on_interval is not None:
                    report_interval(point, final)
                reported[0] = point
                pending.clear()
                while sampler["edge"] <= point["t"] + 1e-9:
                    sampler["edge"] += cfg.interval

        async def sample() -> None:
            while True:
                await asyncio.sleep(cfg.sample_interval)
                take_sample()

        async def reshape() -> None:
            # Kernel mode: tc changes the rate at the schedule's steps.
            assert set_rate is not None
            for at, rate in cfg.steps[1:]:
                await asyncio.sleep(max(0.0, base + at - time.monotonic()))
                await asyncio.to_thread(set_rate, rate)

        tasks = [asyncio.create_task(sample())]
        reshaping: asyncio.Task[None] | None = None
        if set_rate is not None and len(cfg.steps) > 1:
            reshaping = asyncio.create_task(reshape())
            tasks.append(reshaping)
        # A transfer still running at the end may finish; one that takes far longer
        # (a cache too big for the link) is abandoned and counted as incomplete.
        hard_stop = start + max(2 * cfg.duration, cfg.duration + ABANDON_AFTER)
        try:
            i = 0
            while True:
                left = hard_stop - time.monotonic()
                try:
                    receipt = await peer.send(
                        f"{bench_id}-{i}", spec, layers, meta=meta, timeout=max(left, 0.001)
                    )
                except KvwireError as failed:
                    # Its timeout is the hard stop, by the send's own clock: a loop's timer
                    # may fire it a little before this clock reads the hard stop (uvloop's
                    # are in whole milliseconds).
                    if time.monotonic() < hard_stop and not isinstance(failed, TransferTimeoutError):
                        raise
                    res.incomplete += 1
                    break
                res.receipts.append(receipt)
                kv_done += receipt.kv_bytes
                for name, n in receipt.extra.get("chunks_by_codec", {receipt.codec: receipt.chunks}).items():
                    chunks_by_codec[name] = chunks_by_codec.get(name, 0) + int(n)
                i += 1
                if time.monotonic() - start >= cfg.duration:
                    break
            res.ended = time.monotonic()
            res.acked_kv_bytes = kv_acknowledged()
            if counter is not None:  # every completed transfer's bytes have crossed it
                res.carried = counter() - count0
            if at_edge is not None:
                at_edge()
            tasks[0].cancel()  # the sampler: one last sample covers every completed transfer
            await asyncio.gather(tasks[0], return_exceptions=True)
            take_sample(final=True)
            res.acked_bytes = _acked(peer) - acked0
            res.cpu_s = _cpu() - cpu0
            machine1 = machine_cpu_times()
            if machine0 is not None and machine1 is not None:
                res.machine = (machine1[0] - machine0[0], machine1[1] - machine0[1])
            stats = peer.statistics()
            res.estimated_gbps = stats.get("estimated_gbps")
            res.min_rtt_ms = stats.get("min_rtt_ms")
            retr1, dup1 = _tcp_count(stats), _tcp_count(stats, "dsack_dups")
            if retr0 is not None and retr1 is not None:
                res.retransmits = max(0, retr1 - retr0)  # a reconnect restarts a counter
            if dup0 is not None and dup1 is not None:
                res.spurious_retransmits = max(0, dup1 - dup0)
            end_meta = {META_KEY: {"id": bench_id, "seed": cfg.seed, "end": True}}
            await _send_end(peer, f"{bench_id}-end", spec, end_layers, end_meta)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if reshaping is not None and not reshaping.cancelled() and (exc := reshaping.exception()) is not None:
            # the link stayed at its last rate: the report would measure another schedule
            raise KvwireError(f"--kernel: changing the link's rate failed: {_tc_error(exc)}")
    return res


# -- a raw-socket baseline ----------------------------------------------------------------------


def _raw_receiver(conn: Connection, netns: str | None) -> None:
    """Child process: the baseline's receiving end. Whatever ends it (Ctrl-C, which the
    terminal sends to every process of the bench, included) goes to the parent as one
    message, as with the bench's receiver: no traceback of its own."""
    _die_with_parent()
    try:
        if netns is not None:
            _enter_netns(netns)
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(1)
            conn.send(("ready", listener.getsockname()[1]))
            sock, _ = listener.accept()
        with sock:
            cpu0 = _cpu()
            buf = bytearray(4 << 20)
            view = memoryview(buf)
            total = 0
            first: float | None = None
            while True:
                n = sock.recv_into(view)
                if not n:
                    break
                if first is None:
                    first = time.monotonic()
                total += n
            end = time.monotonic()
        conn.send(("done", total, end - (first or end), _cpu() - cpu0))
    except BaseException as exc:  # reported to the parent, which raises it
        with contextlib.suppress(OSError):
            conn.send(("error", f"baseline receiver: {exc!r}"))


def _raw_sender(
    conn: Connection, port: int, model: str, tokens: int, seed: int, seconds: float | None,
    transfers: int | None,
) -> None:
    """Child process: the baseline's sending end (ended as :func:`_raw_receiver` is)."""
    _die_with_parent()
    try:
        layers = bench_cache(get_model(model), tokens, seed)
        views = [memoryview(t.data).cast("B") for pair in layers for t in pair]
        with socket.create_connection(("127.0.0.1", port)) as sock:
            conn.send(("ready",))
            conn.recv()  # go
            cpu0 = _cpu()
            deadline = time.monotonic() + seconds if seconds is not None else float("inf")
            done = 0
            while (transfers is None or done < transfers) and time.monotonic() < deadline:
                for v in views:
                    sock.sendall(v)
                done += 1
        conn.send(("done", done, _cpu() - cpu0))
    except BaseException as exc:
        with contextlib.suppress(OSError):
            conn.send(("error", f"baseline sender: {exc!r}"))


def _cpu() -> float:
    """CPU seconds of this process (all its threads) so far."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def raw_socket_run(
    model: str, tokens: int, *, seconds: float | None = None, transfers: int | None = None,
    seed: int = 0,
) -> dict[str, float]:
    """Send the bench cache's bytes with plain ``sendall``/``recv_into`` between two
    processes over loopback: what the machine can do without any protocol.

    Stops after ``transfers`` caches or ``seconds`` (whichever first). Returns
    ``gbps`` (receiver side, first byte to EOF), ``bytes``, ``seconds`` and the CPU
    seconds of each process.
    """
    if seconds is None and transfers is None:
        raise UsageError("give seconds or transfers")
    with _child(_raw_receiver, None) as (rproc, rconn):
        _, port = _expect(rconn, "baseline receiver", rproc, _READY_TIMEOUT)
        with _child(_raw_sender, port, model, tokens, seed, seconds, transfers) as (sproc, sconn):
            _expect(sconn, "baseline sender", sproc, _READY_TIMEOUT)
            sconn.send(("go",))
            limit = (seconds or 0) + 120.0
            _, _, sender_cpu = _expect(sconn, "baseline sender", sproc, limit)
        _, nbytes, secs, receiver_cpu = _expect(rconn, "baseline receiver", rproc, 30.0)
    return {
        "gbps": nbytes * 8 / secs / 1e9 if secs > 0 else 0.0,
        "bytes": float(nbytes),
        "seconds": secs,
        "sender_cpu_s": sender_cpu,
        "receiver_cpu_s": receiver_cpu,
    }


# -- the whole run ------------------------------------------------------------------------------


def run_bench(
    cfg: BenchConfig, on_progress: Progress | None = None, log: Callable[[str], None] | None = None,
    *, on_interval: Progress | None = None, argv: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Run one bench as configured; returns the report (see ``kvwire bench --json``).

    ``on_progress`` gets every sample (about 10 a second), ``on_interval`` one report per
    ``cfg.interval`` seconds; ``argv`` is recorded in the report's ``start`` block.

    A signal whose handler ends the program (Ctrl-C, ``kvwire``'s SIGTERM and SIGHUP)
    that comes while a transfer loop runs cancels it, and is raised again once that
    loop has stopped (:func:`kvwire.bench._signals.run`).
    """
    from kvwire.bench._signals import run

    log = log or (lambda _l: None)
    bench_id = uuid.uuid4().hex[:12]
    model = get_model(cfg.model)
    result: dict[str, Any] = {
        "schema": REPORT_SCHEMA, "start": start_block(cfg, argv), "model": model.name, "tokens": cfg.tokens,
        "mode": cfg.mode,
    }
    baseline: dict[str, float] | None = None
    if cfg.mode == "loopback" and cfg.baseline:
        secs = min(3.0, max(0.5, cfg.duration / 3))
        log(f"raw-socket baseline for {secs:.1f} s ...")
        baseline = raw_socket_run(cfg.model, cfg.tokens, seconds=secs, seed=cfg.seed)

    receiver: dict[str, Any] | None = None
    receiver_cpu: float | None = None
    emulator_cpu: float | None = None
    emu_samples: list[tuple[float, int]] = []
    t0: float | None = None
    if cfg.mode == "peer":
        assert cfg.peer is not None
        send = run(_send_loop(cfg, cfg.peer[0], cfg.peer[1], cfg.secret, bench_id, None, on_progress,
                              on_interval=on_interval, log=log))
    else:
        secret = secrets.token_bytes(32)
        with contextlib.ExitStack() as stack:
            link: Any = None
            host = "127.0.0.1"
            if cfg.mode == "kernel":
                from kvwire.bench.netns import NetnsLink, NetnsUnavailable, netns_available

                reason = netns_available()
                if reason is not None:
                    raise UsageError(f"--kernel: {reason} (run as root, or drop --kernel)")
                try:
                    link = stack.enter_context(
                        NetnsLink(rate_bps=cfg.steps[0][1], burst_bytes=kernel_burst(cfg.steps),
                                  mtu=cfg.mtu, link_layer=cfg.link_layer)
                    )
                except (NetnsUnavailable, OSError, subprocess.CalledProcessError) as exc:
                    raise KvwireError(f"--kernel: cannot set up the link: {_tc_error(exc)}") from exc
                if link.swept:
                    log(f"removed network namespaces that ended runs left: {', '.join(link.swept)}")
                host = link.receiver_addr
            rproc, rconn = stack.enter_context(
                _child(_receiver_main, secret, host if link else "127.0.0.1",
                       link.receiver_ns if link else None, cfg.chunk_bytes)
            )
            eproc = econn = None
            if cfg.mode == "emulated":
                eproc, econn = stack.enter_context(
                    # Its byte counter every EMULATOR_SAMPLE_S for the per-sample wire
                    # rate; the run's start and end are read exactly (emulator_count).
                    _child(_emulator_main, cfg.steps, cfg.rtt / 2, cfg.jitter, EMULATOR_SAMPLE_S,
                           cfg.emulator == "splice", cfg.mtu if cfg.link_layer == "ethernet" else None)
                )
            _, port = _expect(rconn, "receiver", rproc, _READY_TIMEOUT)
            # The receiver's (and the emulator's) CPU seconds at the run's start and end.
            receiver_cpus: list[float] = []
            emulator_cpus: list[float] = []
            recv_proc, recv_conn = rproc, rconn

            def receiver_edge() -> None:
                recv_conn.send(("cpu",))
                receiver_cpus.append(float(_expect(recv_conn, "receiver", recv_proc, 30.0)[1]))

            if eproc is not None and econn is not None:
                econn.send(("target", port))
                _, port, t0 = _expect(econn, "emulator", eproc, _READY_TIMEOUT)
            if link is not None:
                from kvwire.bench.netns import _inside

                t0 = time.monotonic()
                with _inside(link.sender_ns):
                    send = run(_send_loop(cfg, host, port, secret, bench_id, t0, on_progress,
                                          set_rate=link.set_rate, on_interval=on_interval,
                                          link_bytes=link.tx_payload_bytes, log=log, at_edge=receiver_edge))
            else:
                emulator_count = None
                if eproc is not None and econn is not None:
                    emu_proc, emu_conn = eproc, econn

                    def emulator_count() -> int:
                        emu_conn.send(("count",))
                        _, count, cpu_s = _expect(emu_conn, "emulator", emu_proc, 30.0)
                        emulator_cpus.append(float(cpu_s))
                        return int(count)

                send = run(_send_loop(cfg, "127.0.0.1", port, secret, bench_id, t0, on_progress,
                                      on_interval=on_interval, log=log, link_count=emulator_count,
                                      at_edge=receiver_edge))
            _, receiver, receiver_cpu = _expect(rconn, "receiver", rproc, 300.0)
            if len(receiver_cpus) == 2:  # over the run's window, as the sender's
                receiver_cpu = receiver_cpus[1] - receiver_cpus[0]
            if eproc is not None and econn is not None:
                econn.send(("stop",))
                _, emu_samples, emulator_cpu = _expect(econn, "emulator", eproc, 30.0)
                if len(emulator_cpus) == 2:
                    emulator_cpu = emulator_cpus[1] - emulator_cpus[0]

    base = t0 if t0 is not None else send.started
    link_samples = emu_samples or send.link_samples
    if link_samples:
        _wire_from_link(send.samples, link_samples, base, cfg.sample_interval)
    receipts = send.receipts
    kv = sum(r.kv_bytes for r in receipts)
    wire = sum(r.wire_bytes for r in receipts)
    # The run lasts from the first transfer's start to the last one's end, or to the hard
    # stop that abandoned a transfer: the wire rate counts every byte carried meanwhile
    # (what the link forwarded, else what the receiver acknowledged), not only those of
    # the transfers that completed.
    seconds = max(0.0, send.ended - send.started)
    carried = send.carried if send.carried is not None else send.acked_bytes
    goodput = kv * 8 / seconds / 1e9 if seconds > 0 else 0.0
    acked_kv_gbps = send.acked_kv_bytes * 8 / seconds / 1e9 if seconds > 0 else 0.0
    wire_gbps = carried * 8 / seconds / 1e9 if seconds > 0 else 0.0
    link_bps = mean_rate(cfg.steps, send.started - base, send.ended - base)
    # What the link can carry of TCP payload: the wire rate counts that (the emulator's
    # forwarded bytes, the veth's less their headers), so a saturated link reads 100%.
    capacity_bps = link_bps * cfg.payload_share if link_bps is not None else None
    ttfl = [r.time_to_first_layer for r in receipts if r.time_to_first_layer is not None]
    all_chunks: dict[str, int] = {}
    for r in receipts:
        for name, n in r.extra.get("chunks_by_codec", {r.codec: r.chunks}).items():
            all_chunks[name] = all_chunks.get(name, 0) + int(n)
    stream_counts = [s["streams"] for s in send.samples if s.get("streams") is not None]
    inflight = [s["bytes_in_flight"] for s in send.samples if s.get("bytes_in_flight") is not None]
    span = max(seconds, 1e-9)
    cpu: dict[str, Any] = {
        "sender": send.cpu_s / span if seconds > 0 else None,
        "receiver": receiver_cpu / span if receiver_cpu is not None and seconds > 0 else None,
        "emulator": emulator_cpu / span if emulator_cpu is not None and seconds > 0 else None,
        "cores": os.cpu_count(),
    }
    if send.machine is not None and send.machine[1] > 0:
        busy, total = send.machine
        ours = send.cpu_s + (receiver_cpu or 0.0) + (emulator_cpu or 0.0)
        cpu["machine_busy"] = busy / total
        cpu["others"] = max(0.0, busy - ours) / total
    result.update(
        link_gbps=link_bps / 1e9 if link_bps is not None else None,
        # What the rate counts, and the MTU it is charged at: a link's only (loopback,
        # --rtt alone and --peer have no rate, and no MTU of ours).
        link_layer=cfg.link_layer if cfg.shaped else None,
        mtu=cfg.mtu if cfg.shaped else None,
        payload_capacity_gbps=capacity_bps / 1e9 if capacity_bps is not None else None,
        link_schedule=[[t, r / 1e9] for t, r in cfg.steps] if cfg.steps else None,
        rtt_ms=cfg.rtt * 1e3 if cfg.mode == "emulated" else send.min_rtt_ms,
        measured_rtt_ms=send.min_rtt_ms,
        jitter_ms=cfg.jitter * 1e3,
        codec=cfg.codec,
        codecs_used=sorted(all_chunks),
        codec_shares=codec_shares(all_chunks),
        chunks_by_codec=all_chunks,
        chunk_bytes=send.chunk_bytes,
        chunk_bytes_requested=cfg.chunk_bytes,
        seed=cfg.seed,
        streams=cfg.streams,
        streams_min=min(stream_counts) if stream_counts else None,
        streams_max=max(stream_counts) if stream_counts else None,
        streams_median=statistics.median(stream_counts) if stream_counts else None,
        bytes_in_flight_mean=statistics.fmean(inflight) if inflight else None,
        cpu=cpu,
        retransmits=send.retransmits,
        spurious_retransmits=send.spurious_retransmits,
        transfers=len(receipts),
        incomplete_transfers=send.incomplete,
        kv_bytes_per_transfer=cfg.tokens * model.bytes_per_token(),
        kv_bytes=kv,
        wire_bytes=wire,
        carried_bytes=carried,
        seconds=seconds,
        goodput_gbps=goodput,
        acked_kv_bytes=send.acked_kv_bytes,
        acked_kv_gbps=acked_kv_gbps,
        wire_gbps=wire_gbps,
        utilization=wire_gbps * 1e9 / capacity_bps if capacity_bps else None,
        estimated_gbps=send.estimated_gbps,
        time_to_first_layer_ms=statistics.median(ttfl) * 1e3 if ttfl else None,
        transfer_seconds_median=statistics.median(r.seconds for r in receipts) if receipts else None,
        max_rel_error=receiver["max_rel_error"] if receiver else None,
        checked_layers=receiver["checked_layers"] if receiver else 0,
        baseline_gbps=baseline["gbps"] if baseline else None,
        baseline_ratio=goodput / baseline["gbps"] if baseline and baseline["gbps"] > 0 else None,
        peer=address(cfg.peer) if cfg.peer else None,
        per_transfer=[
            {
                "codec": r.codec, "kv_bytes": r.kv_bytes, "wire_bytes": r.wire_bytes,
                "seconds": r.seconds,
                "time_to_first_layer_ms": r.time_to_first_layer * 1e3
                if r.time_to_first_layer is not None else None,
                "estimated_gbps": r.estimated_gbps,
            }
            for r in receipts
        ],
        samples=send.samples,
    )
    result["intervals"] = intervals(send.samples, cfg.interval, send.initial) if send.initial else []
    result["streams_over_time"] = [[iv["end"], iv["streams"]] for iv in result["intervals"]]
    result["trust"] = trust_note(cfg.mode, measured_link=bool(link_samples))
    from kvwire.aio import ServerOptions

    window = ServerOptions().window if cfg.mode == "peer" else receiver_options(cfg.chunk_bytes)["window"]
    result["diagnosis"] = diagnose(result, window_bytes=window)
    return result


def _wire_from_link(
    samples: list[dict[str, Any]], link: list[tuple[float, int]], base: float, interval: float
) -> None:
    """Replace each sample's wire rate by the link's byte counter (the emulator's
    forwarded bytes, or the shaped veth's transmitted ones) over the same interval: what
    actually crossed the link, not what the sender handed to TCP."""
    times = np.array([t - base for t, _ in link])
    counts = np.array([b for _, b in link], dtype=np.float64)
    if not samples:
        return
    prev_t = samples[0]["t"] - interval
    prev_b = float(np.interp(prev_t, times, counts))
    for point in samples:
        b = float(np.interp(point["t"], times, counts))
        if point["t"] > prev_t:
            point["wire_gbps"] = (b - prev_b) * 8 / (point["t"] - prev_t) / 1e9
        prev_t, prev_b = point["t"], b


if __name__ == "__main__":  # pragma: no cover - run through ``kvwire bench``
    sys.exit("use: kvwire bench")
