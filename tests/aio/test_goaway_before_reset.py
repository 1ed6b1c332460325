"""A sender that reads nothing for a while (a process stopped, then resumed) while its
server shuts down: the server's RESET(SESSION_LOST) and GOAWAY wait unread in the sender's
kernel, the server's sockets are closed, and the sender, resumed, writes before it reads.
Its bytes reach a closed socket, which resets the connection, and the write fails; what
arrived before the reset is still there to read.  The sender acts on it: its send fails
with "the server is shutting down" (it dropped the stream unread, took it for a break and
tried to resume the session against a server that was gone: "could not resume the
session: ... Connection refused")."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest

import kvwire
from kvwire.aio import _stream
from tests.aio.goaway_helpers import SPEC, TOKENS, wait_first_layer_acked
from tests.conftest import SECRET, require_send_queue

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("queue", [True, False], ids=["send-queue", "transport"])
async def test_a_sender_that_writes_before_reading_acts_on_the_goaway_it_had_not_read(
    queue: bool, monkeypatch: pytest.MonkeyPatch,
) -> None:
    if queue:
        require_send_queue()
    else:
        monkeypatch.setattr(_stream, "_sendq", None)  # writes go through the transport
    k = np.ones((TOKENS, SPEC.num_kv_heads, SPEC.head_dim), np.float16)
    release = asyncio.Event()

    async def layers() -> AsyncIterator[tuple[np.ndarray, np.ndarray]]:
        yield k, k
        await release.wait()
        yield k, k
        yield k, k

    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, streams=1, max_reconnects=1) as peer:
            sending = asyncio.ensure_future(peer.send("a", SPEC, layers(), timeout=30))
            await wait_first_layer_acked(peer)
            (stream,) = peer.streams
            assert stream.transport is not None and (stream._queue is not None) is queue
            stream.transport.pause_reading()  # the sender reads nothing more, as if stopped
            # The server tells the sender and closes: its RESET and GOAWAY wait unread in the
            # sender's kernel; once close() returns the server's sockets are closed.
            await asyncio.wait_for(server.close(), 20)
            assert server.statistics()["connections"] == 0
            release.set()  # the sender writes the next layers: the closed socket resets
            with pytest.raises(kvwire.ConnectionLostError) as err:
                await asyncio.wait_for(sending, 20)
            assert str(err.value) == "transfer 'a': the server is shutting down", err.value
            assert peer.resumes == 0
