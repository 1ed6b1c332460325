"""Whole transfers over real loopback sockets."""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import Any

import numpy as np
import pytest

import kvwire
from kvwire.codec import TensorKind, get_codec
from kvwire.wire.frames import DEFAULT_CHUNK_BYTES
from tests.conftest import SECRET, make_layers, require_send_queue, same_cache

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("streams", [1, 4])
async def test_32_layer_cache_arrives_bit_identical(streams: int) -> None:
    spec = kvwire.KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16", model="m")
    layers = make_layers(32, 300, 8, 128)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, streams=streams, chunk_bytes=64 * 1024) as peer:
            recv = asyncio.create_task(server.accept())
            receipt = await peer.send("req-1", spec, layers, meta={"prompt_tokens": 300})
            transfer = await recv
            cache = await transfer.collect(timeout=10)
    assert transfer.request_id == "req-1" and transfer.spec == spec
    assert transfer.meta == {"prompt_tokens": 300}
    assert same_cache(cache.layers, layers)
    assert receipt.kv_bytes == sum(k.nbytes + v.nbytes for k, v in layers)
    assert receipt.wire_bytes > receipt.kv_bytes  # headers and CRCs on top of raw bytes
    assert receipt.codec == "raw"
    if streams > 1:
        stats = peer.statistics()
        assert sum(1 for s in stats["streams"] if s["bytes_sent"] > 100_000) >= 2  # striped


@pytest.mark.parametrize(("chunk_bytes", "server_frame"), [
    (DEFAULT_CHUNK_BYTES, None),  # the defaults (4 MiB chunks), written in pieces
    (16 << 20, 16 << 20),  # one chunk per K or V, written in pieces
    (6 << 20, 8 << 20),  # a payload over SO_RCVLOWAT's cap
    (4 << 20, 1 << 20),  # chunks shrunk to fit the server's frame limit
    (1 << 20, None),  # written whole, checksummed just before
])
async def test_large_chunks_arrive_bit_identical(chunk_bytes: int, server_frame: int | None) -> None:
    """Payloads checksummed as they are written and read with SO_RCVLOWAT: every byte as
    sent, every chunk within the server's frame limit."""
    spec = kvwire.KVSpec(num_layers=2, num_kv_heads=8, head_dim=128, dtype="float16")
    layers = make_layers(2, 5000, 8, 128)  # 9.8 MiB per K or V
    opts = {} if server_frame is None else {"max_frame_size": server_frame + (64 << 10)}
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, **opts) as server:  # type: ignore[arg-type]
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, chunk_bytes=chunk_bytes) as peer:
            receipt = await peer.send("big", spec, layers, timeout=30)
        cache = await (await server.expect("big", timeout=10)).collect(timeout=10)
    assert same_cache(cache.layers, layers)
    limit = min(chunk_bytes, server_frame or chunk_bytes)
    per_tensor = -(-5000 * 8 * 128 * 2 // limit)  # chunks of at most `limit` bytes each
    assert receipt.chunks >= 2 * 2 * per_tensor


@pytest.mark.parametrize("head_dim", [32749, 32753, 32755])
async def test_a_chunk_larger_than_the_window_on_the_wire_fails_at_once(head_dim: int) -> None:
    """A window equal to the frame limit (allowed) cannot hold a frame of that limit's
    body: a frame is its body and 12 bytes more.  A token row between the two waited for
    credit for ever; it is refused at once, and the session goes on."""
    spec = kvwire.KVSpec(num_layers=1, num_kv_heads=1, head_dim=head_dim, dtype="float16")
    layer = np.ones((4, 1, head_dim), np.float16)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, max_frame_size=65536, window=65536) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            wire = 2 * head_dim + 26 + 12  # one token row's CHUNK frame
            if wire <= 65536:
                receiving = asyncio.ensure_future(server.expect("fits", timeout=10))
                await asyncio.wait_for(peer.send("fits", spec, [(layer, layer)]), 10)
                cache = await (await receiving).collect(timeout=10)
                assert same_cache(cache.layers, [(layer, layer)])
            else:
                with pytest.raises(kvwire.UsageError, match="window"):
                    await asyncio.wait_for(peer.send("too-big", spec, [(layer, layer)]), 10)
            small = kvwire.KVSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16")
            rows = np.ones((4, 1, 8), np.float16)
            receiving = asyncio.ensure_future(server.expect("after", timeout=10))
            await asyncio.wait_for(peer.send("after", small, [(rows, rows)]), 10)
            await (await receiving).collect(timeout=10)


