"""A bounded, Hypothesis-driven fuzz of the server side of the sans-IO core.

The long-running variant lives in fuzz/ (atheris).  Here:

- random byte strings, split arbitrarily, fed to a fresh server ``Connection``;
- a valid HELLO (or a complete authenticated handshake) followed by mutated streams of
  well-formed frames with random field values (bit flips, truncation, insertions);

and the properties: nothing ever escapes ``receive_data`` (errors become one
``ConnectionClosed`` event), the state afterwards is CLOSED or a valid server state, the
shell's follow-up calls (welcome, accept, ack, timers) do not raise, and
``FrameDecoder.feed`` raises nothing but :class:`kvwire.ProtocolError`.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import kvwire
from kvwire.wire import (
    Ack,
    Auth,
    Begin,
    BlockVersion,
    Challenge,
    Chunk,
    ChunkReceived,
    ClientAuthenticated,
    Connection,
    ConnectionClosed,
    ConnectionConfig,
    Credit,
    DecodeCost,
    FrameDecoder,
    GoAway,
    Hello,
    Ping,
    Pong,
    Report,
    Reset,
    Role,
    State,
    TransferBegun,
    Welcome,
    frame_bytes,
)
from kvwire.wire.frames import HANDSHAKE_MAX_BODY

pytestmark = pytest.mark.timeout(120)

SECRET = b"fuzz-secret-0123"
MAX_FRAME = 64 * 1024
SERVER_STATES = {
    State.SERVER_AWAIT_HELLO, State.SERVER_CHALLENGE_SENT, State.SERVER_AUTHENTICATED,
    State.OPEN, State.CLOSED,
}
FUZZ = settings(
    max_examples=300, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def fixed_nonce(n: int) -> bytes:
    return b"\x5a" * n


def new_server() -> Connection:
    cfg = ConnectionConfig(secret=SECRET, max_frame_size=MAX_FRAME, window=2 * MAX_FRAME, max_transfers=4,
                           handshake_timeout=10.0)
    return Connection(Role.SERVER, cfg, now=0.0, nonce_source=fixed_nonce)


def _handshake_bytes() -> tuple[bytes, bytes]:
    """HELLO and AUTH of a real client against a server with fixed nonces (so the same
    bytes authenticate every fresh ``new_server()``)."""
    client = Connection(Role.CLIENT, ConnectionConfig(secret=SECRET), nonce_source=fixed_nonce)
    client.initiate()
    hello = b"".join(bytes(p) for p in client.data_to_send())
    server = new_server()
    server.receive_data(hello)
    client.receive_data(b"".join(bytes(p) for p in server.data_to_send()))
    auth = b"".join(bytes(p) for p in client.data_to_send())
    server.receive_data(auth)
    assert isinstance(server.next_event(), ClientAuthenticated)
    return hello, auth


HELLO, AUTH = _handshake_bytes()


class Shell:
    """What kvwire.aio does with a server connection's events, minus the I/O."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.events: list[Any] = []

    def feed(self, data: bytes) -> None:
        self.conn.receive_data(data)  # must never raise
        self.pump()

    def pump(self) -> None:
        conn = self.conn
        while (ev := conn.next_event()) is not None:
            self.events.append(ev)
            if isinstance(ev, ClientAuthenticated):
                # a frame pipelined behind AUTH may already have closed the connection
                if conn.state is State.SERVER_AUTHENTICATED:
                    conn.welcome(b"S" * 16, ("raw",))
            elif isinstance(ev, TransferBegun):
                conn.send_accept(ev.frame.transfer_id, 1)
            elif isinstance(ev, ChunkReceived):
                conn.send_ack(ev.chunk.address)
        conn.data_to_send()

    def check(self) -> None:
        conn = self.conn
        assert conn.state in SERVER_STATES
        closed = [e for e in self.events if isinstance(e, ConnectionClosed)]
        assert len(closed) <= 1
        if conn.state is State.CLOSED:
            assert len(closed) == 1 and closed[-1] is self.events[-1]
            ev = closed[0]
            assert ev.error is None or isinstance(ev.error, kvwire.KvwireError)
            assert isinstance(ev.code, int)
        else:
            assert not closed
            # the decoder never holds more than one maximal frame
            limit = MAX_FRAME if conn.state is State.OPEN else HANDSHAKE_MAX_BODY
            assert conn._decoder.buffered <= limit + 12
        conn.handle_timer(1e9)  # past every deadline: must close cleanly, not raise
        self.pump()
        assert conn.get_timer() is None or conn.state is not State.CLOSED


def authenticated_shell() -> Shell:
    shell = Shell(new_server())
    shell.feed(HELLO)
    shell.feed(AUTH)
    assert shell.conn.state is State.OPEN, shell.events
    return shell


# -- strategies ---------------------------------------------------------------------------

u8 = st.integers(0, 0xFF)
u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 0xFFFFFFFF)
u64 = st.integers(0, 2**64 - 1)
small_text = st.text(max_size=20)
small_bytes = st.binary(max_size=64)

