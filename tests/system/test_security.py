"""Security over real loopback sockets: TLS, mutual TLS, the HMAC handshake, replay,
unauthenticated garbage and slow or silent clients.

Certificates come from a throwaway CA made by ``trustme`` for each test run.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import random
import socket
import ssl
from typing import Any

import pytest
import trustme

import kvwire
from kvwire.errors import ErrorCode
from kvwire.testing.memory import MemoryPair
from kvwire.wire import (
    Auth,
    Challenge,
    ClientAuthenticated,
    Connection,
    ConnectionClosed,
    ConnectionConfig,
    FrameDecoder,
    GoAway,
    HandshakeComplete,
    Hello,
    Role,
    State,
    Welcome,
)
from kvwire.wire.frames import HANDSHAKE_MAX_BODY, HEADER, FrameType
from tests.conftest import SECRET, make_layers, same_cache
from tests.rawpeer import read_one_frame, wait_until
from tests.system.loop_helpers import loop_errors
from tests.system.tls_helpers import client_context, server_context

pytestmark = pytest.mark.timeout(60)

SPEC = kvwire.KVSpec(num_layers=2, num_kv_heads=2, head_dim=16)


# -- helpers ----------------------------------------------------------------------------


async def transfer_ok(server: kvwire.Server, rid: str, *, seed: int = 0, port: int | None = None, **kw: Any) -> bool:
    """One small transfer (through ``port`` if given); True when it arrived bit-identical."""
    layers = make_layers(SPEC.num_layers, 40, SPEC.num_kv_heads, SPEC.head_dim, seed=seed)
    async with kvwire.connect("127.0.0.1", port or server.port, secret=kw.pop("secret", SECRET), **kw) as peer:
        await peer.send(rid, SPEC, layers, timeout=10)
    t = await server.expect(rid, timeout=10)
    cache = await t.collect(timeout=10)
    return same_cache(cache.layers, layers)


async def read_frames(reader: asyncio.StreamReader, *, until: float = 5.0) -> tuple[list[Any], bool]:
    """Frames the server sends until it closes the connection (True) or ``until`` seconds
    pass (False)."""
    dec = FrameDecoder(1 << 20)
    frames: list[Any] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + until
    while True:
        left = deadline - loop.time()
        if left <= 0:
            return frames, False
        try:
            data = await asyncio.wait_for(reader.read(65536), left)
        except TimeoutError:
            return frames, False
        except ConnectionResetError:
            return frames, True
        if not data:
            return frames, True
        frames.extend(f for f, _ in dec.feed(data))


def goaway_of(frames: list[Any]) -> GoAway:
    goaways = [f for f in frames if isinstance(f, GoAway)]
    assert goaways, f"no GOAWAY among {frames}"
    return goaways[-1]


class RecordingProxy:
    """A TCP proxy on 127.0.0.1 that records both directions of every connection."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.forward: list[bytearray] = []
        self.backward: list[bytearray] = []
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []
        self.port = 0

    async def __aenter__(self) -> RecordingProxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for w in self._writers:
            w.close()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5)
        await self._server.wait_closed()

    async def _handle(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        fwd, back = bytearray(), bytearray()
        self.forward.append(fwd)
        self.backward.append(back)
        sreader, swriter = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers += [cwriter, swriter]

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter, rec: bytearray) -> None:
            try:
                while data := await r.read(65536):
                    rec += data
                    w.write(data)
                    await w.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                w.close()

        try:
            await asyncio.gather(pipe(creader, swriter, fwd), pipe(sreader, cwriter, back))
        finally:
            self._tasks.discard(task)
            for w in (cwriter, swriter):
                w.close()


def split_frames(data: bytes) -> list[tuple[Any, bytes]]:
    """Each frame of a recorded byte stream with its exact wire bytes."""
    dec = FrameDecoder(1 << 30)
    out = []
    pos = 0
    for frame, size in dec.feed(data):
        out.append((frame, data[pos : pos + size]))
        pos += size
    return out


# -- TLS ----------------------------------------------------------------------------------


async def test_tls_transfer_arrives_bit_identical(ca: trustme.CA, server_cert: trustme.LeafCert) -> None:
    async with loop_errors() as errors:
        async with kvwire.serve("127.0.0.1", 0, secret=SECRET, ssl=server_context(server_cert)) as server:
            assert await transfer_ok(
                server, "tls", streams=2, ssl=client_context(ca), server_hostname="localhost",
                chunk_bytes=1024,
            )
            # The bytes really went through TLS: the transport is an SSL one.
            async with kvwire.connect(
                "127.0.0.1", server.port, secret=SECRET, ssl=client_context(ca), server_hostname="localhost"
            ) as peer:
                assert peer.streams[0].transport is not None
                assert peer.streams[0].transport.get_extra_info("ssl_object") is not None
    assert errors == []


