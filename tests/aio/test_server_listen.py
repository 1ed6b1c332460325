"""Where a server listens: every address its host names, all on one port (``port=0``
included), the addresses it listens on, and what each host means ("", "0.0.0.0", "::",
a name of several addresses).  Name resolution is simulated by the loop's getaddrinfo."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np
import pytest
import uvloop

import kvwire
import kvwire.aio.server as server_mod
from kvwire.errors import ConnectionLostError
from tests.conftest import SECRET

pytestmark = pytest.mark.timeout(60)

SPEC = kvwire.KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16")
LAYERS = [(np.full((4, 2, 8), i, np.float16), np.full((4, 2, 8), -i, np.float16)) for i in range(2)]
#: A name that no resolver knows: the tests' own getaddrinfo answers for it.
NAME = "several.kvwire.invalid"

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop,
}


def run(loop_kind: str, main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    loop = LOOPS[loop_kind]()
    try:
        loop.run_until_complete(asyncio.wait_for(main(), 45))
    finally:
        loop.close()


def resolving(names: dict[str, list[str]]) -> None:
    """Make the running loop resolve each of ``names`` to its addresses (in that order)."""
    loop = asyncio.get_running_loop()
    real = loop.getaddrinfo

    async def getaddrinfo(host: Any, port: Any, **kw: Any) -> list[Any]:
        if host not in names:
            return await real(host, port, **kw)
        found: list[Any] = []
        for a in names[host]:
            found.extend(await real(a, port, **{**kw, "flags": kw.get("flags", 0) | socket.AI_NUMERICHOST}))
        return found

    loop.getaddrinfo = getaddrinfo  # type: ignore[method-assign]


async def delivered(server: kvwire.Server, host: str, request_id: str) -> None:
    """A transfer sent to ``host`` on the server's port reaches this server."""
    expect = asyncio.ensure_future(server.expect(request_id, timeout=20))
    try:
        async with kvwire.connect(host, server.port, secret=SECRET, connect_timeout=10) as peer:
            await peer.send(request_id, SPEC, LAYERS, timeout=20)
        cache = await (await expect).collect(timeout=20)
    finally:
        expect.cancel()
    assert np.array_equal(cache.layers[1][0], LAYERS[1][0])


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_every_interface_listens_on_one_port_for_both_families(loop_kind: str) -> None:
    """``serve("", 0)`` listened on 0.0.0.0 and :: each on a port of its own, and
    ``server.port`` gave one of them: a client of the other family was refused (or
    reached another server)."""

    async def main() -> None:
        async with kvwire.serve("", 0, secret=SECRET) as server:
            await delivered(server, "127.0.0.1", "v4")
            await delivered(server, "::1", "v6")
            assert sorted(h for h, _ in server.addresses) == ["0.0.0.0", "::"]
            assert {p for _, p in server.addresses} == {server.port}

    run(loop_kind, main)


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_a_name_of_two_addresses_listens_on_one_port(loop_kind: str) -> None:
    """``serve("localhost", 0)`` where localhost is ::1 and 127.0.0.1."""

    async def main() -> None:
        resolving({NAME: ["::1", "127.0.0.1"]})
        async with kvwire.serve(NAME, 0, secret=SECRET) as server:
            await delivered(server, "127.0.0.1", "v4")
            await delivered(server, "::1", "v6")
            assert server.addresses == (("::1", server.port), ("127.0.0.1", server.port))

    run(loop_kind, main)


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_a_port_taken_on_another_address_is_tried_again(loop_kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With port 0 the first address's port may be held on another by someone else: the
    server tries another port, and listens on every address on it."""
    bound = server_mod._bound_socket
    blockers: list[socket.socket] = []

    def taking_the_first(info: tuple[Any, ...], port: int) -> socket.socket:
        if info[3][0] == "127.0.0.2" and not blockers:  # someone takes it first
            blocker = socket.socket()
            blocker.bind(("127.0.0.2", port))
            blocker.listen()
            blockers.append(blocker)
        return bound(info, port)

    monkeypatch.setattr(server_mod, "_bound_socket", taking_the_first)

    async def main() -> None:
        resolving({NAME: ["127.0.0.1", "127.0.0.2"]})
        async with kvwire.serve(NAME, 0, secret=SECRET) as server:
            taken = blockers[0].getsockname()[1]
            assert server.port != taken
            assert server.addresses == (("127.0.0.1", server.port), ("127.0.0.2", server.port))
            await delivered(server, "127.0.0.1", "one")
            await delivered(server, "127.0.0.2", "two")

    try:
        run(loop_kind, main)
    finally:
        for b in blockers:
            b.close()


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_no_port_free_on_every_address_fails_clearly(loop_kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """0.0.0.0 and 127.0.0.1 can never share a port: after PORT_TRIES tries the server
    fails, saying so, and holds no socket (asyncio gave each its own port)."""
    bound = server_mod._bound_socket
    made: list[socket.socket] = []

    def counting(info: tuple[Any, ...], port: int) -> socket.socket:
        made.append(sock := bound(info, port))
        return sock

    monkeypatch.setattr(server_mod, "_bound_socket", counting, raising=False)

    async def main() -> None:
        resolving({NAME: ["0.0.0.0", "127.0.0.1"]})
        with pytest.raises(ConnectionLostError, match=rf"cannot listen on {NAME}:0: .*no port was free"):
            async with kvwire.serve(NAME, 0, secret=SECRET):
                pass

    run(loop_kind, main)
    assert len(made) == server_mod.PORT_TRIES
    assert all(s.fileno() == -1 for s in made)  # every one closed


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_a_port_in_use_names_the_address_in_brackets(loop_kind: str) -> None:
    """The error said 'cannot listen on ::1:PORT'; of several addresses it names the one
    that failed."""

    async def main() -> None:
        resolving({NAME: ["127.0.0.1", "::1"]})
        async with kvwire.serve("::1", 0, secret=SECRET) as first:
            port = first.port
            with pytest.raises(ConnectionLostError, match=rf"^cannot listen on \[::1\]:{port}: "):
                async with kvwire.serve("::1", port, secret=SECRET):
                    pass
            with pytest.raises(ConnectionLostError,
                               match=rf"^cannot listen on {NAME}:{port}: .* on \[::1\]:{port}$"):
                async with kvwire.serve(NAME, port, secret=SECRET):
                    pass

    run(loop_kind, main)


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_ipv6_any_is_ipv6_only_as_documented(loop_kind: str) -> None:
    """``"::"`` is every IPv6 interface and IPv6 only, on both loops: an IPv4 client is
    refused, and another server may take 0.0.0.0 on its port."""

    async def main() -> None:
        async with kvwire.serve("::", 0, secret=SECRET) as v6:
            assert v6.addresses == (("::", v6.port),)
            await delivered(v6, "::1", "v6")
            with pytest.raises(ConnectionLostError):
                async with kvwire.connect("127.0.0.1", v6.port, secret=SECRET, connect_timeout=10):
                    pass
            async with kvwire.serve("0.0.0.0", v6.port, secret=SECRET) as v4:
                await delivered(v4, "127.0.0.1", "v4")

    run(loop_kind, main)


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_a_server_closed_while_it_starts_listens_on_nothing(loop_kind: str) -> None:
    """A close() while start() resolved its host left the server listening once start()
    went on, closed and never to be closed again."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        real, resolving, go_on = loop.getaddrinfo, asyncio.Event(), asyncio.Event()

        async def slow(host: Any, port: Any, **kw: Any) -> Any:
            resolving.set()
            await go_on.wait()
            return await real("127.0.0.1" if host == NAME else host, port, **kw)

        loop.getaddrinfo = slow  # type: ignore[method-assign]
        server = kvwire.serve(NAME, 0, secret=SECRET)
        starting = asyncio.ensure_future(server.start())
        async with asyncio.timeout(10):
            await resolving.wait()
        await server.close()
        go_on.set()
        with pytest.raises(ConnectionLostError, match="closed while it started"):
            await starting
        assert server.addresses == ()

    run(loop_kind, main)
