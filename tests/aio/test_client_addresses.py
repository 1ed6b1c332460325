"""Which address a client's streams connect to: a session's first stream resolves the host
and connects to the first of its addresses to answer (a dead one does not hold the others
up), and every later stream and every resume of the session goes to the address it
reached, never to whatever the name resolves to then (round-robin DNS: another server,
which does not know the session).  A bracketed IPv6 literal is taken as the address, error
texts and log lines write IPv6 addresses in brackets and name the address reached with
the name, and TLS checks a scoped host's certificate against the address without its
scope.

Name resolution is simulated by patching the loop's ``getaddrinfo``; a dead address by
patching its ``sock_connect`` (asyncio's ``create_connection`` connects through it too)."""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop

import kvwire
from kvwire.aio.client import AddrInfo, _interleave, connect_first
from kvwire.sync import SyncPeer
from tests.conftest import SECRET, make_layers
from tests.system.tls_helpers import tls_contexts

pytestmark = pytest.mark.timeout(60)

SPEC = kvwire.KVSpec(num_layers=2, num_kv_heads=2, head_dim=16)
LAYERS = make_layers(SPEC.num_layers, 32, SPEC.num_kv_heads, SPEC.head_dim, seed=5)
LOOPS = ["asyncio", "uvloop"]
#: Bounds every wait, so a regression fails instead of hanging.
BOUND = 20.0
NAME = "kvhost.test"


def run_on(loop: str, main: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    factory: Callable[[], asyncio.AbstractEventLoop] = (
        asyncio.SelectorEventLoop if loop == "asyncio" else uvloop.new_event_loop)
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main())


def v4(host: str, port: int) -> AddrInfo:
    return (socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (host, port))


def v6(host: str, port: int, scope: int = 0) -> AddrInfo:
    return (socket.AF_INET6, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (host, port, 0, scope))


class Resolver:
    """The running loop's ``getaddrinfo`` answering ``name`` with ``answers``, rotated by
    one at every call as round-robin DNS does (with ``rotate``); anything else as before."""

    def __init__(self, name: str, answers: list[AddrInfo], *, rotate: bool = False) -> None:
        self.name, self.answers, self.rotate = name, answers, rotate
        self.calls = 0
        loop = asyncio.get_running_loop()
        real = loop.getaddrinfo

        async def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
            if host != self.name:
                return await real(host, port, *args, **kwargs)
            n = self.calls % len(self.answers) if self.rotate else 0
            self.calls += 1
            return self.answers[n:] + self.answers[:n]

        loop.getaddrinfo = getaddrinfo  # type: ignore[method-assign]


async def roundtrip(server: kvwire.Server, peer: kvwire.Peer, request_id: str) -> None:
    expecting = asyncio.ensure_future(server.expect(request_id, timeout=BOUND))
    await asyncio.wait_for(peer.send(request_id, SPEC, LAYERS), BOUND)
    await asyncio.wait_for((await expecting).collect(), BOUND)


def peer_hosts(peer: kvwire.Peer) -> list[str]:
    hosts = []
    for s in peer.streams:
        assert s.transport is not None
        hosts.append(s.transport.get_extra_info("peername")[0])
    return hosts


# -- a session keeps the address its first stream reached ------------------------------------

