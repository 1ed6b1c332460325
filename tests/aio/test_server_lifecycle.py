"""A server's waits and its teardown: nothing waits for ever on a closed server, nothing a
cancelled wait was handed stays held, a registry failing in its own way fails closed."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import subprocess
import sys
import textwrap
from collections.abc import Iterable
from typing import Any

import pytest

import kvwire
from kvwire.aio._pool import default_pool
from kvwire.errors import ConnectionLostError, UsageError
from tests.conftest import SECRET, make_layers

pytestmark = pytest.mark.timeout(60)

SPEC = kvwire.KVSpec(num_layers=3, num_kv_heads=2, head_dim=16)


def layers() -> list[Any]:
    return make_layers(3, 8, 2, 16)


async def test_accept_and_expect_after_close_fail_at_once() -> None:
    server = await kvwire.serve("127.0.0.1", 0, secret=SECRET).__aenter__()
    await server.close()
    for wait in (server.accept(), server.expect("x"), server.accept(timeout=30), server.expect("x", timeout=30)):
        with pytest.raises(ConnectionLostError, match="closed"):
            await asyncio.wait_for(wait, 5)
    with pytest.raises(UsageError, match="closed"):
        await server.start()


@pytest.mark.parametrize("request_id", [5, b"x", "", None, "x" * 65536, "\ud800"])
async def test_expect_of_an_id_no_sender_can_send_is_refused_at_once(request_id: Any) -> None:
    # A sender's request id is a non-empty str: a wait for anything else could only time out.
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        with pytest.raises(UsageError, match="request_id must be a non-empty str"):
            await asyncio.wait_for(server.expect(request_id, timeout=30), 5)


async def test_accept_and_expect_before_start_say_how_to_start_it() -> None:
    # A server that never listened: nothing can arrive, so no wait (here without end).
    server = kvwire.serve("127.0.0.1", 0, secret=SECRET)
    try:
        for wait in (server.accept(), server.expect("x"), server.accept(timeout=30), server.expect("x", timeout=30)):
            with pytest.raises(UsageError, match=r"async with kvwire\.serve"):
                await asyncio.wait_for(wait, 5)
    finally:
        await server.close()


async def test_start_twice_is_refused() -> None:
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        with pytest.raises(UsageError, match="already listening"):
            await server.start()


async def test_a_cancelled_accept_does_not_keep_the_transfer_it_was_handed() -> None:
    """The transfer was claimed for accept() just as its task was cancelled: nobody will
    take it, so it is aborted and its memory is given back, not held until the server
    closes (claim_timeout does not cover a claimed transfer)."""
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        accepting = asyncio.ensure_future(server.accept())
        await asyncio.sleep(0)
        [fut] = server._accept_waiters

        async def cancel_once_handed() -> None:
            while not fut.done():
                await asyncio.sleep(0)
            accepting.cancel()

        canceller = asyncio.ensure_future(cancel_once_handed())
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            sending = asyncio.ensure_future(peer.send("a", SPEC, layers(), timeout=10))
            await canceller
            with pytest.raises(asyncio.CancelledError):
                await accepting
            with contextlib.suppress(kvwire.TransferAbortedError):
                await sending  # complete already, or aborted with the transfer
        for _ in range(100):
            if server.statistics()["buffered_bytes"] == 0:
                break
            await asyncio.sleep(0.02)
        assert server.statistics()["buffered_bytes"] == 0
        assert not server._transfers


@pytest.mark.parametrize("how", ["accept", "expect", "iterated"])
async def test_a_transfer_the_application_lets_go_of_is_aborted_and_its_memory_given_back(how: str) -> None:
    """Handed out, then dropped before every layer was taken: claim_timeout no longer
    covers it, so the server held its layers (counted against max_buffer_bytes) until the
    session ended; a few such transfers refused every later send."""
    gc.collect()  # an earlier test's transfers, given back now, not while this one runs
    leased = default_pool().leased_bytes
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, claim_timeout=None) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            await peer.send("a", SPEC, layers(), timeout=10)
            assert server.statistics()["buffered_bytes"] > 0
            aborted = server.statistics().get("transfers_aborted", 0)
            transfer = await (server.accept() if how == "accept" else server.expect("a"))
            if how == "iterated":
                async for _ in transfer:
                    break  # leaving the loop early aborts too (once: not again when let go of)
            del transfer
            gc.collect()
            for _ in range(100):
                if server.statistics()["buffered_bytes"] == 0:
                    break
                await asyncio.sleep(0.02)
            assert server.statistics()["buffered_bytes"] == 0
            assert server.statistics().get("transfers_aborted", 0) == aborted + 1
            assert not server._transfers and not server._handed
            await peer.send("b", SPEC, layers(), timeout=10)  # the session goes on
            taken = [layer.index async for layer in await server.expect("b", timeout=10)]
            assert taken == [0, 1, 2]
    assert default_pool().leased_bytes == leased


HELD_AT_EXIT = textwrap.dedent("""
    import asyncio, atexit, sys, weakref
    import numpy as np
    import kvwire

    SECRET = b"s" * 32
    spec = kvwire.KVSpec(num_layers=3, num_kv_heads=2, head_dim=16)
    held = {}

    def finish() -> None:  # an application's shutdown hook, taking a transfer it still holds
        loop, transfer = held["loop"], held["transfer"]
        try:
            cache = loop.run_until_complete(transfer.collect(timeout=30))
            print("taken", len(cache.layers), flush=True)
        except Exception as exc:
            print("failed", repr(exc), flush=True)

    # Registered before any weakref.finalize exists: finalize's own exit hook, registered
    # with the first one, runs before this one (atexit runs the latest first).
    print("first" if not weakref.finalize._registered_with_atexit else "not first", flush=True)
    atexit.register(finish)

    async def main() -> None:
        server = await kvwire.serve("127.0.0.1", 0, secret=SECRET).__aenter__()
        peer = await kvwire.connect("127.0.0.1", server.port, secret=SECRET).__aenter__()
        layer = np.ones((8, 2, 16), np.float16)
        await peer.send("r", spec, [(layer, layer)] * 3, timeout=30)
        held["transfer"] = await server.expect("r", timeout=30)  # handed out, not yet taken
        held["peer"], held["server"] = peer, server

    held["loop"] = loop = asyncio.new_event_loop()
    loop.run_until_complete(main())
    sys.exit(0)