async def test_tls_transfer_of_large_chunks_arrives_bit_identical(ca: trustme.CA, server_cert: trustme.LeafCert) -> None:
    """4 MiB chunks, written in checksummed pieces, through TLS (where the stream leaves
    SO_RCVLOWAT alone)."""
    spec = kvwire.KVSpec(num_layers=2, num_kv_heads=8, head_dim=128)
    layers = make_layers(2, 3000, 8, 128)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, ssl=server_context(server_cert)) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, ssl=client_context(ca),
                                  server_hostname="localhost") as peer:
            await peer.send("tls-big", spec, layers, timeout=30)
        cache = await (await server.expect("tls-big", timeout=10)).collect(timeout=10)
    assert same_cache(cache.layers, layers)


async def test_tls_paged_transfer_lands_in_the_named_blocks(ca: trustme.CA, server_cert: trustme.LeafCert) -> None:
    """Large chunks over many blocks, through TLS: the stream has no socket of its own to
    scatter-read with, so the payload goes into the blocks one place per read."""
    import numpy as np

    from kvwire.paged import PagedDestination, PagedSource, PagedSpec

    spec = PagedSpec(num_layers=2, block_shape=(2, 4, 8, 64), dtype="float16")  # 8 KiB blocks
    rng = np.random.default_rng(5)
    src = [rng.standard_normal((40, *spec.block_shape), dtype=np.float32).astype(np.float16) for _ in range(2)]
    dst = [np.zeros_like(c) for c in src]
    src_ids, dst_ids = rng.choice(40, 32, replace=False), rng.choice(40, 32, replace=False)
    dest = PagedDestination(spec, dst, dst_ids)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, ssl=server_context(server_cert)) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, ssl=client_context(ca),
                                  server_hostname="localhost", chunk_bytes=96 * 1024) as peer:
            waiting = asyncio.create_task(server.expect("tls-paged", into=dest, timeout=10))
            await asyncio.sleep(0)
            await peer.send("tls-paged", spec.wire_spec(), PagedSource(spec, src, src_ids), timeout=30)
            transfer = await waiting
            assert len([layer async for layer in transfer]) == 2
    for li in range(2):
        assert dst[li][dst_ids].tobytes() == src[li][src_ids].tobytes()


async def test_mutual_tls_transfer(ca: trustme.CA, server_cert: trustme.LeafCert) -> None:
    client_cert = ca.issue_cert("client.kvwire.test")
    async with loop_errors() as errors:
        async with kvwire.serve("127.0.0.1", 0, secret=SECRET, ssl=server_context(server_cert, ca)) as server:
            assert await transfer_ok(
                server, "mtls", ssl=client_context(ca, client_cert), server_hostname="localhost",
            )
    assert errors == []


async def test_client_without_certificate_is_refused_by_mtls_server(ca: trustme.CA, server_cert: trustme.LeafCert) -> None:
    async with loop_errors() as errors:
        async with kvwire.serve("127.0.0.1", 0, secret=SECRET, ssl=server_context(server_cert, ca)) as server:
            for ctx in (client_context(ca), client_context(ca, trustme.CA().issue_cert("stranger"))):
                with pytest.raises(kvwire.KvwireError) as info:
                    await asyncio.wait_for(_connect_and_send(server.port, ctx, "nocert"), 10)
                assert not isinstance(info.value, ssl.SSLError) and type(info.value).__module__ == "kvwire.errors"
            assert server.statistics()["transfers_accepted"] == 0
            assert server.statistics()["sessions"] == 0
            # and the server keeps serving clients with a certificate
            assert await transfer_ok(
                server, "after", ssl=client_context(ca, ca.issue_cert("client")), server_hostname="localhost",
            )
    assert errors == []


async def _connect_and_send(port: int, ctx: ssl.SSLContext | None, rid: str, **kw: Any) -> None:
    async with kvwire.connect(
        "127.0.0.1", port, secret=SECRET, ssl=ctx, server_hostname="localhost" if ctx else None,
        connect_timeout=3, **kw,
    ) as peer:
        await peer.send(rid, SPEC, make_layers(2, 8, 2, 16), timeout=3)


