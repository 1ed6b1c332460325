"""A sender and a receiver session core wired together in memory, with a fake clock and
faults at frame boundaries: drops, bit flips, black holes, receiver restarts.

Deterministic: the same faults give the same run, in fake time, without sockets.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvwire.errors import KvwireError
from kvwire.session.receiver import (
    Allocate,
    LayerReady,
    ReceiverConfig,
    ReceiverCore,
    RegistryCheck,
    RegistryPublish,
    TransferArrived,
    byte_buffer,
)
from kvwire.session.receiver import TransferFailed as IncomingFailed
from kvwire.session.sender import (
    ReceiverCosts,
    SenderConfig,
    SenderCore,
    SessionFailed,
    StreamWanted,
    TransferDone,
)
from kvwire.session.sender import TransferFailed as OutgoingFailed
from kvwire.testing.memory import FakeClock

Fault = tuple[str, int]
"""``("drop", 0)``: the connection breaks before this frame; ``("flip", bit)``: flip a bit of
it; ``("blackhole", 0)``: from this frame on the connection delivers nothing either way."""


@dataclass(eq=False)
class _Link:
    index: int
    cid: int
    up: bytearray = field(default_factory=bytearray)  # sender -> receiver, not yet framed
    down: bytearray = field(default_factory=bytearray)
    blackholed: bool = False
    s_closed: bool = False  # the sender's end is closed
    r_closed: bool = False  # the receiver's end is closed

    @property
    def closed(self) -> bool:
        return self.s_closed and self.r_closed


def _split_frames(buf: bytearray) -> list[bytes]:
    """Whole frames at the front of ``buf`` (removed from it)."""
    out = []
    while len(buf) >= 8:
        end = 8 + int.from_bytes(buf[4:8], "big") + 4
        if len(buf) < end:
            break
        out.append(bytes(buf[:end]))
        del buf[:end]
    return out


class SessionPair:
    """One :class:`SenderCore` and one :class:`ReceiverCore` over in-memory connections.

    ``faults`` maps the global frame number (every frame either way, counted from 0) to a
    :data:`Fault`; ``restart_at`` frame numbers replace the receiver by a fresh one (its
    sessions are gone).  The receiving application claims every transfer and takes every
    layer as soon as it is ready; ``delivered`` holds what it took per request id.
    """

    def __init__(
        self, sender: SenderConfig, receiver: ReceiverConfig, *, faults: dict[int, Fault] | None = None,
        restart_at: frozenset[int] = frozenset(), allocate: Allocate = byte_buffer,
        registry: Callable[[tuple[tuple[bytes, int], ...]], KvwireError | None] | None = None,
        abort_at: dict[int, str] | None = None,
    ) -> None:
        self.clock = FakeClock()
        self._rcfg = receiver
        self._allocate = allocate
        self.receiver = ReceiverCore(receiver, allocate=allocate)
        self.sender = SenderCore(sender)
        self.faults = dict(faults or {})
        self.restart_at = restart_at
        self.abort_at = dict(abort_at or {})
        """Frame number -> request id the receiving application aborts when it passes
        (a RESET racing the ACKs in flight)."""
        self.registry = registry
        self.links: dict[int, _Link] = {}
        self._cid = 0
        self.frames = 0
        self.delivered: dict[str, dict[int, tuple[bytes, bytes]]] = {}
        self.failed_incoming: dict[str, KvwireError] = {}
        self.outcomes: dict[int, TransferDone | OutgoingFailed] = {}
        self.ended_at: dict[int, float] = {}
        self.began_at: dict[int, float] = {}  # filled in by whoever starts transfers
        self.session_error: KvwireError | None = None
        self.receiver_costs: list[ReceiverCosts] = []
        """What the receiver's REPORTs told the sender, in order."""
        self.max_buffered = 0
        self.max_layers_buffered = 0
        """The most bytes the receiver held in layers (its buffered_bytes less kept_bytes)."""
        self.max_layers_committed = 0
        """The most bytes of layers the receiver held or had granted and not yet allocated
        (buffered_bytes less kept_bytes, plus reserved_bytes): what its grants promise never
        exceeds its budget."""
        self._requests: dict[tuple[bytes, int], str] = {}
        self._orphans: list[_Link] = []
        self.claim = True
        """Whether the receiving application claims arrived transfers (accept()/expect())."""
        self.hold: set[str] = set()
        """Request ids whose ready layers the application leaves where they are."""
        self.held: list[tuple[tuple[bytes, int], int]] = []
        self.keys: dict[str, tuple[bytes, int]] = {}

    # -- driving -----------------------------------------------------------------------

    def run(self, *, until: float) -> None:
        """Move bytes and fire timers until nothing is left to do or ``until`` (fake s)."""
        while True:
            if self._step():
                continue
            timers = [t for t in (self.sender.get_timer(), self.receiver.get_timer()) if t is not None]
            if not timers:
                return
            when = max(min(timers), self.clock.now)
            if when > until:
                return
            self.clock.now = when
            self.sender.handle_timer(when)
            self.receiver.handle_timer(when)

    def _step(self) -> bool:
        now = self.clock.now
        progressed = False
        while (ev := self.sender.next_event()) is not None:
            progressed = True
            if isinstance(ev, StreamWanted):
                self._open(ev.index)
            elif isinstance(ev, TransferDone | OutgoingFailed):
                self.outcomes[ev.transfer_id] = ev
                self.ended_at[ev.transfer_id] = now
            elif isinstance(ev, SessionFailed):
                self.session_error = ev.error
            elif isinstance(ev, ReceiverCosts):
                self.receiver_costs.append(ev)
        for link in list(self.links.values()) + self._orphans:
            if link.closed:
                continue
            progressed |= self._move(link, True)
            progressed |= self._move(link, False)
            if not link.s_closed and (self._current(link) is False or self.sender.is_closed(link.index)):
                self._end(link, sender_side=True)
                progressed = True
            if not link.r_closed and self.receiver.is_closed(link.cid):
                self._end(link, sender_side=False)
                progressed = True
        self._orphans = [x for x in self._orphans if not x.closed]
        progressed |= self._application()
        self.max_buffered = max(self.max_buffered, self.receiver.buffered_bytes)
        held = self.receiver.buffered_bytes - self.receiver.kept_bytes
        self.max_layers_buffered = max(self.max_layers_buffered, held)
        self.max_layers_committed = max(self.max_layers_committed, held + self.receiver.reserved_bytes)
        return progressed

    def _application(self) -> bool:
        now = self.clock.now
        progressed = False
        while (ev := self.receiver.next_event()) is not None:
            progressed = True
            if isinstance(ev, TransferArrived):
                self._requests[ev.key] = ev.request_id
                self.keys[ev.request_id] = ev.key
                if self.claim:
                    self.receiver.claim(ev.key, now)
            elif isinstance(ev, LayerReady):
                if self._requests[ev.key] in self.hold or not self.claim:
                    self.held.append((ev.key, ev.layer))
                    continue
                try:
                    k, v = self.receiver.take_layer(ev.key, ev.layer, now)
                except KvwireError:
                    continue  # it failed since; its TransferFailed event follows
                self.delivered.setdefault(self._requests[ev.key], {})[ev.layer] = (k, v)
            elif isinstance(ev, IncomingFailed):
                self.failed_incoming[ev.request_id or self._requests.get(ev.key, "?")] = ev.error
            elif isinstance(ev, RegistryCheck):
                err = self.registry(ev.blocks) if self.registry is not None else None
                self.receiver.registry_checked(ev.key, None, err, now)
            elif isinstance(ev, RegistryPublish):
                self.receiver.registry_published(ev.key, None, now)
        return progressed

    def _current(self, link: _Link) -> bool:
        return self.links.get(link.index) is link

    def _open(self, index: int) -> None:
        self._cid += 1
        link = _Link(index, self._cid)
        old = self.links.get(index)
        if old is not None and not old.closed:
            old.s_closed = True  # the sender gave up on it; the receiver's end may linger
            self._orphans.append(old)
        self.links[index] = link
        self.receiver.connection_made(link.cid, self.clock.now)
        self.sender.stream_opened(index, self.clock.now)

    def _end(self, link: _Link, *, sender_side: bool) -> None:
        """One end closed: the other sees EOF, unless the path is black-holed."""
        now = self.clock.now
        if sender_side:
            link.s_closed = True
            if not link.blackholed and not link.r_closed:
                self.receiver.receive_data(link.cid, b"", now)
        else:
            link.r_closed = True
            if not link.blackholed and not link.s_closed and self._current(link):
                self.sender.receive_data(link.index, b"", now)
        if link.r_closed:
            self.receiver.forget(link.cid)

    def _close(self, link: _Link) -> None:
        """The TCP connection breaks: both ends see EOF at once."""
        now = self.clock.now
        if not link.r_closed:
            link.r_closed = True
            self.receiver.receive_data(link.cid, b"", now)
            self.receiver.forget(link.cid)
        if not link.s_closed:
            link.s_closed = True
            if self._current(link):
                self.sender.receive_data(link.index, b"", now)

    def _move(self, link: _Link, up: bool) -> bool:
        now = self.clock.now
        if up:
            live = self._current(link) and not link.s_closed
            data = self.sender.data_to_send(link.index) if live else b""
        else:
            data = self.receiver.data_to_send(link.cid) if not link.r_closed else b""
        buf = link.up if up else link.down
        buf += data
        moved = bool(data)
        for frame in _split_frames(buf):
            n = self.frames
            self.frames += 1
            if n in self.restart_at:
                self._restart()
                return True
            request = self.abort_at.get(n)
            if request is not None and request in self.keys:
                self.receiver.abort(self.keys[request], "aborted by the test", now)
            fault = self.faults.get(n)
            if fault is not None:
                kind, arg = fault
                if kind == "drop":
                    self._close(link)
                    return True
                if kind == "blackhole":
                    link.blackholed = True
                elif kind == "flip":
                    b = bytearray(frame)
                    b[(arg // 8) % len(b)] ^= 1 << (arg % 8)
                    frame = bytes(b)
            if link.blackholed or (link.r_closed if up else (link.s_closed or not self._current(link))):
                continue
            if up:
                self.receiver.receive_data(link.cid, frame, now)
                self._application()  # what is stored (and acknowledged) is taken at once
            else:
                self.sender.receive_data(link.index, frame, now)
        return moved

    def _restart(self) -> None:
        """The receiver process restarts: every connection breaks, its sessions are gone."""
        for link in list(self.links.values()) + self._orphans:
            was_open = not link.s_closed
            link.s_closed = link.r_closed = True
            if was_open and self._current(link):
                self.sender.receive_data(link.index, b"", self.clock.now)
        self._orphans = []
        self.receiver = ReceiverCore(self._rcfg, allocate=self._allocate)


__all__ = ["Fault", "SessionPair"]
