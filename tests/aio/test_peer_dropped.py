"""An async Peer the application drops unclosed is garbage-collected: its connections are
aborted (the server sees its session's connections close) and a ResourceWarning names it,
as an unclosed socket's does.  A closed peer warns of nothing; one with a send() under way
is not collected."""

from __future__ import annotations

import asyncio
import gc
import ssl
import warnings
import weakref
from typing import Literal

import numpy as np
import pytest

import kvwire
from kvwire.aio.client import Peer
from tests.system.tls_helpers import tls_contexts

pytestmark = pytest.mark.timeout(60)

SECRET = b"peer-dropped-secret"
#: How long the server may take to see a dropped peer's connections close (a bound, not a
#: measure: the aborts are scheduled on the loop as the peer is collected).
DEADLINE = 10.0


async def _connections_gone(server: kvwire.Server) -> dict[str, int]:
    """The server's statistics once it holds no connection (or at the deadline)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + DEADLINE
    while True:
        stats = server.statistics()
        if stats["connections"] == 0 or loop.time() >= end:
            return stats
        await asyncio.sleep(0.02)


async def _open_dropped(port: int, streams: int | Literal["auto"]) -> weakref.ref[Peer]:
    peer = kvwire.connect("127.0.0.1", port, secret=SECRET, streams=streams)
    await peer.__aenter__()  # (no `async with`, no close(): the application forgets it)
    return weakref.ref(peer)


@pytest.mark.parametrize("streams", [4, "auto"])
async def test_a_dropped_peer_is_collected_aborted_and_warned_about(streams: int | Literal["auto"]) -> None:
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        with pytest.warns(
            ResourceWarning, match=rf"unclosed kvwire Peer to 127\.0\.0\.1:{server.port}"
        ):
            ref = await _open_dropped(server.port, streams)
            assert server.statistics()["connections"] >= 1
            gc.collect()
            assert ref() is None
        stats = await _connections_gone(server)
        assert stats["connections"] == 0


async def test_a_closed_peer_warns_of_nothing() -> None:
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            peer = kvwire.connect("127.0.0.1", server.port, secret=SECRET, streams=2)
            await peer.__aenter__()
            await peer.close()
            ref = weakref.ref(peer)
            del peer
            gc.collect()
            assert ref() is None
            async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, streams=2) as peer:
                ref = weakref.ref(peer)
            del peer
            gc.collect()
            assert ref() is None


async def test_a_dropped_peer_whose_dropped_send_waits_on_the_server_is_not_collected() -> None:
    """Nobody holds the peer nor its send's task (which waits on the peer for the server's
    acknowledgements): the send still goes on to its end, and then the peer is collected.
    (The task is held only weakly: a task the test held would hold the peer in its frame,
    and the peer's hold while it sends would go untested.)"""
    spec = kvwire.KVSpec(num_layers=4, num_kv_heads=8, head_dim=128, dtype="float16")
    layer = np.ones((4096, 8, 128), np.float16)  # 32 MiB in all: more than the sockets buffer
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        peer = kvwire.connect("127.0.0.1", server.port, secret=SECRET, streams=2)
        await peer.__aenter__()
        for s in server._by_cid.values():  # the server reads nothing for now
            assert s.transport is not None
            s.transport.pause_reading()
        ref = weakref.ref(peer)
        task = weakref.ref(asyncio.ensure_future(peer.send("r1", spec, [(layer, layer)] * 4)))
        del peer
        await asyncio.sleep(0.1)  # the send waits for acknowledgements
        gc.collect()
        assert ref() is not None and task() is not None
        sending = task()
        assert sending is not None and not sending.done()
        del sending
        with pytest.warns(ResourceWarning, match="unclosed kvwire Peer"):
            for s in server._by_cid.values():
                if s.transport is not None:
                    s.transport.resume_reading()
            sending = task()
            assert sending is not None
            receipt = await asyncio.wait_for(sending, 30)
            del sending
            gc.collect()
            assert ref() is None
        assert receipt.request_id == "r1"
        stats = await _connections_gone(server)
        assert stats["connections"] == 0


def _open_and_drop_in_own_loop(port: int, ssl_context: ssl.SSLContext | None = None) -> None:
    """A peer opened in a loop of its own (run in this thread and closed, as asyncio.run()
    does) and dropped there inside a reference cycle: only a collection after the loop is
    closed can let it go."""

    async def open_and_drop() -> None:
        peer = kvwire.connect("127.0.0.1", port, secret=SECRET, streams=2, ssl=ssl_context)
        await peer.__aenter__()
        app: dict[str, object] = {"peer": peer}
        app["self"] = app  # (the application's cycle)
        del peer, app

    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
        runner.run(open_and_drop())


@pytest.mark.parametrize("tls", [False, True])
async def test_a_peer_collected_after_its_loop_closed_closes_its_connections(tls: bool) -> None:
    """Collected once its (asyncio) loop is closed, a dropped peer's connections close
    there and then (the server sees them go), and the one warning is kvwire's: its
    transports are closed with them, and warn of nothing at a later collection.  (uvloop
    closes a loop's transports itself as the loop is closed.)  Under TLS too, where the
    socket is the SSL transport's inner one."""
    server_ctx, client_ctx = tls_contexts() if tls else (None, None)
    gc.disable()  # (nothing collects the peer but the test's own collections)
    try:
        async with kvwire.serve("127.0.0.1", 0, secret=SECRET, ssl=server_ctx) as server:
            await asyncio.to_thread(_open_and_drop_in_own_loop, server.port, client_ctx)
            assert server.statistics()["connections"] >= 1
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                gc.collect()  # the peer, its loop closed
                stats = await _connections_gone(server)
                gc.collect()  # whatever of its connections the first collection left
            assert stats["connections"] == 0
            assert [
                str(w.message)
                for w in caught
                if w.category is ResourceWarning and "unclosed kvwire Peer" not in str(w.message)
            ] == []
            assert (
                len(
                    [
                        w
                        for w in caught
                        if w.category is ResourceWarning
                        and f"unclosed kvwire Peer to 127.0.0.1:{server.port}" in str(w.message)
                    ]
                )
                == 1
            )
    finally:
        gc.enable()
