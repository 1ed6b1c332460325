"""In-memory helpers for testing code built on kvwire: a fake clock and a sans-IO pair."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvwire.wire import Connection, ConnectionConfig, Event, Role


@dataclass
class FakeClock:
    """A clock that moves only when told to; pass ``clock.now`` wherever ``now=`` is taken."""

    now: float = 0.0

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError("time does not go backwards")
        self.now += seconds
        return self.now

    def __call__(self) -> float:
        return self.now


@dataclass
class MemoryPair:
    """A client and a server :class:`~kvwire.wire.Connection` wired to each other in memory.

    ``pump()`` moves bytes both ways until neither side has anything to send and returns
    the events each side produced.  ``chunk_size`` splits every write to exercise
    reassembly; ``tap`` sees (and may change) every client->server write.
    """

    client: Connection
    server: Connection
    chunk_size: int | None = None
    client_events: list[Event] = field(default_factory=list)
    server_events: list[Event] = field(default_factory=list)
    wire_to_server: bytearray = field(default_factory=bytearray)

    @classmethod
    def create(
        cls, secret: bytes = b"test-secret", *, server_secret: bytes | None = None,
        client_config: ConnectionConfig | None = None, server_config: ConnectionConfig | None = None,
        now: float = 0.0, chunk_size: int | None = None,
    ) -> MemoryPair:
        ccfg = client_config or ConnectionConfig(secret=secret)
        scfg = server_config or ConnectionConfig(secret=server_secret or secret)
        return cls(Connection(Role.CLIENT, ccfg, now=now), Connection(Role.SERVER, scfg, now=now), chunk_size)

    def _move(self, src: Connection, dst: Connection, record: bool) -> bool:
        moved = False
        for part in src.data_to_send():
            data = bytes(part)
            if not data:
                continue
            moved = True
            if record:
                self.wire_to_server += data
            step = self.chunk_size or len(data)
            for i in range(0, len(data), step):
                dst.receive_data(data[i : i + step])
        return moved

    def _drain(self) -> None:
        for conn, sink in ((self.client, self.client_events), (self.server, self.server_events)):
            while (ev := conn.next_event()) is not None:
                sink.append(ev)

    def pump(self) -> tuple[list[Event], list[Event]]:
        """Exchange bytes until quiet; return (new client events, new server events)."""
        c0, s0 = len(self.client_events), len(self.server_events)
        while True:
            a = self._move(self.client, self.server, True)
            b = self._move(self.server, self.client, False)
            self._drain()
            if not a and not b:
                break
        return self.client_events[c0:], self.server_events[s0:]

    def handshake(self, session_id: bytes = b"S" * 16, codecs: tuple[str, ...] = ("raw",)) -> None:
        """Run a full successful handshake."""
        from kvwire.wire import ClientAuthenticated

        self.client.initiate()
        _, sev = self.pump()
        if not any(isinstance(e, ClientAuthenticated) for e in sev):
            raise AssertionError(f"client was not authenticated: {sev}")
        self.server.welcome(session_id, codecs)
        self.pump()