@pytest.mark.parametrize("codec", ["raw", "int4"])
async def test_a_transfer_begins_with_a_small_chunk(codec: str) -> None:
    """The receiver grants one layer until the first chunk tells it the layer size: that
    chunk is 64 KiB (K of layer 0), the rest of the cache is chunked as configured (4 MiB)."""
    spec = kvwire.KVSpec(num_layers=3, num_kv_heads=8, head_dim=128, dtype="float16")
    layers = make_layers(3, 5000, 8, 128)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, codec=codec, chunk_bytes=4 << 20) as peer:
            added: list[tuple[int, int, int, int]] = []
            add = peer.core.add_chunk

            def spy(tid: int, chunk: kvwire.wire.Chunk, **kw: int) -> None:
                added.append((chunk.layer, chunk.kind, chunk.token_start, chunk.token_count))
                add(tid, chunk, **kw)

            peer.core.add_chunk = spy  # type: ignore[method-assign]
            receipt = await peer.send("lead", spec, layers, timeout=30)
        cache = await (await server.expect("lead", timeout=10)).collect(timeout=10)
    assert added[0] == (0, 0, 0, 32)  # 32 tokens of 2 KiB
    assert added[1] == (0, 0, 32, 2016)  # the rest of the first 4 MiB
    assert [c for c in added if c[:2] == (0, 1)] == [(0, 1, 0, 2048), (0, 1, 2048, 2048), (0, 1, 4096, 904)]
    assert [c for c in added if c[0] == 1][:3] == [(1, 0, 0, 2048), (1, 0, 2048, 2048), (1, 0, 4096, 904)]
    assert receipt.chunks == len(added) == 3 * 2 * 3 + 1
    # every chunk decodes to what the codec makes of exactly its own tokens
    c = get_codec(codec)
    for layer, kind, start, count in added:
        sent = layers[layer][kind][start : start + count]
        enc = c.encode(sent, TensorKind(kind))
        want = c.decode(enc.params, enc.payload, shape=sent.shape, dtype="float16", kind=TensorKind(kind))
        assert cache.layers[layer][kind][start : start + count].tobytes() == want.tobytes()
    if codec == "raw":
        assert same_cache(cache.layers, layers)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
async def test_every_dtype_round_trips(dtype: str) -> None:
    spec = kvwire.KVSpec(num_layers=3, num_kv_heads=2, head_dim=16, dtype=dtype)
    layers = make_layers(3, 77, 2, 16, dtype)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, streams=2) as peer:
            await peer.send("r", spec, layers)
            cache = await (await server.accept()).collect()
    assert same_cache(cache.layers, layers)


async def test_expect_before_and_after_arrival() -> None:
    spec = kvwire.KVSpec(num_layers=2, num_kv_heads=1, head_dim=8)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        early = asyncio.create_task(server.expect("first"))
        await asyncio.sleep(0)
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            a = make_layers(2, 5, 1, 8, seed=1)
            b = make_layers(2, 6, 1, 8, seed=2)
            await peer.send("other", spec, b)
            await peer.send("first", spec, a)
            t_first = await asyncio.wait_for(early, 5)
            t_other = await server.expect("other", timeout=5)  # arrived before we asked
            assert same_cache((await t_first.collect()).layers, a)
            assert same_cache((await t_other.collect()).layers, b)
        with pytest.raises(kvwire.TransferTimeoutError):
            await server.expect("never", timeout=0.1)


