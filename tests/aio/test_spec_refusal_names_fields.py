"""A BEGIN refused for its KV layout (the server pinned to ``spec=``): the producer's
error named the layouts by fingerprint and then quoted the sent spec, cut at 160
characters (``KVSpec(num_layers=4, ..., model='page...``), so it never said which field
differs; the server logged nothing; and a consumer waiting in ``expect()`` for that name
waited until its own timeout although the one transfer of that name was refused.  Now the
refusal names the differing fields with both values (the model field cut where the two
differ), the server logs it at WARNING (once a minute per reason, the next line counting
the others), and the oldest ``expect()`` of that name fails at once with it."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest

import kvwire
from kvwire.errors import IncompatiblePeerError
from kvwire.paged import PagedDestination, PagedSpec
from kvwire.session.receiver import WIRE_TEXT_LIMIT
from tests.conftest import SECRET, make_layers

pytestmark = pytest.mark.timeout(60)

HERE = kvwire.KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, model="paged:2x16x2x8/t1:" + "m" * 200)
SENT = kvwire.KVSpec(num_layers=2, num_kv_heads=1, head_dim=8, model="paged:2x16x2x8:" + "m" * 200)


async def _send(peer: kvwire.Peer, rid: str, spec: kvwire.KVSpec) -> None:
    await asyncio.wait_for(peer.send(rid, spec, make_layers(spec.num_layers, 4, spec.num_kv_heads,
                                                            spec.head_dim, spec.dtype)), 10)


def test_the_differences_name_each_field_with_both_values_short_ones_first() -> None:
    from kvwire.spec import spec_differences  # (new: the other tests run without it)

    text = spec_differences(HERE, SENT, 90)
    assert text.startswith("num_kv_heads 2 here, 1 sent; model '")
    # the model excerpts start a little before the first difference: both show it
    assert "16x2x8/t1" in text and "16x2x8:mm" in text and len(text) <= 90
    assert spec_differences(HERE, HERE) == ""
    other = kvwire.KVSpec(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float32", model=HERE.model)
    assert spec_differences(HERE, other) == "dtype float16 here, float32 sent; num_layers 2 here, 3 sent"


async def test_the_producer_is_told_which_fields_differ() -> None:
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, spec=HERE) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            with pytest.raises(IncompatiblePeerError) as info:
                await _send(peer, "k", SENT)
            stats = server.statistics()
    text = str(info.value)
    fp = SENT.fingerprint.hex()[:12]
    assert f"does not accept KV layout {fp} (it accepts {HERE.fingerprint.hex()[:12]}): " in text
    assert "num_kv_heads 2 here, 1 sent; model '" in text and "16x2x8/t1" in text and "16x2x8:" in text
    assert stats["transfers_refused"] == 1 and stats["transfers_accepted"] == 0


@pytest.mark.parametrize("into", [False, True])
async def test_a_pending_expect_of_that_name_fails_at_once(into: bool) -> None:
    paged = PagedSpec(num_layers=2, block_shape=(2, 16, 2, 8), dtype="float16")
    pinned = paged.wire_spec()
    sent = kvwire.KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", model=pinned.model)
    caches = [np.zeros((4, *paged.block_shape), np.float16) for _ in range(paged.num_layers)]
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, spec=pinned) as server:
        dest = PagedDestination(paged, caches, [0, 1]) if into else None
        other = asyncio.create_task(server.expect("other", timeout=30))
        waiting = asyncio.create_task(server.expect("k", timeout=30, into=dest))
        await asyncio.sleep(0)
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            with pytest.raises(IncompatiblePeerError):
                await _send(peer, "k", sent)
            await asyncio.wait({waiting}, timeout=5)  # (its own timeout is 30 s)
            assert waiting.done(), "expect() of the refused name still waits"
            with pytest.raises(IncompatiblePeerError, match="dtype float16 here, float32 sent") as info:
                waiting.result()
            assert len(str(info.value)) <= WIRE_TEXT_LIMIT
            assert not other.done()  # only the waiter of that name
            other.cancel()
    assert not any(c.any() for c in caches)


async def test_refusals_are_logged_once_a_minute_per_reason(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level(logging.INFO, logger="kvwire")

    def lines() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.name == "kvwire" and "refused (INCOMPATIBLE_SPEC" in r.getMessage()]

    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, spec=HERE) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            for rid in ("a", "b"):
                with pytest.raises(IncompatiblePeerError) as info:
                    await _send(peer, rid, SENT)
            [line] = lines()
            assert line.levelno == logging.WARNING and str(info.value) in line.getMessage()
            assert "transfer 'a' from 127.0.0.1:" in line.getMessage()
            # another reason has a line of its own
            dtype = kvwire.KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", model=HERE.model)
            with pytest.raises(IncompatiblePeerError, match="dtype float16 here, float32 sent"):
                await _send(peer, "c", dtype)
            assert len(lines()) == 2 and "dtype float16 here" in lines()[1].getMessage()
            later = server.now() + 61.0
            monkeypatch.setattr(server, "now", lambda: later)
            with pytest.raises(IncompatiblePeerError):
                await _send(peer, "d", SENT)
            assert len(lines()) == 3
            assert "transfer 'd' " in lines()[2].getMessage()
            assert "(1 more for this since the last such line)" in lines()[2].getMessage()
