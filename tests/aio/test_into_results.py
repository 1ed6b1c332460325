"""Receiving into caller memory, what a destination's calls return: places from
``regions()``, an array from ``view()`` or byte ranges from ``ranges()`` that cannot take
the chunk fail that transfer, on both sides, with an error naming the destination's call
(never a broken connection resumed until the sender gives up, nor the peer's malformed
chunk)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

import kvwire
from kvwire.errors import ErrorCode, KvwireError
from kvwire.spec import KVSpec
from kvwire.wire.frames import ByteRanges
from tests.conftest import SECRET

pytestmark = pytest.mark.timeout(60)

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", model="m")
TOKENS = 4096  # a K (or V) of 128 KiB per layer


def layers(seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [tuple(rng.standard_normal((TOKENS, 2, 16)).astype(np.float16) for _ in range(2))  # type: ignore[misc]
            for _ in range(SPEC.num_layers)]


class Dest:
    """A destination of its own (not a PagedDestination): one array per layer and kind."""

    def __init__(self) -> None:
        self.buf = np.zeros((SPEC.num_layers, 2, TOKENS, 2, 16), np.float16)

    def check(self, spec: KVSpec, layer_tokens: int | None) -> None:
        pass

    def view(self, layer: int, kind: int, start: int, count: int, layer_tokens: int) -> Any:
        return self.buf[layer, kind, start : start + count]

    def write(self, layer: int, kind: int, start: int, data: Any, layer_tokens: int) -> None:
        place = self.buf[layer, kind, start : start + data.shape[0]]
        if not np.shares_memory(place, data):
            place[...] = data

    def layer(self, index: int) -> tuple[Any, Any]:
        return self.buf[index, 0], self.buf[index, 1]


class RegionsDest(Dest):
    """Names each range's places as two halves, spoiled as ``mode`` says."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode

    def regions(self, layer: int, kind: int, start: int, count: int, layer_tokens: int) -> Any:
        rows = self.buf[layer, kind, start : start + count]
        b = memoryview(rows.reshape(-1).view(np.uint8))
        half = len(b) // 2
        if self.mode == "read-only":
            return [b[:half].toreadonly(), b[half:].toreadonly()]
        if self.mode == "a read-only member of a tuple":
            return (b[:half], b[half:].toreadonly())
        if self.mode == "float16 views":
            return [memoryview(rows.reshape(-1))]
        if self.mode == "strided bytes":
            return [memoryview(np.zeros(2 * len(b), np.uint8)[::2])]
        if self.mode == "too few bytes":
            return [b[:half]]
        if self.mode == "bytes objects":
            return [bytes(b)]
        if self.mode == "one memoryview, not a list":
            return b
        return (b[:half], b[half:])  # "fine": a tuple of writable byte views


async def send_into(dest: Any, chunk_bytes: int, codec: str = "raw", request: str = "r",
                    ) -> tuple[BaseException | None, BaseException | None, dict[str, Any], Any]:
    """Send a cache into ``dest``: (the sender's error, the receiving application's, the
    server's statistics, the cache sent).  Then a second transfer on the same connection,
    which must go through: the connection was not dropped."""
    src = layers(1)
    sent: BaseException | None = None
    received: BaseException | None = None
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, chunk_bytes=chunk_bytes,
                                  codec=codec) as peer:
            waiting = asyncio.create_task(server.expect(request, into=dest, timeout=10))
            await asyncio.sleep(0)
            try:
                await asyncio.wait_for(peer.send(request, SPEC, src), 10)
            except (KvwireError, TimeoutError) as exc:
                sent = exc
            transfer = await asyncio.wait_for(waiting, 10)
            try:
                async with asyncio.timeout(10):
                    async for _ in transfer:
                        pass
            except (KvwireError, TimeoutError) as exc:
                received = exc
            after = asyncio.create_task(server.accept(timeout=10))
            await asyncio.wait_for(peer.send("after", SPEC, layers(2)), 10)
            assert (await after).request_id == "after"
            stats = server.statistics()
    return sent, received, stats, src


