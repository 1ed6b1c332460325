"""A userspace link emulator: an asyncio TCP proxy with a shared rate, delay and jitter.

Every connection accepted on ``127.0.0.1:port`` is forwarded to the target. Bytes going
forward (client to target) from all connections share one FIFO bottleneck whose rate
may change on a schedule; each byte leaves the bottleneck when the bytes before it are
through, then waits the one-way delay (plus jitter) before it is written on. The
reverse direction gets the same delay and, optionally, its own shared rate.

The proxy terminates TCP on both sides: each endpoint's TCP sees a short loopback
path, and the emulated delay shows only in application-level round trips (TCP_INFO at
the endpoints does not see it). A full bottleneck queue pushes back through TCP (the
proxy stops reading) rather than dropping. The rate is a line rate: given an ``mtu``, each
byte read from a TCP socket is charged as the Ethernet frames that would carry it
(:func:`wire_per_payload_byte`), so a saturated link carries the TCP payload a real
Ethernet link of that rate does; without one the rate counts TCP payload bytes. On Linux the bytes are spliced from socket to
kernel pipe to socket and wait out the delay in the pipes (:mod:`kvwire.bench._splice`);
elsewhere, or with ``splice=False``, they are read into Python and written out again.
"""

from __future__ import annotations

import asyncio
import bisect
import math
import random
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType

from kvwire.bench._proxy import Action, ActionKind, ProxyConnection, TcpProxy
from kvwire.bench._splice import AVAILABLE as SPLICE_AVAILABLE
from kvwire.bench._splice import SpliceConnection, SpliceProxy

__all__ = [
    "ETHERNET_FRAMING",
    "MAX_MTU",
    "MIN_MTU",
    "SPLICE_AVAILABLE",
    "TCP_IP_HEADERS",
    "LinkEmulator",
    "LinkStatistics",
    "RateSchedule",
    "check_mtu",
    "default_queue_bytes",
    "payload_share",
    "wire_per_payload_byte",
]

_MIB = 1024 * 1024
#: How long the bottleneck's queue lasts at the link's (peak) rate, as tbf's latency in
#: :mod:`kvwire.bench.netns`; between :data:`MIN_QUEUE` and :data:`MAX_QUEUE`, shared by every connection.
QUEUE_TIME = 0.05
MIN_QUEUE = 64 * 1024
MAX_QUEUE = 4 * _MIB
#: Bytes read at once are scheduled in pieces of this long at the link's rate (at least
#: :data:`MIN_PIECE`), each leaving when it is through.
PIECE_TIME = 0.001
MIN_PIECE = 4096


#: Bytes each Ethernet frame takes on the wire beyond its IP packet: header 14, FCS 4,
#: preamble and start delimiter 8, inter-frame gap 12.
ETHERNET_FRAMING = 38
#: Bytes of each IP packet that are not TCP payload: IPv4 header 20, TCP header with the
#: timestamps option 32 (what Linux sends by default).
TCP_IP_HEADERS = 52
#: The MTUs a link may be given (IPv4's minimum datagram to the largest IP packet).
MIN_MTU = 576
MAX_MTU = 65535  # a veth takes at most ETH_MAX_MTU


def check_mtu(mtu: int) -> int:
    if not MIN_MTU <= mtu <= MAX_MTU:
        raise ValueError(f"the MTU must be between {MIN_MTU} and {MAX_MTU} bytes, not {mtu}")
    return mtu


def wire_per_payload_byte(mtu: int | None) -> float:
    """Bytes on an Ethernet wire of MTU ``mtu`` per byte of TCP payload, as if every
    segment were full: ``(mtu + 38) / (mtu - 52)`` (1538/1448 at MTU 1500, 9038/8948 at
    9000). Short segments (a stream's last bytes, pure ACKs) cost more on a real link;
    this charges them by their payload alone. ``None``: 1 (the rate counts TCP payload)."""
    if mtu is None:
        return 1.0
    check_mtu(mtu)
    return (mtu + ETHERNET_FRAMING) / (mtu - TCP_IP_HEADERS)