@pytest.mark.parametrize("loop", LOOPS)
def test_every_stream_of_a_session_goes_to_the_address_its_first_stream_reached(loop: str) -> None:
    """Two servers behind one name, the resolver rotating its answers: the session's second
    stream joins the first's server (the other answered its join 'no such session'), and
    a new session resolves the name again."""

    async def main() -> None:
        async with kvwire.serve("127.0.0.2", 0, secret=SECRET) as a, \
                kvwire.serve("127.0.0.3", a.port, secret=SECRET) as b:
            dns = Resolver(NAME, [v4("127.0.0.2", a.port), v4("127.0.0.3", a.port)], rotate=True)
            async with kvwire.connect(NAME, a.port, secret=SECRET, streams=2, connect_timeout=BOUND) as peer:
                assert peer_hosts(peer) == ["127.0.0.2", "127.0.0.2"]
                await roundtrip(a, peer, "first")
            assert dns.calls == 1
            async with kvwire.connect(NAME, a.port, secret=SECRET, streams=2, connect_timeout=BOUND) as peer:
                assert peer_hosts(peer) == ["127.0.0.3", "127.0.0.3"]  # resolved again
                await roundtrip(b, peer, "second")
            assert dns.calls == 2

    run_on(loop, main)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_resume_goes_to_the_address_the_session_reached(loop: str, caplog: pytest.LogCaptureFixture) -> None:
    """A stream broken mid-session reconnects to its server, not to the other server the
    name now resolves to first; the log line names the address with the name."""
    caplog.set_level(logging.INFO, logger="kvwire")

    async def main() -> int:
        async with kvwire.serve("127.0.0.2", 0, secret=SECRET) as a, \
                kvwire.serve("127.0.0.3", a.port, secret=SECRET):
            dns = Resolver(NAME, [v4("127.0.0.2", a.port), v4("127.0.0.3", a.port)], rotate=True)
            async with kvwire.connect(NAME, a.port, secret=SECRET, streams=1, connect_timeout=BOUND,
                                      reconnect_backoff=0.01) as peer:
                await roundtrip(a, peer, "before")
                transport = peer.streams[0].transport
                assert transport is not None
                transport.abort()
                await roundtrip(a, peer, "after")
                assert peer.resumes == 1
                assert peer_hosts(peer) == ["127.0.0.2"]
            assert dns.calls == 1
            return a.port

    port = run_on(loop, main)
    client = [r.getMessage() for r in caplog.records if r.module == "client"]
    assert f"stream 0 to {NAME} (127.0.0.2:{port}) broke; resuming (1 of at most 32)" in client


# -- a dead first address --------------------------------------------------------------------

def hang(addresses: set[str], started: list[str] | None = None) -> list[str]:
    """The running loop's ``sock_connect`` to any of ``addresses`` never answers (SYNs
    dropped); what it returns lists how each such connect ended (``started`` each that
    began)."""
    loop = asyncio.get_running_loop()
    real = loop.sock_connect
    ended: list[str] = []

    async def sock_connect(sock: socket.socket, address: Any) -> None:
        if address[0] not in addresses:
            return await real(sock, address)
        if started is not None:
            started.append(address[0])
        try:
            await asyncio.get_running_loop().create_future()
        except asyncio.CancelledError:
            ended.append("cancelled")
            raise

    loop.sock_connect = sock_connect  # type: ignore[method-assign]
    return ended


@pytest.mark.parametrize("loop", LOOPS)
def test_a_dead_first_address_does_not_keep_the_next_waiting(loop: str) -> None:
    """Its first address dead, the name's second is tried beside it and wins well within
    connect_timeout (it took all of it, then failed); the dead attempt is cancelled."""

    async def main() -> None:
        async with kvwire.serve("127.0.0.2", 0, secret=SECRET) as server:
            Resolver(NAME, [v4("127.0.0.9", server.port), v4("127.0.0.2", server.port)])
            ended = hang({"127.0.0.9"})
            async with kvwire.connect(NAME, server.port, secret=SECRET, streams=2, connect_timeout=10) as peer:
                assert peer_hosts(peer) == ["127.0.0.2", "127.0.0.2"]
                assert ended == ["cancelled"]  # tried once: the joining stream went to the live one
                await roundtrip(server, peer, "r")

    run_on(loop, main)


