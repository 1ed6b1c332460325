"""Injected faults between a real client and a real server (``kvwire.testing.FaultProxy``).

Every case is one fresh small transfer with a deadline.  The invariants:

- the sender either completes (and then the receiver holds a bit-identical cache) or
  raises a :class:`kvwire.KvwireError` subclass before its deadline; never a raw
  exception, never a hang;
- the receiver never hands out a cache that differs from what was sent;
- nothing escapes into the event loop's exception handler;
- the server keeps serving the next client.

Outcome counts are printed (run with ``-s``); docs/reliability.md records them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections import Counter
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import kvwire
from kvwire.errors import ErrorCode
from kvwire.testing import CLEAN, FaultPlan, FaultProxy, Faults
from kvwire.wire import (
    Accept,
    Ack,
    Begin,
    Connection,
    ConnectionConfig,
    FrameDecoder,
    GoAway,
    Reset,
    Role,
    frame_bytes,
)
from kvwire.wire.frames import HEADER
from tests.conftest import SECRET, make_layers, same_cache
from tests.rawpeer import raw_client
from tests.system.loop_helpers import loop_errors

pytestmark = pytest.mark.timeout(120)

SPEC = kvwire.KVSpec(num_layers=4, num_kv_heads=2, head_dim=32, dtype="float16")
TOKENS = 64
CHUNK_BYTES = 512  # 4 tokens per chunk: 16 chunks per K or V per layer, 128 per transfer
SEND_TIMEOUT = 5.0
CONNECT_TIMEOUT = 3.0
GRACE = 3.0  # beyond every deadline before a case counts as hung


@dataclass
class Outcome:
    sender: str  # "completed" | "typed:<Class>" | "raw:<Class>" | "hung"
    receiver: str  # "identical" | "typed:<Class>" | "never-arrived" | "corrupted" | "raw:<Class>" | "hung"
    seconds: float

    @property
    def row(self) -> str:
        if self.sender == "hung" or self.receiver == "hung":
            return "hung"
        if self.receiver == "corrupted":
            return "corrupted"
        if self.sender.startswith("raw") or self.receiver.startswith("raw"):
            return "raw-exception"
        if self.sender == "completed":
            return "completed-identical" if self.receiver == "identical" else "completed-but-receiver-lacks-it"
        return "failed-typed"


def _kind(exc: BaseException) -> str:
    prefix = "typed" if isinstance(exc, kvwire.KvwireError) else "raw"
    return f"{prefix}:{type(exc).__name__}"


async def run_case(
    server: kvwire.Server, plan: FaultPlan, rid: str, layers: list[tuple[np.ndarray, np.ndarray]],
    *, streams: int = 1, send_timeout: float = SEND_TIMEOUT, spec: kvwire.KVSpec = SPEC,
    chunk_bytes: int = CHUNK_BYTES,
) -> Outcome:
    """One transfer through a FaultProxy whose first connection gets ``plan``."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    arrived = asyncio.Event()

    async def receive() -> str:
        t = await server.expect(rid)
        arrived.set()
        try:
            cache = await t.collect(timeout=send_timeout + GRACE)
        except kvwire.KvwireError as exc:
            return _kind(exc)
        return "identical" if same_cache(cache.layers, layers) else "corrupted"

    async def send(port: int) -> str:
        async with kvwire.connect(
            "127.0.0.1", port, secret=SECRET, streams=streams, chunk_bytes=chunk_bytes,
            connect_timeout=CONNECT_TIMEOUT,
        ) as peer:
            await peer.send(rid, spec, layers, timeout=send_timeout)
        return "completed"

    receiver = asyncio.create_task(receive())
    async with FaultProxy("127.0.0.1", server.port, plan=lambda i: plan if i == 0 else CLEAN) as proxy:
        sender = asyncio.create_task(send(proxy.port))
        done, _ = await asyncio.wait({sender}, timeout=CONNECT_TIMEOUT + send_timeout + GRACE)
        if not done:
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
            s_out = "hung"
        else:
            exc = sender.exception()
            s_out = "completed" if exc is None else _kind(exc)
        # The receiver: if the transfer got there it must finish (either way) in time.
        if s_out != "completed":
            with suppress(TimeoutError):
                await asyncio.wait_for(arrived.wait(), 0.3)
        if not arrived.is_set() and s_out != "completed":
            receiver.cancel()
            await asyncio.gather(receiver, return_exceptions=True)
            r_out = "never-arrived"
        else:
            done, _ = await asyncio.wait({receiver}, timeout=send_timeout + 2 * GRACE)
            if not done:
                receiver.cancel()
                await asyncio.gather(receiver, return_exceptions=True)
                r_out = "hung"
            else:
                exc = receiver.exception()
                r_out = receiver.result() if exc is None else _kind(exc)
    return Outcome(s_out, r_out, loop.time() - t0)


