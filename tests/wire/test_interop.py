"""An independent kvwire client, written from docs/protocol.md alone, against a real server.

Nothing here imports kvwire.wire or kvwire.aio internals: frames are built with
``struct``, checked with ``crc32c``, authenticated with ``hmac``/``hashlib`` and carried
over plain asyncio streams.  Only ``kvwire.serve``, ``kvwire.KVSpec`` and numpy are used,
to run the server and to check what it received.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import os
import struct
from dataclasses import dataclass, field

import numpy as np
import pytest
from crc32c import crc32c

import kvwire

pytestmark = pytest.mark.timeout(30)

SECRET = b"interop-secret-0123"
STEP = 5.0  # seconds any single wait may take

# Frame types (docs/protocol.md, "Frame types").
HELLO, CHALLENGE, AUTH, WELCOME = 0x01, 0x02, 0x03, 0x04
BEGIN, ACCEPT, CHUNK, ACK, CREDIT, RESET, REPORT = 0x10, 0x11, 0x12, 0x13, 0x14, 0x15, 0x16
PING, PONG, GOAWAY = 0x20, 0x21, 0x30

# Error codes (docs/protocol.md, "Error codes").
NO_ERROR, INTEGRITY_ERROR, AUTHENTICATION_FAILED, UNSUPPORTED_VERSION = 0x0000, 0x0002, 0x0004, 0x0005

MAGIC = b"KVWIRE\r\n"
HEADER = struct.Struct(">BBHI")  # type, flags, reserved, body length
CHUNK_FIXED = struct.Struct(">QHBBIIIH")  # 26 bytes


# -- framing ------------------------------------------------------------------------------


def frame(ftype: int, body: bytes) -> bytes:
    header = HEADER.pack(ftype, 0, 0, len(body))
    return header + body + struct.pack(">I", crc32c(header + body))


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    header = await asyncio.wait_for(reader.readexactly(8), STEP)
    ftype, _flags, reserved, length = HEADER.unpack(header)
    assert reserved == 0
    rest = await asyncio.wait_for(reader.readexactly(length + 4), STEP)
    body, (crc,) = rest[:-4], struct.unpack(">I", rest[-4:])
    assert crc32c(header + body) == crc, f"bad CRC on frame type 0x{ftype:02x}"
    return ftype, body


def parse_goaway(body: bytes) -> tuple[int, str]:
    code, n = struct.unpack_from(">HH", body)
    assert len(body) == 4 + n
    return code, body[4:].decode("utf-8")


def codec_list(names: list[str]) -> bytes:
    out = bytes([len(names)])
    for name in names:
        raw = name.encode()
        out += bytes([len(raw)]) + raw
    return out


def read_codec_list(body: bytes, pos: int) -> tuple[list[str], int]:
    count = body[pos]
    pos += 1
    names = []
    for _ in range(count):
        n = body[pos]
        names.append(body[pos + 1 : pos + 1 + n].decode())
        pos += 1 + n
    return names, pos


def fingerprint(num_layers: int, heads: int, head_dim: int, dtype: str, model: str) -> bytes:
    return hashlib.sha256(f"{num_layers}/{heads}/{head_dim}/{dtype}/{model}".encode()).digest()[:16]


# -- the handshake --------------------------------------------------------------------------


@dataclass
class Welcome:
    session_id: bytes
    max_frame_size: int
    window: int
    max_transfers: int
    codecs: list[str]


def hello_body(
    *, min_version: int = 1, max_version: int = 1, fp: bytes = bytes(16), session: bytes = bytes(16), index: int = 0
) -> bytes:
    return (
        struct.pack(">8sHH32s16sHI", MAGIC, min_version, max_version, os.urandom(32), session, index, 1 << 20)
        + codec_list(["raw"])
        + fp
    )


async def handshake(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: bytes, fp: bytes = bytes(16),
    session: bytes = bytes(16), version: int = 1,
) -> Welcome | tuple[int, str]:
    """HELLO (versions 1 to ``version``) -> CHALLENGE -> AUTH -> WELCOME; the server's
    GOAWAY (code, message) if refused."""
    hello = hello_body(fp=fp, session=session, max_version=version)
    writer.write(frame(HELLO, hello))
    ftype, challenge = await read_frame(reader)
    if ftype == GOAWAY:
        return parse_goaway(challenge)
    assert ftype == CHALLENGE and len(challenge) == 34
    (chosen,) = struct.unpack_from(">H", challenge)
    assert chosen == version  # the server speaks versions 1 and 2: the highest common one

    sha = lambda b: hashlib.sha256(b).digest()  # noqa: E731
    label = f"kvwire/{chosen} ".encode()
    client_proof = hmac.new(secret, label + b"client" + sha(hello) + sha(challenge), "sha256").digest()
    writer.write(frame(AUTH, client_proof))

    ftype, body = await read_frame(reader)
    if ftype == GOAWAY:
        return parse_goaway(body)
    assert ftype == WELCOME
    sid, mfs, window, max_transfers = struct.unpack_from(">16sIQI", body)
    codecs, pos = read_codec_list(body, 32)
    assert len(body) == pos + 32
    unsigned, proof = body[:pos], body[pos:]
    expected = hmac.new(
        secret,
        label + b"server" + sha(hello) + sha(challenge) + client_proof + sha(unsigned),
        "sha256",
    ).digest()
    assert hmac.compare_digest(proof, expected), "server failed to prove the secret"
    return Welcome(sid, mfs, window, max_transfers, codecs)


async def open_session(port: int, secret: bytes = SECRET, fp: bytes = bytes(16), session: bytes = bytes(16),  # type: ignore[no-untyped-def]
                       version: int = 1):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    result = await handshake(reader, writer, secret, fp, session, version)
    return reader, writer, result


async def close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(ConnectionError, TimeoutError):
        await asyncio.wait_for(writer.wait_closed(), STEP)


# -- a minimal sender -----------------------------------------------------------------------


def begin_body(tid: int, num_layers: int, heads: int, head_dim: int, dtype_id: int, model: str, request_id: str, meta: bytes) -> bytes:
    m, r = model.encode(), request_id.encode()
    return (
        struct.pack(">QHHHB", tid, num_layers, heads, head_dim, dtype_id)
        + bytes([len(m)]) + m
        + struct.pack(">H", len(r)) + r
        + struct.pack(">I", len(meta)) + meta
        + struct.pack(">H", 0)  # no prefix blocks
    )


def chunk_frame(tid: int, layer: int, kind: int, start: int, count: int, layer_tokens: int, payload: bytes,
                codec: int = 0x00) -> bytes:
    fixed = CHUNK_FIXED.pack(tid, layer, kind, codec, start, count, layer_tokens, 0)  # no params
    return frame(CHUNK, fixed + payload)


@dataclass
class Sender:
    """Connection credit, per-transfer layer credit and outstanding acks of one stream."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    credit: int
    layer_limit: dict[int, int] = field(default_factory=dict)
    unacked: dict[tuple[int, int, int, int], list[int]] = field(default_factory=dict)
    acks: list[tuple[int, int, int, int]] = field(default_factory=list)
    pongs: list[int] = field(default_factory=list)
    reports: list[tuple[int, dict[int, int]]] = field(default_factory=list)  # (transport_ns, {codec: decode_ns})

    async def pump(self) -> None:
        """Read and apply one frame from the server."""
        ftype, body = await read_frame(self.reader)
        if ftype in (ACCEPT, CREDIT):
            tid, limit = struct.unpack(">QI", body)
            self.layer_limit[tid] = max(self.layer_limit.get(tid, 0), limit)
        elif ftype == ACK:
            tid, layer, kind, pad, start = struct.unpack(">QHBBI", body)
            assert pad == 0
            addr = (tid, layer, kind, start)
            sizes = self.unacked[addr]
            self.credit += sizes.pop(0)
            if not sizes:
                del self.unacked[addr]
            self.acks.append(addr)
        elif ftype == PONG:
            self.pongs.append(struct.unpack(">Q", body)[0])
        elif ftype == REPORT:
            transport, count = struct.unpack_from(">IB", body)
            assert len(body) == 5 + 5 * count
            entries = [struct.unpack_from(">BI", body, 5 + 5 * i) for i in range(count)]
            decode = dict(entries)
            assert len(decode) == count  # each codec once
            self.reports.append((transport, decode))
        elif ftype == RESET:
            tid, code, n = struct.unpack_from(">QHH", body)
            raise AssertionError(f"RESET of transfer {tid}: 0x{code:04x} {body[12:12 + n].decode()}")
        elif ftype == GOAWAY:
            raise AssertionError(f"GOAWAY {parse_goaway(body)}")
        # any other type: ignored

    async def begin(self, tid: int, num_layers: int, heads: int, head_dim: int, model: str, request_id: str,
                    meta: bytes = b"") -> None:
        """BEGIN a float16 transfer and wait for its ACCEPT."""
        self.writer.write(frame(BEGIN, begin_body(tid, num_layers, heads, head_dim, 1, model, request_id, meta)))
        while tid not in self.layer_limit:
            await self.pump()

    async def send_chunk(self, tid: int, layer: int, kind: int, start: int, count: int, layer_tokens: int,
                         payload: bytes, codec: int = 0x00) -> None:
        while layer >= self.layer_limit.get(tid, 0):
            await self.pump()
        data = chunk_frame(tid, layer, kind, start, count, layer_tokens, payload, codec)
        while len(data) > self.credit:
            await self.pump()
        self.credit -= len(data)
        self.unacked.setdefault((tid, layer, kind, start), []).append(len(data))
        self.writer.write(data)
        await self.writer.drain()


