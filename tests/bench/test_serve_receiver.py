"""``kvwire serve``'s receiver (``BenchReceiver``) against peers it cannot trust and
senders that stall: a bench's meta is checked field by field, a transfer whose layer
cannot be checked fails alone, each transfer is received on its own (one stalled
sender holds up no other) and a layer's reference is bounded by what the transfer
brought and built off the event loop."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from kvwire.bench import runner
from kvwire.bench.models import bench_cache
from kvwire.errors import TransferAbortedError
from kvwire.spec import KVSpec
from tests.bench.process_helpers import child_env
from tests.bench.receiver_fakes import TINY, FakeServer, FakeTransfer, bench_transfer, until

pytestmark = pytest.mark.timeout(120)

# -- the bench's meta --------------------------------------------------------------------------


@pytest.mark.parametrize(("bench", "says"), [
    ("junk", "kvwire_bench must be an object"),
    ({"seed": 0}, "kvwire_bench.id"),
    ({"id": 7}, "kvwire_bench.id"),
    ({"id": ""}, "kvwire_bench.id"),
    ({"id": "x" * 65}, "kvwire_bench.id"),
    ({"id": "two words"}, "kvwire_bench.id"),
    ({"id": "line\nbreak"}, "kvwire_bench.id"),
    ({"id": "b", "seed": "abc"}, "kvwire_bench.seed"),
    ({"id": "b", "seed": -1}, "kvwire_bench.seed"),
    ({"id": "b", "seed": None}, "kvwire_bench.seed"),
    ({"id": "b", "seed": 1.5}, "kvwire_bench.seed"),
    ({"id": "b", "seed": True}, "kvwire_bench.seed"),
    ({"id": "b", "seed": 2**64}, "kvwire_bench.seed"),
    ({"id": "b", "end": "yes"}, "kvwire_bench.end"),
])
def test_a_bench_meta_is_checked_field_by_field(bench: Any, says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        runner.bench_meta({"kvwire_bench": bench})


def test_a_bench_meta_that_is_right() -> None:
    assert runner.bench_meta({"other": 1}) is None and runner.bench_meta(None) is None
    assert runner.bench_meta({"kvwire_bench": {"id": "a1b2"}}) == runner.BenchMeta("a1b2", 0, False)
    got = runner.bench_meta({"kvwire_bench": {"id": "a", "seed": 2**64 - 1, "end": True, "more": []}})
    assert got == runner.BenchMeta("a", 2**64 - 1, True)


def test_serve_survives_bench_metas_it_cannot_use(tmp_path: Any) -> None:
    """`kvwire serve` crashed (ValueError, TypeError out of the receiving loop) on one
    authenticated transfer whose bench seed was not a whole number >= 0. Now each such
    transfer is aborted with a line saying why, and the server goes on receiving."""
    from kvwire.aio import connect

    server = subprocess.Popen([sys.executable, "-m", "kvwire", "serve", "--port", "0"],
                              stderr=subprocess.PIPE, text=True, env=child_env())
    lines: list[str] = []
    reader: threading.Thread | None = None
    try:
        assert server.stderr is not None
        for line in server.stderr:
            lines.append(line)
            if (match := re.search(r"listening on 127\.0\.0\.1:(\d+)", line)) is not None:
                break
        else:
            raise AssertionError("".join(lines))
        port = int(match[1])
        reader = threading.Thread(target=lambda: lines.extend(server.stderr), daemon=True)  # type: ignore[arg-type]
        reader.start()
        spec = TINY.spec()
        layers = bench_cache(TINY, 4, 0)
        bad = [{"id": "x", "seed": "abc"}, {"id": "x", "seed": -1}, {"id": "x", "seed": None},
               {"id": "x", "seed": 2**70}, {"id": "x\ny"}, {"id": "x", "end": 1}]

        async def main() -> list[str]:
            refused = []
            async with connect("127.0.0.1", port, secret=runner.DEV_SECRET, streams=1) as peer:
                for i, bench in enumerate(bad):
                    with pytest.raises(TransferAbortedError) as exc:
                        await peer.send(f"bad-{i}", spec, layers, meta={"kvwire_bench": bench}, timeout=20)
                    refused.append(str(exc.value))
                # A bench after them is received and reported as ever.
                for i in range(2):
                    await peer.send(f"good-{i}", spec, layers, meta={"kvwire_bench": {"id": "good", "seed": 0}},
                                    timeout=20)
                await peer.send("good-end", spec, bench_cache(TINY, 1, 0),
                                meta={"kvwire_bench": {"id": "good", "seed": 0, "end": True}}, timeout=20)
            return refused

        refused = asyncio.run(asyncio.wait_for(main(), 60))
        assert all("kvwire serve: kvwire_bench." in r for r in refused), refused
        assert server.poll() is None, "".join(lines)

        async def report() -> None:
            await until(lambda: any("bench good: 2 transfers" in x for x in lines), "the bench's report")

        asyncio.run(report())
    finally:
        if server.poll() is None:
            server.terminate()
        server.wait(timeout=20)
        if reader is not None:
            reader.join(timeout=10)
        if server.stderr is not None:
            server.stderr.close()
    out = "".join(lines)
    assert "Traceback" not in out, out
    assert out.count(": refused: kvwire_bench.") == len(bad), out
    assert "max_rel_error 0 " in out, out


# -- the check of a layer ----------------------------------------------------------------------


async def test_a_layer_that_cannot_be_checked_fails_only_its_transfer() -> None:
    """A peer's layers of other token counts than the last (not a kvwire sender's)
    reached layer_error's ValueError, out of the receiving loop: now the transfer counts
    as failed in its bench, with a line."""
    lines: list[str] = []
    recv = runner.BenchReceiver(FakeServer(), lines.append)
    uneven = bench_transfer("u", 0)
    # Layer 0 (the one checked) of 1 token, the others of 16: its reference has 16.
    uneven._layers = [bench_cache(TINY, 1, 0)[0], *bench_cache(TINY, 16, 0)[1:]]
    assert await recv.handle(uneven) is None
    assert await recv.handle(bench_transfer("u", 1)) is None
    report = await recv.handle(bench_transfer("u", 2, end=True))
    assert report is not None and report["failed"] == 1 and report["transfers"] == 1
    assert report["checked_layers"] == 1
    assert any(x.startswith("u-0: failed: layer 0 could not be checked:") for x in lines), lines


async def test_a_reference_larger_than_the_transfer_is_not_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference of a checked layer is bench_cache's pool, which has about 1,000
    elements per tensor of the model whatever their size: 4096 layers of one element
    made the server build (on its event loop) and keep 16 MiB for a transfer of 16 KiB,
    65535 of them 256 MiB. Now a reference much larger than the transfer is not built
    (the transfer fails its check), and one that is, is built in a worker thread."""
    built: list[str] = []
    real = runner.bench_cache

    def recording(*args: Any) -> Any:
        built.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(runner, "bench_cache", recording)
    lines: list[str] = []
    recv = runner.BenchReceiver(FakeServer(), lines.append)
    spec = KVSpec(num_layers=4096, num_kv_heads=1, head_dim=1, model="many-tiny-layers")
    one = np.zeros((1, 1, 1), np.float16)
    hostile = FakeTransfer("h-0", {"kvwire_bench": {"id": "h", "seed": 0}}, spec, [(one, one)] * 4096)
    assert await recv.handle(hostile) is None
    state = recv._benches["h"]
    assert state.reference is None and state.failed == 1 and built == []
    assert any("h-0: failed: layer 0 could not be checked: its reference would take" in x for x in lines), lines
    # A bench's own transfer: checked, its reference built off the loop.
    assert await recv.handle(bench_transfer("t", 0)) is None
    assert recv._benches["t"].checked_layers == 1
    assert built and threading.main_thread().name not in built


