"""The connection state machine: handshake, auth, transfers, credits, the state table."""

from __future__ import annotations

import pytest

from kvwire.errors import (
    AuthenticationError,
    ErrorCode,
    ProtocolError,
    TransferTimeoutError,
    UsageError,
)
from kvwire.testing.memory import MemoryPair
from kvwire.wire import (
    KIND_KV,
    KV_CHUNK_VERSION,
    PROTOCOL_VERSION,
    Accept,
    Ack,
    Auth,
    Begin,
    Challenge,
    Chunk,
    ChunkAcked,
    ChunkReceived,
    ClientAuthenticated,
    Connection,
    ConnectionClosed,
    ConnectionConfig,
    Credit,
    CreditGranted,
    DecodeCost,
    FrameDecoder,
    GoAway,
    HandshakeComplete,
    Hello,
    Ping,
    PingReceived,
    Pong,
    Report,
    ReportReceived,
    Reset,
    Role,
    State,
    TransferAccepted,
    TransferBegun,
    TransferReset,
    Welcome,
    chunk_frame_size,
    frame_bytes,
)
from kvwire.wire.connection import TRANSITIONS, client_proof, server_proof

BEGIN = Begin(transfer_id=1, num_layers=2, num_kv_heads=1, head_dim=4, dtype_id=1, model="",
              request_id="r", meta=b"{}")


def chunk(layer: int = 0, kind: int = 0, start: int = 0, n: int = 2) -> Chunk:
    return Chunk(transfer_id=1, layer=layer, kind=kind, codec_id=0, token_start=start, token_count=n,
                 layer_tokens=n, params=b"", payload=b"\x01" * (8 * n))


@pytest.mark.parametrize("split", [None, 1, 7])
def test_handshake_both_sides_open(split: int | None) -> None:
    pair = MemoryPair.create(chunk_size=split)
    pair.handshake()
    assert pair.client.state is State.OPEN and pair.server.state is State.OPEN
    assert any(isinstance(e, HandshakeComplete) for e in pair.client_events)
    assert any(isinstance(e, HandshakeComplete) for e in pair.server_events)
    assert pair.client.session_id == b"S" * 16
    assert pair.client.send_credit == pair.server.config.window


def test_wrong_secret_fails_on_both_sides_and_nothing_is_accepted() -> None:
    pair = MemoryPair.create(b"client-secret", server_secret=b"server-secret")
    pair.client.initiate()
    cev, sev = pair.pump()
    assert not any(isinstance(e, ClientAuthenticated) for e in sev)
    [sclosed] = [e for e in sev if isinstance(e, ConnectionClosed)]
    [cclosed] = [e for e in cev if isinstance(e, ConnectionClosed)]
    assert isinstance(sclosed.error, AuthenticationError)
    assert isinstance(cclosed.error, AuthenticationError)
    assert pair.server.state is State.CLOSED and pair.client.state is State.CLOSED


def test_server_that_does_not_know_the_secret_is_caught_by_the_client() -> None:
    pair = MemoryPair.create(b"right-secret")
    pair.client.initiate()
    pair.pump()
    # A forged server: answers with a WELCOME whose proof it cannot compute.
    forged = Welcome(session_id=b"X" * 16, max_frame_size=1 << 22, window=1 << 25,
                     max_transfers=1, codecs=("raw",), proof=b"\x00" * 32)
    pair.client.receive_data(frame_bytes(forged))
    events = []
    while (e := pair.client.next_event()) is not None:
        events.append(e)
    [closed] = [e for e in events if isinstance(e, ConnectionClosed)]
    assert isinstance(closed.error, AuthenticationError)