# -- tests ------------------------------------------------------------------------------------


async def test_independent_client_transfers_a_cache() -> None:
    num_layers, heads, head_dim, tokens = 2, 2, 4, 10
    spec = kvwire.KVSpec(num_layers=num_layers, num_kv_heads=heads, head_dim=head_dim, dtype="float16", model="interop")
    fp = fingerprint(num_layers, heads, head_dim, "float16", "interop")
    assert fp == spec.fingerprint
    rng = np.random.default_rng(7)
    layers = [
        tuple(rng.standard_normal((tokens, heads, head_dim)).astype(np.float16) for _ in range(2))
        for _ in range(num_layers)
    ]
    # A buffer smaller than one layer: the server grants one layer at a time, so layer 1
    # can only be sent after a CREDIT, which comes once the application took layer 0.
    async with kvwire.serve(secret=SECRET, spec=spec, window=64 * 1024, max_frame_size=64 * 1024,
                            transfer_buffer_bytes=100) as server:
        received = asyncio.ensure_future(_collect(server))
        reader, writer, welcome = await open_session(server.port, fp=fp)
        try:
            assert isinstance(welcome, Welcome)
            assert welcome.window == 64 * 1024 and welcome.max_frame_size == 64 * 1024
            assert "raw" in welcome.codecs and len(welcome.session_id) == 16
            tx = Sender(reader, writer, credit=welcome.window)

            writer.write(frame(PING, struct.pack(">Q", 0xC0FFEE)))
            writer.write(frame(0x7E, b"an unknown frame type is ignored once open"))
            await tx.begin(1, num_layers, heads, head_dim, "interop", "interop-1", b'{"n":1}')
            assert tx.layer_limit[1] == 1  # ACCEPT grants at least one layer

            sent = 0
            for index, (k, v) in enumerate(layers):
                for kind, arr in ((0, k), (1, v)):
                    for start in range(0, tokens, 4):
                        count = min(4, tokens - start)
                        await tx.send_chunk(1, index, kind, start, count, tokens, arr[start : start + count].tobytes())
                        sent += 1
            # A duplicate is acknowledged again and dropped.
            await tx.send_chunk(1, 0, 0, 0, 4, tokens, layers[0][0][0:4].tobytes())
            while tx.unacked:
                await tx.pump()
            assert len(tx.acks) == sent + 1
            assert tx.acks.count((1, 0, 0, 0)) == 2
            assert tx.credit == welcome.window
            assert tx.layer_limit[1] == num_layers

            while not tx.pongs:
                await tx.pump()
            assert tx.pongs == [0xC0FFEE]

            transfer, cache = await asyncio.wait_for(received, STEP)
            assert transfer.request_id == "interop-1" and transfer.meta == {"n": 1}
            assert transfer.spec == spec
            assert len(cache.layers) == num_layers
            for (k, v), (rk, rv) in zip(layers, cache.layers, strict=True):
                assert rk.dtype == np.float16 and rk.shape == (tokens, heads, head_dim)
                assert rk.tobytes() == k.tobytes() and rv.tobytes() == v.tobytes()

            writer.write(frame(GOAWAY, struct.pack(">HH", NO_ERROR, 0)))
            await writer.drain()
        finally:
            received.cancel()
            await close(writer)


