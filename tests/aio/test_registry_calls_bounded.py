"""Over loopback: registry calls whose transfer failed cannot pile up.  Before, a client
sending BEGIN (with prefix blocks) and RESET in a loop against a slow registry had one
check running per BEGIN until the registry answered, each holding its block list, while
max_transfers and the budget let the next BEGIN in (95 calls running after 1500 loops with
max_transfers=4).  Now a check whose transfer failed is cancelled, and until a call has
ended (a registry may go on when cancelled, and a publish is never cancelled) its
transfer counts among the session's failed ones awaiting the registry, an allowance of
their own beside max_transfers: at most 2 x max_transfers calls run for a session, and
all drain once the registry answers."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import pytest

import kvwire
from kvwire.errors import ErrorCode
from kvwire.session.receiver import BLOCK_ENTRY_BYTES
from kvwire.wire import Begin, Connection, TransferReset
from kvwire.wire.frames import BlockVersion
from tests.conftest import SECRET, make_layers
from tests.rawpeer import raw_client, wait_until

pytestmark = pytest.mark.timeout(60)

SPEC = kvwire.KVSpec(num_layers=1, num_kv_heads=2, head_dim=8, dtype="float16")
BLOCKS = tuple(BlockVersion(block=f"i:{i}".encode(), version=1) for i in range(1, 65))
BLOCKS_BYTES = sum(2 * len(b.block) + BLOCK_ENTRY_BYTES for b in BLOCKS)  # (what a call's block list counts)


class HeldRegistry:
    """A registry whose calls wait until :meth:`release` (a stalled Redis); ``stubborn``:
    a call cancelled goes on waiting all the same, as a registry may."""

    def __init__(self, *, stubborn: bool = False, hold_checks: bool = True, hold_publishes: bool = False) -> None:
        self.released = asyncio.Event()
        self.stubborn, self.hold_checks, self.hold_publishes = stubborn, hold_checks, hold_publishes
        self.started = self.running = self.peak = self.cancelled = 0

    def release(self) -> None:
        self.released.set()

    async def _call(self, hold: bool) -> list[Any]:
        self.started += 1
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            if hold:
                try:
                    await self.released.wait()
                except asyncio.CancelledError:
                    self.cancelled += 1
                    if not self.stubborn:
                        raise
                    await self.released.wait()
            return []
        finally:
            self.running -= 1

    async def check_many(self, pairs: Iterable[Any]) -> list[Any]:
        return await self._call(self.hold_checks)

    async def publish(self, pairs: Iterable[Any]) -> list[Any]:
        return await self._call(self.hold_publishes)


def write(conn: Connection, writer: Any) -> None:
    writer.writelines([bytes(p) for p in conn.data_to_send()])


def begin(tid: int) -> Begin:
    return Begin(transfer_id=tid, num_layers=1, num_kv_heads=2, head_dim=8, dtype_id=1, model="",
                 request_id=f"r{tid}", meta=b"", blocks=BLOCKS)


class Resets:
    """The RESETs the server sends a raw client, read as they come."""

    def __init__(self, conn: Connection, reader: asyncio.StreamReader) -> None:
        self.conn, self.reader = conn, reader
        self.seen: list[TransferReset] = []
        self.task = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        while data := await self.reader.read(65536):
            self.conn.receive_data(data)
            self.seen += [e for e in iter(self.conn.next_event, None) if isinstance(e, TransferReset)]

    def of(self, code: int) -> list[TransferReset]:
        return [r for r in self.seen if r.code == code]

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


async def test_checks_of_reset_transfers_are_cancelled_and_free_their_places() -> None:
    registry = HeldRegistry()
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, registry=registry, max_sessions=1,
                            max_transfers=4) as server:
        conn, reader, writer = await raw_client(server.port)
        resets = Resets(conn, reader)
        # BEGIN and RESET in one write, 300 times: each check is cancelled before it began.
        for tid in range(1, 301):
            conn.send_begin(begin(tid))
            conn.send_reset(tid, ErrorCode.CANCELLED, "gave up")
            write(conn, writer)
            await writer.drain()
            assert registry.running <= 4 and len(server._tasks) <= 4
        assert await wait_until(lambda: server.core.counters["transfers_aborted_by_peer"]
                                + server.core.counters["transfers_refused"] == 300, 20)
        assert await wait_until(lambda: registry.running == 0 and not server._tasks, 10)
        assert server.core.registry_calls == 0 and server.core.held_transfers == 0
        # A check that began (the registry was asked) is cancelled too when its transfer fails.
        for tid in range(301, 311):
            started = registry.started
            conn.send_begin(begin(tid))
            write(conn, writer)
            assert await wait_until(lambda s=started: registry.started == s + 1, 10)  # type: ignore[misc]
            conn.send_reset(tid, ErrorCode.CANCELLED, "gave up")
            write(conn, writer)
            assert await wait_until(lambda: registry.running == 0 and not server._tasks, 10)
        assert registry.cancelled == 10 and registry.peak == 1 and not server._checks
        assert server.core.registry_calls == 0
        assert server.statistics()["buffered_bytes"] == 0
        await resets.close()
        writer.close()


async def test_calls_that_go_on_when_cancelled_hold_their_places_until_they_end() -> None:
    registry = HeldRegistry(stubborn=True)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, registry=registry, max_sessions=1,
                            max_transfers=4) as server:
        conn, reader, writer = await raw_client(server.port)
        try:
            resets = Resets(conn, reader)
            for first in (1, 5):  # four checks begin (max_transfers) ...
                for tid in range(first, first + 4):
                    conn.send_begin(begin(tid))
                write(conn, writer)
                assert await wait_until(lambda f=first: registry.running == f + 3, 10)  # type: ignore[misc]
                for tid in range(first, first + 4):  # ... and are reset: cancelled, they run on
                    conn.send_reset(tid, ErrorCode.CANCELLED, "gave up")
                write(conn, writer)
                assert await wait_until(lambda f=first: registry.cancelled == f + 3, 10)  # type: ignore[misc]
            # (four more than max_transfers: the allowance of failed transfers awaiting the registry)
            for tid in range(9, 209):  # BEGIN+RESET in a loop: refused, no call begins
                conn.send_begin(begin(tid))
                conn.send_reset(tid, ErrorCode.CANCELLED, "gave up")
                write(conn, writer)
                await writer.drain()
            assert await wait_until(lambda: len(resets.of(ErrorCode.LIMIT_EXCEEDED)) == 200, 20)
            assert ("8 failed transfers of the session awaiting the registry"
                    in resets.of(ErrorCode.LIMIT_EXCEEDED)[0].message)
            assert registry.started == 8 and registry.running == 8 == registry.peak
            assert server.core.registry_calls == 8
            assert server.statistics()["buffered_bytes"] == 8 * BLOCKS_BYTES  # (their block lists)
            registry.release()  # the registry answers at last: everything drains
            assert await wait_until(lambda: registry.running == 0 and server.core.registry_calls == 0
                                    and not server._tasks and not server._checks, 10)
            assert server.core.held_transfers == 0 and server.statistics()["buffered_bytes"] == 0
            conn.send_begin(begin(1000))  # and a transfer is let in again
            write(conn, writer)
            assert await wait_until(lambda: server.core.counters["transfers_accepted"] == 1, 10)
            await resets.close()
            writer.close()
        finally:  # (a registry that goes on when cancelled would hold the server's close)
            registry.release()


async def test_a_publish_whose_transfer_failed_is_not_cancelled_and_holds_its_place() -> None:
    registry = HeldRegistry(hold_checks=False, hold_publishes=True)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, registry=registry, max_transfers=1) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            blocks = [(b"i:1", 1)]
            sending = asyncio.ensure_future(peer.send("first", SPEC, make_layers(1, 4, 2, 8), blocks=blocks))
            assert await wait_until(lambda: registry.running == 1, 10)  # its publish runs
            sending.cancel()  # the sender gives up: its RESET fails the transfer
            await asyncio.gather(sending, return_exceptions=True)
            assert await wait_until(lambda: server.core.counters["transfers_aborted_by_peer"] == 1, 10)
            assert registry.running == 1 and registry.cancelled == 0  # not cancelled
            # (the next send goes in at once: the failed one's place is an allowance of its own)
            receiving = asyncio.ensure_future(server.expect("second", timeout=10))
            await asyncio.wait_for(peer.send("second", SPEC, make_layers(1, 4, 2, 8)), 10)
            await (await receiving).collect(timeout=10)
            assert server.core.registry_calls == 1
            assert server.statistics()["failed_arrivals"] == 1  # (kept to be handed out failed)
            registry.release()
            assert await wait_until(lambda: server.core.registry_calls == 0 and not server._tasks, 10)
            receiving = asyncio.ensure_future(server.expect("third", timeout=10))
            await asyncio.wait_for(peer.send("third", SPEC, make_layers(1, 4, 2, 8), blocks=blocks), 10)
            await (await receiving).collect(timeout=10)


async def test_checks_running_at_close_are_answered_to_the_core() -> None:
    """close() cancels the registry calls still running; their ends reach the core all the
    same (before, they stopped at the server being closed, and statistics() after close kept
    registry_calls 4 and buffered_bytes at their block lists')."""
    registry = HeldRegistry()
    server = kvwire.serve("127.0.0.1", 0, secret=SECRET, registry=registry, max_transfers=4)
    async with server:
        conn, _reader, writer = await raw_client(server.port)
        for tid in range(1, 5):
            conn.send_begin(begin(tid))
        write(conn, writer)
        assert await wait_until(lambda: registry.running == 4, 10)
        assert server.statistics()["registry_calls"] == 4
        assert server.statistics()["buffered_bytes"] >= 4 * BLOCKS_BYTES
    assert registry.running == 0 and registry.cancelled == 4
    stats = server.statistics()
    assert stats["registry_calls"] == 0 and stats["buffered_bytes"] == 0
    assert server.core.kept_bytes == 0
    writer.close()