async def test_plain_client_against_tls_server_fails_cleanly(ca: trustme.CA, server_cert: trustme.LeafCert) -> None:
    async with loop_errors() as errors:
        async with kvwire.serve(
            "127.0.0.1", 0, secret=SECRET, ssl=server_context(server_cert), handshake_timeout=1.0,
        ) as server:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            with pytest.raises(kvwire.KvwireError) as info:
                await asyncio.wait_for(_connect_and_send(server.port, None, "plain"), 10)
            assert not isinstance(info.value, ssl.SSLError) and type(info.value).__module__ == "kvwire.errors"
            assert loop.time() - t0 < 10  # bounded: the wait_for above did not fire
            assert await transfer_ok(server, "tls-ok", ssl=client_context(ca), server_hostname="localhost")
    assert errors == []


async def test_tls_client_against_plain_server_fails_cleanly(ca: trustme.CA) -> None:
    async with loop_errors() as errors:
        async with kvwire.serve("127.0.0.1", 0, secret=SECRET, handshake_timeout=1.0) as server:
            with pytest.raises(kvwire.KvwireError) as info:
                await asyncio.wait_for(_connect_and_send(server.port, client_context(ca), "tls"), 10)
            assert not isinstance(info.value, ssl.SSLError) and type(info.value).__module__ == "kvwire.errors"
            assert await transfer_ok(server, "plain-ok")
    assert errors == []


async def test_tls_client_rejects_server_with_untrusted_certificate(server_cert: trustme.LeafCert) -> None:
    other_ca = trustme.CA()
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, ssl=server_context(server_cert)) as server:
        with pytest.raises(kvwire.AuthenticationError):
            await asyncio.wait_for(_connect_and_send(server.port, client_context(other_ca), "x"), 10)
        assert server.statistics()["sessions"] == 0


async def test_the_server_handshake_deadline_counts_from_the_tcp_accept_and_covers_tls(
    ca: trustme.CA, server_cert: trustme.LeafCert,
) -> None:
    """One deadline covers the TLS and the kvwire handshake (protocol.md 5.8, 5.9): the
    server made it when TLS was done, so a client that took its time over TLS had a whole
    handshake_timeout more for the kvwire handshake (a WELCOME at 7 s with 4 s)."""
    timeout, delay = 10.0, 2.0
    async with kvwire.serve(
        "127.0.0.1", 0, secret=SECRET, ssl=server_context(server_cert), handshake_timeout=timeout,
    ) as server:
        loop = asyncio.get_running_loop()
        sock = socket.socket()
        sock.setblocking(False)
        await loop.sock_connect(sock, ("127.0.0.1", server.port))
        connected = loop.time()
        await asyncio.sleep(delay)  # the client begins TLS late
        _, writer = await asyncio.open_connection(sock=sock, ssl=client_context(ca), server_hostname="localhost")
        try:
            assert await wait_until(lambda: len(server._by_cid) == 1, 5)
            [conn] = [server.core.connection(cid) for cid in server._by_cid]
            assert conn is not None and conn.state is State.SERVER_AWAIT_HELLO
            deadline = conn.get_timer()
            assert deadline is not None and connected < deadline <= connected + timeout + delay / 2, (
                deadline - connected)
        finally:
            writer.close()


async def test_the_client_handshake_deadline_counts_from_the_tcp_connect_and_covers_tls(
    ca: trustme.CA, server_cert: trustme.LeafCert,
) -> None:
    """connect_timeout bounds the TCP connect, the TLS handshake and the kvwire handshake
    together: the kvwire handshake gets what the TLS handshake left of it."""
    timeout, delay = 10.0, 2.0
    held: list[Any] = []
    loop = asyncio.get_running_loop()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)

    async def slow_tls() -> None:
        sock, _ = await loop.sock_accept(listener)
        await asyncio.sleep(delay)  # the client's ClientHello waits in the socket
        tr, _ = await loop.connect_accepted_socket(asyncio.Protocol, sock, ssl=server_context(server_cert))
        held.append(tr)  # then it answers nothing

    serving = asyncio.ensure_future(slow_tls())
    peer = kvwire.connect("127.0.0.1", listener.getsockname()[1], secret=SECRET, ssl=client_context(ca),
                          server_hostname="localhost", connect_timeout=timeout)
    began = loop.time()
    opening = asyncio.ensure_future(peer.open())
    try:
        assert await wait_until(lambda: peer.core.connection(0) is not None, 10)
        conn = peer.core.connection(0)
        assert conn is not None and conn.state is State.CLIENT_HELLO_SENT
        deadline = conn.get_timer()
        assert deadline is not None and began < deadline <= began + timeout + delay / 2, deadline - began
    finally:
        opening.cancel()
        serving.cancel()
        for task in (opening, serving):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for tr in held:
            tr.abort()
        listener.close()