@pytest.mark.parametrize("loop", LOOPS)
def test_the_race_closes_every_socket_it_does_not_hand_out(loop: str) -> None:
    """connect_first() cancelled while its attempts hang leaves none running, and one whose
    attempts all fail says so for each address where their reasons differ."""

    async def main() -> None:
        started: list[str] = []
        ended = hang({"127.0.0.9", "127.0.0.10"}, started)
        infos = [v4("127.0.0.9", 9), v4("127.0.0.10", 9)]
        racing = asyncio.ensure_future(connect_first(asyncio.get_running_loop(), infos, delay=0.01))
        async with asyncio.timeout(BOUND):
            while len(started) < 2:
                await asyncio.sleep(0.01)
        racing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(racing, BOUND)
        assert started == ["127.0.0.9", "127.0.0.10"]
        assert ended == ["cancelled", "cancelled"]
        assert {t for t in asyncio.all_tasks() if t is not asyncio.current_task()} == set()

        lst = socket.socket()
        lst.bind(("127.0.0.1", 0))
        port = lst.getsockname()[1]  # bound, not listening: refused
        try:
            loop = asyncio.get_running_loop()
            real = loop.sock_connect

            async def unreachable(sock: socket.socket, address: Any) -> None:
                if address[0] == "127.0.0.11":
                    raise OSError(113, "No route to host")
                await real(sock, address)

            loop.sock_connect = unreachable  # type: ignore[method-assign]
            with pytest.raises(OSError) as caught:
                await connect_first(loop, [v4("127.0.0.11", port), v4("127.0.0.1", port)], delay=BOUND)
            assert str(caught.value) == (f"127.0.0.11:{port}: [Errno 113] No route to host; "
                                         f"127.0.0.1:{port}: [Errno 111] Connection refused")
        finally:
            lst.close()

    run_on(loop, main)


def test_address_families_alternate_after_the_first() -> None:
    a, b, c = v6("2001:db8::1", 1), v6("2001:db8::2", 1), v6("2001:db8::3", 1)
    x, y = v4("192.0.2.1", 1), v4("192.0.2.2", 1)
    assert _interleave([a, b, c, x, y]) == [a, x, b, y, c]
    assert _interleave([x, a, b]) == [x, a, b]


# -- IPv6 literals ---------------------------------------------------------------------------

@pytest.mark.parametrize("loop", LOOPS)
def test_a_bracketed_ipv6_address_is_the_address(loop: str) -> None:
    async def main() -> None:
        async with kvwire.serve("::1", 0, secret=SECRET) as server:
            async with kvwire.connect("[::1]", server.port, secret=SECRET, connect_timeout=BOUND) as peer:
                assert peer_hosts(peer) == ["::1"]
                await roundtrip(server, peer, "r")

    run_on(loop, main)


def test_the_sync_api_takes_a_bracketed_ipv6_address_too() -> None:
    async def main() -> None:
        async with kvwire.serve("::1", 0, secret=SECRET) as server:
            expecting = asyncio.ensure_future(server.expect("r", timeout=BOUND))

            def send() -> None:
                with SyncPeer("[::1]", server.port, secret=SECRET, connect_timeout=BOUND) as peer:
                    peer.send("r", SPEC, LAYERS, timeout=BOUND)

            await asyncio.wait_for(asyncio.to_thread(send), BOUND)
            await asyncio.wait_for((await expecting).collect(), BOUND)

    run_on("asyncio", main)


def test_a_dropped_sync_peer_names_an_ipv6_server_in_brackets() -> None:
    async def main() -> None:
        async with kvwire.serve("::1", 0, secret=SECRET) as server:

            def dropped() -> None:
                peer = SyncPeer("::1", server.port, secret=SECRET, connect_timeout=BOUND)
                with pytest.warns(ResourceWarning, match=rf"unclosed kvwire\.sync\.SyncPeer to \[::1\]:{server.port}\b"):
                    del peer
                    gc.collect()

            await asyncio.wait_for(asyncio.to_thread(dropped), BOUND)

    run_on("asyncio", main)


def test_brackets_around_anything_but_an_ipv6_address_are_refused_at_once() -> None:
    for host in ("[kvhost]", "[127.0.0.1]", "[]"):
        with pytest.raises(kvwire.UsageError, match="brackets enclose an IPv6 address only"):
            kvwire.connect(host, 7070, secret=SECRET)


