"""``Server.close()`` with transfers waiting to start (their ACCEPT held for room in
``max_buffer_bytes``, docs/protocol.md 7.1, 8.2), over real sockets: the room each
failing transfer frees starts none of them (a closing server accepts nothing), and every
transfer admitted, those waiting included, is told by a ``RESET(SESSION_LOST)`` before the
stream's GOAWAY (docs/protocol.md 10)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import kvwire
from kvwire.errors import ErrorCode
from kvwire.wire import Begin, Chunk, FrameDecoder, frame_bytes
from kvwire.wire.frames import Accept, Credit, GoAway, Reset
from tests.conftest import SECRET
from tests.rawpeer import raw_client, wait_until

pytestmark = pytest.mark.timeout(60)

MIB = 1 << 20
HEADS, DIM = 2, 64
BPT = HEADS * DIM * 2  # float16
TOKENS = 2048  # a layer of 1 MiB (K and V)
WAITING = range(3, 13)


def begin(tid: int) -> Begin:
    return Begin(transfer_id=tid, num_layers=16, num_kv_heads=HEADS, head_dim=DIM, dtype_id=1,
                 model="", request_id=f"r{tid}", meta=b"{}")


def chunk(tid: int, kind: int) -> Chunk:
    return Chunk(transfer_id=tid, layer=0, kind=kind, codec_id=0, token_start=0, token_count=TOKENS,
                 layer_tokens=TOKENS, params=b"", payload=bytes(TOKENS * BPT))


async def test_a_closing_server_starts_none_of_the_transfers_waiting_and_resets_each_before_its_goaway() -> None:
    server = await kvwire.serve("127.0.0.1", 0, secret=SECRET, max_buffer_bytes=8 * MIB,
                                transfer_buffer_bytes=8 * MIB, claim_timeout=None).__aenter__()
    frames: list[Any] = []
    try:
        _, reader, writer = await raw_client(server.port)

        async def read() -> None:
            dec = FrameDecoder(1 << 24)
            try:
                while data := await reader.read(1 << 20):
                    frames.extend(f for f, _ in dec.feed(data))
            except ConnectionError:
                pass  # (what arrived before a reset was read already)

        reading = asyncio.ensure_future(read())

        def send(*fs: Any) -> None:
            writer.write(b"".join(frame_bytes(f) for f in fs))

        def of(kind: type) -> list[Any]:
            return [f for f in frames if isinstance(f, kind)]

        send(begin(1))
        assert await wait_until(lambda: len(of(Accept)) == 1, 10)
        send(chunk(1, 0), chunk(1, 1))  # its first layer: its window, the budget less an eighth
        assert await wait_until(lambda: bool(of(Credit)), 10)
        send(begin(2))  # its first layer's estimate: the room left
        assert await wait_until(lambda: len(of(Accept)) == 2, 10)
        send(*(begin(tid) for tid in WAITING))
        assert await wait_until(lambda: server.statistics()["transfers_waiting_to_start"] == len(WAITING), 10)
        seen = len(frames)
        closing = asyncio.ensure_future(server.close())
        assert await wait_until(lambda: bool(of(GoAway)), 10)
        writer.close()
        async with asyncio.timeout(10):
            await closing
            await reading
    finally:
        await server.close()
    after = frames[seen:]
    assert not [f for f in after if isinstance(f, Accept)]  # nothing started once close began
    resets = [f for f in after if isinstance(f, Reset)]
    assert sorted(r.transfer_id for r in resets) == [1, 2, *WAITING]
    assert all(r.code == ErrorCode.SESSION_LOST and "the server is shutting down" in r.message for r in resets)
    assert isinstance(after[-1], GoAway) and after[-1].code == ErrorCode.NO_ERROR  # after every RESET
    assert server.statistics()["transfers_accepted"] == 2
