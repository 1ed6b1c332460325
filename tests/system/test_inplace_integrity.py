"""Raw payloads are received straight into their layer; a corrupted header must never let
that path overwrite bytes already verified (the frames here are built by the independent
peer of tests/wire/test_interop.py, so the corruption is exactly where we put it)."""

from __future__ import annotations

import asyncio
import struct

import numpy as np
import pytest

import kvwire
from tests.wire import test_interop as T

pytestmark = pytest.mark.timeout(30)
L, H, D, N = 1, 8, 128, 128  # 32 tokens of K = 64 KiB: above the in-place threshold


@pytest.mark.parametrize("field,offset,value", [
    ("token_start", 8 + 12, 64),        # 96 -> 64: would overlap verified tokens 64..95
    ("layer_tokens", 8 + 20, N + 1024),  # a wrong layer size must not be learnt from it
])
async def test_corrupted_chunk_header_never_overwrites_verified_tokens(field: str, offset: int, value: int) -> None:
    rng = np.random.default_rng(1)
    k = rng.standard_normal((N, H, D)).astype(np.float16)
    v = rng.standard_normal((N, H, D)).astype(np.float16)
    async with kvwire.serve(secret=T.SECRET, resume_timeout=5) as server:
        got = asyncio.ensure_future(T._collect(server))
        r, w, wel = await T.open_session(server.port)
        tx = T.Sender(r, w, credit=wel.window)
        w.write(T.frame(T.BEGIN, T.begin_body(1, L, H, D, 1, "x", "req", b"")))
        while 1 not in tx.layer_limit:
            await tx.pump()
        await tx.send_chunk(1, 0, 0, 0, 96, N, k[0:96].tobytes())
        while tx.unacked:
            await tx.pump()
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