@pytest.mark.parametrize(("field", "value"), [("window", 1 << 16), ("max_transfers", 0)])
def test_a_welcome_the_client_could_never_use_is_refused(field: str, value: int) -> None:
    """A server (not kvwire's, whose config refuses both) granting less credit than the
    frames it accepts (a chunk of that size could never be sent: the client would wait for
    credit forever), or announcing max_transfers 0 (every BEGIN would be refused): the
    client refuses the WELCOME, naming the field."""
    scfg = ConnectionConfig(secret=b"test-secret", max_frame_size=1 << 20, window=1 << 20)
    object.__setattr__(scfg, field, value)  # past the config's own check
    pair = MemoryPair.create(server_config=scfg)
    pair.client.initiate()
    pair.pump()
    pair.server.welcome(b"S" * 16, ("raw",))
    cev, _ = pair.pump()
    [closed] = [e for e in cev if isinstance(e, ConnectionClosed)]
    assert closed.code == ErrorCode.PROTOCOL_ERROR and field in str(closed.error)
    assert pair.client.state is State.CLOSED


def test_replayed_auth_is_refused() -> None:
    first = MemoryPair.create()
    first.client.initiate()
    first.pump()
    recorded = bytes(first.wire_to_server)  # HELLO + AUTH of a successful handshake
    victim = Connection(Role.SERVER, ConnectionConfig(secret=b"test-secret"))
    victim.receive_data(recorded)
    events = []
    while (e := victim.next_event()) is not None:
        events.append(e)
    assert not any(isinstance(e, ClientAuthenticated) for e in events)
    assert isinstance(events[-1], ConnectionClosed)
    assert isinstance(events[-1].error, AuthenticationError)


def test_handshake_timeout() -> None:
    conn = Connection(Role.SERVER, ConnectionConfig(secret=b"test-secret", handshake_timeout=5), now=100.0)
    assert conn.get_timer() == 105.0
    conn.handle_timer(104.9)
    assert conn.state is State.SERVER_AWAIT_HELLO
    conn.handle_timer(105.0)
    ev = conn.next_event()
    assert isinstance(ev, ConnectionClosed) and isinstance(ev.error, TransferTimeoutError)
    assert conn.get_timer() is None


@pytest.mark.parametrize("role", [Role.SERVER, Role.CLIENT])
def test_the_handshake_deadline_counts_from_when_the_connection_started(role: Role) -> None:
    """A connection made after a TLS handshake (``now``) that began earlier (``started``):
    one deadline covers both, what is left of it for the kvwire handshake."""
    cfg = ConnectionConfig(secret=b"test-secret", handshake_timeout=4)
    conn = Connection(role, cfg, now=103.5, started=100.0)
    assert conn.get_timer() == 104.0
    conn.handle_timer(104.0)
    ev = conn.next_event()
    assert isinstance(ev, ConnectionClosed) and isinstance(ev.error, TransferTimeoutError)
    # a start past the deadline: it has passed already; no start (or a later one): from now
    assert Connection(role, cfg, now=110.0, started=100.0).get_timer() == 104.0
    assert Connection(role, cfg, now=100.0).get_timer() == Connection(role, cfg, now=100.0, started=101.0).get_timer() == 104.0


def test_version_mismatch_is_refused() -> None:
    server = Connection(Role.SERVER, ConnectionConfig(secret=b"test-secret"))
    hello = Hello(min_version=PROTOCOL_VERSION + 1, max_version=PROTOCOL_VERSION + 2, nonce=b"n" * 32, session_id=bytes(16),
                  stream_index=0, max_frame_size=1 << 22, codecs=("raw",), fingerprint=bytes(16))
    server.receive_data(frame_bytes(hello))
    ev = server.next_event()
    assert isinstance(ev, ConnectionClosed) and ev.code == ErrorCode.UNSUPPORTED_VERSION


@pytest.mark.parametrize(("client_max", "server_max"), [(2, 2), (1, 2), (2, 1), (1, 1)])
def test_the_highest_common_version_is_agreed(client_max: int, server_max: int) -> None:
    pair = MemoryPair.create(client_config=ConnectionConfig(secret=b"test-secret", max_version=client_max),
                             server_config=ConnectionConfig(secret=b"test-secret", max_version=server_max))
    pair.handshake()
    agreed = min(client_max, server_max)
    assert pair.client.version == pair.server.version == agreed
    for events in (pair.client_events, pair.server_events):
        [done] = [e for e in events if isinstance(e, HandshakeComplete)]
        assert done.version == agreed
    assert pair.client.sends_kv_chunks is (agreed >= KV_CHUNK_VERSION)