async def test_expects_of_one_request_id_take_one_transfer_each_in_order() -> None:
    """Requests that share a name (one prompt sampled n ways, or a name derived from the
    prompt) each expect() it: each takes one transfer, the oldest expect() first; one that
    gave up is passed over, and one made after the transfers came takes the oldest left."""
    spec = kvwire.KVSpec(num_layers=2, num_kv_heads=1, head_dim=8)
    caches = [make_layers(2, 5, 1, 8, seed=i) for i in range(4)]
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        first = asyncio.create_task(server.expect("shared", timeout=30))
        gave_up = asyncio.create_task(server.expect("shared", timeout=30))
        second = asyncio.create_task(server.expect("shared", timeout=30))
        await asyncio.sleep(0)
        gave_up.cancel()
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            for cache in caches:
                await peer.send("shared", spec, cache, timeout=10)
            got = [await asyncio.wait_for(first, 10), await asyncio.wait_for(second, 10),
                   await server.expect("shared", timeout=5), await server.expect("shared", timeout=5)]
            for t, cache in zip(got, caches, strict=True):
                assert same_cache((await t.collect(timeout=10)).layers, cache)
            with pytest.raises(kvwire.TransferTimeoutError):
                await server.expect("shared", timeout=0.1)
        with pytest.raises(asyncio.CancelledError):
            await gave_up


async def test_an_expect_cancelled_as_its_transfer_is_handed_over_aborts_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """expect() cancelled in the moment its transfer was handed to it (the transfer is
    its, but the caller is gone): the transfer is aborted, and the sender told, rather
    than received for nobody."""
    spec = kvwire.KVSpec(num_layers=2, num_kv_heads=1, head_dim=8)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        waiting = asyncio.create_task(server.expect("gone"))
        await asyncio.sleep(0)
        deliver = server._deliver

        def deliver_then_cancel(transfer: Any) -> None:
            deliver(transfer)
            waiting.cancel()

        monkeypatch.setattr(server, "_deliver", deliver_then_cancel)
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            with pytest.raises(kvwire.TransferAbortedError):
                await peer.send("gone", spec, make_layers(2, 64, 1, 8), timeout=10)
        with pytest.raises(asyncio.CancelledError):
            await waiting


async def test_16_concurrent_transfers_on_one_peer() -> None:
    spec = kvwire.KVSpec(num_layers=4, num_kv_heads=2, head_dim=32)
    caches = {f"r{i}": make_layers(4, 50 + i, 2, 32, seed=i) for i in range(16)}
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, streams=3, chunk_bytes=4096) as peer:
            async def receive(rid: str) -> bool:
                t = await server.expect(rid, timeout=10)
                return same_cache((await t.collect(timeout=10)).layers, caches[rid])

            recvs = [asyncio.create_task(receive(rid)) for rid in caches]
            receipts = await asyncio.gather(*(peer.send(rid, spec, c) for rid, c in caches.items()))
            assert all(await asyncio.gather(*recvs))
    assert len({r.transfer_id for r in receipts}) == 16


async def test_layers_are_pipelined() -> None:
    """The producer waits after layer 0 until the receiver has it: deadlocks unless layer-wise."""
    spec = kvwire.KVSpec(num_layers=4, num_kv_heads=2, head_dim=16)
    layers = make_layers(4, 64, 2, 16)
    seen_layer0 = asyncio.Event()

    async def produce():  # type: ignore[no-untyped-def]
        for i, kv in enumerate(layers):
            yield kv
            if i == 0:
                await asyncio.wait_for(seen_layer0.wait(), 10)

    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            send = asyncio.create_task(peer.send("p", spec, produce()))
            transfer = await server.accept(timeout=5)
            got = {}
            async for layer in transfer:
                got[layer.index] = (layer.k, layer.v)
                if layer.index == 0:
                    seen_layer0.set()
            await send
    assert same_cache([got[i] for i in range(4)], layers)


async def test_async_for_then_collect_is_refused() -> None:
    spec = kvwire.KVSpec(num_layers=1, num_kv_heads=1, head_dim=8)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            await peer.send("x", spec, make_layers(1, 3, 1, 8))
            t = await server.accept()
            await t.collect()
            with pytest.raises(kvwire.UsageError):
                await t.collect()


async def test_huge_frame_header_is_refused_before_allocation() -> None:
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(struct.pack(">BBHI", 0x01, 0, 0, 0xFFFFFFF0))
        await writer.drain()
        reply = await asyncio.wait_for(reader.read(1024), 5)
        assert reply[0] == 0x30  # GOAWAY
        code = struct.unpack(">H", reply[8:10])[0]
        assert code == kvwire.ErrorCode.FRAME_TOO_LARGE
        assert await asyncio.wait_for(reader.read(1024), 5) == b""  # and it closes
        writer.close()
        # ... and keeps serving others
        await _small_transfer(server.port)