def payload_share(mtu: int | None) -> float:
    """The share of an Ethernet link's line rate that full segments carry as TCP payload
    (0.9415 at MTU 1500, 0.990 at 9000); 1 with ``None`` (a rate of TCP payload)."""
    return 1.0 / wire_per_payload_byte(mtu)


def default_queue_bytes(peak_bps: float | None) -> int:
    """The bottleneck's queue on a link of ``peak_bps`` (None: unlimited), every connection's:
    :data:`QUEUE_TIME` of the rate, so a slow link does not queue many seconds of bytes
    (at 2 Mbit/s, 4 MiB would be 17 s)."""
    if peak_bps is None:
        return MAX_QUEUE
    return int(min(MAX_QUEUE, max(MIN_QUEUE, peak_bps / 8.0 * QUEUE_TIME)))


class RateSchedule:
    """A piecewise-constant rate over time; ``None`` means unlimited.

    Times are seconds from the emulator's start. The first step is at 0.
    """

    def __init__(self, steps: Sequence[tuple[float, float | None]]) -> None:
        if not steps:
            raise ValueError("a schedule needs at least one step")
        ordered = sorted(steps, key=lambda s: s[0])
        if ordered[0][0] > 0:
            ordered.insert(0, (0.0, ordered[0][1]))
        for _, rate in ordered:
            if rate is not None and rate <= 0:
                raise ValueError("rates must be positive (or None for unlimited)")
        self._times = [max(t, 0.0) for t, _ in ordered]
        self._rates = [r for _, r in ordered]

    @classmethod
    def constant(cls, rate_bps: float | None) -> RateSchedule:
        return cls([(0.0, rate_bps)])

    @property
    def steps(self) -> list[tuple[float, float | None]]:
        return list(zip(self._times, self._rates, strict=True))

    @property
    def peak_bps(self) -> float | None:
        """Highest rate in the schedule; ``None`` if any step is unlimited."""
        if any(r is None for r in self._rates):
            return None
        return max(r for r in self._rates if r is not None)

    def rate_at(self, t: float) -> float | None:
        """Rate in effect at ``t`` seconds from the start (bits/s)."""
        i = bisect.bisect_right(self._times, t) - 1
        return self._rates[max(i, 0)]

    def add_step(self, t: float, rate_bps: float | None) -> None:
        """Change the rate from ``t`` on, dropping later steps."""
        if rate_bps is not None and rate_bps <= 0:
            raise ValueError("rates must be positive (or None for unlimited)")
        i = bisect.bisect_left(self._times, t)
        del self._times[i:], self._rates[i:]
        self._times.append(t)
        self._rates.append(rate_bps)

    def finish_time(self, start: float, nbytes: float) -> float:
        """When ``nbytes`` starting through the bottleneck at ``start`` are through."""
        bits = 8.0 * nbytes
        t = start
        i = max(bisect.bisect_right(self._times, t) - 1, 0)
        while True:
            rate = self._rates[i]
            if rate is None:
                return t
            end = self._times[i + 1] if i + 1 < len(self._times) else math.inf
            capacity = (end - t) * rate
            if bits <= capacity:
                return t + bits / rate
            bits -= capacity
            t = end
            i += 1


class _Bottleneck:
    """A FIFO serializer shared by every connection in one direction."""

    def __init__(self, schedule: RateSchedule, burst: float, wire_per_byte: float = 1.0) -> None:
        self.schedule = schedule
        self.burst = burst
        self.wire_per_byte = wire_per_byte
        """Wire bytes each payload byte is charged (:func:`wire_per_payload_byte`)."""
        self.free_at = 0.0
        self.bytes = 0
        """Payload bytes passed to the bottleneck."""

    def finish(self, now: float, nbytes: int) -> float:
        # Capacity left unused for up to ``burst`` seconds may still be used: the proxy's
        # own scheduling hiccups would otherwise be lost for good and pull the rate below
        # the set one. Over any window the overshoot is at most rate x burst.
        start = max(now - self.burst, self.free_at)
        self.free_at = self.schedule.finish_time(start, nbytes * self.wire_per_byte)
        self.bytes += nbytes
        # Catching up never lets bytes leave before they arrived.
        return max(self.free_at, now)


