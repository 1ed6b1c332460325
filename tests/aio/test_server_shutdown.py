"""A server that closes tells the senders of the transfers it still holds why, before
its streams close: their send() says the server is shutting down."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

import kvwire
from kvwire.errors import ConnectionLostError
from tests.conftest import SECRET, make_layers

pytestmark = pytest.mark.timeout(60)

SPEC = kvwire.KVSpec(num_layers=3, num_kv_heads=2, head_dim=16)


async def _first_layer_then_wait(stop: asyncio.Event) -> AsyncIterator[tuple[np.ndarray, np.ndarray]]:
    """Layer 0 of a cache, then nothing until ``stop``: a transfer in progress."""
    yield make_layers(3, 8, 2, 16)[0]
    await stop.wait()


async def _wait_first_layer_acked(peer: Any) -> None:
    while not any((t := peer.core.transfer(tid)) is not None and t.kv_bytes_acked > 0 for tid in list(peer.sends)):
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("taken", [False, True, None], ids=["unclaimed", "being-taken", "let-go"])
async def test_close_tells_the_sender_the_server_is_shutting_down(taken: bool | None) -> None:
    # The sender learnt only that its streams closed ("stream N closed"), or, where the
    # application's task was stopped first, "the application stopped taking layers".
    stop = asyncio.Event()
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, streams=2) as peer:
            sending = asyncio.ensure_future(peer.send("a", SPEC, _first_layer_then_wait(stop), timeout=30))
            taking: asyncio.Future[Any] | None = None
            if taken:
                transfer = await server.expect("a", timeout=10)
                taking = asyncio.ensure_future(transfer.collect(timeout=30))
            elif taken is None:  # handed out, let go of, and the server closing before it aborts it
                transfer = await server.expect("a", timeout=10)
            await _wait_first_layer_acked(peer)
            if taken is None:
                del transfer
                gc.collect()
            await server.close()
            with pytest.raises(kvwire.ConnectionLostError, match="transfer 'a': the server is shutting down"):
                await sending
            if taking is not None:
                with pytest.raises(ConnectionLostError, match="the server is shutting down"):
                    await taking
            stop.set()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
async def test_kvwire_serve_stopped_by_a_signal_tells_the_sender(signum: int) -> None:
    """Ctrl-C on `kvwire serve` stopped its handler first, whose RESET said "the
    application stopped taking layers"; the server now closes first."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "KVWIRE_SECRET": SECRET.decode()}
    server = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvwire", "serve", "--host", "127.0.0.1", "--port", "0",
        stderr=subprocess.PIPE, env=env,
    )
    try:
        assert server.stderr is not None
        line = (await asyncio.wait_for(server.stderr.readline(), 30)).decode()
        match = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
        assert match, line
        stop = asyncio.Event()
        async with kvwire.connect("127.0.0.1", int(match[1]), secret=SECRET, streams=2) as peer:
            sending = asyncio.ensure_future(peer.send("x", SPEC, _first_layer_then_wait(stop), timeout=30))
            await _wait_first_layer_acked(peer)
            server.send_signal(signum)
            with pytest.raises(kvwire.ConnectionLostError) as err:
                await sending
            stop.set()
        assert "the server is shutting down" in str(err.value), err.value
        rest = (await asyncio.wait_for(server.stderr.read(), 30)).decode()
        assert await asyncio.wait_for(server.wait(), 30) == 128 + signum, rest
        assert ("interrupted" if signum == signal.SIGINT else "terminated") in rest
    finally:
        if server.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                server.kill()
            await server.wait()