async def _small_transfer(port: int) -> None:
    spec = kvwire.KVSpec(num_layers=1, num_kv_heads=1, head_dim=8)
    layers = make_layers(1, 4, 1, 8)
    async with kvwire.connect("127.0.0.1", port, secret=SECRET) as peer:
        await peer.send("ok", spec, layers, timeout=10)


async def test_wrong_secret_fails_on_both_sides_and_no_data_is_accepted() -> None:
    spec = kvwire.KVSpec(num_layers=1, num_kv_heads=1, head_dim=8)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        with pytest.raises(kvwire.AuthenticationError):
            async with kvwire.connect("127.0.0.1", server.port, secret=b"not-the-secret") as peer:
                await peer.send("bad", spec, make_layers(1, 4, 1, 8))
        assert server.statistics()["transfers_accepted"] == 0
        assert server.statistics()["sessions"] == 0
        await _small_transfer(server.port)


async def test_server_without_the_secret_is_refused_by_the_client() -> None:
    async with kvwire.serve("127.0.0.1", 0, secret=b"server-only-secret") as server:
        with pytest.raises(kvwire.AuthenticationError):
            async with kvwire.connect("127.0.0.1", server.port, secret=SECRET):
                pass


async def test_mismatched_spec_is_an_incompatible_peer() -> None:
    server_spec = kvwire.KVSpec(num_layers=32, num_kv_heads=8, head_dim=128)
    other = kvwire.KVSpec(num_layers=32, num_kv_heads=8, head_dim=64)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, spec=server_spec) as server:
        with pytest.raises(kvwire.IncompatiblePeerError):
            async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, spec=other):
                pass
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            with pytest.raises(kvwire.IncompatiblePeerError):
                await peer.send("x", other, make_layers(32, 2, 8, 64), timeout=10)
            # the connection survives a refused transfer
            await peer.send("y", server_spec, make_layers(32, 2, 8, 128), timeout=10)


async def test_unknown_codec_fails_before_sending() -> None:
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, codecs=["raw"]) as server:
        with pytest.raises(kvwire.UsageError):
            kvwire.connect("127.0.0.1", server.port, secret=SECRET, codec="no-such-codec")


async def test_killed_connection_without_resume_fails_every_waiter_on_both_sides() -> None:
    spec = kvwire.KVSpec(num_layers=8, num_kv_heads=2, head_dim=16)
    layers = make_layers(8, 64, 2, 16)
    release = asyncio.Event()

    async def produce():  # type: ignore[no-untyped-def]
        for i, kv in enumerate(layers):
            yield kv
            if i == 2:
                await release.wait()

    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        peer = kvwire.connect("127.0.0.1", server.port, secret=SECRET, streams=2, reconnect_attempts=0)
        await peer.open()
        sends = [asyncio.create_task(peer.send(f"k{i}", spec, produce())) for i in range(3)]
        transfers = [await server.expect(f"k{i}", timeout=5) for i in range(3)]
        collects = [asyncio.create_task(t.collect()) for t in transfers]
        await asyncio.sleep(0.2)
        peer.streams[1].transport.abort()  # type: ignore[union-attr]  # the kill
        results = await asyncio.wait_for(
            asyncio.gather(*sends, *collects, return_exceptions=True), 10
        )
        assert all(isinstance(r, kvwire.ConnectionLostError) for r in results), results
        await peer.close()
        await _small_transfer(server.port)  # the server keeps serving


async def test_connect_to_nothing_is_a_kvwire_error() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(kvwire.ConnectionLostError):
        async with kvwire.connect("127.0.0.1", port, secret=SECRET):
            pass