def test_a_server_that_only_speaks_a_newer_version_is_refused_by_the_client() -> None:
    client = Connection(Role.CLIENT, ConnectionConfig(secret=b"test-secret", max_version=1))
    client.initiate()
    client.data_to_send()
    client.receive_data(frame_bytes(Challenge(version=2, nonce=b"c" * 32)))
    ev = client.next_event()
    assert isinstance(ev, ConnectionClosed) and ev.code == ErrorCode.UNSUPPORTED_VERSION


def test_proofs_are_bound_to_the_version() -> None:
    secret, hello, challenge = b"test-secret", b"hello", b"challenge"
    assert client_proof(secret, hello, challenge, 1) != client_proof(secret, hello, challenge, 2)
    assert server_proof(secret, hello, challenge, b"p", b"w", 1) != server_proof(secret, hello, challenge, b"p", b"w", 2)


def test_max_version_outside_the_known_range_is_a_usage_error() -> None:
    for bad in (0, PROTOCOL_VERSION + 1):
        with pytest.raises(UsageError, match="max_version"):
            ConnectionConfig(secret=b"test-secret", max_version=bad)


def _open_pair(version: int) -> MemoryPair:
    pair = MemoryPair.create(client_config=ConnectionConfig(secret=b"test-secret", max_version=version))
    pair.handshake()
    pair.client.send_begin(BEGIN)
    pair.pump()
    pair.server.send_accept(1, 2)
    pair.pump()
    return pair


def test_a_kv_chunk_crosses_a_version_2_connection() -> None:
    pair = _open_pair(2)
    kv = Chunk(transfer_id=1, layer=0, kind=KIND_KV, codec_id=0, token_start=0, token_count=2,
               layer_tokens=2, params=b"", payload=(b"\x01" * 16, b"\x02" * 16))
    pair.client.send_chunk(kv, chunk_frame_size(0, 32))
    _, sev = pair.pump()
    [got] = [e for e in sev if isinstance(e, ChunkReceived)]
    assert got.chunk.kind == KIND_KV and bytes(got.chunk.payload) == b"\x01" * 16 + b"\x02" * 16
    pair.server.send_ack(got.chunk.address)
    cev, _ = pair.pump()
    assert [e.address.kind for e in cev if isinstance(e, ChunkAcked)] == [KIND_KV]