async def clean_bytes(server: kvwire.Server, layers: list[tuple[np.ndarray, np.ndarray]], streams: int,
                      spec: kvwire.KVSpec = SPEC, chunk_bytes: int = CHUNK_BYTES) -> tuple[int, int]:
    """Bytes each direction of connection 0 carries in a clean run (handshake included)."""
    async with FaultProxy("127.0.0.1", server.port) as proxy:
        async with kvwire.connect(
            "127.0.0.1", proxy.port, secret=SECRET, streams=streams, chunk_bytes=chunk_bytes,
        ) as peer:
            await peer.send(f"clean-{streams}", spec, layers, timeout=SEND_TIMEOUT)
        await (await server.expect(f"clean-{streams}", timeout=5)).collect(timeout=5)
        conn = proxy.connections[0]
        assert conn.forward is not None and conn.backward is not None
        return conn.forward.bytes_out, conn.backward.bytes_out


def check_invariants(outcomes: list[tuple[str, Outcome]], errors: list[dict[str, Any]], what: str) -> Counter[str]:
    rows = Counter(o.row for _, o in outcomes)
    senders = Counter(o.sender for _, o in outcomes)
    receivers = Counter(o.receiver for _, o in outcomes)
    print(
        f"\nFAULT SUMMARY {what}: cases={len(outcomes)} "
        + " ".join(f"{k}={rows.get(k, 0)}" for k in ("completed-identical", "failed-typed", "corrupted", "hung", "raw-exception"))
    )
    print(f"  sender outcomes: {dict(senders)}")
    print(f"  receiver outcomes: {dict(receivers)}")
    bad = [(d, o) for d, o in outcomes if o.row not in ("completed-identical", "failed-typed")]
    assert not bad, f"{what}: cases breaking the invariants: {bad}"
    assert errors == [], f"{what}: exceptions escaped into the event loop: {errors[:3]}"
    return rows


# -- drops at random offsets ---------------------------------------------------------------


async def test_50_random_drops_complete_identical_or_fail_typed() -> None:
    rng = random.Random(1234)
    layers = make_layers(SPEC.num_layers, TOKENS, SPEC.num_kv_heads, SPEC.head_dim, seed=5)
    async with loop_errors() as errors:
        async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
            totals = {s: await clean_bytes(server, layers, s) for s in (1, 2)}
            outcomes = []
            for i in range(50):
                streams = 1 + i % 2
                direction = "forward" if rng.random() < 0.7 else "backward"
                total = totals[streams][0 if direction == "forward" else 1]
                offset = rng.randrange(0, total)
                mode = rng.choice(["close", "reset"])
                faults = Faults(drop_at=offset, drop_mode=mode)
                plan = FaultPlan(forward=faults) if direction == "forward" else FaultPlan(backward=faults)
                desc = f"drop {direction}@{offset}/{total} {mode} streams={streams}"
                outcomes.append((desc, await run_case(server, plan, f"drop-{i}", layers, streams=streams)))
            # The server still serves a clean client afterwards.
            after = await run_case(server, CLEAN, "after-drops", layers)
            assert after.row == "completed-identical", after
    check_invariants(outcomes, errors, "drops")