async def test_independent_client_sends_kv_chunks_in_version_2() -> None:
    """Version 2: a KV chunk carries a token range of K and V, K's bytes then V's; a whole
    layer in one frame, or part of one."""
    num_layers, heads, head_dim, tokens = 3, 2, 4, 10
    spec = kvwire.KVSpec(num_layers=num_layers, num_kv_heads=heads, head_dim=head_dim, dtype="float16", model="interop")
    rng = np.random.default_rng(8)
    layers = [tuple(rng.standard_normal((tokens, heads, head_dim)).astype(np.float16) for _ in range(2))
              for _ in range(num_layers)]
    async with kvwire.serve(secret=SECRET, spec=spec) as server:
        received = asyncio.ensure_future(_collect(server))
        reader, writer, welcome = await open_session(server.port, fp=spec.fingerprint, version=2)
        try:
            assert isinstance(welcome, Welcome)
            tx = Sender(reader, writer, credit=welcome.window)
            await tx.begin(1, num_layers, heads, head_dim, "interop", "interop-kv")
            k, v = layers[0]
            await tx.send_chunk(1, 0, 2, 0, tokens, tokens, k.tobytes() + v.tobytes())  # the whole layer
            while tx.layer_limit[1] < num_layers:
                await tx.pump()
            for index in (1, 2):  # K and V of tokens [0, 6) and [6, 10): layer 1 as KV, layer 2 as K, V
                k, v = layers[index]
                for start, count in ((0, 6), (6, 4)):
                    rows = slice(start, start + count)
                    if index == 1:
                        await tx.send_chunk(1, index, 2, start, count, tokens, k[rows].tobytes() + v[rows].tobytes())
                    else:
                        await tx.send_chunk(1, index, 0, start, count, tokens, k[rows].tobytes())
                        await tx.send_chunk(1, index, 1, start, count, tokens, v[rows].tobytes())
            while tx.unacked:
                await tx.pump()
            assert (1, 0, 2, 0) in tx.acks and (1, 1, 2, 6) in tx.acks  # ACKs name the KV address
            _transfer, cache = await asyncio.wait_for(received, STEP)
            for (k, v), (rk, rv) in zip(layers, cache.layers, strict=True):
                assert rk.tobytes() == k.tobytes() and rv.tobytes() == v.tobytes()
        finally:
            received.cancel()
            await close(writer)