# -- one transfer at a time no more -------------------------------------------------------------


async def test_a_stalled_sender_holds_up_no_other() -> None:
    """``kvwire serve`` received one transfer at a time: a sender that stopped in the
    middle of one (SIGSTOP, a dead link) kept every other sender's transfers unclaimed,
    and past 64 of them the server refused each one ("more than 64 transfers in
    progress") until the stalled session was dropped. Now each transfer is received on
    its own; the stalled one is cancelled when the receiver stops."""
    from kvwire.aio import connect, serve

    spec = TINY.spec()
    layers = bench_cache(TINY, 4, 0)
    stall = asyncio.Event()

    async def stalled() -> AsyncIterator[tuple[Any, Any]]:
        yield layers[0]
        await stall.wait()  # never set: the sender stops sending mid-transfer
        for layer in layers[1:]:
            yield layer

    lines: list[str] = []
    async with serve("127.0.0.1", 0, secret=runner.DEV_SECRET) as server:
        recv = runner.BenchReceiver(server, lines.append)
        receiving = asyncio.create_task(recv.run())
        try:
            async with connect("127.0.0.1", server.port, secret=runner.DEV_SECRET, streams=1) as a, \
                    connect("127.0.0.1", server.port, secret=runner.DEV_SECRET, streams=1) as b:
                a_send = asyncio.create_task(
                    a.send("a-0", spec, stalled(), meta={"kvwire_bench": {"id": "a", "seed": 0}}, timeout=None))
                await until(lambda: "a" in recv._benches and recv._benches["a"].busy == 1, "A's transfer taken")

                async def bench_b() -> None:
                    for i in range(server.core.config.max_transfers + 6):
                        await b.send(f"b-{i}", spec, layers, meta={"kvwire_bench": {"id": "b", "seed": 0}},
                                     timeout=20)
                    await b.send("b-end", spec, bench_cache(TINY, 1, 0),
                                 meta={"kvwire_bench": {"id": "b", "seed": 0, "end": True}}, timeout=20)

                await asyncio.wait_for(bench_b(), 60)
                await until(lambda: any(x.startswith("bench b: 70 transfers") for x in lines), "B's report")
                assert not a_send.done() and recv._benches["a"].busy == 1
                receiving.cancel()
                await asyncio.gather(receiving, return_exceptions=True)
                # A's transfer was being received in a task of its own: cancelled with the
                # receiver, which aborted it (its sender is told).
                with pytest.raises(TransferAbortedError):
                    await asyncio.wait_for(a_send, 30)
        finally:
            receiving.cancel()
            await asyncio.gather(receiving, return_exceptions=True)


