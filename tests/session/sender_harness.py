"""A :class:`SenderCore` driven in memory, in fake time, against receiving connections
that the tests steer."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from kvwire.errors import ConnectionLostError, ErrorCode
from kvwire.session.sender import SenderConfig, SenderCore, SenderEvent, StreamWanted
from kvwire.wire import (
    ChunkAddress,
    ChunkReceived,
    ClientAuthenticated,
    Connection,
    ConnectionConfig,
    Role,
    TransferBegun,
    TransferReset,
)

SECRET = b"sender-core-secret"
SESSION = bytes(range(16))
FINGERPRINT = bytes(range(100, 116))
WINDOW = 256 * 1024


@dataclass
class Harness:
    """A SenderCore and one hand-driven server Connection per slot; nothing is acknowledged
    unless the test says so."""

    core: SenderCore
    now: float = 0.0
    servers: dict[int, Connection] = field(default_factory=dict)
    events: list[SenderEvent] = field(default_factory=list)
    received: list[tuple[int, ChunkAddress]] = field(default_factory=list)  # (stream, chunk) not acked
    resets: list[tuple[int, int]] = field(default_factory=list)  # (stream, transfer id) RESET by the client
    hellos: list[ClientAuthenticated] = field(default_factory=list)
    layer_limit: int = 1 << 30
    session_id: bytes = SESSION
    welcomes: dict[int, dict[str, object]] = field(default_factory=dict)
    """Per slot: what its server's WELCOME says otherwise (max_frame_size, window,
    max_transfers, codecs)."""
    refuse: dict[int, ErrorCode] = field(default_factory=dict)
    """Per slot: the GOAWAY code its server refuses it with after AUTH instead of WELCOME."""
    unreachable: set[int] = field(default_factory=set)
    """Slots whose TCP connect fails (``stream_failed``)."""
    connects: dict[int, int] = field(default_factory=dict)
    """Connection attempts per slot."""
    hold_accept: bool = False
    """The servers answer no BEGIN (as one holds ACCEPT while its budget has no room)."""

    def open(self, index: int) -> None:
        cfg: dict[str, object] = dict(secret=SECRET, codecs=("raw", "fp8"), window=WINDOW, max_transfers=7,
                                      max_frame_size=128 * 1024)
        cfg.update(self.welcomes.get(index, {}))
        self.servers[index] = Connection(Role.SERVER, ConnectionConfig(**cfg), now=self.now)  # type: ignore[arg-type]
        self.core.stream_opened(index, self.now)

    def step(self) -> None:
        """Move bytes both ways until quiet; open every wanted stream."""
        busy = True
        while busy:
            busy = False
            while (ev := self.core.next_event()) is not None:
                self.events.append(ev)
                busy = True
                if isinstance(ev, StreamWanted):
                    self.connects[ev.index] = self.connects.get(ev.index, 0) + 1
                    if ev.index in self.unreachable:
                        self.core.stream_failed(ev.index, self.now, ConnectionLostError("refused"))
                    else:
                        self.open(ev.index)
            for i, srv in list(self.servers.items()):
                up = self.core.data_to_send(i)
                if up and srv.closed_event is None:
                    busy = True
                    srv.receive_data(up, self.now)
                    self._serve(i, srv)
                down = b"".join(bytes(p) for p in srv.data_to_send())
                if down:
                    busy = True
                    self.core.receive_data(i, down, self.now)

    def _serve(self, index: int, srv: Connection) -> None:
        while (ev := srv.next_event()) is not None:
            if isinstance(ev, ClientAuthenticated):
                self.hellos.append(ev)
                if index in self.refuse:
                    srv.refuse(self.refuse[index], "refused")
                else:
                    srv.welcome(self.session_id, srv.config.codecs)
            elif isinstance(ev, TransferBegun) and not self.hold_accept:
                srv.send_accept(ev.frame.transfer_id, min(self.layer_limit, ev.frame.num_layers))
            elif isinstance(ev, ChunkReceived):
                self.received.append((index, ev.chunk.address))
            elif isinstance(ev, TransferReset):
                self.resets.append((index, ev.transfer_id))

    def ack(self, n: int | None = None, *, order: random.Random | None = None) -> None:
        """Acknowledge ``n`` (all) received chunks, oldest first or in a random order."""
        if order is not None:
            order.shuffle(self.received)
        take, self.received = self.received[: n], self.received[n:] if n is not None else []
        for index, address in take:
            self.servers[index].send_ack(address)
        self.step()

    def kill(self, index: int) -> None:
        """The TCP connection of slot ``index`` breaks (EOF both ways)."""
        srv = self.servers.pop(index)
        srv.receive_data(b"")
        self.received = [r for r in self.received if r[0] != index]
        self.core.receive_data(index, b"", self.now)
        self.step()

    def of(self, kind: type) -> list:  # type: ignore[type-arg]
        return [e for e in self.events if isinstance(e, kind)]

    def advance(self, until: float) -> None:
        """Fire the core's timers (reconnect backoffs, deadlines, pings) up to ``until``."""
        while True:
            self.step()
            when = self.core.get_timer()
            if when is None or when > until:
                self.now = until
                return
            self.now = max(self.now, when)
            self.core.handle_timer(self.now)


def harness(streams: int = 1, **config: object) -> Harness:
    h = Harness(SenderCore(SenderConfig(secret=SECRET, streams=streams, codecs=("raw",),
                                        fingerprint=FINGERPRINT, **config)))  # type: ignore[arg-type]
    h.step()
    return h


def begin(h: Harness, layers: int = 4, **kw: object) -> int:
    tid = h.core.begin("r", num_layers=layers, num_kv_heads=1, head_dim=8, now=h.now, **kw)  # type: ignore[arg-type]
    h.step()
    return tid