async def test_a_kv_chunk_in_version_1_is_a_protocol_error() -> None:
    spec = kvwire.KVSpec(num_layers=1, num_kv_heads=1, head_dim=4, dtype="float16", model="interop")
    async with kvwire.serve(secret=SECRET, spec=spec) as server:
        reader, writer, welcome = await open_session(server.port, fp=spec.fingerprint, version=1)
        try:
            assert isinstance(welcome, Welcome)
            tx = Sender(reader, writer, credit=welcome.window)
            await tx.begin(1, 1, 1, 4, "interop", "interop-v1")
            writer.write(chunk_frame(1, 0, 2, 0, 2, 2, bytes(32)))
            while True:
                ftype, body = await read_frame(reader)
                if ftype == GOAWAY:
                    break
            code, message = parse_goaway(body)
            assert code == 0x0001 and "kind 2" in message  # PROTOCOL_ERROR
        finally:
            await close(writer)


async def test_independent_client_reads_the_servers_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    """REPORT as docs/protocol.md 4.10 lays it out, for raw chunks and int8 ones built from
    docs/codecs.md (f32 scales per (token, head), then int8 codes).  The server reports
    on every pump here (its interval and minimums patched), so some reports must come."""
    from kvwire.aio import server as server_module

    monkeypatch.setattr(server_module, "REPORT_INTERVAL", 0.0)
    monkeypatch.setattr(server_module, "REPORT_MIN_BYTES", 1)
    monkeypatch.setattr(server_module, "REPORT_MIN_ELEMENTS", 1)
    heads, head_dim, tokens = 2, 4, 10
    async with kvwire.serve(secret=SECRET) as server:
        received = asyncio.ensure_future(_collect(server))
        reader, writer, welcome = await open_session(server.port)
        try:
            assert "int8" in welcome.codecs
            tx = Sender(reader, writer, credit=welcome.window)
            writer.write(frame(BEGIN, begin_body(1, 1, heads, head_dim, 1, "", "reports", b"{}")))
            rows = tokens * heads
            scales = struct.pack(f"<{rows}f", *([0.5] * rows))
            codes = bytes((i % 255) - 127 & 0xFF for i in range(rows * head_dim))
            await tx.send_chunk(1, 0, 0, 0, tokens, tokens, scales + codes, codec=0x02)  # K: int8
            await tx.send_chunk(1, 0, 1, 0, tokens, tokens, bytes(2 * rows * head_dim))  # V: raw zeros
            while tx.unacked:
                await tx.pump()
            _, cache = await asyncio.wait_for(received, STEP)
            k = cache.layers[0][0].astype(np.float32).reshape(-1)
            assert k.tolist() == [0.5 * ((i % 255) - 127) for i in range(rows * head_dim)]
            writer.write(frame(PING, struct.pack(">Q", 1)))  # a PONG comes after any REPORT queued
            while not tx.pongs:
                await tx.pump()
            assert tx.reports, "no REPORT arrived"
            assert any(transport > 0 for transport, _ in tx.reports)
            decoded = {c for _, decode in tx.reports for c in decode}
            assert decoded == {0x02}  # the int8 chunk's decode; raw is never reported
        finally:
            received.cancel()
            await close(writer)