@pytest.mark.parametrize("chunk_bytes", [4096, 100_000, 1 << 20])  # decoded from small frames, or read in place
@pytest.mark.parametrize("mode", ["read-only", "a read-only member of a tuple", "float16 views", "strided bytes",
                                  "too few bytes", "bytes objects", "one memoryview, not a list"])
async def test_unusable_regions_fail_the_transfer_not_the_connection(mode: str, chunk_bytes: int) -> None:
    sent, received, stats, _ = await send_into(RegionsDest(mode), chunk_bytes)
    for err in (sent, received):
        assert type(err) is KvwireError, repr(err)
        assert err.code == ErrorCode.INTERNAL_ERROR
        assert "the destination of transfer 'r' failed to take layer" in str(err)
        assert "its regions() returned" in str(err)
    assert stats.get("resumes", 0) == 0


@pytest.mark.parametrize("chunk_bytes", [4096, 100_000, 1 << 20])
async def test_a_tuple_of_writable_regions_takes_the_cache(chunk_bytes: int) -> None:
    dest = RegionsDest("fine")
    sent, received, _, src = await send_into(dest, chunk_bytes)
    assert sent is None and received is None
    for i, (k, v) in enumerate(src):
        assert dest.buf[i, 0].tobytes() == k.tobytes() and dest.buf[i, 1].tobytes() == v.tobytes()


class ViewDest(Dest):
    """``view()`` gives something that cannot take the chunk's rows."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode

    def view(self, layer: int, kind: int, start: int, count: int, layer_tokens: int) -> Any:
        rows = super().view(layer, kind, start, count, layer_tokens)
        if self.mode == "rows of one head":
            return rows[:, :1]
        if self.mode == "a list":
            return [0.0] * count
        if self.mode == "int16":
            return rows.view(np.int16)
        if self.mode == "float32":
            return np.zeros(rows.shape, np.float32)
        rows = rows.view()
        rows.flags.writeable = False  # "read-only"
        return rows


@pytest.mark.parametrize("chunk_bytes", [4096, 100_000])
@pytest.mark.parametrize("mode", ["rows of one head", "a list", "int16", "float32", "read-only"])
async def test_an_unusable_view_fails_the_transfer_naming_the_destination(mode: str, chunk_bytes: int) -> None:
    sent, received, stats, _ = await send_into(ViewDest(mode), chunk_bytes)
    for err in (sent, received):
        assert type(err) is KvwireError, repr(err)
        assert err.code == ErrorCode.INTERNAL_ERROR
        assert "the destination of transfer 'r' failed to take layer 0: its view() returned" in str(err)
    assert stats.get("resumes", 0) == 0


class RangesDest(Dest):
    """``ranges()`` gives something that does not name the chunk's rows."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode

    def ranges(self, layer: int, kind: int, start: int, count: int, layer_tokens: int) -> Any:
        flat = memoryview(self.buf[layer, kind].reshape(-1).view(np.uint8))
        row = 2 * 16 * 2
        spans = np.array([[start * row, count * row]], np.int64)
        if self.mode == "a tuple":
            return (b"", b"")
        if self.mode == "a read-only base":
            return ByteRanges(flat.toreadonly(), spans.data, count * row)
        if self.mode == "a range past the base":
            spans[0, 0] = len(flat)
        elif self.mode == "too few rows":
            spans[0, 1] -= row
        elif self.mode == "spans not pairs":
            return ByteRanges(flat, spans.reshape(-1)[:1].data, count * row)  # a start, no size
        return ByteRanges(flat, spans.data, count * row)


@pytest.mark.parametrize("mode", ["a tuple", "a read-only base", "a range past the base", "too few rows",
                                  "spans not pairs"])
async def test_unusable_ranges_fail_the_transfer_naming_the_destination(mode: str) -> None:
    sent, received, stats, _ = await send_into(RangesDest(mode), 4096, codec="int8")
    for err in (sent, received):
        assert type(err) is KvwireError, repr(err)
        assert err.code == ErrorCode.INTERNAL_ERROR
        assert "the destination of transfer 'r' failed to take layer 0: its ranges() returned" in str(err)
    assert stats.get("resumes", 0) == 0