class _SharedQueue:
    """The bytes in one direction's bottleneck that it has not passed yet, from every
    connection: one queue of ``limit`` bytes, as a router's port has (the pumps' gate,
    :class:`kvwire.bench._proxy.QueueGate`). Times are the event loop's."""

    def __init__(self, limit: int) -> None:
        self.limit = max(limit, 1)
        self._low = self.limit // 2
        self.read_size = max(16 * 1024, self.limit // 8)
        """Most a connection reads at once while the queue is shared: each reader takes its
        turn, not all the room the queue has when they are woken."""
        self._through: deque[tuple[float, int]] = deque()  # (leaves the bottleneck, bytes)
        self._bytes = 0
        self._waiters: dict[Callable[[], None], None] = {}
        self._timer: asyncio.TimerHandle | None = None

    def add(self, through: float, nbytes: int) -> None:
        self._through.append((through, nbytes))
        self._bytes += nbytes

    def backlog(self, now: float) -> int:
        through = self._through
        while through and through[0][0] <= now:
            self._bytes -= through.popleft()[1]
        return self._bytes

    def room(self, now: float) -> int:
        return self.limit - self.backlog(now)

    def drained(self, now: float) -> bool:
        return self.backlog(now) <= self._low

    def wait(self, now: float, wake: Callable[[], None]) -> None:
        self._waiters[wake] = None
        if self._timer is None:
            self._arm(now)

    def _arm(self, now: float) -> None:
        # When enough of the oldest bytes have left for the rest to be at the low mark.
        left, at = self.backlog(now), now
        for through, nbytes in self._through:
            if left <= self._low:
                break
            left -= nbytes
            at = through
        self._timer = asyncio.get_running_loop().call_at(at, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        now = asyncio.get_running_loop().time()
        if not self.drained(now):
            self._arm(now)
            return
        waiters, self._waiters = self._waiters, {}
        for wake in waiters:
            wake()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._waiters.clear()


class _LinkPolicy:
    def __init__(
        self,
        emulator: LinkEmulator,
        bottleneck: _Bottleneck | None,
        delay: float,
        jitter: float,
        rng: random.Random,
        gate: _SharedQueue | None = None,
    ) -> None:
        self._emulator = emulator
        self._bottleneck = bottleneck
        self.gate = gate
        """The bottleneck's queue, shared with every connection (None: no bottleneck)."""
        self._delay = delay
        self._jitter = jitter
        self._rng = rng
        self._last = -math.inf

    def when(self, now: float, nbytes: int) -> float:
        """When ``nbytes`` read at ``now`` may be written on."""
        t0 = self._emulator.start_time
        through = (
            now if self._bottleneck is None else t0 + self._bottleneck.finish(now - t0, nbytes)
        )
        if self.gate is not None:
            self.gate.add(through, nbytes)
        extra = self._delay
        if self._jitter:
            extra = max(0.0, extra + self._rng.uniform(-self._jitter, self._jitter))
        self._last = through + extra
        return self._last

    def pieces(self, now: float, nbytes: int) -> list[tuple[int, float]]:
        """``nbytes`` read at ``now`` as pieces of about :data:`PIECE_TIME` of the link's
        rate, each with the time it may be written on: a read's first bytes leave when
        they are through, not when its last byte is (a 600 KB read at 100 Mbit/s would
        hold its first byte 50 ms)."""
        bottleneck = self._bottleneck  # this direction's rate (None: unlimited)
        size = nbytes
        if bottleneck is not None:
            rate = bottleneck.schedule.rate_at(now - self._emulator.start_time)
            if rate is not None:  # the payload that crosses in PIECE_TIME
                size = max(MIN_PIECE, int(rate / 8.0 * PIECE_TIME / bottleneck.wire_per_byte))
        out = []
        while nbytes > 0:
            n = nbytes if nbytes < 2 * size else size
            out.append((n, self.when(now, n)))
            nbytes -= n
        return out

    def feed(self, data: bytes, now: float) -> Iterable[Action]:
        if len(data) < 2 * MIN_PIECE:
            return (Action(self.when(now, len(data)), ActionKind.DATA, data),)
        actions, at = [], 0
        for n, due in self.pieces(now, len(data)):
            actions.append(Action(due, ActionKind.DATA, data[at : at + n]))
            at += n
        return actions

    def eof_at(self, now: float) -> float:
        """When an EOF read at ``now`` may be passed on."""
        return max(now + self._delay, self._last)

    def feed_eof(self, now: float) -> Iterable[Action]:
        return (Action(self.eof_at(now), ActionKind.EOF),)


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkStatistics:
    elapsed: float
    """Seconds since the emulator started."""
    connections: int
    active: int
    bytes_forward: int
    """Bytes written to the target so far."""
    bytes_backward: int
    queued_bytes: int
    """Bytes read from the senders that the forward bottleneck has not passed yet (its
    queue, shared by every connection; 0 on an unlimited link)."""
    rate_bps: float | None
    """Forward rate in effect now (``None``: unlimited)."""
    reverse_rate_bps: float | None


class LinkEmulator:
    """An emulated link between a sender and a receiver listening at ``target_host:port``.

    ::

        async with LinkEmulator("127.0.0.1", port, rate_bps=10e9, delay=0.010) as link:
            await connect("127.0.0.1", link.port)

    :param rate_bps: forward rate in bits/s (``None``: unlimited), shared by all
        connections. Ignored when ``schedule`` is given.
    :param delay: one-way delay in seconds, added in both directions.
    :param jitter: each read's delay varies uniformly by +-``jitter`` seconds (bytes are
        never reordered, so a short delay waits behind a longer one before it).
    :param schedule: ``[(t, rate_bps), ...]``: the forward rate from ``t`` seconds after
        start, e.g. ``[(0.0, 10e9), (3.0, 2.5e9)]``.
    :param reverse_rate_bps: shared rate for target-to-client bytes (``None``: unlimited).
    :param queue_bytes: the bottleneck's queue, shared by every connection (as a router
        port's), beyond the bytes in the delay line: while it is full the proxy reads
        from no connection, so senders ahead of the link by more are pushed back through
        TCP.  Default (None): :func:`default_queue_bytes` of the peak rate.  Below
        :data:`MAX_QUEUE` an eighth of it (at least 32 KiB) is each accepted socket's
        receive buffer and the rest the proxy's shared queue, so the kernel does not
        queue megabytes more than it.
    :param burst: seconds of unused capacity that may be caught up (a token bucket of
        ``rate x burst`` bytes); covers the proxy's own scheduling delays.
    :param mtu: the rates are Ethernet line rates at this MTU: each byte read from a TCP
        socket is charged :func:`wire_per_payload_byte` bytes of them, as if carried in full
        segments, so a saturated link forwards ``rate x`` :func:`payload_share` of TCP
        payload. ``None`` (the default): the rates count TCP payload bytes.
    :param seed: jitter's random seed, for repeatable runs.
    :param splice: forward with splice(2), the bytes waiting in kernel pipes
        (:mod:`kvwire.bench._splice`: a third to a half less of the emulator's CPU per byte,
        part of which the receiver pays back; a lower unshaped ceiling), or read them into
        Python and write them out again. ``None`` (the default): splice where the platform
        has it (Linux).
    """

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        rate_bps: float | None = None,
        delay: float = 0.0,
        jitter: float = 0.0,
        schedule: Sequence[tuple[float, float | None]] | None = None,
        reverse_rate_bps: float | None = None,
        queue_bytes: int | None = None,
        burst: float = 0.005,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        seed: int | None = None,
        splice: bool | None = None,
        mtu: int | None = None,
    ) -> None:
        if delay < 0 or jitter < 0:
            raise ValueError("delay and jitter must be >= 0")
        self.delay = delay
        self.jitter = jitter
        self.schedule = RateSchedule(schedule) if schedule else RateSchedule.constant(rate_bps)
        self.reverse_schedule = RateSchedule.constant(reverse_rate_bps)
        if burst < 0:
            raise ValueError("burst must be >= 0")
        self.mtu = mtu
        charge = wire_per_payload_byte(mtu)
        self._forward = _Bottleneck(self.schedule, burst, charge)
        self._backward = _Bottleneck(self.reverse_schedule, burst, charge)
        self._rng = random.Random(seed)
        self.start_time = 0.0
        # The reverse direction's queue follows its own rate (its sockets are the target's
        # side, whose receive buffers the proxy leaves to the kernel).
        reverse_queue = queue_bytes if queue_bytes is not None else default_queue_bytes(self.reverse_schedule.peak_bps)
        if queue_bytes is None:
            queue_bytes = default_queue_bytes(self.schedule.peak_bps)
        self.queue_bytes = queue_bytes
        # Below MAX_QUEUE each accepted socket's receive buffer holds a small part of the
        # queue (what arrives while the proxy is not reading) and the shared queue the
        # rest, so a sender gets about ``queue_bytes`` ahead of the link, not the kernel's
        # doubled buffer on top of it.
        rcvbuf = max(MIN_QUEUE // 2, queue_bytes // 8) if queue_bytes < MAX_QUEUE else None
        shared = queue_bytes if rcvbuf is None else max(queue_bytes - rcvbuf, rcvbuf)
        self._forward_queue = _SharedQueue(shared)
        self._backward_queue = _SharedQueue(reverse_queue)
        high = queue_bytes + self._in_delay_line(self.schedule.peak_bps)
        if splice is None:
            splice = SPLICE_AVAILABLE
        elif splice and not SPLICE_AVAILABLE:
            raise ValueError("splice=True needs splice(2), which this platform does not have")
        self.splice = splice
        proxy = SpliceProxy if splice else TcpProxy
        self._proxy: TcpProxy | SpliceProxy = proxy(
            target_host,
            target_port,
            self._policies,
            listen_host=listen_host,
            listen_port=listen_port,
            high_water=high,
            client_rcvbuf=rcvbuf,
        )

    def _in_delay_line(self, peak_bps: float | None) -> int:
        # Bytes that are through the bottleneck but still delayed must not count against
        # the queue, or the delay would cap throughput at queue / delay.
        if not self.delay and not self.jitter:
            return 0
        peak = peak_bps if peak_bps is not None else 40e9
        return int(peak / 8.0 * (self.delay + self.jitter) * 1.25)

    def _policies(self, conn: ProxyConnection | SpliceConnection) -> tuple[_LinkPolicy, _LinkPolicy]:
        backward = self._backward if self.reverse_schedule.peak_bps is not None else None
        limited = any(rate is not None for _, rate in self.schedule.steps)
        return (
            _LinkPolicy(
                self, self._forward, self.delay, self.jitter, self._rng, self._forward_queue if limited else None
            ),
            _LinkPolicy(
                self, backward, self.delay, self.jitter, self._rng, self._backward_queue if backward else None
            ),
        )

    @property
    def port(self) -> int:
        return self._proxy.port

    @property
    def host(self) -> str:
        return self._proxy.listen_host

    def rate_at(self, t: float) -> float | None:
        """Forward rate (bits/s) in effect ``t`` seconds after start, for plots."""
        return self.schedule.rate_at(t)

    def now(self) -> float:
        """Seconds since start on the emulator's clock (the event loop's)."""
        return asyncio.get_running_loop().time() - self.start_time

    def set_rate(self, rate_bps: float | None) -> None:
        """Change the forward rate from now on (replacing any later scheduled steps).

        Bytes already queued keep the times they were given.
        """
        self.schedule.add_step(self.now(), rate_bps)

    def statistics(self) -> LinkStatistics:
        conns = self._proxy.connections
        elapsed = self.now()
        return LinkStatistics(
            elapsed=elapsed,
            connections=len(conns),
            active=len(self._proxy.active),
            bytes_forward=sum(c.forward.bytes_out for c in conns if c.forward),
            bytes_backward=sum(c.backward.bytes_out for c in conns if c.backward),
            queued_bytes=self._forward_queue.backlog(asyncio.get_running_loop().time()),
            rate_bps=self.schedule.rate_at(elapsed),
            reverse_rate_bps=self.reverse_schedule.rate_at(elapsed),
        )

    async def start(self) -> None:
        await self._proxy.start()
        self.start_time = asyncio.get_running_loop().time()

    async def close(self) -> None:
        await self._proxy.close()
        self._forward_queue.close()
        self._backward_queue.close()

    async def __aenter__(self) -> LinkEmulator:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
