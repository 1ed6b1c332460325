"""The server-wide cap of max_sessions x max_transfers transfers held is visible on the
server: before, a producer that reconnected (its first session's transfers complete and
not claimed) had every send refused with LIMIT_EXCEEDED, and the server said nothing, nor
counted anything that showed it.  Now statistics() has held_transfers and registry_calls,
and the log has a WARNING as a refusal comes (at most once a minute; the next line counts
those refused in between) saying what holds the room and what to change."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

import pytest

import kvwire
from kvwire.errors import LimitExceededError
from tests.conftest import SECRET, make_layers
from tests.rawpeer import wait_until

pytestmark = pytest.mark.timeout(60)

SPEC = kvwire.KVSpec(num_layers=1, num_kv_heads=2, head_dim=8, dtype="float16")


async def test_a_reconnecting_producer_refused_at_the_cap_is_logged_and_counted(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reviewer's r4: max_sessions=1, max_transfers=2, claim_timeout=None.  The line
    comes with the refusal, with the numbers of that moment; refusals within a minute of
    it are counted, and said by the next line a refusal brings (before, the next pump a
    minute later logged them, with the numbers of that later moment, the cap cleared)."""
    caplog.set_level(logging.INFO, logger="kvwire")

    def lines() -> list[logging.LogRecord]:
        return [r for r in caplog.records if "transfer(s) refused" in r.getMessage()]

    def advice(held: int, ended: int) -> str:
        return (f"the server holds {held} transfers (max_sessions x max_transfers = 2), "
                f"{ended} of them complete transfers of sessions that ended, which the application has not "
                "claimed; to make room: claim them (accept()/expect()), set claim_timeout (None: only "
                "claiming frees them), or raise max_sessions")

    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, max_sessions=1, max_transfers=2,
                            claim_timeout=None) as server:
        stats = server.statistics()
        assert stats["held_transfers"] == 0 and stats["registry_calls"] == 0
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as first:
            for rid in ("a1", "a2"):
                await asyncio.wait_for(first.send(rid, SPEC, make_layers(1, 16, 2, 8)), 10)
        assert await wait_until(lambda: server.statistics()["sessions"] == 0, 10)
        assert server.statistics()["held_transfers"] == 2 and not lines()
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as second:
            for rid in ("b1", "b2"):
                with pytest.raises(LimitExceededError, match="complete from ended sessions"):
                    await asyncio.wait_for(second.send(rid, SPEC, make_layers(1, 16, 2, 8)), 10)
            # A line for the first refusal, at once; the second, within the minute, is
            # only counted.
            [line] = lines()
            assert line.levelno == logging.WARNING
            assert line.getMessage() == "1 transfer(s) refused: " + advice(2, 2)
            assert server.statistics()["held_transfers"] == 2
            claimed = await server.accept(timeout=5)
            assert claimed.request_id == "a1"
            assert server.statistics()["held_transfers"] == 1
            later = server.now() + 61.0  # a minute later, the cap cleared: no line
            monkeypatch.setattr(server, "now", lambda: later)
            await asyncio.wait_for(second.send("b3", SPEC, make_layers(1, 16, 2, 8)), 10)
            assert server.statistics()["held_transfers"] == 2 and len(lines()) == 1
            # The next refusal: its line, with the numbers of its moment, and the count of
            # the one not said.
            with pytest.raises(LimitExceededError):
                await asyncio.wait_for(second.send("b4", SPEC, make_layers(1, 16, 2, 8)), 10)
            assert [r.getMessage() for r in lines()[1:]] == [
                "1 transfer(s) refused (1 more since the last such line): " + advice(2, 1)]


async def test_the_line_names_the_claim_timeout_to_lower(caplog: pytest.LogCaptureFixture) -> None:
    """With a claim_timeout, the line says to lower it (the rest as above)."""
    caplog.set_level(logging.INFO, logger="kvwire")
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, max_sessions=1, max_transfers=1,
                            claim_timeout=600.0) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as first:
            await asyncio.wait_for(first.send("a", SPEC, make_layers(1, 16, 2, 8)), 10)
        assert await wait_until(lambda: server.statistics()["sessions"] == 0, 10)
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as second:
            with pytest.raises(LimitExceededError):
                await asyncio.wait_for(second.send("b", SPEC, make_layers(1, 16, 2, 8)), 10)
    [line] = [r.getMessage() for r in caplog.records if "transfer(s) refused" in r.getMessage()]
    assert "1 of them complete transfers of sessions that ended" in line
    assert line.endswith("lower claim_timeout (600 s), or raise max_sessions")


class HeldCheck:
    """A registry whose checks wait until released."""

    def __init__(self) -> None:
        self.released = asyncio.Event()

    async def check_many(self, pairs: Iterable[Any]) -> list[Any]:
        await self.released.wait()
        return []

    async def publish(self, pairs: Iterable[Any]) -> list[Any]:
        return []


async def test_statistics_count_the_registry_calls_running() -> None:
    registry = HeldCheck()
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, registry=registry) as server:
        try:
            async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
                sending = asyncio.ensure_future(
                    peer.send("a", SPEC, make_layers(1, 16, 2, 8), blocks=[(b"i:1", 1)]))
                assert await wait_until(lambda: server.statistics()["registry_calls"] == 1, 10)
                assert server.statistics()["held_transfers"] == 1
                registry.released.set()
                await asyncio.wait_for(sending, 10)
                assert server.statistics()["registry_calls"] == 0
        finally:
            registry.released.set()
