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
import contextlib
import logging
from collections.abc import AsyncIterator

import numpy as np
import pytest

import kvwire
from kvwire.errors import IncompatiblePeerError
from kvwire.paged import PagedDestination, PagedSpec
from kvwire.session.receiver import WIRE_TEXT_LIMIT
from kvwire.wire import Begin, Connection, TransferReset
from tests.conftest import SECRET, make_layers
from tests.rawpeer import raw_client, wait_until

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
            # the interval's refusal not said is counted, then the reason said again
            assert len(lines()) == 4
            assert lines()[2].getMessage().startswith("1 more BEGIN(s) refused (INCOMPATIBLE_SPEC")
            assert "for 1 reason(s)" in lines()[2].getMessage()
            assert "transfer 'd' " in lines()[3].getMessage()


def _begin(tid: int, rid: str, model: str = "x", dtype_id: int = 1) -> Begin:
    return Begin(transfer_id=tid, num_layers=2, num_kv_heads=2, head_dim=8, dtype_id=dtype_id,
                 model=model, request_id=rid, meta=b"{}")


async def _resets(conn: Connection, reader: asyncio.StreamReader, n: int) -> list[TransferReset]:
    """The next ``n`` RESETs the server sends (within a bounded wait each)."""
    got: list[TransferReset] = []
    while len(got) < n:
        data = await asyncio.wait_for(reader.read(65536), 5)
        assert data, "server closed"
        conn.receive_data(data)
        while (ev := conn.next_event()) is not None:
            if isinstance(ev, TransferReset):
                got.append(ev)
    return got


@contextlib.asynccontextmanager
async def _raw(port: int) -> AsyncIterator[tuple[Connection, asyncio.StreamReader, asyncio.StreamWriter]]:
    """A client connection through its handshake, its socket closed at the end."""
    conn, reader, writer = await raw_client(port)
    try:
        yield conn, reader, writer
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


def _send_begins(conn: Connection, writer: asyncio.StreamWriter, *begins: Begin) -> None:
    for b in begins:
        conn.send_begin(b)
    writer.writelines([bytes(p) for p in conn.data_to_send()])


async def test_a_refused_begin_sent_again_fails_one_expect_and_is_counted_once() -> None:
    """Re-sending an unanswered BEGIN is normal (a stream broke, another opened): the copy
    is answered with the same RESET from the transfer id's tombstone, and fails no second
    expect() of that name (it failed both, and counted two refusals)."""
    here = kvwire.KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, model="m")
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, spec=here) as server:
        first = asyncio.create_task(server.expect("k", timeout=30))
        second = asyncio.create_task(server.expect("k", timeout=30))
        await asyncio.sleep(0)
        try:
            async with _raw(server.port) as (conn, reader, writer):
                _send_begins(conn, writer, _begin(1, "k"), _begin(1, "k"))
                a, b = await _resets(conn, reader, 2)
                assert a.transfer_id == b.transfer_id == 1
                assert a.code == b.code == kvwire.ErrorCode.INCOMPATIBLE_SPEC
                assert a.message == b.message and "model 'm' here, 'x' sent" in a.message
                assert await wait_until(first.done)
                with pytest.raises(IncompatiblePeerError):
                    first.result()
                await asyncio.sleep(0.1)  # (a second event would have failed it by now)
                assert not second.done()
                assert server.statistics()["transfers_refused"] == 1
        finally:
            for task in (first, second):
                task.cancel()
            await asyncio.gather(first, second, return_exceptions=True)


@pytest.mark.parametrize("pinned", [False, True])
async def test_a_malformed_layout_fails_no_expect(pinned: bool) -> None:
    """An undefined dtype is refused (INCOMPATIBLE_SPEC) with or without spec=, but it is
    not a layout the server was not given: no expect() fails for it (one did, on a server
    started without spec= too)."""
    spec = kvwire.KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, model="x") if pinned else None
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, spec=spec) as server:
        waiting = asyncio.create_task(server.expect("k", timeout=30))
        await asyncio.sleep(0)
        try:
            async with _raw(server.port) as (conn, reader, writer):
                _send_begins(conn, writer, _begin(1, "k", dtype_id=99))
                [reset] = await _resets(conn, reader, 1)
                assert reset.code == kvwire.ErrorCode.INCOMPATIBLE_SPEC and "dtype" in reset.message
                await asyncio.sleep(0.1)
                assert not waiting.done()
        finally:
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)