async def test_drop_mid_transfer_resumes_and_completes_identical() -> None:
    """When a connection breaks mid-transfer, the sender reconnects and re-sends only the
    unacknowledged chunks: the transfer completes bit-identical."""
    rng = random.Random(99)
    layers = make_layers(SPEC.num_layers, TOKENS, SPEC.num_kv_heads, SPEC.head_dim, seed=6)
    async with loop_errors() as errors:
        async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
            fwd, _ = await clean_bytes(server, layers, 1)
            outcomes = []
            for i in range(5):
                # well after the handshake, well before the end
                offset = rng.randrange(fwd // 4, 3 * fwd // 4)
                plan = FaultPlan(forward=Faults(drop_at=offset))
                outcomes.append((f"drop forward@{offset}", await run_case(server, plan, f"resume-{i}", layers)))
    assert all(o.row == "completed-identical" for _, o in outcomes), outcomes
    assert errors == []


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_a_drop_mid_scattered_payload_resumes_into_the_named_blocks(seed: int) -> None:
    """Large chunks read straight into many blocks of a paged destination: the connection
    breaks at a random byte (often inside such a payload, part of it already in the
    blocks); the chunk is sent again and the blocks end up exactly as the source's."""
    from kvwire.paged import PagedDestination, PagedSource, PagedSpec

    rng = np.random.default_rng(seed)
    spec = PagedSpec(num_layers=2, block_shape=(2, 4, 8, 64), dtype="float16")  # 8 KiB blocks
    src = [rng.standard_normal((48, *spec.block_shape), dtype=np.float32).astype(np.float16) for _ in range(2)]
    dst = [np.zeros_like(c) for c in src]
    src_ids, dst_ids = rng.choice(48, 40, replace=False), rng.choice(48, 40, replace=False)
    total = 2 * 40 * 8192
    drop_at = int(rng.integers(total // 4, 3 * total // 4))
    plan = FaultPlan(forward=Faults(drop_at=drop_at))
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with FaultProxy("127.0.0.1", server.port, plan=lambda i: plan if i == 0 else CLEAN) as proxy:
            async with kvwire.connect("127.0.0.1", proxy.port, secret=SECRET, chunk_bytes=96 * 1024,
                                      connect_timeout=3) as peer:
                waiting = asyncio.create_task(
                    server.expect("paged-drop", into=PagedDestination(spec, dst, dst_ids), timeout=10))
                await asyncio.sleep(0)
                await peer.send("paged-drop", spec.wire_spec(), PagedSource(spec, src, src_ids), timeout=SEND_TIMEOUT)
                transfer = await waiting
                assert len([layer async for layer in transfer]) == 2
            assert proxy.statistics().connections >= 2  # it broke and reconnected
    for li in range(2):
        assert dst[li][dst_ids].tobytes() == src[li][src_ids].tobytes()


async def test_resume_resends_only_unacknowledged_chunks() -> None:
    layers = make_layers(SPEC.num_layers, TOKENS, SPEC.num_kv_heads, SPEC.head_dim, seed=7)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        fwd, _ = await clean_bytes(server, layers, 1)
        plan = FaultPlan(forward=Faults(drop_at=fwd // 2))
        async with FaultProxy("127.0.0.1", server.port, plan=lambda i: plan if i == 0 else CLEAN) as proxy:
            async with kvwire.connect(
                "127.0.0.1", proxy.port, secret=SECRET, chunk_bytes=CHUNK_BYTES, connect_timeout=3,
            ) as peer:
                receipt = await peer.send("resume-count", SPEC, layers, timeout=SEND_TIMEOUT)
            stats = proxy.statistics()
        cache = await (await server.expect("resume-count", timeout=5)).collect(timeout=5)
    assert same_cache(cache.layers, layers)
    assert stats.connections >= 2  # it reconnected
    total_chunks = SPEC.num_layers * 2 * (TOKENS // 4)
    # re-sent chunks are at most those in flight at the drop, never the whole transfer
    assert receipt.chunks < 2 * total_chunks
    assert stats.bytes_forward < 2 * fwd


async def test_corrupted_ack_after_the_receiver_has_everything_is_resumed() -> None:
    """The last ACK is corrupted on its way back: the receiver holds the whole cache, the
    sender does not know it.  Resuming must still work (the server keeps the session for
    the reconnect and acknowledges the re-sent duplicates), so the send completes."""
    layers = make_layers(SPEC.num_layers, TOKENS, SPEC.num_kv_heads, SPEC.head_dim, seed=15)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        _, back = await clean_bytes(server, layers, 1)
        # 16 bytes before the end of the server's stream: inside the last ACK frame
        plan = FaultPlan(backward=Faults(flip_bits=(8 * (back - 16) + 1,)))
        out = await run_case(server, plan, "last-ack-flip", layers)
    assert out.receiver == "identical", out
    assert out.sender == "completed", out


# -- bit flips -----------------------------------------------------------------------------


async def test_30_random_bit_flips_never_deliver_corruption() -> None:
    rng = random.Random(1234)
    layers = make_layers(SPEC.num_layers, TOKENS, SPEC.num_kv_heads, SPEC.head_dim, seed=8)
    async with loop_errors() as errors:
        async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
            fwd, back = await clean_bytes(server, layers, 1)
            outcomes = []
            for i in range(30):
                direction = "forward" if rng.random() < 0.8 else "backward"
                total = fwd if direction == "forward" else back
                bit = rng.randrange(0, 8 * total)
                faults = Faults(flip_bits=(bit,))
                plan = FaultPlan(forward=faults) if direction == "forward" else FaultPlan(backward=faults)
                desc = f"flip {direction} bit {bit} (byte {bit // 8}/{total})"
                outcomes.append((desc, await run_case(server, plan, f"flip-{i}", layers)))
            after = await run_case(server, CLEAN, "after-flips", layers)
            assert after.row == "completed-identical", after
    rows = check_invariants(outcomes, errors, "bit flips")
    assert rows.get("corrupted", 0) == 0


# Layers whose K and V go as one KV chunk (protocol version 2) of 128 KiB: above the
# receiver's big-frame size, so each is read in place into its layer's array.
KV_SPEC = kvwire.KVSpec(num_layers=4, num_kv_heads=8, head_dim=64, dtype="float16")
KV_CHUNK_BYTES = 2 * TOKENS * 8 * 64 * 2


async def test_drops_and_flips_of_kv_chunks_read_in_place_complete_identical_or_fail_typed() -> None:
    rng = random.Random(4321)
    layers = make_layers(KV_SPEC.num_layers, TOKENS, KV_SPEC.num_kv_heads, KV_SPEC.head_dim, seed=16)
    kw: dict[str, Any] = {"spec": KV_SPEC, "chunk_bytes": KV_CHUNK_BYTES}
    async with loop_errors() as errors:
        async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
            async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, chunk_bytes=KV_CHUNK_BYTES) as peer:
                receipt = await peer.send("kv-shape", KV_SPEC, layers, timeout=SEND_TIMEOUT)
            await (await server.expect("kv-shape", timeout=5)).collect(timeout=5)
            # layer 0 as a K and a V chunk, every other layer as one KV chunk
            assert receipt.chunks == 2 + (KV_SPEC.num_layers - 1)
            totals = {s: await clean_bytes(server, layers, s, **kw) for s in (1, 2)}
            outcomes = []
            for i in range(24):
                streams = 1 + i % 2
                direction = "forward" if rng.random() < 0.8 else "backward"
                total = totals[streams][0 if direction == "forward" else 1]
                if i % 2:
                    faults = Faults(flip_bits=(rng.randrange(0, 8 * total),))
                else:
                    faults = Faults(drop_at=rng.randrange(0, total), drop_mode=rng.choice(["close", "reset"]))
                plan = FaultPlan(forward=faults) if direction == "forward" else FaultPlan(backward=faults)
                outcomes.append((f"{faults} {direction} streams={streams}",
                                 await run_case(server, plan, f"kv-{i}", layers, streams=streams, **kw)))
            after = await run_case(server, CLEAN, "kv-after", layers, **kw)
            assert after.row == "completed-identical", after
    rows = check_invariants(outcomes, errors, "KV chunks")
    assert rows.get("corrupted", 0) == 0


async def test_flipped_payload_bit_is_discarded_never_delivered() -> None:
    """A flip inside a chunk payload: the chunk fails its CRC and is discarded.  Either
    the connection is resumed and the transfer completes bit-identical, or the sender's
    error names integrity and the receiver yields no cache; never the flipped bytes."""
    layers = make_layers(SPEC.num_layers, TOKENS, SPEC.num_kv_heads, SPEC.head_dim, seed=9)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        fwd, _ = await clean_bytes(server, layers, 1)
        # the middle of the stream is deep inside some CHUNK's payload
        plan = FaultPlan(forward=Faults(flip_bits=(8 * (fwd // 2) + 3,)))
        out = await run_case(server, plan, "payload-flip", layers)
    assert out.receiver != "corrupted", out
    if out.sender == "completed":
        assert out.receiver == "identical", out
    else:
        assert out.sender in ("typed:IntegrityError", "typed:ConnectionLostError"), out
        assert out.receiver != "identical", out


# -- stalls and kills ---------------------------------------------------------------------


@pytest.mark.parametrize("direction", ["forward", "backward"])
async def test_stall_forever_is_a_transfer_timeout(direction: str) -> None:
    layers = make_layers(SPEC.num_layers, TOKENS, SPEC.num_kv_heads, SPEC.head_dim, seed=10)
    async with loop_errors() as errors:
        async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
            fwd, back = await clean_bytes(server, layers, 1)
            at = (fwd if direction == "forward" else back) // 2
            faults = Faults(stall_at=at, stall_for=None)
            plan = FaultPlan(forward=faults) if direction == "forward" else FaultPlan(backward=faults)
            async with FaultProxy("127.0.0.1", server.port, plan=lambda i: plan if i == 0 else CLEAN) as proxy:
                loop = asyncio.get_running_loop()
                peer = kvwire.connect("127.0.0.1", proxy.port, secret=SECRET, chunk_bytes=CHUNK_BYTES)
                await peer.open()
                t0 = loop.time()
                with pytest.raises(kvwire.TransferTimeoutError):
                    await asyncio.wait_for(peer.send("stalled", SPEC, layers, timeout=1), 1 + GRACE)
                assert loop.time() - t0 < 1 + GRACE
                await asyncio.wait_for(peer.close(), GRACE)
                # the receiver never yields a partial cache: either it got every chunk
                # (a stall of the acks only, claimed before the sender's RESET came) or it
                # fails typed (a complete transfer the RESET reached unclaimed is never
                # handed out: the sender's send() failed)
                try:
                    t = await server.expect("stalled", timeout=1)
                    cache = await t.collect(timeout=1)
                except kvwire.KvwireError:
                    pass
                else:
                    assert direction == "backward", "a cache completed whose chunks never arrived"
                    assert same_cache(cache.layers, layers)
            after = await run_case(server, CLEAN, "after-stall", layers)
            assert after.row == "completed-identical", after
    assert errors == []


async def test_stall_during_handshake_is_a_connect_timeout() -> None:
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        plan = FaultPlan(backward=Faults(stall_at=0))
        async with FaultProxy("127.0.0.1", server.port, plan=plan) as proxy:
            with pytest.raises(kvwire.TransferTimeoutError):
                await asyncio.wait_for(
                    kvwire.connect("127.0.0.1", proxy.port, secret=SECRET, connect_timeout=1).open(), 1 + GRACE
                )


@pytest.mark.parametrize("reset", [False, True])
async def test_kill_mid_transfer_fails_typed_on_both_sides(reset: bool) -> None:
    layers = make_layers(SPEC.num_layers, TOKENS, SPEC.num_kv_heads, SPEC.head_dim, seed=11)
    release = asyncio.Event()

    async def produce():  # type: ignore[no-untyped-def]
        for i, kv in enumerate(layers):
            yield kv
            if i == 1:
                await release.wait()

    async with loop_errors() as errors:
        async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
            async with FaultProxy("127.0.0.1", server.port) as proxy:
                async with kvwire.connect(
                    "127.0.0.1", proxy.port, secret=SECRET, streams=2, chunk_bytes=CHUNK_BYTES,
                ) as peer:
                    send = asyncio.create_task(peer.send("killed", SPEC, produce(), timeout=SEND_TIMEOUT))
                    t = await server.expect("killed", timeout=5)
                    collect = asyncio.create_task(t.collect(timeout=SEND_TIMEOUT))
                    await asyncio.sleep(0.2)
                    proxy.drop(0, reset=reset)
                    release.set()
                    results = await asyncio.wait_for(
                        asyncio.gather(send, collect, return_exceptions=True), SEND_TIMEOUT + GRACE
                    )
            for r in results:
                # completed (resume) is fine, and then it must be identical
                if isinstance(r, BaseException):
                    assert isinstance(r, kvwire.KvwireError), repr(r)
            if not isinstance(results[1], BaseException):
                assert same_cache(results[1].layers, layers)
            after = await run_case(server, CLEAN, "after-kill", layers)
            assert after.row == "completed-identical", after
    assert errors == []


async def test_receiver_restart_fails_in_flight_transfer_typed() -> None:
    """The server goes away mid-transfer and a new one takes its port: the sender gets a
    typed error within its deadline, never a hang and never a success."""
    layers = make_layers(SPEC.num_layers, TOKENS, SPEC.num_kv_heads, SPEC.head_dim, seed=12)
    release = asyncio.Event()

    async def produce():  # type: ignore[no-untyped-def]
        for i, kv in enumerate(layers):
            yield kv
            if i == 1:
                await release.wait()

    async with loop_errors() as errors:
        server = kvwire.serve("127.0.0.1", 0, secret=SECRET)
        await server.start()
        port = server.port
        async with kvwire.connect("127.0.0.1", port, secret=SECRET, chunk_bytes=CHUNK_BYTES) as peer:
            send = asyncio.create_task(peer.send("restart", SPEC, produce(), timeout=SEND_TIMEOUT))
            t = await server.expect("restart", timeout=5)
            collect = asyncio.create_task(t.collect())
            await asyncio.sleep(0.1)
            await server.close()
            async with kvwire.serve("127.0.0.1", port, secret=SECRET) as server2:
                release.set()
                with pytest.raises(kvwire.KvwireError) as info:
                    await asyncio.wait_for(send, SEND_TIMEOUT + GRACE)
                assert not isinstance(info.value, kvwire.TransferTimeoutError), "lost transfer noticed only by the deadline"
                with pytest.raises(kvwire.KvwireError):
                    await asyncio.wait_for(collect, GRACE)
                assert server2.statistics()["transfers_accepted"] == 0
    assert errors == []


# -- hostile frames from a raw socket ------------------------------------------------------


async def _goaway_and_close(reader: asyncio.StreamReader) -> tuple[GoAway, bool]:
    dec = FrameDecoder(1 << 24)
    frames: list[Any] = []
    closed = False
    loop = asyncio.get_running_loop()
    end = loop.time() + 5
    while loop.time() < end:
        try:
            data = await asyncio.wait_for(reader.read(65536), max(0.01, end - loop.time()))
        except TimeoutError:
            break
        except ConnectionResetError:
            closed = True
            break
        if not data:
            closed = True
            break
        frames.extend(f for f, _ in dec.feed(data))
    goaways = [f for f in frames if isinstance(f, GoAway)]
    assert goaways, f"no GOAWAY in {frames}"
    return goaways[-1], closed


BEGIN = Begin(transfer_id=1, num_layers=1, num_kv_heads=1, head_dim=8, dtype_id=1, model="",
              request_id="raw", meta=b"{}")


MAX_FRAME = 64 * 1024
HOSTILE_AFTER_AUTH = {
    "oversized header": (lambda: HEADER.pack(0x12, 0, 0, MAX_FRAME + 1), ErrorCode.FRAME_TOO_LARGE),
    "oversized 4 GiB header": (lambda: HEADER.pack(0x12, 0, 0, 0xFFFFFFFF), ErrorCode.FRAME_TOO_LARGE),
    "bad CRC": (lambda: frame_bytes(BEGIN)[:-1] + b"\x00", ErrorCode.INTEGRITY_ERROR),
    "noise": (lambda: bytes(random.Random(3).getrandbits(8) for _ in range(80_000)), None),
    # A flipped reserved bit under a CRC that does not cover it is line noise (resumable);
    # a CRC-valid header with reserved bits set was sent that way (fatal).
    "reserved bits, bad CRC": (lambda: HEADER.pack(0x20, 0, 1, 8) + bytes(12), ErrorCode.INTEGRITY_ERROR),
    "reserved bits, valid CRC": (lambda: _reframe(0x20, bytes(8), reserved=1), ErrorCode.PROTOCOL_ERROR),
    "server-only frame": (lambda: frame_bytes(Ack(transfer_id=1, layer=0, kind=0, token_start=0)), ErrorCode.PROTOCOL_ERROR),
    "second HELLO": (lambda: None, ErrorCode.PROTOCOL_ERROR),
    "truncated BEGIN": (lambda: _reframe(0x10, frame_bytes(BEGIN)[8:-4][:10]), ErrorCode.PROTOCOL_ERROR),
}


def _reframe(ftype: int, body: bytes, *, reserved: int = 0) -> bytes:
    """A frame of ``ftype`` around ``body`` with a correct CRC (so only the body is bad)."""
    from crc32c import crc32c

    header = HEADER.pack(ftype, 0, reserved, len(body))
    return header + body + crc32c(body, crc32c(header)).to_bytes(4, "big")


@pytest.mark.parametrize("name", list(HOSTILE_AFTER_AUTH))
async def test_hostile_frames_after_auth_get_goaway_with_code_and_server_serves_next(name: str) -> None:
    make, code = HOSTILE_AFTER_AUTH[name]
    layers = make_layers(SPEC.num_layers, TOKENS, SPEC.num_kv_heads, SPEC.head_dim, seed=13)
    async with loop_errors() as errors, kvwire.serve(
        "127.0.0.1", 0, secret=SECRET, max_frame_size=MAX_FRAME, window=2 * MAX_FRAME,
    ) as server:
        _, reader, writer = await raw_client(server.port)
        payload = make()
        if payload is None:  # the client's HELLO again
            c2 = Connection(Role.CLIENT, ConnectionConfig(secret=SECRET))
            c2.initiate()
            payload = b"".join(bytes(p) for p in c2.data_to_send())
        writer.write(payload)
        goaway, closed = await _goaway_and_close(reader)
        writer.close()
        assert goaway.code != ErrorCode.NO_ERROR
        if code is not None:
            assert goaway.code == code, (ErrorCode(goaway.code), goaway.message)
        assert closed
        out = await run_case(server, CLEAN, f"after-{name}", layers)
        assert out.row == "completed-identical", out
        assert server.statistics()["sessions"] <= 1
    assert errors == []


@pytest.mark.parametrize(
    "begin,code",
    [
        (Begin(transfer_id=1, num_layers=1, num_kv_heads=1, head_dim=8, dtype_id=250, model="",
               request_id="x", meta=b""), ErrorCode.INCOMPATIBLE_SPEC),
        (Begin(transfer_id=1, num_layers=0, num_kv_heads=1, head_dim=8, dtype_id=1, model="",
               request_id="x", meta=b""), ErrorCode.INCOMPATIBLE_SPEC),
        (Begin(transfer_id=1, num_layers=1, num_kv_heads=1, head_dim=8, dtype_id=1, model="",
               request_id="x", meta=b"{not json"), ErrorCode.PROTOCOL_ERROR),
    ],
    ids=["unknown-dtype", "zero-layers", "bad-meta"],
)
async def test_bad_begin_is_reset_and_the_connection_survives(begin: Begin, code: ErrorCode) -> None:
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        _, reader, writer = await raw_client(server.port)
        writer.write(frame_bytes(begin))
        dec = FrameDecoder(1 << 24)
        frames: list[Any] = []
        while not frames:
            data = await asyncio.wait_for(reader.read(65536), 5)
            assert data, "server closed the connection for a refused transfer"
            frames.extend(f for f, _ in dec.feed(data))
        assert isinstance(frames[0], Reset) and frames[0].code == code, frames
        # the connection is still usable: a valid transfer on it is accepted
        writer.write(frame_bytes(dataclasses.replace(BEGIN, transfer_id=2, request_id="ok")))
        frames = []
        while not frames:
            data = await asyncio.wait_for(reader.read(65536), 5)
            assert data
            frames.extend(f for f, _ in dec.feed(data))
        assert isinstance(frames[0], Accept), frames
        writer.close()


async def test_too_many_transfers_is_limit_exceeded_and_others_continue() -> None:
    layers = make_layers(1, 4, 1, 8)
    spec = kvwire.KVSpec(num_layers=1, num_kv_heads=1, head_dim=8)
    hold = asyncio.Event()

    async def produce():  # type: ignore[no-untyped-def]
        await hold.wait()
        for kv in layers:
            yield kv

    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, max_transfers=2) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            held = [asyncio.create_task(peer.send(f"h{i}", spec, produce(), timeout=SEND_TIMEOUT)) for i in range(2)]
            claimed = [await server.expect(f"h{i}", timeout=5) for i in range(2)]  # (kept: one let go of is aborted)
            with pytest.raises(kvwire.LimitExceededError):
                await peer.send("third", spec, layers, timeout=SEND_TIMEOUT)
            hold.set()
            await asyncio.gather(*held)
            assert all(t.complete for t in claimed)
            await peer.send("fourth", spec, layers, timeout=SEND_TIMEOUT)


async def test_silent_authenticated_client_is_closed_after_idle_timeout() -> None:
    """Past the handshake, a client that stops talking (no frames, no PONG to the server's
    PING) loses its connection after idle_timeout with GOAWAY(TIMEOUT)."""
    layers = make_layers(SPEC.num_layers, TOKENS, SPEC.num_kv_heads, SPEC.head_dim, seed=14)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, idle_timeout=1.0) as server:
        _conn, reader, writer = await raw_client(server.port)
        goaway, closed = await _goaway_and_close(reader)
        writer.close()
        assert goaway.code == ErrorCode.TIMEOUT and closed
        out = await run_case(server, CLEAN, "after-idle", layers)
        assert out.row == "completed-identical", out