""")


def test_a_transfer_still_held_at_interpreter_exit_is_not_taken_for_let_go() -> None:
    """The server's finalizer for a handed-out transfer ran at interpreter exit (a
    weakref.finalize's default), before an application's own exit hook that still held the
    transfer and was taking it: the transfer was aborted as 'let go of'."""
    out = subprocess.run([sys.executable, "-c", HELD_AT_EXIT], capture_output=True, text=True, timeout=60,
                         check=False)
    words = out.stdout.split()
    assert words[:1] == ["first"], out.stdout + out.stderr[-3000:]  # the order that matters
    assert words[1:3] == ["taken", "3"], out.stdout + out.stderr[-3000:]


async def test_a_transfer_taken_whole_and_let_go_of_is_not_aborted() -> None:
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            sending = asyncio.ensure_future(peer.send("a", SPEC, layers(), timeout=10))
            transfer = await server.expect("a", timeout=10)
            await transfer.collect(timeout=10)
            await sending
            del transfer
            gc.collect()
            await asyncio.sleep(0.05)
            assert server.statistics().get("transfers_aborted", 0) == 0


async def test_timed_out_accepts_leave_no_waiter_behind() -> None:
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        for _ in range(50):
            with pytest.raises(kvwire.TransferTimeoutError):
                await server.accept(timeout=0.001)
        assert not server._accept_waiters


async def test_close_drops_transfers_nobody_claimed_with_their_memory() -> None:
    gc.collect()  # an earlier test's transfers, given back now, not while this one runs
    leased = default_pool().leased_bytes
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, claim_timeout=None) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            await peer.send("unclaimed", SPEC, layers(), timeout=10)
        assert server.statistics()["pending_arrivals"] == 1
    assert server.statistics()["pending_arrivals"] == 0 and server.statistics()["buffered_bytes"] == 0
    assert not server._transfers
    assert default_pool().leased_bytes == leased
    with pytest.raises(ConnectionLostError):
        await server.accept()


class _BrokenRegistry:
    """A registry of the caller's whose calls fail with an error of its own kind."""

    async def check_many(self, pairs: Iterable[Any]) -> list[Any]:
        raise RuntimeError("the registry's database is down")

    async def publish(self, pairs: Iterable[Any]) -> list[Any]:
        raise RuntimeError("the registry's database is down")


async def test_a_registry_raising_its_own_error_fails_the_transfer_closed() -> None:
    """Not a KvwireError: the transfer was neither refused nor accepted, and send() and
    expect() waited until their own timeouts (for ever without one)."""
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, registry=_BrokenRegistry()) as server:  # type: ignore[arg-type]
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            receiving = asyncio.ensure_future(server.expect("gated", timeout=30))
            with pytest.raises(kvwire.KvwireError, match="registry"):
                await asyncio.wait_for(peer.send("gated", SPEC, layers(), blocks=[(b"b0", 1)]), 15)
            receiving.cancel()
            await asyncio.gather(receiving, return_exceptions=True)