def test_a_kv_chunk_is_refused_on_a_version_1_connection() -> None:
    pair = _open_pair(1)
    kv = Chunk(transfer_id=1, layer=0, kind=KIND_KV, codec_id=0, token_start=0, token_count=2,
               layer_tokens=2, params=b"", payload=b"\x01" * 32)
    with pytest.raises(UsageError, match="version 2"):
        pair.client.send_chunk(kv, chunk_frame_size(0, 32))
    # A peer that sends one anyway breaks version 1: PROTOCOL_ERROR, whatever its size.
    for size in (32, 256 * 1024):
        pair = _open_pair(1)
        raw = frame_bytes(Chunk(transfer_id=1, layer=0, kind=KIND_KV, codec_id=0, token_start=0,
                                token_count=size // 16, layer_tokens=size // 16, params=b"", payload=bytes(size)))
        pair.server.receive_data(raw)
        closed = []
        while (e := pair.server.next_event()) is not None:
            closed += [e] if isinstance(e, ConnectionClosed) else []
        assert closed and closed[0].code == ErrorCode.PROTOCOL_ERROR and "K (0) or V (1)" in closed[0].message


def test_transfer_flow_and_credit_accounting() -> None:
    pair = MemoryPair.create()
    pair.handshake()
    c, s = pair.client, pair.server
    credit0 = c.send_credit
    c.send_begin(BEGIN)
    _, sev = pair.pump()
    assert isinstance(sev[-1], TransferBegun)
    s.send_accept(1, 1)
    cev, _ = pair.pump()
    assert cev[-1] == TransferAccepted(transfer_id=1, layer_limit=1)
    ch = chunk()
    size = chunk_frame_size(0, len(ch.payload))
    c.send_chunk(ch, size)
    assert c.send_credit == credit0 - size
    _, sev = pair.pump()
    [rec] = [e for e in sev if isinstance(e, ChunkReceived)]
    assert rec.wire_size == size and bytes(rec.chunk.payload) == bytes(ch.payload)
    assert s.recv_unacked == size
    s.send_ack(rec.chunk.address)
    s.send_credit_frame(1, 2)
    cev, _ = pair.pump()
    assert ChunkAcked(address=ch.address, wire_size=size) in cev
    assert CreditGranted(transfer_id=1, layer_limit=2) in cev
    assert c.send_credit == credit0 and s.recv_unacked == 0


def test_sending_beyond_credit_is_a_flow_control_error() -> None:
    pair = MemoryPair.create(server_config=ConnectionConfig(secret=b"test-secret", window=1 << 16, max_frame_size=1 << 16))
    pair.handshake()
    # A client that ignores its credit: write frames directly.
    big = Chunk(transfer_id=1, layer=0, kind=0, codec_id=0, token_start=0, token_count=1,
                layer_tokens=1, params=b"", payload=b"x" * 40000)
    pair.server.receive_data(frame_bytes(big) + frame_bytes(big))
    events = []
    while (e := pair.server.next_event()) is not None:
        events.append(e)
    assert isinstance(events[-1], ConnectionClosed)
    assert events[-1].code == ErrorCode.FLOW_CONTROL_ERROR


def test_ack_for_unknown_chunk_is_a_protocol_error() -> None:
    pair = MemoryPair.create()
    pair.handshake()
    pair.client.receive_data(frame_bytes(Ack(transfer_id=9, layer=0, kind=0, token_start=0)))
    events = []
    while (e := pair.client.next_event()) is not None:
        events.append(e)
    assert isinstance(events[-1], ConnectionClosed)
    assert events[-1].code == ErrorCode.PROTOCOL_ERROR


def test_goaway_carries_the_typed_error() -> None:
    pair = MemoryPair.create()
    pair.handshake()
    pair.server.close(ErrorCode.LIMIT_EXCEEDED, "too many")
    cev, _ = pair.pump()
    closed = cev[-1]
    assert isinstance(closed, ConnectionClosed) and closed.by_peer
    assert closed.code == ErrorCode.LIMIT_EXCEEDED and "too many" in closed.message


ALL_FRAMES = [
    Hello(min_version=1, max_version=1, nonce=b"n" * 32, session_id=bytes(16), stream_index=0,
          max_frame_size=1 << 22, codecs=("raw",), fingerprint=bytes(16)),
    Challenge(version=1, nonce=b"c" * 32),
    Auth(proof=b"p" * 32),
    Welcome(session_id=b"s" * 16, max_frame_size=1 << 22, window=1 << 25, max_transfers=1,
            codecs=("raw",), proof=b"w" * 32),
    BEGIN, Accept(transfer_id=1, layer_limit=1), chunk(), Ack(transfer_id=1, layer=0, kind=0, token_start=0),
    Credit(transfer_id=1, layer_limit=1), Reset(transfer_id=1, code=1, message=""), Ping(opaque=1),
    Pong(opaque=1), Report(transport_ns_per_mib=1, decode=(DecodeCost(codec_id=1, ns_per_melem=2),)),
]


def _connection_in(state: State) -> Connection:
    pair = MemoryPair.create()
    if state is State.CLIENT_IDLE:
        return pair.client
    if state is State.SERVER_AWAIT_HELLO:
        return pair.server
    pair.client.initiate()
    if state is State.CLIENT_HELLO_SENT:
        return pair.client
    pair._move(pair.client, pair.server, True)
    if state is State.SERVER_CHALLENGE_SENT:
        return pair.server
    pair._move(pair.server, pair.client, False)
    if state is State.CLIENT_AUTH_SENT:
        return pair.client
    pair._move(pair.client, pair.server, True)
    if state is State.SERVER_AUTHENTICATED:
        return pair.server
    raise AssertionError(state)


@pytest.mark.parametrize("state", [s for s in State if s not in (State.OPEN, State.CLOSED)])
@pytest.mark.parametrize("frame", ALL_FRAMES, ids=lambda f: type(f).__name__)
def test_every_frame_not_in_the_table_is_a_protocol_error(state: State, frame: object) -> None:
    conn = _connection_in(state)
    assert conn.state is state
    while conn.next_event() is not None:
        pass
    conn.receive_data(frame_bytes(frame))  # type: ignore[arg-type]
    events = []
    while (e := conn.next_event()) is not None:
        events.append(e)
    if (state, type(frame)) in TRANSITIONS:
        return  # a legal input: covered by the handshake tests
    assert conn.state is State.CLOSED
    closed = events[-1]
    assert isinstance(closed, ConnectionClosed)
    assert isinstance(closed.error, ProtocolError | AuthenticationError)


@pytest.mark.parametrize("role", [Role.CLIENT, Role.SERVER])
@pytest.mark.parametrize("frame", ALL_FRAMES, ids=lambda f: type(f).__name__)
def test_open_state_accepts_only_the_peer_roles_frames(role: Role, frame: object) -> None:
    pair = MemoryPair.create()
    pair.handshake()
    conn = pair.client if role is Role.CLIENT else pair.server
    if role is Role.SERVER and isinstance(frame, Chunk):
        pass
    conn.receive_data(frame_bytes(frame))  # type: ignore[arg-type]
    events = []
    while (e := conn.next_event()) is not None:
        events.append(e)
    client_sends = (Begin, Chunk)
    server_sends = (Accept, Credit, Report)
    both = (Reset, Ping, Pong)
    legal = isinstance(frame, both) or (
        role is Role.SERVER and isinstance(frame, client_sends)
    ) or (role is Role.CLIENT and isinstance(frame, server_sends))
    if legal:
        assert conn.state is State.OPEN, events
    else:
        assert conn.state is State.CLOSED
        assert isinstance(events[-1], ConnectionClosed)


def test_report_goes_from_server_to_client_only() -> None:
    pair = MemoryPair.create()
    report = Report(transport_ns_per_mib=5, decode=(DecodeCost(codec_id=3, ns_per_melem=9),))
    with pytest.raises(UsageError):
        pair.server.send_report(report)  # not open yet
    pair.handshake()
    with pytest.raises(UsageError):
        pair.client.send_report(report)
    pair.server.send_report(report)
    cev, _ = pair.pump()
    assert [e for e in cev if isinstance(e, ReportReceived)] == [ReportReceived(report=report)]
    assert pair.client.state is State.OPEN and pair.server.state is State.OPEN
    pair.server.close()
    pair.pump()
    pair.server.send_report(report)  # closed: dropped, like any send
    assert not pair.server.data_to_send()


def test_the_client_times_hello_to_challenge_when_given_now() -> None:
    cfg = ConnectionConfig(secret=b"test-secret")
    client, server = Connection(Role.CLIENT, cfg, now=10.0), Connection(Role.SERVER, cfg, now=10.0)
    client.initiate()
    server.receive_data(b"".join(bytes(p) for p in client.data_to_send()), now=10.01)
    client.receive_data(b"".join(bytes(p) for p in server.data_to_send()), now=10.03)  # CHALLENGE
    server.receive_data(b"".join(bytes(p) for p in client.data_to_send()), now=10.04)  # AUTH
    while server.next_event() is not None:
        pass
    server.welcome(b"S" * 16, ("raw",))
    client.receive_data(b"".join(bytes(p) for p in server.data_to_send()), now=10.06)
    [done] = [e for e in iter(client.next_event, None) if isinstance(e, HandshakeComplete)]
    assert done.hello_rtt == pytest.approx(0.03)  # HELLO at 10.0, CHALLENGE at 10.03
    pair = MemoryPair.create()  # no ``now`` passed with the bytes: not timed
    pair.handshake()
    assert [e.hello_rtt for e in pair.client_events if isinstance(e, HandshakeComplete)] == [None]


def test_eof_mid_handshake_is_connection_lost() -> None:
    from kvwire.errors import ConnectionLostError

    pair = MemoryPair.create()
    pair.client.initiate()
    pair.pump()
    pair.client.receive_data(b"")
    ev = [e for e in [*pair.client_events, pair.client.next_event()] if isinstance(e, ConnectionClosed)]
    assert isinstance(ev[-1].error, ConnectionLostError)


def test_goaway_frame_from_unauthenticated_peer_reveals_nothing() -> None:
    server = Connection(Role.SERVER, ConnectionConfig(secret=b"test-secret"))
    server.receive_data(b"GET / HTTP/1.1\r\n\r\n")
    out = b"".join(bytes(p) for p in server.data_to_send())
    from kvwire.wire import FrameDecoder

    [(goaway, _)] = FrameDecoder(1 << 16).feed(out)
    assert isinstance(goaway, GoAway) and goaway.message == ""


def test_idle_timer_pings_then_closes() -> None:
    cfg = ConnectionConfig(secret=b"test-secret", idle_timeout=10.0)
    pair = MemoryPair.create(client_config=cfg, server_config=cfg, now=0.0)
    pair.handshake()
    c = pair.client
    assert c.get_timer() == 5.0  # half the idle timeout after the last byte (t=0)
    c.handle_timer(4.9)
    assert not c.data_to_send()
    c.handle_timer(5.0)
    out = b"".join(bytes(p) for p in c.data_to_send())
    assert out[0] == 0x20  # PING
    assert c.get_timer() == 10.0  # waiting for any byte until the full timeout
    # the server answers (PONG): the timer restarts from the answer
    pair.server.receive_data(out, now=5.0)
    pong = b"".join(bytes(p) for p in pair.server.data_to_send())
    c.receive_data(pong, now=5.5)
    assert c.get_timer() == 10.5
    c.handle_timer(10.5)
    assert bytes(c.data_to_send()[0])[0] == 0x20  # pinged again: nothing arrived since 5.5
    c.handle_timer(15.4)
    assert c.state is State.OPEN  # still within the timeout
    c.handle_timer(15.5)
    assert c.state is State.CLOSED
    closed = [e for e in iter(c.next_event, None) if isinstance(e, ConnectionClosed)][-1]
    assert isinstance(closed.error, TransferTimeoutError)
    assert c.get_timer() is None


def test_pings_while_output_is_blocked_are_answered_once_with_the_latest_when_it_drains() -> None:
    """A peer that floods PINGs and reads nothing: while this side's writes are backed up
    it queues no PONG per PING (the flood would grow its memory without bound), and
    answers the latest once they drain; then it answers each PING at once again."""
    from kvwire.wire import FrameDecoder

    pair = MemoryPair.create()
    pair.handshake()
    c = pair.client
    c.set_output_blocked(True)
    c.receive_data(b"".join(frame_bytes(Ping(opaque=i)) for i in range(1, 10_001)), now=1.0)
    assert not c.data_to_send() and c.state is State.OPEN
    c.set_output_blocked(False)
    frames = [f for f, _ in FrameDecoder(1 << 16).feed(b"".join(bytes(p) for p in c.data_to_send()))]
    assert frames == [Pong(opaque=10_000)]
    c.set_output_blocked(False)  # nothing more is owed
    assert not c.data_to_send()
    c.receive_data(frame_bytes(Ping(opaque=7)), now=2.0)
    frames = [f for f, _ in FrameDecoder(1 << 16).feed(b"".join(bytes(p) for p in c.data_to_send()))]
    assert frames == [Pong(opaque=7)]


def test_no_idle_timeout_means_no_timer() -> None:
    cfg = ConnectionConfig(secret=b"test-secret", idle_timeout=None)
    pair = MemoryPair.create(client_config=cfg, server_config=cfg)
    pair.handshake()
    assert pair.client.get_timer() is None and pair.server.get_timer() is None


def test_a_chunk_head_started_after_the_frames_before_it_fails_the_connection_if_impossible() -> None:
    """start_deferred(): a CHUNK head read behind a PING is started once the PING was
    handled; one whose params are longer than its body is read to its CRC, then fails the
    connection with PROTOCOL_ERROR (the CRC holds: the peer sent it that way)."""
    from kvwire.errors import ProtocolError
    from kvwire.wire import PingReceived
    from kvwire.wire.crc import crc32c
    from kvwire.wire.frames import CHUNK_FIXED, CRC, HEADER, FrameType

    pair = MemoryPair.create()
    pair.handshake()
    conn = pair.server
    conn.set_payload_sink(lambda head, size: memoryview(bytearray(size)))
    # A body just over the 64 KiB that makes a frame big, params of 65535 bytes in it.
    body = CHUNK_FIXED.pack(1, 0, 0, 0, 0, 1, 1, 65535)
    body += bytes(65540 - len(body))
    header = HEADER.pack(FrameType.CHUNK, 0, 0, len(body))
    bad_head = header + body[: CHUNK_FIXED.size]
    data = frame_bytes(Ping(opaque=4)) + bad_head
    buf = conn.get_buffer()
    buf[: len(data)] = data
    assert conn.buffer_updated(len(data), now=1.0)
    assert conn.next_event() == PingReceived(opaque=4) and conn.state is State.OPEN
    assert not conn.start_deferred(now=1.0)  # its body is still to come
    rest = memoryview(body[CHUNK_FIXED.size :] + CRC.pack(crc32c(body, crc32c(header))))
    while rest and conn.state is State.OPEN:
        buf = conn.get_buffer()
        n = min(len(buf), len(rest))
        buf[:n] = rest[:n]
        rest = rest[n:]
        conn.buffer_updated(n, now=1.0)
    events = []
    while (e := conn.next_event()) is not None:
        events.append(e)
    assert isinstance(events[-1], ConnectionClosed) and isinstance(events[-1].error, ProtocolError)
    assert events[-1].code == ErrorCode.PROTOCOL_ERROR
    assert conn.state is State.CLOSED and not conn.start_deferred(now=1.0)


def test_start_deferred_with_nothing_waiting_changes_nothing() -> None:
    pair = MemoryPair.create()
    pair.handshake()
    assert not pair.server.start_deferred(now=1.0)
    assert pair.server.next_event() is None and pair.server.state is State.OPEN


def test_a_reset_never_carries_no_error() -> None:
    """A local error with no wire code (ConnectionLostError: a lost connection, a server
    closing) gave RESET(NO_ERROR), which a peer takes for PROTOCOL_ERROR (4.9): it goes
    out as CANCELLED, the transfer given up."""
    pair = _open_pair(2)
    pair.client.send_reset(7, ErrorCode.NO_ERROR, "server closed")
    pair.client.send_reset(8, ErrorCode.TIMEOUT, "late")
    pair.pump()
    resets = [ev for ev in pair.server_events if isinstance(ev, TransferReset)]
    assert [(r.transfer_id, r.code) for r in resets] == [(7, ErrorCode.CANCELLED), (8, ErrorCode.TIMEOUT)]


@pytest.mark.parametrize("same_read", [True, False])
def test_frames_read_with_a_later_corrupt_frame_are_handled_before_the_connection_fails(same_read: bool) -> None:
    """A RESET and a PING, then a frame whose CRC does not hold (line noise): the receiver
    handles the frames before the failing one, in order, then fails (docs/protocol.md
    3.4), whether they came in one read or in several.  (In one read they were dropped
    with the bad frame: the transfer the sender had reset was left to be delivered.)"""
    pair = _open_pair(2)
    bad = bytearray(frame_bytes(Ping(opaque=9)))
    bad[-1] ^= 0x01
    parts = [frame_bytes(Reset(transfer_id=1, code=int(ErrorCode.CANCELLED), message="sender cancelled")),
             frame_bytes(Ping(opaque=7)), bytes(bad)]
    for data in ([b"".join(parts)] if same_read else parts):
        pair.server.receive_data(data)
    events = []
    while (e := pair.server.next_event()) is not None:
        events.append(e)
    assert [type(e) for e in events] == [TransferReset, PingReceived, ConnectionClosed]
    assert events[0].transfer_id == 1 and events[2].code == ErrorCode.INTEGRITY_ERROR
    # the PING was answered and the GOAWAY sent after it, in that order
    answered = FrameDecoder(1 << 20).feed(b"".join(bytes(b) for b in pair.server.data_to_send()))
    assert [type(f) for f, _ in answered] == [Pong, GoAway]
