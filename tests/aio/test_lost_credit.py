"""A CREDIT lost with a broken stream whose slot then gives up reconnecting, while the
session's other stream stays open: the server says the CREDIT again on the open stream
and the transfer completes there (docs/protocol.md 6.3).  It waited for the send()
timeout, or the server's transfer_timeout (300 s), with nothing the client might send.

Loopback: a frame-aware proxy between client and server.  Its first connection (stream 0)
is forwarded until the server's second CREDIT on it, which it drops as it cuts both sides
(a break that loses exactly that CREDIT); its second (stream 1) is forwarded untouched;
every later one (stream 0's reconnects) is closed at once, so the slot is given up."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

import kvwire
from kvwire.wire.frames import CRC_SIZE, HEADER, HEADER_SIZE, FrameType
from tests.conftest import make_layers

pytestmark = pytest.mark.timeout(90)

SECRET = b"lost-credit-secret-0123456789"
LAYERS, TOKENS, HEADS, HEAD_DIM = 6, 512, 8, 128  # 2 MiB layers; the server grants one at a time
SPEC = kvwire.KVSpec(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM)


async def test_a_credit_lost_with_a_slot_given_up_is_said_again_on_the_open_stream() -> None:
    layers = make_layers(LAYERS, TOKENS, HEADS, HEAD_DIM)
    accepted = 0
    cut = asyncio.Event()
    tasks: set[asyncio.Task[object]] = set()
    writers: list[asyncio.StreamWriter] = []

    async def forward(r: asyncio.StreamReader, w: asyncio.StreamWriter, *, drop_credit: int = 0) -> None:
        """Copy r to w frame by frame; stop at the ``drop_credit``-th CREDIT (not copied)."""
        buf = b""
        credits = 0
        try:
            while data := await r.read(1 << 16):
                buf += data
                while len(buf) >= HEADER_SIZE:
                    ftype, _, _, length = HEADER.unpack_from(buf)
                    end = HEADER_SIZE + length + CRC_SIZE
                    if len(buf) < end:
                        break
                    frame, buf = buf[:end], buf[end:]
                    if drop_credit and ftype == FrameType.CREDIT:
                        credits += 1
                        if credits == drop_credit:
                            cut.set()
                            return
                    w.write(frame)
                    await w.drain()
        except (ConnectionError, OSError):
            pass

    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, transfer_buffer_bytes=1 << 20) as server:

        async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
            nonlocal accepted
            index, accepted = accepted, accepted + 1
            writers.append(cw)
            if index >= 2:  # stream 0's reconnects: refused
                cw.close()
                return
            sr, sw = await asyncio.open_connection("127.0.0.1", server.port)
            writers.append(sw)
            up = asyncio.create_task(forward(cr, sw))
            tasks.add(up)
            await forward(sr, cw, drop_credit=2 if index == 0 else 0)
            up.cancel()
            sw.close()
            cw.close()

        def spawn(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
            task = asyncio.create_task(handle(cr, cw))
            tasks.add(task)

        proxy = await asyncio.start_server(spawn, "127.0.0.1", 0)
        port = proxy.sockets[0].getsockname()[1]
        try:
            async with kvwire.connect("127.0.0.1", port, secret=SECRET, streams=2, chunk_bytes=256 << 10,
                                      reconnect_attempts=2, reconnect_backoff=0.01) as peer:

                async def receive() -> list[tuple[bytes, bytes]]:
                    transfer = await server.expect("r", timeout=60)
                    got = await transfer.collect(timeout=60)  # takes each layer: the next is granted
                    return [(bytes(k.tobytes()), bytes(v.tobytes())) for k, v in got.layers]

                receiving = asyncio.create_task(receive())
                tasks.add(receiving)
                await asyncio.wait_for(peer.send("r", SPEC, layers), 45)
                got = await asyncio.wait_for(receiving, 30)
                assert got == [(k.tobytes(), v.tobytes()) for k, v in layers]
                assert cut.is_set()

                async def given_up() -> None:
                    while not peer.core.is_given_up(0):
                        await asyncio.sleep(0.01)

                await asyncio.wait_for(given_up(), 30)  # the slot did not come back
                assert peer.core.open_streams == [1]
        finally:
            proxy.close()
            for w in writers:
                w.close()
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            await proxy.wait_closed()
