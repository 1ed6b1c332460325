"""A peer whose session ended (its server shut down or restarted) says so: ``peer.broken``
holds the error, and every later ``send()`` fails at once, of that error's class, saying
that the session has ended and the peer must connect again."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import kvwire
from kvwire.sync import SyncPeer, SyncServer

SECRET = b"s" * 32
SPEC = kvwire.KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16")
LAYERS = [(np.ones((4, 2, 8), np.float16), np.ones((4, 2, 8), np.float16))] * 2


async def until(cond: object, limit: float = 30.0) -> None:
    """Poll ``cond()`` (a bound on how long a broken test waits, not a timing claim)."""
    async with asyncio.timeout(limit):
        while not cond():  # type: ignore[operator]
            await asyncio.sleep(0.01)


async def test_a_peer_whose_server_shut_down_is_broken_and_says_to_connect_again() -> None:
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        port = server.port
        peer = kvwire.connect("127.0.0.1", port, secret=SECRET)
        async with peer:
            rx = asyncio.create_task(server.expect("a"))
            await peer.send("a", SPEC, LAYERS, timeout=20)
            await (await rx).collect()
            assert peer.broken is None
            await server.close()
            await until(lambda: peer.broken is not None)
            assert isinstance(peer.broken, kvwire.ConnectionLostError)
            assert not peer.closed  # close() was not called: the peer still needs it
            async with kvwire.serve("127.0.0.1", port, secret=SECRET):  # back on its port
                for _ in range(2):
                    try:
                        await peer.send("b", SPEC, LAYERS, timeout=20)
                    except kvwire.ConnectionLostError as exc:
                        assert "session has ended: close it and connect() again" in str(exc)
                        assert str(peer.broken) in str(exc)
                    else:
                        raise AssertionError("a send on a peer whose session ended succeeded")
            assert peer.broken is not None


def test_a_sync_peer_says_its_session_ended() -> None:
    server = SyncServer("127.0.0.1", 0, secret=SECRET)
    try:
        peer = SyncPeer("127.0.0.1", server.port, secret=SECRET)
        try:
            assert peer.broken is None
            server.close()
            h = peer.begin("a", SPEC)
            for k, v in LAYERS:
                h.send_layer(k, v)
            with pytest.raises(kvwire.KvwireError):  # no server: the send cannot complete
                h.wait(timeout=30)
            assert isinstance(peer.broken, kvwire.ConnectionLostError)
        finally:
            peer.close()
    finally:
        server.close()