async def test_at_most_max_receiving_transfers_are_received_at_once() -> None:
    """Transfers are received side by side up to MAX_RECEIVING; the next is accepted once
    one ends, and stopping the receiver cancels every one."""
    hold = asyncio.Event()
    handed: list[FakeTransfer] = []

    class Server(FakeServer):
        async def accept(self) -> FakeTransfer:
            t = bench_transfer(f"s{len(handed)}", 0, hold=hold)
            handed.append(t)
            return t

    recv = runner.BenchReceiver(Server())
    receiving = asyncio.create_task(recv.run())
    try:
        await until(lambda: len(handed) == runner.MAX_RECEIVING, f"{runner.MAX_RECEIVING} transfers taken")
        for _ in range(50):
            await asyncio.sleep(0)
        assert len(handed) == runner.MAX_RECEIVING
        hold.set()  # they end: more are taken
        await until(lambda: len(handed) > runner.MAX_RECEIVING, "more transfers taken")
        hold.clear()
    finally:
        receiving.cancel()
        await asyncio.gather(receiving, return_exceptions=True)
    # Every transfer whose layers were being read was closed; one taken as the receiver
    # stopped may have been cancelled before its reading began (several can be taken
    # between two polls once the first ones end).
    assert all(t.closed for t in handed if t.begun)
    assert sum(t.closed for t in handed) >= runner.MAX_RECEIVING


async def test_a_bench_ends_once_its_transfers_in_progress_have_ended() -> None:
    """With transfers received side by side, a bench's end could overtake its last
    transfer still being received (or checked): the report missed it."""
    recv = runner.BenchReceiver(FakeServer())
    hold = asyncio.Event()
    last = asyncio.create_task(recv.handle(bench_transfer("e", 0, hold=hold)))
    await until(lambda: "e" in recv._benches and recv._benches["e"].busy == 1, "the transfer begun")
    end = asyncio.create_task(recv.handle(bench_transfer("e", 1, end=True)))
    for _ in range(50):
        await asyncio.sleep(0)
    assert not end.done()
    hold.set()
    report = await asyncio.wait_for(end, 30)
    assert await last is None
    assert report is not None and report["transfers"] == 1 and report["checked_layers"] == 1


async def test_a_prune_keeps_a_bench_whose_layer_is_being_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A transfer stopped counting as busy before its layer check, so a prune in the
    meantime dropped its bench, whose report then lost every earlier transfer."""
    entered, release = threading.Event(), threading.Event()
    real = runner.layer_error

    def slow(*args: Any) -> float:
        entered.set()
        release.wait(30)
        return real(*args)

    monkeypatch.setattr(runner, "layer_error", slow)
    lines: list[str] = []
    recv = runner.BenchReceiver(FakeServer(), lines.append)
    checking = asyncio.create_task(recv.handle(bench_transfer("p", 0)))
    try:
        await until(entered.is_set, "the check begun")
        recv.prune(now=runner.time.monotonic() + runner.BENCH_IDLE)
        assert "p" in recv._benches, lines
    finally:
        release.set()
        await asyncio.wait_for(checking, 30)
    assert recv._benches["p"].checked_layers == 1