async def test_bad_layers_are_usage_errors() -> None:
    spec = kvwire.KVSpec(num_layers=2, num_kv_heads=2, head_dim=8)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            wrong_dtype = [(np.zeros((4, 2, 8), np.float32), np.zeros((4, 2, 8), np.float32))] * 2
            with pytest.raises(kvwire.UsageError, match="dtype"):
                await peer.send("a", spec, wrong_dtype)
            # an iterator (a list's length is checked before anything is sent)
            too_few = iter(make_layers(1, 4, 2, 8))
            with pytest.raises(kvwire.UsageError, match="layers"):
                await peer.send("b", spec, too_few)
            # the receiver sees those transfers aborted, never a partial cache
            t = await server.expect("b", timeout=5)
            with pytest.raises(kvwire.TransferAbortedError):
                await t.collect(timeout=5)
            await peer.send("c", spec, make_layers(2, 4, 2, 8), timeout=10)


async def test_server_transfer_deadline_fails_both_sides() -> None:
    spec = kvwire.KVSpec(num_layers=3, num_kv_heads=1, head_dim=8)
    layers = make_layers(3, 4, 1, 8)
    never = asyncio.Event()

    async def stuck():  # type: ignore[no-untyped-def]
        yield layers[0]
        await never.wait()

    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, transfer_timeout=0.5) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            send = asyncio.create_task(peer.send("slow", spec, stuck()))
            t = await server.expect("slow", timeout=5)
            with pytest.raises(kvwire.TransferTimeoutError):
                await t.collect(timeout=5)
            with pytest.raises(kvwire.TransferTimeoutError):
                await asyncio.wait_for(send, 5)
            await peer.send("next", spec, layers, timeout=5)  # the session goes on


async def test_silent_server_is_detected_by_the_idle_timeout() -> None:
    # A listener that completes TCP but never speaks: the handshake deadline fires.
    writers: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)

    srv = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        with pytest.raises(kvwire.TransferTimeoutError):
            async with kvwire.connect("127.0.0.1", port, secret=SECRET, connect_timeout=0.3):
                pass
    finally:
        for w in writers:
            w.close()
        srv.close()
        await srv.wait_closed()


@pytest.mark.parametrize("streams", [1, 3])
async def test_killed_stream_is_resumed_and_the_transfer_completes_identical(streams: int) -> None:
    spec = kvwire.KVSpec(num_layers=8, num_kv_heads=2, head_dim=16)
    layers = make_layers(8, 64, 2, 16)
    halfway = asyncio.Event()
    go_on = asyncio.Event()

    async def produce():  # type: ignore[no-untyped-def]
        for i, kv in enumerate(layers):
            yield kv
            if i == 3:
                halfway.set()
                await go_on.wait()

    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, streams=streams,
                                  chunk_bytes=1024) as peer:
            send = asyncio.create_task(peer.send("r", spec, produce(), timeout=20))
            t = await server.expect("r", timeout=5)
            collect = asyncio.create_task(t.collect(timeout=20))
            await halfway.wait()
            victim = peer.streams[streams - 1]
            victim.transport.abort()  # type: ignore[union-attr]
            go_on.set()
            receipt = await send
            cache = await collect
            # the break was noticed (its connection_lost ran before the producer went on):
            # the session resumed the slot. Whether it also reconnected or resent chunks
            # before the transfer ended depends on what was in flight on it.
            assert peer.resumes >= 1
    assert same_cache(cache.layers, layers)
    assert receipt.kv_bytes == sum(k.nbytes + v.nbytes for k, v in layers)


async def test_receiver_restart_fails_the_transfer_cleanly() -> None:
    spec = kvwire.KVSpec(num_layers=4, num_kv_heads=1, head_dim=8)
    layers = make_layers(4, 8, 1, 8)
    gate = asyncio.Event()

    async def produce():  # type: ignore[no-untyped-def]
        for i, kv in enumerate(layers):
            yield kv
            if i == 1:
                await gate.wait()

    server = kvwire.serve("127.0.0.1", 0, secret=SECRET)
    await server.start()
    port = server.port
    peer = kvwire.connect("127.0.0.1", port, secret=SECRET, reconnect_backoff=0.05, reconnect_attempts=4)
    await peer.open()
    send = asyncio.create_task(peer.send("r", spec, produce(), timeout=20))
    t = await server.expect("r", timeout=5)
    collect = asyncio.create_task(t.collect())
    await asyncio.sleep(0.1)
    await server.close()  # the receiver goes away with the transfer half done ...
    restarted = kvwire.serve("127.0.0.1", port, secret=SECRET)
    await restarted.start()  # ... and comes back without the session
    try:
        gate.set()
        with pytest.raises(kvwire.ConnectionLostError):
            await send
        with pytest.raises(kvwire.ConnectionLostError):
            await collect  # never a half-filled cache
    finally:
        await peer.close()
        await restarted.close()