async def test_failed_tls_handshakes_leave_no_server_state(ca: trustme.CA, server_cert: trustme.LeafCert) -> None:
    """Connections that never finish TLS must not stay in the server's books (each would
    be memory an unauthenticated client pins)."""
    async with kvwire.serve(
        "127.0.0.1", 0, secret=SECRET, ssl=server_context(server_cert, ca), handshake_timeout=0.5,
    ) as server:
        for i in range(5):
            with pytest.raises(kvwire.KvwireError):
                await asyncio.wait_for(_connect_and_send(server.port, None, f"p{i}"), 10)
            with pytest.raises(kvwire.KvwireError):
                await asyncio.wait_for(_connect_and_send(server.port, client_context(ca), f"c{i}"), 10)
        # raw TCP connections that never speak TLS at all
        writers = []
        for _ in range(3):
            _, w = await asyncio.open_connection("127.0.0.1", server.port)
            writers.append(w)
        await asyncio.sleep(0.1)
        for w in writers:
            w.close()
        assert await wait_until(lambda: server.statistics()["connections"] == 0, 5), server.statistics()
        assert server.statistics()["sessions"] == 0


# -- the HMAC handshake ---------------------------------------------------------------------


async def test_wrong_secret_is_refused_on_both_sides() -> None:
    async with loop_errors() as errors:
        async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
            # client with the wrong secret: the server refuses it...
            with pytest.raises(kvwire.AuthenticationError):
                await asyncio.wait_for(_wrong_secret_client(server.port), 10)
            # ...and says so on the wire with AUTHENTICATION_FAILED, nothing more
            frames, closed = await _raw_handshake_frames(server.port, b"wrong-secret-xyz")
            g = goaway_of(frames)
            assert g.code == ErrorCode.AUTHENTICATION_FAILED
            assert g.message == "authentication failed"
            assert closed
            assert not any(isinstance(f, Welcome) for f in frames)
            assert server.statistics()["sessions"] == 0
            assert server.statistics()["transfers_accepted"] == 0
        # a server without the secret is refused by the client
        async with kvwire.serve("127.0.0.1", 0, secret=b"another-secret-1") as server:
            with pytest.raises(kvwire.AuthenticationError):
                await asyncio.wait_for(_connect_and_send(server.port, None, "srv"), 10)
    assert errors == []


async def _wrong_secret_client(port: int) -> None:
    async with kvwire.connect("127.0.0.1", port, secret=b"wrong-secret-xyz", connect_timeout=3) as peer:
        await peer.send("bad", SPEC, make_layers(2, 8, 2, 16), timeout=3)


async def _raw_handshake_frames(port: int, secret: bytes) -> tuple[list[Any], bool]:
    """Run a sans-IO client over a raw socket; return what the server sent and whether
    it closed."""
    conn = Connection(Role.CLIENT, ConnectionConfig(secret=secret))
    conn.initiate()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    frames: list[Any] = []
    dec = FrameDecoder(1 << 20)
    try:
        writer.writelines([bytes(p) for p in conn.data_to_send()])
        while True:
            try:
                data = await asyncio.wait_for(reader.read(65536), 5)
            except ConnectionResetError:
                return frames, True
            if not data:
                return frames, True
            frames.extend(f for f, _ in dec.feed(data))
            conn.receive_data(data)
            out = conn.data_to_send()
            if conn.state is State.OPEN:
                return frames, False
            if out and conn.state is not State.CLOSED:
                writer.writelines([bytes(p) for p in out])
    finally:
        writer.close()


def test_wrong_secret_sans_io_both_sides_raise_authentication_error() -> None:
    pair = MemoryPair.create(b"client-secret-1", server_secret=b"server-secret-2")
    pair.client.initiate()
    cev, sev = pair.pump()
    [s_closed] = [e for e in sev if isinstance(e, ConnectionClosed)]
    [c_closed] = [e for e in cev if isinstance(e, ConnectionClosed)]
    assert isinstance(s_closed.error, kvwire.AuthenticationError)
    assert isinstance(c_closed.error, kvwire.AuthenticationError)
    assert not any(isinstance(e, ClientAuthenticated) for e in sev)