async def _collect(server: kvwire.Server):  # type: ignore[no-untyped-def]
    transfer = await server.accept()
    return transfer, await transfer.collect()


async def test_wrong_secret_gets_authentication_failed() -> None:
    async with kvwire.serve(secret=SECRET) as server:
        reader, writer, result = await open_session(server.port, secret=b"not-the-secret!!")
        try:
            assert result == (AUTHENTICATION_FAILED, "authentication failed")
            assert await asyncio.wait_for(reader.read(), STEP) == b""  # then the server closes
        finally:
            await close(writer)


async def test_unsupported_version_learns_only_the_code() -> None:
    async with kvwire.serve(secret=SECRET) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        try:
            writer.write(frame(HELLO, hello_body(min_version=7, max_version=9)))
            ftype, body = await read_frame(reader)
            assert ftype == GOAWAY
            assert parse_goaway(body) == (UNSUPPORTED_VERSION, "")
        finally:
            await close(writer)


async def test_corrupted_chunk_crc_gets_integrity_error() -> None:
    async with kvwire.serve(secret=SECRET) as server:
        reader, writer, welcome = await open_session(server.port)
        try:
            assert isinstance(welcome, Welcome)
            writer.write(frame(BEGIN, begin_body(1, 1, 1, 2, 1, "", "bad-crc", b"")))
            ftype, body = await read_frame(reader)
            assert ftype == ACCEPT and struct.unpack(">QI", body) == (1, 1)
            data = bytearray(chunk_frame(1, 0, 0, 0, 2, 2, np.ones((2, 1, 2), np.float16).tobytes()))
            data[-1] ^= 0x01  # flip one bit of the CRC
            writer.write(bytes(data))
            ftype, body = await read_frame(reader)
            assert ftype == GOAWAY
            code, _message = parse_goaway(body)
            assert code == INTEGRITY_ERROR
            assert await asyncio.wait_for(reader.read(), STEP) == b""
        finally:
            await close(writer)



async def test_broken_stream_resumes_and_resends_unacknowledged_chunks() -> None:
    num_layers, heads, head_dim, tokens = 2, 1, 8, 12
    rng = np.random.default_rng(11)
    layers = [
        tuple(rng.standard_normal((tokens, heads, head_dim)).astype(np.float16) for _ in range(2))
        for _ in range(num_layers)
    ]
    plan = [(layer, kind, start) for layer in range(num_layers) for kind in (0, 1) for start in range(0, tokens, 4)]

    def payload(layer: int, kind: int, start: int) -> bytes:
        return layers[layer][kind][start : start + 4].tobytes()

    async with kvwire.serve(secret=SECRET) as server:
        received = asyncio.ensure_future(_collect(server))
        reader, writer, welcome = await open_session(server.port)
        try:
            assert isinstance(welcome, Welcome)
            tx = Sender(reader, writer, credit=welcome.window)
            await tx.begin(5, num_layers, heads, head_dim, "", "resume-1")
            for layer, kind, start in plan[:3]:  # part of layer 0's K, never acknowledged here
                await tx.send_chunk(5, layer, kind, start, 4, tokens, payload(layer, kind, start))
        finally:
            await close(writer)  # the stream breaks: EOF without GOAWAY

        # Reconnect the same slot of the same session and re-send what was not acknowledged.
        reader, writer, again = await open_session(server.port, session=welcome.session_id)
        try:
            assert isinstance(again, Welcome) and again.session_id == welcome.session_id
            tx = Sender(reader, writer, credit=again.window, layer_limit={5: 1})
            for layer, kind, start in plan:
                await tx.send_chunk(5, layer, kind, start, 4, tokens, payload(layer, kind, start))
            while tx.unacked:
                await tx.pump()
            assert sorted(tx.acks) == sorted((5, *addr) for addr in plan)
            transfer, cache = await asyncio.wait_for(received, STEP)
            assert transfer.request_id == "resume-1"
            for (k, v), (rk, rv) in zip(layers, cache.layers, strict=True):
                assert rk.tobytes() == k.tobytes() and rv.tobytes() == v.tobytes()
        finally:
            received.cancel()
            await close(writer)