@pytest.mark.parametrize("loop", LOOPS)
def test_an_ipv6_address_in_an_error_is_in_brackets(loop: str) -> None:
    lst = socket.socket(socket.AF_INET6)
    lst.bind(("::1", 0))
    port = lst.getsockname()[1]  # bound, not listening: refused

    async def main() -> None:
        for host in ("::1", "[::1]"):
            with pytest.raises(kvwire.ConnectionLostError) as caught:
                async with kvwire.connect(host, port, secret=SECRET, connect_timeout=BOUND):
                    pass
            # the same text on both loops (asyncio's said "Connect call failed ('::1', ...)")
            assert str(caught.value) == f"cannot connect to [::1]:{port}: [Errno 111] Connection refused"

    try:
        run_on(loop, main)
    finally:
        lst.close()


@pytest.mark.parametrize("loop", LOOPS)
def test_an_error_after_a_name_was_reached_names_the_address(loop: str) -> None:
    """A stream of a session that cannot reconnect: its error names the name and the
    address it tried."""

    async def main() -> None:
        async with kvwire.serve("127.0.0.2", 0, secret=SECRET) as server:
            Resolver(NAME, [v4("127.0.0.2", server.port)])
            async with kvwire.connect(NAME, server.port, secret=SECRET, connect_timeout=BOUND,
                                      reconnect_backoff=0.01, max_reconnects=1) as peer:
                await roundtrip(server, peer, "r")
                loop = asyncio.get_running_loop()

                async def refused(sock: socket.socket, address: Any) -> None:
                    raise ConnectionRefusedError(111, "Connection refused")

                loop.sock_connect = refused  # type: ignore[method-assign]
                transport = peer.streams[0].transport
                assert transport is not None
                transport.abort()
                with pytest.raises(kvwire.ConnectionLostError) as caught:
                    await asyncio.wait_for(peer.send("after", SPEC, LAYERS), BOUND)
                assert (f"cannot connect to {NAME} (127.0.0.2:{server.port}): [Errno 111] Connection refused"
                        in str(caught.value))

    run_on(loop, main)


# -- TLS: the name a certificate is checked against ------------------------------------------

@pytest.mark.parametrize("loop", LOOPS)
def test_tls_checks_a_scoped_address_without_its_scope(loop: str) -> None:
    """``fe80::1%lo`` (resolved here to ::1, where the server listens): the certificate is
    for fe80::1, which is what TLS checks, not 'fe80::1%lo'."""
    server_ctx, client_ctx = tls_contexts("fe80::1")
    lo = socket.if_nametoindex("lo")

    async def main() -> None:
        async with kvwire.serve("::1", 0, secret=SECRET, ssl=server_ctx) as server:
            # a scope in the address too: connected to as it is
            Resolver("fe80::1%lo", [v6("::1", server.port, lo)])
            async with kvwire.connect("fe80::1%lo", server.port, secret=SECRET, ssl=client_ctx,
                                      connect_timeout=BOUND) as peer:
                await roundtrip(server, peer, "r")

    run_on(loop, main)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_scoped_address_is_connected_to_with_its_scope(loop: str) -> None:
    """uvloop's getaddrinfo answers ``fe80::1%lo`` without its scope (scope_id 0, which the
    kernel refuses for a link-local address): the connect still carries it."""
    lo = socket.if_nametoindex("lo")

    async def main() -> None:
        Resolver("fe80::1%lo", [v6("fe80::1", 7070)])
        tried: list[Any] = []
        loop = asyncio.get_running_loop()

        async def refused(sock: socket.socket, address: Any) -> None:
            tried.append(address)
            raise ConnectionRefusedError(111, "Connection refused")

        loop.sock_connect = refused  # type: ignore[method-assign]
        with pytest.raises(kvwire.ConnectionLostError) as caught:
            async with kvwire.connect("fe80::1%lo", 7070, secret=SECRET, connect_timeout=BOUND):
                pass
        assert [(a[0].partition("%")[0], *a[1:]) for a in tried] == [("fe80::1", 7070, 0, lo)]
        assert str(caught.value) == "cannot connect to [fe80::1%lo]:7070: [Errno 111] Connection refused"

    run_on(loop, main)
