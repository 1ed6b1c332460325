"""A TCP proxy that breaks connections on purpose, for testing the asyncio shell.

Every connection through :class:`FaultProxy` gets a :class:`FaultPlan` from a plan
callable (given the connection's index: 0 for the first accepted, 1 for the next...).
A plan holds one :class:`Faults` per direction: ``forward`` is client to target,
``backward`` target to client. Byte offsets count the bytes of that direction of that
connection from 0.

::

    plan = FaultPlan(forward=Faults(drop_at=1000))
    async with FaultProxy("127.0.0.1", server_port, plan=lambda i: plan if i == 0 else CLEAN) as proxy:
        await connect("127.0.0.1", proxy.port)   # first connection dies after 1000 bytes
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import Literal

from kvwire.bench._proxy import Action, ActionKind, ProxyConnection, TcpProxy

__all__ = ["CLEAN", "FaultPlan", "FaultProxy", "FaultStatistics", "Faults"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Faults:
    """Faults for one direction of one connection. Every field is optional."""

    drop_at: int | None = None
    """Forward exactly this many bytes, then close the connection (both directions)."""
    drop_mode: Literal["close", "reset"] = "close"
    """``close``: FIN to both sides. ``reset``: RST (bytes still in kernel buffers may be
    discarded by the reset, so only ``close`` guarantees ``drop_at`` bytes arrive)."""
    flip_bits: tuple[int, ...] = ()
    """Bit offsets to invert; bit ``i`` is ``1 << (i % 8)`` of byte ``i // 8``."""
    stall_at: int | None = None
    """Stop forwarding once this many bytes went through..."""
    stall_for: float | None = None
    """...for this many seconds; ``None`` stalls until :meth:`FaultProxy.resume`."""
    trickle_from: int | None = None
    """From this offset on, forward ``trickle_bytes`` at a time, ``trickle_interval`` apart."""
    trickle_bytes: int = 1
    trickle_interval: float = 0.001
    rate_bps: float | None = None
    """Cap the direction's rate (bits/s)."""
    delay: float = 0.0
    """Seconds added to every byte's forwarding time."""

    def __post_init__(self) -> None:
        if self.drop_at is not None and self.drop_at < 0:
            raise ValueError("drop_at must be >= 0")
        if self.trickle_bytes < 1 or self.trickle_interval < 0:
            raise ValueError("trickle_bytes must be >= 1 and trickle_interval >= 0")
        if self.rate_bps is not None and self.rate_bps <= 0:
            raise ValueError("rate_bps must be positive")
        if any(b < 0 for b in self.flip_bits):
            raise ValueError("bit offsets must be >= 0")


@dataclass(frozen=True, slots=True, kw_only=True)
class FaultPlan:
    forward: Faults = field(default_factory=Faults)
    """Client to target."""
    backward: Faults = field(default_factory=Faults)
    """Target to client."""


