"""What a hostile or faulty peer could do to a server (and a client) and must not: each test
is one defect found by an independent client written from docs/protocol.md, over real
loopback sockets.  A client that floods PINGs and never reads the PONGs:
tests/aio/test_server_reply_queue.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

import kvwire
from kvwire.aio._pool import size_class
from kvwire.aio._receive import ArrayStore
from kvwire.errors import ErrorCode
from kvwire.session.receiver import WIRE_TEXT_LIMIT
from kvwire.wire import Ack, Begin, Chunk, FrameDecoder, Reset, frame_bytes
from kvwire.wire.frames import Accept
from tests.conftest import SECRET, make_layers, same_cache
from tests.rawpeer import raw_client, wait_until
from tests.system.loop_helpers import loop_errors

pytestmark = pytest.mark.timeout(60)

SPEC = kvwire.KVSpec(num_layers=4, num_kv_heads=2, head_dim=16)
TOKENS = 96


def layers(seed: int = 0, tokens: int = TOKENS) -> list[tuple[np.ndarray, np.ndarray]]:
    return make_layers(SPEC.num_layers, tokens, SPEC.num_kv_heads, SPEC.head_dim, seed=seed)


async def frames_until(reader: asyncio.StreamReader, want: type, *, timeout: float = 5.0) -> list[Any]:
    """Frames from the server until one of type ``want`` arrived."""
    dec = FrameDecoder(1 << 24)
    got: list[Any] = []
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not any(isinstance(f, want) for f in got):
        data = await asyncio.wait_for(reader.read(65536), max(0.01, end - loop.time()))
        assert data, f"server closed before a {want.__name__}: {got}"
        got += [f for f, _ in dec.feed(data)]
    return got


# -- the receive path -------------------------------------------------------------------


async def test_allocation_failure_fails_the_transfer_on_both_sides_and_never_gives_a_receipt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    original = ArrayStore.allocate
    failed: list[int] = []

    def allocate_once_out_of_memory(self: ArrayStore, key: Any, chunk: Chunk, nbytes: int) -> Any:
        if chunk.layer == 2 and not failed:
            failed.append(chunk.layer)
            raise MemoryError
        return original(self, key, chunk, nbytes)

    monkeypatch.setattr(ArrayStore, "allocate", allocate_once_out_of_memory)
    sent = layers(1)
    async with loop_errors() as errors, kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, chunk_bytes=1024) as peer:
            recv = asyncio.create_task(server.expect("oom", timeout=10))
            with pytest.raises(kvwire.LimitExceededError):
                await peer.send("oom", SPEC, sent, timeout=10)
            t = await recv
            with pytest.raises(kvwire.LimitExceededError):
                await t.collect(timeout=10)
            # the session survives and the next transfer is complete and exact
            recv = asyncio.create_task(server.expect("after", timeout=10))
            await peer.send("after", SPEC, sent, timeout=10)
            assert same_cache((await (await recv).collect(timeout=10)).layers, sent)
        assert server.statistics()["buffered_bytes"] == 0
    assert failed == [2]
    assert errors == []


@pytest.mark.parametrize("exc", [OverflowError, RecursionError, ValueError, MemoryError])
async def test_any_decoder_exception_becomes_a_typed_error(monkeypatch: pytest.MonkeyPatch, exc: type) -> None:
    codec = kvwire.codec.get_codec("fp8")

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise exc("from a codec")

    monkeypatch.setattr(codec, "decode", broken)
    async with loop_errors() as errors, kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, codec="fp8") as peer:
            with pytest.raises(kvwire.KvwireError) as info:
                await peer.send("bad", SPEC, layers(), timeout=10)
    expected = kvwire.LimitExceededError if exc is MemoryError else kvwire.ProtocolError
    assert isinstance(info.value, expected)
    assert errors == []


async def test_chunk_that_would_decompress_beyond_the_limit_is_refused_before_decompressing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = kvwire.KVSpec(num_layers=1, num_kv_heads=8, head_dim=128)
    zeros = np.zeros((4096, 8, 128), np.float16)  # 8 MiB per K: a few KiB compressed
    codec = kvwire.codec.get_codec("raw+zstd")
    calls: list[int] = []
    original = type(codec)._decompress

    def spy(self: Any, data: Any, size: int) -> bytes:
        calls.append(size)
        return original(self, data, size)

    monkeypatch.setattr(type(codec), "_decompress", spy)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, max_chunk_bytes=1 << 20) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, codec="raw+zstd",
                                  chunk_bytes=16 << 20) as peer:
            with pytest.raises(kvwire.LimitExceededError):
                await peer.send("bomb", spec, [(zeros, zeros)], timeout=10)
    # the transfer's small first chunk (64 KiB) was within the limit and decompressed; the
    # 8 MiB one after it never was
    assert calls == [64 << 10]


async def test_layer_larger_than_max_layer_bytes_is_refused() -> None:
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, max_layer_bytes=8 * 1024) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            with pytest.raises(kvwire.LimitExceededError):
                await peer.send("big", SPEC, layers(tokens=200), timeout=10)  # 25.6 KB a layer
            await peer.send("small", SPEC, layers(tokens=32), timeout=10)  # 4 KB a layer


# -- output to a peer that does not read --------------------------------------------------


async def test_a_peer_text_is_not_echoed_back_in_full() -> None:
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        _, reader, writer = await raw_client(server.port)
        begin = Begin(transfer_id=1, num_layers=1, num_kv_heads=1, head_dim=8, dtype_id=1, model="",
                      request_id="echo", meta=b"{}")
        writer.write(frame_bytes(begin))
        await frames_until(reader, Accept)
        writer.write(frame_bytes(Reset(transfer_id=1, code=int(ErrorCode.CANCELLED), message="x" * 1000)))
        payload = bytes(16 * 2 * 8)
        chunks = b"".join(
            frame_bytes(Chunk(transfer_id=1, layer=0, kind=k, codec_id=0, token_start=0, token_count=16,
                              layer_tokens=16, params=b"", payload=payload[: 16 * 8 * 2]))
            for k in (0, 1)
        )
        writer.write(chunks)
        got = await frames_until(reader, Ack)
        resets = [f for f in got if isinstance(f, Reset)]
        assert resets and all(len(r.message.encode()) <= WIRE_TEXT_LIMIT for r in resets)
        assert all("x" * 100 not in r.message for r in resets)
        writer.transport.abort()


# -- memory held for the application -------------------------------------------------------


async def test_unclaimed_transfers_count_toward_max_transfers_and_are_dropped_after_claim_timeout() -> None:
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, max_transfers=2, claim_timeout=0.5) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            await peer.send("a", SPEC, layers(), timeout=10)
            await peer.send("b", SPEC, layers(), timeout=10)
            assert server.statistics()["buffered_bytes"] > 0
            with pytest.raises(kvwire.LimitExceededError):
                await peer.send("c", SPEC, layers(), timeout=10)
            loop = asyncio.get_running_loop()
            end = loop.time() + 5
            while server.statistics().get("transfers_unclaimed", 0) < 2 and loop.time() < end:
                await asyncio.sleep(0.05)
            stats = server.statistics()
            assert stats["transfers_unclaimed"] == 2
            assert stats["buffered_bytes"] == 0 and stats["pending_arrivals"] == 0
            with pytest.raises(kvwire.TransferTimeoutError):
                await server.expect("a", timeout=0.1)
            recv = asyncio.create_task(server.expect("d", timeout=10))
            sent = layers(4)
            await peer.send("d", SPEC, sent, timeout=10)
            assert same_cache((await (await recv).collect(timeout=10)).layers, sent)


async def test_tiny_layers_count_as_the_memory_they_take() -> None:
    """Layers of a few bytes each take a 64 KiB pool slab: the budget counts that, so a
    transfer of many tiny layers cannot hold thousands of times max_buffer_bytes."""
    spec = kvwire.KVSpec(num_layers=40, num_kv_heads=1, head_dim=8)
    tiny = make_layers(spec.num_layers, 1, 1, 8, seed=3)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, max_buffer_bytes=1 << 20) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            # Nobody takes its layers: it stops at the 14 slabs its window may have (the
            # budget's 16 less the eighth kept for first layers; bounded by the budget,
            # whatever transfer_buffer_bytes says) ...
            first = asyncio.create_task(peer.send("tiny", spec, tiny, timeout=60))
            async with asyncio.timeout(30):
                while server.statistics()["buffered_bytes"] < 14 * 64 * 1024:
                    await asyncio.sleep(0.01)
            assert not first.done()
            assert server.statistics()["buffered_bytes"] <= (1 << 20) + (1 << 20)  # (and the room kept past it)
            # ... two more transfers' first layers take the room left, and a fourth waits to
            # start (its ACCEPT waits for room for its first layer).
            more = [asyncio.create_task(peer.send(f"tiny{i}", spec, tiny, timeout=60)) for i in (2, 3)]
            assert await wait_until(lambda: server.statistics()["transfers_waiting_for_room"] == 3, 30)  # (and "tiny")
            more.append(asyncio.create_task(peer.send("tiny4", spec, tiny, timeout=60)))
            assert await wait_until(lambda: server.statistics()["transfers_waiting_to_start"] == 1, 30)
            assert server.statistics()["admission_waits"] == 1 and not more[-1].done()
            assert server.statistics()["buffered_bytes"] <= (1 << 20) + (1 << 20)
            for task in (first, *more):
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task


async def test_server_wide_byte_budget_slows_what_does_not_fit() -> None:
    # A layer counts as the pool slab it takes (its size class, at least 64 KiB).
    layer_bytes = size_class(2 * TOKENS * SPEC.num_kv_heads * SPEC.head_dim * 2)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, max_buffer_bytes=5 * layer_bytes) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            await peer.send("one", SPEC, layers(), timeout=10)  # 4 layers held, unclaimed
            # The second's first layer fits; the rest of it waits for credit (slowed, not
            # failed: protocol.md 8.2) until the application takes layers.
            two = asyncio.create_task(peer.send("two", SPEC, layers(), timeout=10))
            assert await wait_until(lambda: server.statistics()["transfers_waiting_for_room"] == 1, 5)
            # A third finds no room for its first layer: it waits to start (not failed with
            # LIMIT_EXCEEDED).
            three = asyncio.create_task(peer.send("three", SPEC, layers(), timeout=10))
            assert await wait_until(lambda: server.statistics()["transfers_waiting_to_start"] == 1, 5)
            assert server.statistics()["buffered_bytes"] <= 5 * layer_bytes
            assert not two.done() and not three.done()
            t = await server.expect("one", timeout=5)
            await t.collect(timeout=5)
            # (the room left holds three's first layer and less than two's window: two's
            # sender finishes as its layers are taken)
            await asyncio.gather(two, (await server.expect("two", timeout=5)).collect(timeout=10))
            await asyncio.gather(three, (await server.expect("three", timeout=5)).collect(timeout=10))
            stats = server.statistics()
            assert stats["buffered_bytes"] == 0 and stats["reserved_bytes"] == 0
            assert stats["transfers_waiting_to_start"] == 0 and stats["admission_waits"] == 1
            assert stats["buffer_budget_refusals"] == 0
            await peer.send("four", SPEC, layers(), timeout=10)


# -- the receiving application gives up --------------------------------------------------


async def _stalled_producer(gate: asyncio.Event) -> AsyncIterator[tuple[np.ndarray, np.ndarray]]:
    for i, kv in enumerate(layers()):
        if i == 2:
            await gate.wait()
        yield kv


@pytest.mark.parametrize("how", ["abort", "break", "collect-timeout"])
async def test_receiver_giving_up_fails_the_sender_promptly_with_transfer_aborted(how: str) -> None:
    gate = asyncio.Event()
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, transfer_timeout=60) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            send = asyncio.create_task(peer.send("gives-up", SPEC, _stalled_producer(gate), timeout=30))
            t = await server.expect("gives-up", timeout=5)
            if how == "abort":
                t.abort("no room for it")
            elif how == "break":
                async for _layer in t:
                    break
            else:
                with pytest.raises(kvwire.TransferTimeoutError):
                    await t.collect(timeout=0.2)
            with pytest.raises(kvwire.TransferAbortedError):
                await asyncio.wait_for(send, 5)
            gate.set()
            assert server.statistics()["transfers_aborted"] == 1
            await peer.send("next", SPEC, layers(), timeout=10)


# -- meta, options, expect ---------------------------------------------------------------


async def test_meta_must_be_a_bounded_json_object() -> None:
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, max_meta_bytes=1024) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            with pytest.raises(kvwire.UsageError):
                await peer.send("list", SPEC, layers(), meta=[1, 2], timeout=10)  # type: ignore[arg-type]
            with pytest.raises(kvwire.LimitExceededError):
                await peer.send("big", SPEC, layers(), meta={"x": "y" * 2000}, timeout=10)
            with pytest.raises(kvwire.UsageError):
                await peer.send("huge", SPEC, layers(), meta={"x": "y" * (8 << 20)}, timeout=10)
        _, reader, writer = await raw_client(server.port)
        for tid, meta in enumerate([b"[1]", b"[1", b"\xff"], start=1):
            begin = Begin(transfer_id=tid, num_layers=1, num_kv_heads=1, head_dim=8, dtype_id=1,
                          model="", request_id=f"m{tid}", meta=meta)
            writer.write(frame_bytes(begin))
            got = await frames_until(reader, Reset)
            [reset] = [f for f in got if isinstance(f, Reset)]
            assert reset.code == ErrorCode.PROTOCOL_ERROR, reset
        writer.transport.abort()


async def test_deeply_nested_meta_is_a_protocol_error_not_recursion() -> None:
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, max_meta_bytes=256 * 1024) as server:
        _, reader, writer = await raw_client(server.port)
        meta = b'{"a":' * 20_000 + b"1" + b"}" * 20_000
        begin = Begin(transfer_id=1, num_layers=1, num_kv_heads=1, head_dim=8, dtype_id=1,
                      model="", request_id="deep", meta=meta)
        writer.write(frame_bytes(begin))
        [reset] = [f for f in await frames_until(reader, Reset) if isinstance(f, Reset)]
        assert reset.code == ErrorCode.PROTOCOL_ERROR, reset
        writer.transport.abort()


@pytest.mark.parametrize("port", [70000, -1, "80"])
def test_port_out_of_range_is_a_usage_error(port: Any) -> None:
    with pytest.raises(kvwire.UsageError):
        kvwire.serve("127.0.0.1", port, secret=SECRET)
    with pytest.raises(kvwire.UsageError):
        kvwire.connect("127.0.0.1", port, secret=SECRET)


@pytest.mark.parametrize("option", [
    {"handshake_timeout": -1}, {"idle_timeout": 0}, {"transfer_timeout": -5.0}, {"resume_timeout": -1},
    {"window": 1000}, {"max_frame_size": 10}, {"max_transfers": 0}, {"claim_timeout": -1},
    {"max_buffer_bytes": 0},
])
def test_serve_options_are_validated(option: dict[str, Any]) -> None:
    with pytest.raises(kvwire.UsageError):
        kvwire.serve("127.0.0.1", 0, secret=SECRET, **option)


@pytest.mark.parametrize("option", [
    {"connect_timeout": -1}, {"chunk_bytes": 0}, {"reconnect_attempts": -1}, {"reconnect_backoff": -0.1},
    {"idle_timeout": 0}, {"max_frame_size": 10},
])
def test_connect_options_are_validated(option: dict[str, Any]) -> None:
    with pytest.raises(kvwire.UsageError):
        kvwire.connect("127.0.0.1", 1, secret=SECRET, **option)


async def test_errors_have_one_class_per_wire_code_on_both_sides() -> None:
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, codecs=["raw", "fp8"], max_tokens=64) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            recv = asyncio.create_task(server.expect("long", timeout=5))
            with pytest.raises(kvwire.LimitExceededError) as sender_side:
                await peer.send("long", SPEC, layers(tokens=100), timeout=10)
            t = await recv
            with pytest.raises(kvwire.KvwireError) as receiver_side:
                await t.collect(timeout=5)
    assert type(receiver_side.value) is type(sender_side.value)
    assert receiver_side.value.code == sender_side.value.code == ErrorCode.LIMIT_EXCEEDED
    for code in ErrorCode:
        err = kvwire.errors.error_from_code(code, "")
        assert err.code == code
        assert code.name in str(err)  # a peer's GOAWAY or RESET with no text: not an empty message


async def test_meta_over_64k_is_refused_once_not_reconnected_forever() -> None:
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            with pytest.raises(kvwire.LimitExceededError):
                await peer.send("meta", SPEC, layers(), meta={"x": "y" * 100_000}, timeout=10)
            assert peer.statistics().get("resumes", 0) == 0
            await peer.send("after", SPEC, layers(), timeout=10)
