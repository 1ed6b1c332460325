"""Two sans-IO endpoints driven by Hypothesis through handshakes, transfers, credits and closes."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvwire.errors import ErrorCode
from kvwire.wire import (
    Begin,
    Chunk,
    ChunkAcked,
    ChunkReceived,
    ClientAuthenticated,
    Connection,
    ConnectionClosed,
    ConnectionConfig,
    CreditGranted,
    Role,
    State,
    TransferAccepted,
    TransferBegun,
    TransferReset,
    chunk_frame_size,
)

WINDOW = 1 << 16


class TwoEndpoints(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.client = Connection(Role.CLIENT, ConnectionConfig(secret=b"secret-xyz", max_frame_size=1 << 16))
        self.server = Connection(
            Role.SERVER, ConnectionConfig(secret=b"secret-xyz", window=WINDOW, max_frame_size=1 << 16)
        )
        self.to_server = bytearray()
        self.to_client = bytearray()
        self.client.initiate()
        self.next_tid = 1
        self.begun: set[int] = set()
        self.accepted: set[int] = set()
        self.sent: dict[tuple[int, int, int, int], int] = {}  # address -> frame size, unacked
        self.received_unacked: list[object] = []
        self.acked = 0
        self.closed = {"client": False, "server": False}
        self.credit_limits: dict[int, int] = {}
        self.granted: dict[int, int] = {}
        self.resets_seen: set[int] = set()

    # -- plumbing -------------------------------------------------------------------------

    def _collect(self) -> None:
        for part in self.client.data_to_send():
            self.to_server += bytes(part)
        for part in self.server.data_to_send():
            self.to_client += bytes(part)
        while (e := self.server.next_event()) is not None:
            assert not self.closed["server"], f"event after close: {e}"
            if isinstance(e, ClientAuthenticated):
                self.server.welcome(b"Z" * 16, ("raw",))
            elif isinstance(e, TransferBegun):
                assert e.frame.transfer_id in self.begun
                if e.frame.transfer_id % 3:  # most transfers are accepted at once
                    self.server.send_accept(e.frame.transfer_id, 1)
            elif isinstance(e, ChunkReceived):
                if e.chunk.token_start % 2 == 0 and self.server.state is State.OPEN:
                    self.server.send_ack(e.chunk.address)  # acked at once, like a real receiver
                else:
                    self.received_unacked.append(e.chunk.address)
            elif isinstance(e, ConnectionClosed):
                self.closed["server"] = True
        while (e := self.client.next_event()) is not None:
            assert not self.closed["client"], f"event after close: {e}"
            if isinstance(e, TransferAccepted):
                self.accepted.add(e.transfer_id)
            elif isinstance(e, ChunkAcked):
                a = e.address
                key = (a.transfer_id, a.layer, a.kind, a.token_start)
                assert self.sent.pop(key) == e.wire_size
                self.acked += 1
            elif isinstance(e, CreditGranted):
                assert e.layer_limit >= self.credit_limits.get(e.transfer_id, 0)
                self.credit_limits[e.transfer_id] = e.layer_limit
            elif isinstance(e, TransferReset):
                self.resets_seen.add(e.transfer_id)
            elif isinstance(e, ConnectionClosed):
                self.closed["client"] = True
        for part in self.client.data_to_send():
            self.to_server += bytes(part)
        for part in self.server.data_to_send():
            self.to_client += bytes(part)

    @property
    def both_open(self) -> bool:
        return self.client.state is State.OPEN and self.server.state is State.OPEN

    # -- rules ----------------------------------------------------------------------------

    @initialize(split=st.integers(1, 400))
    def handshake(self, split: int) -> None:
        # Handshake bytes cross in pieces of ``split`` bytes.
        self._collect()
        for _ in range(20):
            for buf, conn in ((self.to_server, self.server), (self.to_client, self.client)):
                while buf:
                    data = bytes(buf[:split])
                    del buf[:split]
                    conn.receive_data(data)
                    self._collect()
        assert self.both_open

    @rule(n=st.one_of(st.integers(1, 5000), st.just(1 << 30)))
    def deliver_to_server(self, n: int) -> None:
        data, self.to_server[:] = bytes(self.to_server[:n]), self.to_server[n:]
        if data:
            self.server.receive_data(data)
        self._collect()

    @rule(n=st.one_of(st.integers(1, 5000), st.just(1 << 30)))
    def deliver_to_client(self, n: int) -> None:
        data, self.to_client[:] = bytes(self.to_client[:n]), self.to_client[n:]
        if data:
            self.client.receive_data(data)
        self._collect()

    @rule()
    def settle(self) -> None:
        for _ in range(4):
            self.deliver_to_server(1 << 30)
            self.deliver_to_client(1 << 30)

    @precondition(lambda self: self.both_open)
    @rule()
    def begin(self) -> None:
        tid = self.next_tid
        self.next_tid += 1
        self.begun.add(tid)
        self.client.send_begin(Begin(transfer_id=tid, num_layers=4, num_kv_heads=2, head_dim=4,
                                     dtype_id=1, model="", request_id=f"r{tid}", meta=b"{}"))
        self._collect()

    @precondition(lambda self: self.both_open and self.begun)
    @rule(data=st.data())
    def accept(self, data: st.DataObject) -> None:
        tid = data.draw(st.sampled_from(sorted(self.begun)))
        self.server.send_accept(tid, 1)
        self._collect()

    @precondition(lambda self: self.both_open and self.accepted)
    @rule(data=st.data(), tokens=st.integers(1, 300))
    def send_chunk(self, data: st.DataObject, tokens: int) -> None:
        tid = data.draw(st.sampled_from(sorted(self.accepted)))
        layer = data.draw(st.integers(0, 3))
        kind = data.draw(st.integers(0, 2))  # K, V or (version 2) KV
        start = data.draw(st.integers(0, 10_000))
        key = (tid, layer, kind, start)
        payload = bytes(tokens * 16)
        size = chunk_frame_size(0, len(payload))
        if key in self.sent or not self.client.can_send_chunk(size):
            return
        self.client.send_chunk(
            Chunk(transfer_id=tid, layer=layer, kind=kind, codec_id=0, token_start=start,
                  token_count=tokens, layer_tokens=start + tokens, params=b"", payload=payload),
            size,
        )
        self.sent[key] = size
        self._collect()

    @precondition(lambda self: self.server.state is State.OPEN and self.received_unacked)
    @rule()
    def ack_oldest(self) -> None:
        self.server.send_ack(self.received_unacked.pop(0))  # type: ignore[arg-type]
        self._collect()

    @precondition(lambda self: self.server.state is State.OPEN and self.accepted)
    @rule(data=st.data(), limit=st.integers(1, 4))
    def grant(self, data: st.DataObject, limit: int) -> None:
        tid = data.draw(st.sampled_from(sorted(self.accepted)))
        limit = max(limit, self.granted.get(tid, 0))
        self.granted[tid] = limit
        self.server.send_credit_frame(tid, limit)
        self._collect()

    @precondition(lambda self: self.server.state is State.OPEN and self.begun)
    @rule(data=st.data())
    def server_resets(self, data: st.DataObject) -> None:
        tid = data.draw(st.sampled_from(sorted(self.begun)))
        self.server.send_reset(tid, ErrorCode.STALE_VERSION, "stale")
        self._collect()

    @rule(who=st.sampled_from(["client", "server"]), code=st.sampled_from([ErrorCode.NO_ERROR, ErrorCode.CANCELLED]),
          dice=st.integers(0, 9))
    def close(self, who: str, code: ErrorCode, dice: int) -> None:
        if dice:  # closes are rare, so runs get far enough to move data
            return
        conn = self.client if who == "client" else self.server
        conn.close(code, "bye")
        self._collect()

    # -- invariants -----------------------------------------------------------------------

    @invariant()
    def client_credit_is_conserved(self) -> None:
        if self.client.state is State.OPEN:
            assert self.client.send_credit + sum(self.sent.values()) == WINDOW

    @invariant()
    def server_never_holds_more_than_its_window(self) -> None:
        assert 0 <= self.server.recv_unacked <= WINDOW

    @invariant()
    def closed_is_terminal(self) -> None:
        for name, conn in (("client", self.client), ("server", self.server)):
            if self.closed[name]:
                assert conn.state is State.CLOSED
                assert conn.get_timer() is None


TwoEndpoints.TestCase.settings = settings(max_examples=60, stateful_step_count=50, deadline=None)


test_two_endpoints = TwoEndpoints.TestCase


class _Draws:
    def __init__(self, *values: object) -> None:
        self.values = list(values)

    def draw(self, strategy: object) -> object:
        return self.values.pop(0)


def test_the_machine_moves_data() -> None:
    """The rules compose into a full transfer (guards the machine against vacuity)."""
    m = TwoEndpoints()
    m.handshake(split=7)
    m.begin()
    m.settle()
    assert m.accepted == {1}
    m.send_chunk(_Draws(1, 0, 0, 0), tokens=10)  # type: ignore[arg-type]
    m.send_chunk(_Draws(1, 0, 1, 1), tokens=10)  # type: ignore[arg-type]
    m.settle()
    m.ack_oldest()
    m.settle()
    assert m.acked == 2 and not m.sent
    m.client_credit_is_conserved()