begins = st.builds(
    Begin, transfer_id=u64, num_layers=u16, num_kv_heads=u16, head_dim=u16, dtype_id=u8,
    model=small_text, request_id=small_text, meta=small_bytes,
    blocks=st.lists(st.builds(BlockVersion, block=st.binary(max_size=8), version=u64), max_size=3).map(tuple),
)
chunks = st.builds(
    Chunk, transfer_id=st.one_of(st.integers(0, 3), u64), layer=st.one_of(st.integers(0, 3), u16),
    kind=st.integers(0, 3), codec_id=st.one_of(st.integers(0, 8), u8),  # 2: KV (version 2), 3: unknown
    token_start=st.one_of(st.integers(0, 64), u32), token_count=st.one_of(st.integers(0, 64), u32),
    layer_tokens=st.one_of(st.integers(0, 64), u32), params=st.binary(max_size=16),
    payload=st.binary(max_size=256),
)
frames = st.one_of(
    begins,
    chunks,
    st.builds(Ack, transfer_id=u64, layer=u16, kind=u8, token_start=u32),
    st.builds(Credit, transfer_id=u64, layer_limit=u32),
    st.builds(Reset, transfer_id=u64, code=u16, message=small_text),
    st.builds(Ping, opaque=u64),
    st.builds(Pong, opaque=u64),
    st.builds(Report, transport_ns_per_mib=u32, decode=st.dictionaries(u8, u32, max_size=4).map(
        lambda d: tuple(DecodeCost(codec_id=c, ns_per_melem=v) for c, v in d.items()))),
    st.builds(GoAway, code=u16, message=small_text),
    st.builds(Challenge, version=u16, nonce=st.binary(min_size=32, max_size=32)),
    st.builds(Auth, proof=st.binary(min_size=32, max_size=32)),
    st.builds(
        Welcome, session_id=st.binary(min_size=16, max_size=16), max_frame_size=u32, window=u64,
        max_transfers=u32, codecs=st.lists(st.text(max_size=8), max_size=3).map(tuple),
        proof=st.binary(min_size=32, max_size=32),
    ),
    st.builds(
        Hello, min_version=u16, max_version=u16, nonce=st.binary(min_size=32, max_size=32),
        session_id=st.binary(min_size=16, max_size=16), stream_index=u16, max_frame_size=u32,
        codecs=st.lists(st.text(max_size=8), max_size=3).map(tuple),
        fingerprint=st.binary(min_size=16, max_size=16),
    ),
)


def _encode(f: Any) -> bytes:
    try:
        return frame_bytes(f)
    except kvwire.ProtocolError:  # a field the encoder refuses (too long): skip it
        return b""


frame_streams = st.lists(frames, min_size=1, max_size=8).map(lambda fs: b"".join(_encode(f) for f in fs))


@st.composite
def mutated(draw: st.DrawFn, base: st.SearchStrategy[bytes]) -> bytes:
    data = bytearray(draw(base))
    for _ in range(draw(st.integers(0, 4))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "delete", "duplicate"]))
        if not data:
            data += draw(st.binary(min_size=1, max_size=16))
            continue
        i = draw(st.integers(0, len(data) - 1))
        if op == "flip":
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "truncate":
            del data[i:]
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete":
            del data[i : i + draw(st.integers(1, 16))]
        else:
            j = draw(st.integers(i, min(len(data), i + 64)))
            data[j:j] = data[i:j]
    return bytes(data)


splits = st.lists(st.integers(1, 97), min_size=1, max_size=6)


def pieces(data: bytes, cuts: list[int]) -> list[bytes]:
    out, pos, k = [], 0, 0
    while pos < len(data):
        n = cuts[k % len(cuts)]
        out.append(data[pos : pos + n])
        pos += n
        k += 1
    return out


# -- properties ---------------------------------------------------------------------------


@FUZZ
@given(st.lists(st.binary(max_size=300), max_size=8))
def test_random_bytes_never_escape_a_fresh_server(chunks_in: list[bytes]) -> None:
    shell = Shell(new_server())
    for data in chunks_in:
        if data:
            shell.feed(data)
    shell.check()
    assert shell.conn.state is not State.OPEN  # random bytes never authenticate


@FUZZ
@given(mutated(frame_streams), splits)
def test_mutated_frames_after_hello_never_escape(data: bytes, cuts: list[int]) -> None:
    shell = Shell(new_server())
    shell.feed(HELLO)
    assert shell.conn.state is State.SERVER_CHALLENGE_SENT
    for piece in pieces(data, cuts):
        shell.feed(piece)
    shell.check()
    assert shell.conn.state is not State.OPEN  # without the right AUTH nothing opens


@FUZZ
@given(mutated(frame_streams), splits)
def test_mutated_frames_after_authentication_never_escape(data: bytes, cuts: list[int]) -> None:
    shell = authenticated_shell()
    for piece in pieces(data, cuts):
        shell.feed(piece)
    shell.check()


@FUZZ
@given(st.lists(frames, min_size=1, max_size=12), splits)
def test_well_formed_frames_in_any_order_after_authentication(fs: list[Any], cuts: list[int]) -> None:
    """Unmutated frames with random fields: every CRC passes, so the state machine and
    every frame handler see them."""
    shell = authenticated_shell()
    data = b"".join(_encode(f) for f in fs)
    for piece in pieces(data, cuts):
        shell.feed(piece)
    shell.check()


@FUZZ
@given(st.one_of(st.binary(max_size=2000), mutated(frame_streams)), splits, st.sampled_from([16, 1024, HANDSHAKE_MAX_BODY, MAX_FRAME]))
@example(  # a whole frame, then one whose header is over the limit, in one read
    data=bytes.fromhex("130000000000001000000000000000000000000000000000267cb133"
                       "0000000000000011000000000000000000000000000000000000000000"),
    cuts=[57],
    max_body=16,
)
def test_frame_decoder_raises_only_protocol_error(data: bytes, cuts: list[int], max_body: int) -> None:
    dec = FrameDecoder(max_body)
    for piece in pieces(data, cuts):
        try:
            got = dec.feed(piece)
        except kvwire.ProtocolError:
            return
        for _frame, size in got:
            assert size >= 12
        try:  # a frame that failed after those it returned: they are processed, then this
            dec.raise_pending()
        except kvwire.ProtocolError:
            with pytest.raises(kvwire.ProtocolError):
                dec.feed(b"\0")  # and nothing after it is decoded
            return
        assert dec.buffered <= max_body + 12