async def test_streams_auto_opens_a_pool_and_delivers() -> None:
    spec = kvwire.KVSpec(num_layers=4, num_kv_heads=2, head_dim=32)
    layers = make_layers(4, 256, 2, 32)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, streams="auto",
                                  max_streams=3, chunk_bytes=4096) as peer:
            assert len(peer.streams) == 3
            assert 1 <= peer.active_streams <= 3
            recv = asyncio.create_task(server.accept())
            await peer.send("auto", spec, layers, timeout=10)
            assert same_cache((await (await recv).collect()).layers, layers)
            # the streams beyond those in use carried no chunks
            idle = peer.statistics()["streams"][peer.active_streams :]
            assert all(s["bytes_sent"] < 5000 for s in idle)
    with pytest.raises(kvwire.UsageError):
        kvwire.connect("127.0.0.1", 1, secret=SECRET, streams="many")


def _send_128_mib_on_uvloop(streams: int) -> None:
    """A 128 MiB cache (more than the kernel takes at once) over ``kvwire.aio.run``'s
    uvloop, sent and received bit-identical."""
    spec = kvwire.KVSpec(num_layers=8, num_kv_heads=8, head_dim=128, dtype="float16")
    layers = make_layers(8, 4096, 8, 128)  # 8 MiB per K or V

    async def main() -> tuple[kvwire.Receipt, list[tuple[np.ndarray, np.ndarray]]]:
        async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
            async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, streams=streams) as peer:
                receipt = await peer.send("uv", spec, layers, timeout=60)
            cache = await (await server.expect("uv", timeout=10)).collect(timeout=30)
        return receipt, cache.layers

    receipt, got = kvwire.aio.run(main())
    assert same_cache(got, layers) and receipt.chunks >= 2 * 8 * 2


@pytest.mark.parametrize("streams", [1, 2])
def test_on_uvloop_every_stream_writes_through_its_send_queue(
    streams: int, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the compiled send queue, both sides' streams write through it (nothing through
    the transport) and the cache arrives as sent."""
    import kvwire.aio._stream as stream_mod

    require_send_queue()
    queued: list[bool] = []
    through_transport: list[object] = []
    open_own, write_parts = stream_mod.Stream._open_own, stream_mod.write_parts

    def spy_open(self: stream_mod.Stream, sock: object) -> None:
        open_own(self, sock)
        queued.append(self._queue is not None)

    def spy_write(tr: object, parts: object, gather: bool = False) -> None:
        through_transport.append(parts)
        write_parts(tr, parts, gather)  # type: ignore[arg-type]

    monkeypatch.setattr(stream_mod.Stream, "_open_own", spy_open)
    monkeypatch.setattr(stream_mod, "write_parts", spy_write)
    _send_128_mib_on_uvloop(streams)
    assert len(queued) == 2 * streams and all(queued)  # the client's streams and the server's
    assert through_transport == []


@pytest.mark.parametrize("streams", [1, 2])
def test_without_the_send_queue_frames_go_out_gathered_on_uvloop_and_arrive_bit_identical(
    streams: int, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without the compiled send queue (not built) a stream writes through its transport:
    on uvloop each frame's head in one writev with its first payload piece."""
    import kvwire.aio._stream as stream_mod

    gathered: list[bool] = []
    write_parts = stream_mod.write_parts

    def spy(tr: object, parts: object, gather: bool = False) -> None:
        gathered.append(gather)
        write_parts(tr, parts, gather)  # type: ignore[arg-type]

    monkeypatch.setattr(stream_mod, "_sendq", None)
    monkeypatch.setattr(stream_mod, "write_parts", spy)
    _send_128_mib_on_uvloop(streams)
    assert gathered and all(gathered)  # both sides' streams, every write