async def test_refusals_of_many_layouts_log_a_few_lines_and_a_count(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each sender's layout gives a text of its own: 100 refusals of 100 layouts logged
    100 WARNINGs.  Now at most REFUSED_LINES_PER_INTERVAL a minute, then one line counting
    the others and their reasons."""
    from kvwire.aio.server import REFUSED_LINES_PER_INTERVAL
    caplog.set_level(logging.INFO, logger="kvwire")

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "kvwire" and "INCOMPATIBLE_SPEC" in r.getMessage()]

    here = kvwire.KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, model="m")
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, spec=here) as server:
        now = [server.now()]
        monkeypatch.setattr(server, "now", lambda: now[0])
        async with _raw(server.port) as (conn, reader, writer):
            _send_begins(conn, writer, *(_begin(i + 1, f"r{i}", model=f"x{i}") for i in range(100)))
            await _resets(conn, reader, 100)
            assert await wait_until(lambda: server.statistics()["transfers_refused"] == 100)
            assert len(lines()) == REFUSED_LINES_PER_INTERVAL
            now[0] += 61.0
            _send_begins(conn, writer, _begin(101, "late", model="y"))
            await _resets(conn, reader, 1)
            assert await wait_until(lambda: len(lines()) == REFUSED_LINES_PER_INTERVAL + 2)
            assert lines()[-2].startswith(f"{100 - REFUSED_LINES_PER_INTERVAL} more BEGIN(s) refused")
            assert "for at least 64 reason(s)" in lines()[-2] and "transfer 'late' " in lines()[-1]


def _literals(*texts: str) -> bool:
    import ast
    try:
        return all(isinstance(ast.literal_eval(t), str) for t in texts)
    except (ValueError, SyntaxError):
        return False


@pytest.mark.parametrize(("here", "sent", "must"), [
    ("模型" * 40 + "甲", "模型" * 40 + "乙", ("甲", "乙")),
    ("'" * 60 + "a", "'" * 60 + "b", ("a", "b")),
    ("a\\", "a\\' here, 'z", ("z",)),
])
def test_the_model_excerpts_are_reprs_sized_after_escaping(here: str, sent: str, must: tuple[str, ...]) -> None:
    """The excerpt was sized before its quotes were escaped (and backslashes were not):
    a quote-laden model was cut past the room computed."""
    from kvwire.spec import spec_differences
    one, two = (kvwire.KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, model=m) for m in (here, sent))
    for limit in (40, 60, 90, 160):
        text = spec_differences(one, two, limit)
        assert len(text) <= limit and (text == "model differs" or (text.startswith("model ") and text.endswith(" sent")))
        if text != "model differs":
            both = text[len("model "):-len(" sent")]
            assert any(_literals(both[:i], both[i + len(" here, "):])  # whole reprs: quotes, escapes intact
                       for i in range(len(both)) if both.startswith(" here, ", i))
    text = spec_differences(one, two, 90)
    assert all(c in text for c in must)


def test_that_the_model_differs_is_said_even_with_three_short_fields() -> None:
    """Three short fields differing left the final cut to drop "; model differs"."""
    from kvwire.spec import spec_differences
    one = kvwire.KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, model="a" * 60)
    two = kvwire.KVSpec(num_layers=300, num_kv_heads=16, head_dim=256, dtype="bfloat16", model="b" * 60)
    for limit in (20, 40, 60, 90, 160):
        text = spec_differences(one, two, limit)
        assert len(text) <= limit and text.startswith("d")
        assert text.endswith("; model differs") or ("; model 'a" in text and text.endswith("' sent"))