def test_proofs_are_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both proofs go through ``hmac.compare_digest`` (never ``==``)."""
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        calls.append((bytes(a), bytes(b)))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    pair = MemoryPair.create(SECRET)
    pair.handshake()
    assert pair.client.state is State.OPEN and pair.server.state is State.OPEN
    proofs = [c for c in calls if len(c[0]) == 32 and c[0] == c[1]]
    assert len(proofs) >= 2, calls  # the client's proof on the server, the server's on the client


async def test_replayed_handshake_is_refused() -> None:
    """HELLO+AUTH recorded from a real successful client, replayed on a new connection."""
    async with loop_errors() as errors, kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with RecordingProxy(server.port) as proxy:
            assert await transfer_ok(server, "original", port=proxy.port)
        recorded = bytes(proxy.forward[0])
        answers = split_frames(bytes(proxy.backward[0]))
        frames = split_frames(recorded)
        assert isinstance(frames[0][0], Hello) and isinstance(frames[1][0], Auth)
        assert isinstance(answers[0][0], Challenge) and isinstance(answers[1][0], Welcome)
        hello_raw, auth_raw = frames[0][1], frames[1][1]
        accepted = server.statistics()["transfers_accepted"]

        # 1. step by step: HELLO, read the (new) CHALLENGE, replay the old AUTH
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(hello_raw)
        challenge = await read_one_frame(reader)
        assert isinstance(challenge, Challenge)
        assert challenge.nonce != answers[0][0].nonce  # the server's nonce is fresh
        writer.write(auth_raw)
        got, closed = await read_frames(reader)
        writer.close()
        g = goaway_of(got)
        assert g.code == ErrorCode.AUTHENTICATION_FAILED
        assert closed
        assert not any(isinstance(f, Welcome) for f in got)

        # 2. the whole recorded client stream at once (HELLO, AUTH, BEGIN, CHUNKs...)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(recorded)
        got, closed = await read_frames(reader)
        writer.close()
        assert goaway_of(got).code == ErrorCode.AUTHENTICATION_FAILED and closed
        assert not any(isinstance(f, Welcome) for f in got)

        assert server.statistics()["transfers_accepted"] == accepted
        assert server.statistics()["sessions"] == 0
        assert await transfer_ok(server, "next")
    assert errors == []


def test_client_hello_nonces_are_fresh_and_a_replayed_server_is_refused() -> None:
    """The other direction: a recorded CHALLENGE+WELCOME fed to a new client fails."""
    a = MemoryPair.create(SECRET)
    a.handshake()
    server_bytes = bytearray()
    # Rebuild what server A sent: CHALLENGE then WELCOME, from a fresh pair we record.
    b = MemoryPair.create(SECRET)
    b.client.initiate()
    hello_b = b"".join(bytes(p) for p in b.client.data_to_send())
    b.server.receive_data(hello_b)
    server_bytes += b"".join(bytes(p) for p in b.server.data_to_send())
    b.client.receive_data(bytes(server_bytes))
    auth_b = b"".join(bytes(p) for p in b.client.data_to_send())
    b.server.receive_data(auth_b)
    assert isinstance(b.server.next_event(), ClientAuthenticated)
    b.server.welcome(b"S" * 16, ("raw",))
    server_bytes += b"".join(bytes(p) for p in b.server.data_to_send())

    c = Connection(Role.CLIENT, ConnectionConfig(secret=SECRET))
    c.initiate()
    hello_c = b"".join(bytes(p) for p in c.data_to_send())
    assert split_frames(hello_c)[0][0].nonce != split_frames(hello_b)[0][0].nonce
    c.receive_data(bytes(server_bytes))
    events = []
    while (ev := c.next_event()) is not None:
        events.append(ev)
    assert not any(isinstance(e, HandshakeComplete) for e in events)
    [closed] = [e for e in events if isinstance(e, ConnectionClosed)]
    assert isinstance(closed.error, kvwire.AuthenticationError)
    assert c.state is State.CLOSED


# -- unauthenticated clients ----------------------------------------------------------------


async def test_unauthenticated_garbage_gets_goaway_and_the_server_serves_the_next_client() -> None:
    rng = random.Random(7)
    async with loop_errors() as errors:
        async with kvwire.serve("127.0.0.1", 0, secret=SECRET, handshake_timeout=3.0) as server:
            payloads = [
                bytes(rng.getrandbits(8) for _ in range(20_000)),  # noise
                HEADER.pack(FrameType.HELLO, 0, 0, 100) + bytes(104),  # a HELLO-typed frame, bad CRC
                HEADER.pack(FrameType.CHUNK, 0, 0, 64) + bytes(68),  # a CHUNK before authentication
                b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(20_000),
            ]
            for junk in payloads:
                reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
                writer.write(junk)
                frames, closed = await read_frames(reader)
                writer.close()
                g = goaway_of(frames)
                assert g.code != ErrorCode.NO_ERROR
                assert g.message == ""  # before authentication the peer learns only a code
                assert closed
                assert all(isinstance(f, GoAway) for f in frames)
            assert server.statistics()["sessions"] == 0
            assert await transfer_ok(server, "after-garbage")
    assert errors == []


async def test_handshake_frames_are_bounded_before_authentication() -> None:
    """A header announcing more than 16 KiB before authentication is refused without
    waiting for (or buffering) the body."""
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, handshake_timeout=3.0) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(HEADER.pack(FrameType.HELLO, 0, 0, HANDSHAKE_MAX_BODY + 1))
        frames, closed = await read_frames(reader, until=2.0)
        writer.close()
        assert goaway_of(frames).code == ErrorCode.FRAME_TOO_LARGE
        assert closed
        assert await transfer_ok(server, "ok")


async def test_silent_client_is_closed_after_handshake_timeout_and_blocks_nobody() -> None:
    async with loop_errors() as errors:
        async with kvwire.serve("127.0.0.1", 0, secret=SECRET, handshake_timeout=0.5) as server:
            loop = asyncio.get_running_loop()
            silent = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(8)]
            t0 = loop.time()
            # others are served while the silent ones hold their connections
            assert await transfer_ok(server, "busy")
            for reader, writer in silent:
                frames, closed = await read_frames(reader, until=5.0)
                writer.close()
                assert closed, "silent client still connected 5 s after a 0.5 s handshake timeout"
                assert goaway_of(frames).code == ErrorCode.TIMEOUT
            assert loop.time() - t0 >= 0.4  # not closed before its time
            assert await wait_until(lambda: server.statistics()["connections"] == 0, 5)
    assert errors == []


async def test_slowloris_hello_is_closed_after_handshake_timeout() -> None:
    """HELLO one byte at a time, each within the timeout: the whole handshake still has
    to finish within handshake_timeout."""
    conn = Connection(Role.CLIENT, ConnectionConfig(secret=SECRET))
    conn.initiate()
    hello = b"".join(bytes(p) for p in conn.data_to_send())
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, handshake_timeout=0.5) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)

        async def trickle() -> None:
            for b in hello:
                writer.write(bytes([b]))
                await asyncio.sleep(0.1)

        drip = asyncio.create_task(trickle())
        frames, closed = await read_frames(reader, until=5.0)
        drip.cancel()
        await asyncio.gather(drip, return_exceptions=True)
        writer.close()
        assert closed
        assert goaway_of(frames).code == ErrorCode.TIMEOUT
        assert await transfer_ok(server, "ok")


async def test_session_limit_refuses_with_a_code_and_serves_again_after() -> None:
    async with loop_errors() as errors:
        async with kvwire.serve("127.0.0.1", 0, secret=SECRET, max_sessions=2) as server:
            a = kvwire.connect("127.0.0.1", server.port, secret=SECRET)
            b = kvwire.connect("127.0.0.1", server.port, secret=SECRET)
            await a.open()
            await b.open()
            with pytest.raises(kvwire.LimitExceededError):
                async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, connect_timeout=3):
                    pass
            await a.close()
            assert await wait_until(lambda: server.statistics()["sessions"] < 2, 5)
            assert await transfer_ok(server, "freed")
            await b.close()
    assert errors == []


async def test_silent_client_against_tls_server_is_closed_after_handshake_timeout(
    ca: trustme.CA, server_cert: trustme.LeafCert
) -> None:
    """handshake_timeout covers the TLS handshake too: a client that opens TCP and never
    starts TLS must not hold the connection for longer."""
    async with kvwire.serve(
        "127.0.0.1", 0, secret=SECRET, ssl=server_context(server_cert), handshake_timeout=0.5,
    ) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        _, closed = await read_frames(reader, until=5.0)
        writer.close()
        assert closed, "a client that never started TLS was still connected after 5 s"
        assert await transfer_ok(server, "ok", ssl=client_context(ca), server_hostname="localhost")
