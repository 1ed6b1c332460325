"""Under TLS too: a sender that reads nothing for a while (a process stopped, then
resumed) while its server shuts down finds the server's RESET(SESSION_LOST) and GOAWAY
unread in its kernel once its write fails on the reset connection, and acts on them: its
send fails with "the server is shutting down" (it dropped the stream unread, took it for
a break and tried to resume the session against a server that was gone: "could not
resume the session: ... Connection refused").  See test_goaway_before_reset.py for plain
TCP."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest

import kvwire
from tests.aio.goaway_helpers import SPEC, TOKENS, wait_first_layer_acked
from tests.conftest import SECRET
from tests.system.tls_helpers import tls_contexts

pytestmark = pytest.mark.timeout(60)


async def test_a_tls_sender_that_writes_before_reading_acts_on_the_goaway_it_had_not_read() -> None:
    server_ctx, client_ctx = tls_contexts()
    k = np.ones((TOKENS, SPEC.num_kv_heads, SPEC.head_dim), np.float16)
    release = asyncio.Event()

    async def layers() -> AsyncIterator[tuple[np.ndarray, np.ndarray]]:
        yield k, k
        await release.wait()
        yield k, k
        yield k, k

    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, ssl=server_ctx) as server:
        async with kvwire.connect(
            "127.0.0.1", server.port, secret=SECRET, streams=1, max_reconnects=1, ssl=client_ctx
        ) as peer:
            sending = asyncio.ensure_future(peer.send("a", SPEC, layers(), timeout=30))
            await wait_first_layer_acked(peer)
            (stream,) = peer.streams
            assert stream.transport is not None
            assert stream.transport.get_extra_info("sslcontext") is not None
            # The sender reads nothing more from its socket, as if stopped: its TLS layer's
            # own transport (the one that reads the kernel) is paused.
            inner = stream.transport._ssl_protocol._transport  # type: ignore[attr-defined]
            inner.pause_reading()
            # The server tells the sender and closes: its RESET and GOAWAY wait unread in the
            # sender's kernel; once close() returns the server's sockets are closed.
            await asyncio.wait_for(server.close(), 20)
            assert server.statistics()["connections"] == 0
            release.set()  # the sender writes the next layers: the closed socket resets
            with pytest.raises(kvwire.ConnectionLostError) as err:
                await asyncio.wait_for(sending, 20)
            assert str(err.value) == "transfer 'a': the server is shutting down", err.value
            assert peer.resumes == 0
