"""Raw payloads are received straight into their layer; a corrupted header must never let
that path overwrite bytes already verified (the frames here are built by the independent
peer of tests/wire/test_interop.py, so the corruption is exactly where we put it)."""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import numpy as np
import pytest

import kvwire
from tests.wire import test_interop as T

pytestmark = pytest.mark.timeout(30)
L, H, D, N = 1, 8, 128, 128  # 32 tokens of K = 64 KiB: above the in-place threshold


def _layer() -> tuple[np.ndarray, np.ndarray]:
    """The one layer's K and V the transfers here carry."""
    rng = np.random.default_rng(1)
    return tuple(rng.standard_normal((N, H, D)).astype(np.float16) for _ in range(2))  # type: ignore[return-value]


async def _first_tokens(server: kvwire.Server, k: np.ndarray) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, Any]:
    """A session of the independent peer that began transfer 1 (one layer) and had K's
    first 96 tokens acknowledged: its reader, writer and WELCOME."""
    r, w, wel = await T.open_session(server.port)
    tx = T.Sender(r, w, credit=wel.window)
    w.write(T.frame(T.BEGIN, T.begin_body(1, L, H, D, 1, "x", "req", b"")))
    while 1 not in tx.layer_limit:
        await tx.pump()
    await tx.send_chunk(1, 0, 0, 0, 96, N, k[0:96].tobytes())
    while tx.unacked:
        await tx.pump()
    return r, w, wel


@pytest.mark.parametrize("field,offset,value", [
    ("token_start", 8 + 12, 64),        # 96 -> 64: would overlap verified tokens 64..95
    ("layer_tokens", 8 + 20, N + 1024),  # a wrong layer size must not be learnt from it
])
async def test_corrupted_chunk_header_never_overwrites_verified_tokens(field: str, offset: int, value: int) -> None:
    k, v = _layer()
    async with kvwire.serve(secret=T.SECRET, resume_timeout=5) as server:
        got = asyncio.ensure_future(T._collect(server))
        r, w, wel = await _first_tokens(server, k)
        bad = bytearray(T.chunk_frame(1, 0, 0, 96, 32, N, k[96:128].tobytes()))
        struct.pack_into(">I", bad, offset, value)  # the bit flip in transit
        w.write(bytes(bad))
        await w.drain()
        ftype, body = await T.read_frame(r)
        assert ftype == T.GOAWAY and T.parse_goaway(body)[0] == kvwire.ErrorCode.INTEGRITY_ERROR
        await T.close(w)
        # The sender resumes the session and re-sends what was not acknowledged.
        r2, w2, wel2 = await T.open_session(server.port, session=wel.session_id)
        tx2 = T.Sender(r2, w2, credit=wel2.window, layer_limit={1: 1})
        await tx2.send_chunk(1, 0, 0, 96, 32, N, k[96:128].tobytes())
        await tx2.send_chunk(1, 0, 1, 0, 96, N, v[0:96].tobytes())
        await tx2.send_chunk(1, 0, 1, 96, 32, N, v[96:128].tobytes())
        while tx2.unacked:
            await tx2.pump()
        _, cache = await asyncio.wait_for(got, 5)
        rk, rv = cache.layers[0]
        assert rk.tobytes() == k.tobytes() and rv.tobytes() == v.tobytes()
        await T.close(w2)


async def _backed_up(server: kvwire.Server, w: asyncio.StreamWriter) -> object:
    """Stop reading what the server writes (a stuck peer) until its writes back up; its stream."""
    stream = next(iter(server._by_cid.values()))
    ping = T.frame(T.PING, struct.pack(">Q", 1))

    def waiting() -> int:  # bytes the server could not write yet: in its send queue, or its transport's
        if stream._queue is not None:
            return int(stream._queue.pending)
        return stream.transport.get_write_buffer_size() if stream.transport is not None else 0

    while waiting() == 0:
        w.write(ping * 200)
        await w.drain()
        await asyncio.sleep(0.01)
    return stream


async def test_a_replaced_stream_never_writes_the_layer_it_was_reading_into() -> None:
    """Stream A, whose peer reads nothing, is mid-way through V's payload (read in place)
    when the client reconnects its slot: A is replaced, but its socket stays open until
    its GOAWAY is written. B sends V whole and the layer is delivered; the rest of A's
    payload arriving afterwards must not land in the delivered layer."""
    k, v = _layer()
    async with kvwire.serve(secret=T.SECRET, resume_timeout=5) as server:
        got = asyncio.ensure_future(T._collect(server))
        _, w, wel = await _first_tokens(server, k)
        stream = await _backed_up(server, w)
        w.write(T.chunk_frame(1, 0, 1, 0, N, N, v.tobytes())[: 8 + 26 + 1000])
        await w.drain()
        for _ in range(300):
            await asyncio.sleep(0.01)
            if server.core.payload_remaining(stream.key):  # type: ignore[attr-defined]
                break
        assert server.core.payload_remaining(stream.key)  # type: ignore[attr-defined]
        r2, w2, wel2 = await T.open_session(server.port, session=wel.session_id)
        tx2 = T.Sender(r2, w2, credit=wel2.window, layer_limit={1: 1})
        await tx2.send_chunk(1, 0, 1, 0, N, N, v.tobytes())
        await tx2.send_chunk(1, 0, 0, 96, 32, N, k[96:128].tobytes())
        while tx2.unacked:
            await tx2.pump()
        _, cache = await asyncio.wait_for(got, 5)
        rk, rv = cache.layers[0]
        assert rk.tobytes() == k.tobytes() and rv.tobytes() == v.tobytes()
        w.write(b"\xee" * 261144)  # A's frame goes on
        await w.drain()
        await asyncio.sleep(0.3)
        assert np.asarray(rv).tobytes() == v.tobytes()
        w.transport.abort()
        await T.close(w2)


async def test_a_closed_stream_whose_peer_reads_nothing_is_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    """The idle timeout closes a stream mid-payload whose peer reads nothing, so its GOAWAY
    cannot be written: after CLOSE_LINGER its socket is dropped, and the layer memory its
    unfinished payload was being read into goes back to the receive pool."""
    from kvwire.aio import _stream
    from kvwire.aio._pool import default_pool

    monkeypatch.setattr(_stream, "CLOSE_LINGER", 0.5)
    k = np.ones((N, H, D), np.float16)
    leased = default_pool().leased_bytes
    async with kvwire.serve(secret=T.SECRET, resume_timeout=0.5, idle_timeout=1.0) as server:
        accepted = asyncio.ensure_future(server.accept())
        _, w, _ = await _first_tokens(server, k)
        await _backed_up(server, w)
        w.write(T.chunk_frame(1, 0, 1, 0, N, N, bytes(N * H * D * 2))[: 8 + 26 + 1000])
        await w.drain()
        transfer = await accepted
        with pytest.raises(kvwire.KvwireError):
            await transfer.collect(timeout=10)  # the session is lost: the transfer fails
        del transfer
        for _ in range(100):
            await asyncio.sleep(0.1)
            if server.statistics()["connections"] == 0 and default_pool().leased_bytes <= leased:
                break
        assert server.statistics()["connections"] == 0
        assert default_pool().leased_bytes <= leased
        w.transport.abort()
