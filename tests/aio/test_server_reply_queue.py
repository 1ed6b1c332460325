"""A server's replies queued unsent for a client that sends frames the server answers and
reads nothing are held to the server's own small mark (REPLY_QUEUE_HIGH), not the 4 MiB a
client's stream may queue of chunks: above it the server stops reading from that client."""

from __future__ import annotations

import asyncio

import pytest

import kvwire
from kvwire.aio import _stream
from kvwire.aio._stream import QUEUE_HIGH, REPLY_QUEUE_HIGH
from kvwire.wire import frame_bytes
from kvwire.wire.frames import Ping
from tests.conftest import SECRET, require_send_queue
from tests.rawpeer import raw_client

pytestmark = pytest.mark.timeout(60)

#: Over the mark by at most the replies to one read (16 KiB of PINGs: 16 KiB of PONGs), and
#: one flush's worth of slack.
SLACK = 64 << 10


@pytest.mark.parametrize("queue", ["send queue", "transport"])
async def test_replies_to_a_client_that_never_reads_stay_under_the_servers_mark(
    queue: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    if queue == "send queue":
        require_send_queue()  # (skipped only where extensions are off or cannot be built; fails in CI)
    if queue == "transport":
        monkeypatch.setattr(_stream, "_sendq", None)  # every stream writes through its transport
    assert REPLY_QUEUE_HIGH + SLACK < QUEUE_HIGH
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        _, _reader, writer = await raw_client(server.port)
        [stream] = list(server._streams)
        assert stream.high == REPLY_QUEUE_HIGH
        ping = frame_bytes(Ping(opaque=7))  # each one answered by a PONG of the same size
        sent = 48 << 20
        writer.write(ping * (sent // len(ping)))  # never reading the PONGs
        loop = asyncio.get_running_loop()
        last, still_since, peak = -1, loop.time(), 0
        end = loop.time() + 30
        # Until the server has taken no bytes for a while (or, on a broken tree, the bound).
        while loop.time() - still_since < 0.5 and loop.time() < end:
            await asyncio.sleep(0.02)
            peak = max(peak, stream.queued)
            now = stream.conn._decoder.bytes_received
            if now != last:
                last, still_since = now, loop.time()
        peak = max(peak, stream.queued)
        assert stream.reading_paused
        assert last < sent // 2, last  # it stopped reading long before the end
        assert 0 < stream.queued <= peak <= REPLY_QUEUE_HIGH + SLACK, (stream.queued, peak)
        assert server.statistics()["connections"] == 1  # paused, not dropped
        writer.transport.abort()
