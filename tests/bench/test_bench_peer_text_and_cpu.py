"""``kvwire serve`` writes what a peer chose (its request ids, the errors they caused)
escaped, one log line per event whatever the peer sent; ``kvwire bench`` counts the
receiver's and the emulator's CPU over the run's window, as the sender's."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

import kvwire
from kvwire.aio._logtext import PEER_TEXT_LIMIT, printable
from kvwire.bench import runner
from kvwire.bench.models import bench_cache
from tests.bench.receiver_fakes import TINY, FakeServer, FakeTransfer, bench_transfer

pytestmark = pytest.mark.timeout(120)

FORGED = "x\n2099-01-01T00:00:00.000Z ERROR   kvwire: forged line\r\x1b[2K\u2028"


class _Failing(FakeTransfer):
    async def __aiter__(self) -> Any:
        raise kvwire.TransferAbortedError(f"aborted by the sender: {FORGED}")
        yield  # pragma: no cover - makes it an async generator


def _one_line_each(lines: list[str]) -> None:
    for line in lines:
        assert not any(c in line for c in "\n\r\x1b\u2028"), line
        assert line.isprintable(), line


async def test_serve_escapes_a_peers_request_id_in_its_log_line() -> None:
    """A client sent a request id with a line break and a fake timestamp, level and
    message: kvwire serve's line for the transfer wrote it raw, a forged log line."""
    lines: list[str] = []
    ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    serving = asyncio.create_task(runner.serve_benches(
        "127.0.0.1", 0, secret=b"s" * 16, log=lines.append, ready=ready.set_result))
    try:
        port = await asyncio.wait_for(ready, 30)
        spec = kvwire.KVSpec(num_layers=1, num_kv_heads=1, head_dim=16, dtype="float16")
        z = np.zeros((4, 1, 16), np.float16)
        async with kvwire.connect("127.0.0.1", port, secret=b"s" * 16, streams=1) as peer:
            await peer.send(FORGED, spec, [(z, z)], timeout=30)

        async def logged() -> None:
            while not lines:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(logged(), 30)
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
    assert len(lines) == 1, lines
    _one_line_each(lines)
    assert lines[0].startswith("x\\n2099-01-01T00:00:00.000Z ERROR   kvwire: forged line\\r\\x1b[2K\\u2028: 4 tokens")


async def test_every_serve_line_escapes_peer_text() -> None:
    """The refused, failed and unchecked lines name the peer's request id and the error
    its meta or layers caused: escaped too, a long id cut short."""
    lines: list[str] = []
    recv = runner.BenchReceiver(FakeServer(), lines.append)
    # A bench meta it refuses.
    refused = FakeTransfer(FORGED, {"kvwire_bench": {"id": "b", "seed": -1}}, TINY.spec(), bench_cache(TINY, 4, 0))
    assert await recv.handle(refused) is None and refused.aborted is not None
    # A layer that cannot be checked (its bench's reference has other token counts).
    uneven = bench_transfer("u", 0)
    uneven.request_id = FORGED + "y" * 70_000
    uneven._layers = [bench_cache(TINY, 1, 0)[0], *bench_cache(TINY, 16, 0)[1:]]
    assert await recv.handle(uneven) is None
    # A transfer that fails while received, for a reason naming what the peer sent.
    failing = _Failing("f\n" + FORGED, None, TINY.spec(), [])
    assert await recv.handle(failing) is None
    assert len(lines) == 3, lines
    _one_line_each(lines)
    assert lines[0].startswith("x\\n2099") and ": refused: kvwire_bench.seed" in lines[0]
    assert ": failed: layer 0 could not be checked: " in lines[1]
    assert len(lines[1]) < 1000, len(lines[1])
    assert lines[2].startswith("f\\nx\\n2099") and "aborted by the sender: x\\n2099" in lines[2]


def test_peer_text_is_escaped_and_cut() -> None:
    assert printable("plain id-1") == "plain id-1"
    assert printable("a\nb\\n\x00\u2028é") == "a\\nb\\\\n\\x00\\u2028é"
    assert printable("z" * PEER_TEXT_LIMIT) == "z" * PEER_TEXT_LIMIT
    assert printable("z" * (PEER_TEXT_LIMIT + 1)) == "z" * PEER_TEXT_LIMIT + "..."
    assert printable("\n" * (PEER_TEXT_LIMIT + 1)) == "\\n" * PEER_TEXT_LIMIT + "..."  # cut, then escaped


@pytest.mark.parametrize("link_bps", [None, 200e6], ids=["loopback", "emulated"])
def test_receiver_cpu_is_counted_over_the_runs_window(monkeypatch: pytest.MonkeyPatch, link_bps: float | None) -> None:
    """The receiver child's CPU was counted from its start to its end (building the
    reference and checking the last transfers after the run's end, the end transfer,
    the wait for the sender to hang up), the emulator's from its start to its stop, and
    divided by the run's seconds. Both are now read at the run's start and end, where
    the sender's is."""
    seen: dict[str, list[tuple[Any, ...]]] = {"receiver": [], "emulator": []}
    expect = runner._expect

    def recording(conn: Any, what: str, proc: Any, timeout: float) -> tuple[Any, ...]:
        msg = expect(conn, what, proc, min(timeout, 60.0))
        seen.setdefault(what, []).append(msg)
        return msg

    monkeypatch.setattr(runner, "_expect", recording)
    cfg = runner.BenchConfig(model="tiny", tokens=64, duration=0.3, baseline=False, link_bps=link_bps)
    result = runner.run_bench(cfg)
    cpu_reads = [float(m[1]) for m in seen["receiver"] if m[0] == "cpu"]
    done = [m for m in seen["receiver"] if m[0] == "done"]
    assert len(cpu_reads) == 2 and len(done) == 1, seen
    window = cpu_reads[1] - cpu_reads[0]
    assert 0 <= window <= float(done[0][2])
    assert result["cpu"]["receiver"] == pytest.approx(window / result["seconds"])
    if link_bps is None:
        assert result["cpu"]["emulator"] is None
        return
    counts = [m for m in seen["emulator"] if m[0] == "count"]
    stopped = [m for m in seen["emulator"] if m[0] == "done"]
    assert len(counts) == 2 and len(stopped) == 1, seen
    window = float(counts[1][2]) - float(counts[0][2])
    assert 0 <= window <= float(stopped[0][2])
    assert result["cpu"]["emulator"] == pytest.approx(window / result["seconds"])