CLEAN = FaultPlan()
"""A plan that forwards everything untouched."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FaultStatistics:
    connections: int
    active: int
    bytes_forward: int
    bytes_backward: int
    drops: int
    bit_flips: int
    stalls: int
    trickled_bytes: int


class _Counters:
    __slots__ = ("bit_flips", "drops", "stalls", "trickled_bytes")

    def __init__(self) -> None:
        self.drops = 0
        self.bit_flips = 0
        self.stalls = 0
        self.trickled_bytes = 0


class _FaultPolicy:
    def __init__(self, faults: Faults, counters: _Counters) -> None:
        self.faults = faults
        self._counters = counters
        self._offset = 0
        self._cursor = -math.inf
        self._flips = sorted(set(faults.flip_bits))
        self._flip_index = 0
        self._stalled = False
        self._dropped = False

    def feed(self, data: bytes, now: float) -> Iterable[Action]:
        if self._dropped:
            return ()
        return list(self._feed(data, now))

    def _feed(self, data: bytes, now: float) -> Iterator[Action]:
        f = self.faults
        start = self._offset
        end = start + len(data)
        if f.drop_at is not None and end >= f.drop_at:
            data = data[: f.drop_at - start]
            end = f.drop_at
        if self._flip_index < len(self._flips) and self._flips[self._flip_index] < 8 * end:
            buf = bytearray(data)
            while self._flip_index < len(self._flips):
                bit = self._flips[self._flip_index]
                if bit >= 8 * end:
                    break
                buf[bit // 8 - start] ^= 1 << (bit % 8)
                self._flip_index += 1
                self._counters.bit_flips += 1
            data = bytes(buf)

        pos = 0
        while pos < len(data):
            offset = start + pos
            if f.stall_at is not None and not self._stalled and offset >= f.stall_at:
                self._stall(now)
            piece_end = len(data)
            if f.stall_at is not None and not self._stalled and f.stall_at > offset:
                piece_end = min(piece_end, f.stall_at - start)
            trickling = f.trickle_from is not None and offset >= f.trickle_from
            if trickling:
                piece_end = min(piece_end, pos + f.trickle_bytes)
            elif f.trickle_from is not None and f.trickle_from > offset:
                piece_end = min(piece_end, f.trickle_from - start)
            piece = data[pos:piece_end]
            yield Action(self._schedule(len(piece), now, trickling), ActionKind.DATA, piece)
            pos = piece_end
        # A stall exactly at the end of this read must hold whatever comes next.
        if f.stall_at is not None and not self._stalled and end >= f.stall_at:
            self._stall(now)
        self._offset = end

        if f.drop_at is not None and end >= f.drop_at:
            self._dropped = True
            self._counters.drops += 1
            kind = ActionKind.RESET if f.drop_mode == "reset" else ActionKind.CLOSE
            yield Action(self._cursor + f.delay, kind)

    def _stall(self, now: float) -> None:
        self._stalled = True
        self._counters.stalls += 1
        duration = self.faults.stall_for
        base = max(now, self._cursor)
        self._cursor = math.inf if duration is None else base + duration

    def _schedule(self, nbytes: int, now: float, trickling: bool) -> float:
        f = self.faults
        t = max(now, self._cursor)
        if trickling:
            t += f.trickle_interval
            self._counters.trickled_bytes += nbytes
        if f.rate_bps is not None:
            t += nbytes * 8.0 / f.rate_bps
        self._cursor = t
        return t + f.delay

    def resume(self, now: float) -> None:
        if math.isinf(self._cursor):
            self._cursor = now

    def feed_eof(self, now: float) -> Iterable[Action]:
        if self._dropped:
            return ()
        return (Action(self._cursor + self.faults.delay, ActionKind.EOF),)


PlanSource = Callable[[int], FaultPlan]


class FaultProxy:
    """An asyncio TCP proxy that injects faults per connection.

    :param plan: a :class:`FaultPlan` for every connection, or a callable giving the plan
        for connection ``index``. Replace it at runtime with :attr:`plan`; connections
        already open keep theirs.
    :param buffer_bytes: bytes held per direction before reading from the source pauses.
    """

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        plan: FaultPlan | PlanSource = CLEAN,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        buffer_bytes: int = 1024 * 1024,
    ) -> None:
        self.plan = plan
        self._counters = _Counters()
        self._proxy = TcpProxy(
            target_host,
            target_port,
            self._make_policies,
            listen_host=listen_host,
            listen_port=listen_port,
            high_water=buffer_bytes,
        )

    def _make_policies(self, conn: ProxyConnection) -> tuple[_FaultPolicy, _FaultPolicy]:
        # Held by the connection's pipes only, which let go of them when it ends.
        plan = self.plan(conn.index) if callable(self.plan) else self.plan
        return (
            _FaultPolicy(plan.forward, self._counters),
            _FaultPolicy(plan.backward, self._counters),
        )

    @property
    def port(self) -> int:
        return self._proxy.port

    @property
    def connections(self) -> list[ProxyConnection]:
        """Every connection accepted so far; ``connections[i].index == i``. One that has
        ended keeps its byte counts (``forward.bytes_out``...), not its buffers or faults."""
        return self._proxy.connections

    async def start(self) -> None:
        await self._proxy.start()

    async def close(self) -> None:
        await self._proxy.close()

    async def __aenter__(self) -> FaultProxy:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # -- runtime faults ---------------------------------------------------------------

    def _selected(self, index: int | None) -> list[ProxyConnection]:
        if index is None:
            return list(self._proxy.active)
        conn = self._proxy.connections[index]
        return [conn] if conn in self._proxy.active else []

    def drop(self, index: int | None = None, *, reset: bool = False) -> None:
        """Drop connection ``index`` (all open ones if ``None``) now."""
        for conn in self._selected(index):
            self._counters.drops += 1
            if reset:
                conn.abort()
            else:
                conn.close()

    def stall(self, index: int | None = None, seconds: float | None = None) -> None:
        """Stop forwarding on connection ``index`` (all if ``None``), both directions."""
        for conn in self._selected(index):
            self._counters.stalls += 1
            for pipe in (conn.forward, conn.backward):
                if pipe is not None:
                    loop_now = conn.closed.get_loop().time()
                    pipe.hold(math.inf if seconds is None else loop_now + seconds)

    def resume(self, index: int | None = None) -> None:
        """End stalls on connection ``index`` (all if ``None``), planned ones included."""
        for conn in self._selected(index):
            now = conn.closed.get_loop().time()
            for pipe in (conn.forward, conn.backward):
                if pipe is not None:
                    if isinstance(pipe.policy, _FaultPolicy):
                        pipe.policy.resume(now)
                    pipe.release()

    def statistics(self) -> FaultStatistics:
        fwd = sum(c.forward.bytes_out for c in self._proxy.connections if c.forward)
        back = sum(c.backward.bytes_out for c in self._proxy.connections if c.backward)
        k = self._counters
        return FaultStatistics(
            connections=len(self._proxy.connections),
            active=len(self._proxy.active),
            bytes_forward=fwd,
            bytes_backward=back,
            drops=k.drops,
            bit_flips=k.bit_flips,
            stalls=k.stalls,
            trickled_bytes=k.trickled_bytes,
        )
