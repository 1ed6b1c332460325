"""The sending side under faults that repeat, resets that race the producer, and the errors
and logs a user sees."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import pytest

import kvwire
from kvwire.aio._send import SendState, next_or_fail, until
from kvwire.aio._stream import QUEUE_HIGH
from kvwire.session.sender import TransferDone
from kvwire.testing.fault_proxy import FaultPlan, FaultProxy, Faults
from kvwire.wire import (
    ClientAuthenticated,
    Connection,
    ConnectionConfig,
    Ping,
    Report,
    Role,
    State,
    frame_bytes,
)
from tests.conftest import SECRET, make_layers

pytestmark = pytest.mark.timeout(60)

SPEC = kvwire.KVSpec(num_layers=4, num_kv_heads=2, head_dim=16)


def layers(tokens: int = 256) -> list[tuple[np.ndarray, np.ndarray]]:
    return make_layers(SPEC.num_layers, tokens, SPEC.num_kv_heads, SPEC.head_dim, seed=5)


# -- a RESET between producing a layer and waiting for its credit ------------------------


async def test_credit_wait_sees_a_failure_that_arrived_before_it() -> None:
    st = SendState(asyncio.Event())
    limit = [0]  # no layer granted yet
    st.fail(kvwire.TransferAbortedError("reset while the layer was produced"))
    with pytest.raises(kvwire.TransferAbortedError):
        await asyncio.wait_for(until(st, lambda: limit[0] > 1), 2)


async def test_credit_wait_returns_for_a_grant_that_arrived_before_it() -> None:
    st = SendState(asyncio.Event())
    limit = [2]
    await asyncio.wait_for(until(st, lambda: limit[0] > 1), 2)


async def test_credit_wait_wakes_for_a_grant_that_arrives_while_it_waits() -> None:
    st = SendState(asyncio.Event())
    limit = [0]
    waiter = asyncio.create_task(until(st, lambda: limit[0] > 1))
    await asyncio.sleep(0)
    limit[0] = 2
    st.changed.set()  # what the peer's pump does after the core's credit event
    await asyncio.wait_for(waiter, 2)


async def test_layer_produced_in_the_same_tick_as_a_reset_is_not_sent() -> None:
    st = SendState(asyncio.Event())
    kv = layers()[0]

    async def producer() -> AsyncIterator[tuple[Any, Any]]:
        st.fail(kvwire.TransferAbortedError("reset"))  # arrives while this layer is produced
        yield kv

    with pytest.raises(kvwire.TransferAbortedError):
        await asyncio.wait_for(next_or_fail(producer(), st), 2)


# -- a fault that comes back after every reconnect ----------------------------------------


def corrupt_every_connection(_index: int) -> FaultPlan:
    # a bit of the first CHUNK's payload, after the handshake and BEGIN
    return FaultPlan(forward=Faults(flip_bits=(8 * 2000 + 3,)))


async def test_a_fault_that_repeats_after_every_reconnect_ends_in_connection_lost() -> None:
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with FaultProxy("127.0.0.1", server.port, plan=corrupt_every_connection) as proxy:
            async with kvwire.connect(
                "127.0.0.1", proxy.port, secret=SECRET, reconnect_backoff=0.01, max_reconnects=3,
                chunk_bytes=4096,
            ) as peer:
                with pytest.raises(kvwire.ConnectionLostError):
                    await peer.send("loops", SPEC, layers(), timeout=30)
                assert peer.statistics()["resumes"] == 4
                assert len(proxy.connections) <= 5


async def test_one_transfer_lives_through_a_bounded_number_of_broken_streams() -> None:
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with FaultProxy("127.0.0.1", server.port, plan=corrupt_every_connection) as proxy:
            async with kvwire.connect(
                "127.0.0.1", proxy.port, secret=SECRET, reconnect_backoff=0.01, max_reconnects=100,
                max_transfer_reconnects=2, chunk_bytes=4096,
            ) as peer:
                with pytest.raises(kvwire.ConnectionLostError, match="broken streams"):
                    await peer.send("loops", SPEC, layers(), timeout=30)
                assert peer.statistics()["resumes"] == 3


# -- errors and logs ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["async generator", "generator"])
async def test_producer_exception_is_the_cause_and_the_receiver_sees_an_abort(kind: str) -> None:
    boom = ValueError("the model crashed")

    async def async_producer() -> AsyncIterator[tuple[Any, Any]]:
        yield layers()[0]
        raise boom

    def sync_producer() -> Iterator[tuple[Any, Any]]:  # read with next(), not through futures
        yield layers()[0]
        raise boom

    producer = async_producer if kind == "async generator" else sync_producer

    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            recv = asyncio.create_task(server.expect("crash", timeout=10))
            with pytest.raises(kvwire.TransferAbortedError) as info:
                await peer.send("crash", SPEC, producer(), timeout=10)
            assert info.value.__cause__ is boom
            t = await recv
            with pytest.raises(kvwire.TransferAbortedError):
                await t.collect(timeout=10)


async def test_timeouts_are_timeout_errors_and_lost_connections_connection_errors() -> None:
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        with pytest.raises(TimeoutError):
            await server.expect("never", timeout=0.05)
        port = server.port
    with pytest.raises(ConnectionError) as info:
        async with kvwire.connect("127.0.0.1", port, secret=SECRET, connect_timeout=2):
            pass
    assert isinstance(info.value, kvwire.ConnectionLostError)


async def test_failed_authentication_is_logged_with_the_address_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvwire")
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        with pytest.raises(kvwire.AuthenticationError):
            async with kvwire.connect("127.0.0.1", server.port, secret=b"wrong-secret-123"):
                pass
        loop = asyncio.get_running_loop()
        end = loop.time() + 5
        while server.statistics().get("authentication_failures", 0) < 1 and loop.time() < end:
            await asyncio.sleep(0.02)
        assert server.statistics()["authentication_failures"] == 1
    records = [r for r in caplog.records if r.name == "kvwire" and "authentication failed" in r.getMessage()]
    assert records and "127.0.0.1" in records[0].getMessage()
    assert records[0].levelno == logging.WARNING


async def test_resumes_are_logged_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvwire")
    sent = layers()

    def first_breaks(index: int) -> FaultPlan:
        return FaultPlan(forward=Faults(drop_at=3000)) if index == 0 else FaultPlan()

    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with FaultProxy("127.0.0.1", server.port, plan=first_breaks) as proxy:
            async with kvwire.connect("127.0.0.1", proxy.port, secret=SECRET, reconnect_backoff=0.01,
                                      chunk_bytes=4096) as peer:
                recv = asyncio.create_task(server.expect("resumed", timeout=10))
                await peer.send("resumed", SPEC, sent, timeout=20)
                await (await recv).collect(timeout=10)
                assert peer.statistics()["resumes"] == 1
                assert server.statistics()["resumes"] >= 1
    assert any("resuming" in r.getMessage() for r in caplog.records if r.name == "kvwire")


@pytest.mark.timeout(150)  # above its own bounds (30 s to stall, the send's 90 s, 30 s to collect)
@pytest.mark.parametrize("compiled_queue", [True, False])
async def test_write_marks_tell_when_the_streams_no_longer_hold_what_was_queued(
    compiled_queue: bool, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A send's frames wait in a stream's send queue while the path is stalled: a write
    mark taken then is not passed until they are written.  Without the compiled queue the
    transport copies what the kernel does not take, so nothing of the caller's is held and
    every mark is passed at once.

    The queue holds bytes only when more is in flight than the kernel's buffers between
    the sender and the stalled proxy absorb.  On a loaded host the in-flight target falls
    to its 4 MiB floor, one chunk, which those buffers can take whole (the queue then
    stays empty); so the floor is raised above the whole cache (32 MiB, the server's
    window), and the proxy's receive buffer is kept small: the kernel takes a few MiB at
    most, and the rest waits in the queue however the host is scheduled.  Nothing goes
    idle while the proxy stalls, however long a loaded host takes."""
    from kvwire.aio import _stream
    from kvwire.aio import client as client_module
    from kvwire.control import InflightController

    if not compiled_queue:
        monkeypatch.setattr(_stream, "_sendq", None)
    monkeypatch.setattr(client_module, "InflightController",
                        functools.partial(InflightController, min_bytes=64 << 20))
    held = _stream._sendq is not None  # (none without the extension: KVWIRE_NO_EXTENSIONS)
    spec = kvwire.KVSpec(num_layers=8, num_kv_heads=8, head_dim=128, dtype="float16")
    layers = make_layers(8, 1024, 8, 128, "float16")  # 32 MiB, more than the socket buffers hold
    stall = FaultPlan(forward=Faults(stall_at=1 << 20))
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, idle_timeout=None) as server:
        proxy = FaultProxy("127.0.0.1", server.port, plan=lambda i: stall)
        proxy._proxy.client_rcvbuf = 256 * 1024  # (set before it listens: accepted sockets inherit it)
        async with proxy:
            receiving = asyncio.ensure_future(server.accept())
            async with kvwire.connect("127.0.0.1", proxy.port, secret=SECRET, idle_timeout=None) as peer:
                sending = asyncio.ensure_future(peer.send("r", spec, layers, timeout=90))

                def queued() -> int:
                    return sum(s._queue.pending for s in peer.streams if s._queue is not None)

                loop = asyncio.get_running_loop()
                end = loop.time() + 30
                while not (proxy.statistics().stalls and (queued() or not held)) and loop.time() < end:
                    assert not sending.done(), sending  # (its exception, if it failed)
                    await asyncio.sleep(0.01)
                assert proxy.statistics().stalls, "the proxy never stalled"
                assert queued() or not held, "the send queue held nothing while the path was stalled"
                marks = peer.write_marks()
                assert peer.written_past(marks) is not held
                proxy.resume()
                await sending
                assert peer.written_past(marks)
                await (await receiving).collect(timeout=30)


async def test_a_replaced_stream_still_counts_until_its_socket_is_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream the idle timeout gave up on (its peer stalled) is replaced by a reconnect,
    but its socket stays open while its GOAWAY waits to be written, its send queue still
    holding the caller's buffers: write marks wait for it too, and close() leaves none of
    it holding them.

    That needs the old stream's queue to hold bytes when it is replaced: more in flight
    than the kernel's buffers between it and the stalled proxy absorb.  On a loaded host
    the in-flight target can fall to what those buffers take, so a try that finds the
    queue empty is not counted, and up to three are made; and the in-flight floor is
    raised to 64 MiB, far above what those buffers take, so a loaded host's falling
    target does not leave the queue empty in every try."""
    from kvwire.aio import _stream
    from kvwire.aio import client as client_module
    from kvwire.control import InflightController

    monkeypatch.setattr(_stream, "CLOSE_LINGER", 120.0)  # the old socket stays until close(), however slow the host
    monkeypatch.setattr(client_module, "InflightController",
                        functools.partial(InflightController, min_bytes=64 << 20))
    held = _stream._sendq is not None  # without the extension a transport copies: nothing is held
    spec = kvwire.KVSpec(num_layers=8, num_kv_heads=8, head_dim=128)
    layers = make_layers(8, 8192, 8, 128)
    exercised = False
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        for _ in range(3):
            async with FaultProxy("127.0.0.1", server.port, buffer_bytes=64 * 1024) as proxy:
                peer = kvwire.connect("127.0.0.1", proxy.port, secret=SECRET, streams=1, idle_timeout=1.0)
                await peer.__aenter__()
                try:
                    old = peer.streams[0]
                    sending = asyncio.create_task(peer.send("x", spec, layers))
                    await asyncio.sleep(0.05)
                    proxy.stall(0)
                    for _ in range(300):  # the idle timeout, then a reconnect: up to 30 s on a busy host
                        await asyncio.sleep(0.1)
                        if peer.streams[0] is not old and peer.core.is_open(0):
                            break
                    assert peer.streams[0] is not old
                    queued = old.transport is not None and old._queue is not None and old._queue.pending > 0
                    sending.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await sending
                    if held and not queued:
                        continue  # the kernel took it all: this try shows nothing
                    marks = peer.write_marks()
                    assert peer.written_past(marks) is not held  # the old stream still holds what it had
                finally:
                    await peer.close()
                assert old._queue is None  # dropped with its buffers
                exercised = True
                break
    assert exercised, "the old stream's queue was empty at its replacement in every try"


async def test_a_host_name_the_resolver_refuses_is_a_connection_error() -> None:
    """A host name with a label over 63 characters fails to encode (UnicodeError, not an
    OSError): connect() fails with ConnectionLostError instead of waiting for ever."""
    host = "a" * 64 + ".example"
    with pytest.raises(kvwire.ConnectionLostError, match="cannot connect"):
        await asyncio.wait_for(kvwire.connect(host, 5555, secret=SECRET, connect_timeout=1).__aenter__(), 30)


@pytest.mark.parametrize("codec", ["raw", "auto"])
async def test_a_peer_never_opened_says_how_to_open_it(codec: str) -> None:
    # Not "the server does not accept codec 'raw' (it accepts )": the peer never connected.
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        peer = kvwire.connect("127.0.0.1", server.port, secret=SECRET)
        try:
            with pytest.raises(kvwire.UsageError, match=r"async with kvwire\.connect"):
                await peer.send("a", SPEC, layers(), codec=codec)
        finally:
            await peer.close()
        with pytest.raises(kvwire.ConnectionLostError, match="closed"):  # closed: not a misuse
            await peer.send("a", SPEC, layers(), codec=codec)


async def test_a_cancelled_send_ends_its_producers_wait() -> None:
    """send() cancelled while its producer waits for the next layer (the model computing
    it): the producer's wait ends with it (its finally runs, it never goes on), nothing of
    the send is left running, and the next send on the peer works."""
    spec = kvwire.KVSpec(num_layers=4, num_kv_heads=2, head_dim=16)
    layers = make_layers(4, 256, 2, 16)
    gate = asyncio.Event()
    state = {"went_on": False, "finally": False}

    async def producer() -> AsyncIterator[tuple[np.ndarray, np.ndarray]]:
        try:
            yield layers[0]
            await gate.wait()
            state["went_on"] = True
            for kv in layers[1:]:
                yield kv
        finally:
            state["finally"] = True

    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            before = set(asyncio.all_tasks())
            sending = asyncio.create_task(peer.send("r", spec, producer(), timeout=30))
            await asyncio.sleep(0.3)
            sending.cancel()
            with pytest.raises(asyncio.CancelledError):
                await sending
            await asyncio.sleep(0.1)
            left = [t for t in asyncio.all_tasks() if t not in before and t is not asyncio.current_task()]
            assert left == [] and state["finally"]
            gate.set()
            await asyncio.sleep(0.1)
            assert not state["went_on"]
            assert (await peer.send("r2", spec, layers, timeout=10)).chunks > 0


@pytest.mark.parametrize("fault", [FaultPlan(backward=Faults(drop_at=40)),
                                   FaultPlan(forward=Faults(drop_at=10, drop_mode="reset"))],
                         ids=["dropped-in-welcome", "reset-in-hello"])
async def test_a_later_stream_breaking_in_its_handshake_is_reconnected_not_fatal(fault: FaultPlan) -> None:
    """The session exists once the first stream is welcomed: a later stream of it that
    breaks in its handshake is reconnected like any other, and connect() succeeds (it
    failed with 'connection closed during the handshake')."""
    spec = kvwire.KVSpec(num_layers=4, num_kv_heads=2, head_dim=32)
    layers = make_layers(4, 64, 2, 32)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        # the proxy's third connection is stream 2's first
        async with FaultProxy("127.0.0.1", server.port, plan=lambda i: fault if i == 2 else FaultPlan()) as proxy:
            async with kvwire.connect("127.0.0.1", proxy.port, secret=SECRET, streams=4, connect_timeout=5) as peer:
                assert len(proxy.connections) == 5  # stream 2 connected twice
                receiving = asyncio.ensure_future(server.expect("a", timeout=30))
                await peer.send("a", spec, layers, timeout=30)
                got = await (await receiving).collect(timeout=30)
                assert all(np.array_equal(a, b) for (k, v), (gk, gv) in zip(layers, got.layers, strict=True)
                           for a, b in ((k, gk), (v, gv)))


# -- a server that floods PINGs and reads nothing ------------------------------------------


async def _fake_server_handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                                 session_id: bytes = b"F" * 16) -> Connection:
    """A server side written with the sans-IO connection: the handshake only."""
    conn = Connection(Role.SERVER, ConnectionConfig(secret=SECRET))
    while conn.state is not State.OPEN:
        data = await reader.read(65536)
        assert data, "the client went away during the handshake"
        conn.receive_data(data)
        while (ev := conn.next_event()) is not None:
            if isinstance(ev, ClientAuthenticated):
                conn.welcome(ev.session_id if any(ev.session_id) else session_id, ("raw",))
        writer.write(b"".join(bytes(p) for p in conn.data_to_send()))
    return conn


async def test_a_server_flooding_pings_while_it_reads_nothing_does_not_grow_the_clients_queue() -> None:
    """Each PING answered at once with a PONG the server never reads: the client's send
    queue grew by a PONG per PING without bound (the server pauses reading in this case;
    the client goes on reading, for its acks, and owes one PONG instead)."""
    flood = frame_bytes(Ping(opaque=7)) * 50_000  # 1 MB of PINGs per write
    megabytes = 8
    held: list[Any] = []  # a transport that is not read holds nothing else alive

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(asyncio.current_task())
        try:
            await _fake_server_handshake(reader, writer)
            writer.transport.pause_reading()  # reads nothing from here on
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            for _ in range(megabytes):
                writer.write(flood)
                await writer.drain()
            writer.write(frame_bytes(Report(transport_ns_per_mib=1000)))  # marks the end
            await writer.drain()
            await asyncio.Event().wait()
        finally:
            writer.transport.abort()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        port = srv.sockets[0].getsockname()[1]
        async with kvwire.connect("127.0.0.1", port, secret=SECRET, idle_timeout=None) as peer:
            stream = peer.streams[0]
            sock = stream.transport.get_extra_info("socket") if stream.transport is not None else None
            if sock is not None:  # the kernel takes little of what the client queues
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            for _ in range(3000):  # every PING before the REPORT was read and handled
                if peer.receiver["transport_s_per_gb"] is not None:
                    break
                await asyncio.sleep(0.01)
            assert peer.receiver["transport_s_per_gb"] is not None
            queued = stream._queue.pending if stream._queue is not None else stream.transport.get_write_buffer_size()
            assert queued <= QUEUE_HIGH + (1 << 20), f"{queued:,} bytes queued for a server that reads nothing"
    finally:
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        srv.close()
        await srv.wait_closed()


async def test_a_send_cancelled_after_every_chunk_was_acknowledged_is_not_delivered() -> None:
    """The last ACK arrived (the core completed the transfer) and send() was cancelled
    before it took the receipt: it raised CancelledError, so the receiver must not hand
    the transfer out; the sender sends its RESET all the same."""
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            sending = asyncio.ensure_future(peer.send("late", SPEC, layers(), timeout=30))
            on_event = peer._on_event

            def cancel_when_done(ev: Any) -> None:
                on_event(ev)
                if isinstance(ev, TransferDone):
                    sending.cancel()  # before the send task runs again to take its receipt

            peer._on_event = cancel_when_done  # type: ignore[method-assign]
            with pytest.raises(asyncio.CancelledError):
                await sending
            peer._on_event = on_event  # type: ignore[method-assign]
            for _ in range(500):
                if server.statistics()["failed_arrivals"] == 1:
                    break
                await asyncio.sleep(0.01)
            # Not delivered: handed out as the failure the sender's RESET made it.
            assert server.statistics()["failed_arrivals"] == 1, "a cancelled send was delivered"
            late = await server.expect("late", timeout=5)
            with pytest.raises(kvwire.TransferAbortedError):
                await late.collect(timeout=5)
            # the session goes on
            receiving = asyncio.ensure_future(server.expect("next", timeout=30))
            await peer.send("next", SPEC, layers(), timeout=30)
            assert len((await (await receiving).collect(timeout=30)).layers) == SPEC.num_layers


# -- streams that cannot join ------------------------------------------------------------


async def test_open_fails_when_a_stream_can_never_join_instead_of_waiting_for_ever() -> None:
    """Stream 0 opens; every join of stream 1 is dropped after its HELLO (a resumable
    break): once its reconnect_attempts were used the slot was given up silently, and
    open() waited for it with no end (still waiting after 40 s)."""
    drop_joins = FaultPlan(forward=Faults(drop_at=20))
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with FaultProxy("127.0.0.1", server.port, plan=lambda i: drop_joins if i else FaultPlan()) as proxy:
            peer = kvwire.connect("127.0.0.1", proxy.port, secret=SECRET, streams=2, connect_timeout=5,
                                  reconnect_attempts=3, reconnect_backoff=0.01)
            with pytest.raises(kvwire.ConnectionLostError, match="stream 1 could not join the session in 4 attempts"):
                await asyncio.wait_for(peer.open(), 20)
            assert peer.closed and len(proxy.connections) == 5


async def test_open_is_bounded_when_a_stream_joins_too_slowly() -> None:
    """Joins that are never answered (each attempt waits out connect_timeout): open()
    gives the other streams connect_timeout after the first one opened, then fails (a
    fixed count) or goes on with the streams open ("auto"; the others keep trying, as
    reconnects do)."""
    stall_joins = FaultPlan(forward=Faults(stall_at=0))
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with FaultProxy("127.0.0.1", server.port, plan=lambda i: stall_joins if i else FaultPlan()) as proxy:
            peer = kvwire.connect("127.0.0.1", proxy.port, secret=SECRET, streams=2, connect_timeout=1)
            with pytest.raises(kvwire.TransferTimeoutError, match=r"stream\(s\) 1 did not join the session"):
                await asyncio.wait_for(peer.open(), 20)
            assert peer.closed
        async with FaultProxy("127.0.0.1", server.port, plan=lambda i: stall_joins if i else FaultPlan()) as proxy:
            async with kvwire.connect("127.0.0.1", proxy.port, secret=SECRET, streams="auto", max_streams=3,
                                      connect_timeout=1) as peer:
                assert peer.core.open_streams == [0]
                receiving = asyncio.ensure_future(server.expect("auto", timeout=30))
                await peer.send("auto", SPEC, layers(), timeout=30)
                assert len((await (await receiving).collect(timeout=30)).layers) == SPEC.num_layers


async def test_auto_streams_settle_for_the_streams_the_server_allows(caplog: pytest.LogCaptureFixture) -> None:
    """streams="auto" opens max_streams streams; a server allowing fewer per session
    (max_streams=3) refuses the rest with LIMIT_EXCEEDED, which failed connect() outright:
    now the peer goes on with the 3 it has (an expected outcome: logged as information,
    not warned about).  A fixed count the server refuses still fails with
    LimitExceededError."""
    caplog.set_level(logging.INFO, logger="kvwire")
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, max_streams=3) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, streams="auto", max_streams=6) as peer:
            assert len(peer.core.open_streams) == 3
            assert sum(peer.core.is_given_up(i) for i in range(6)) == 3
            given_up = [r for r in caplog.records if "given up" in r.getMessage()]
            assert len(given_up) == 3 and {r.levelno for r in given_up} == {logging.INFO}
            assert peer.stream_controller is not None
            receiving = asyncio.ensure_future(server.expect("auto", timeout=30))
            await peer.send("auto", SPEC, layers(), timeout=30)
            assert len((await (await receiving).collect(timeout=30)).layers) == SPEC.num_layers
        with pytest.raises(kvwire.LimitExceededError):
            async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, streams=4):
                pass


# -- a slot given up after open() ------------------------------------------------------------


@contextlib.asynccontextmanager
async def _peer_that_gave_up_slot_2(**connect: Any) -> AsyncIterator[kvwire.Peer]:
    """A peer of three streams whose stream 2 breaks once it is open and can never come
    back (every later connection through the proxy is closed at once): its slot is given
    up and the session goes on with streams 0 and 1."""
    drop = FaultPlan(forward=Faults(drop_at=0))
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with FaultProxy("127.0.0.1", server.port, plan=lambda i: drop if i >= 3 else FaultPlan()) as proxy:
            async with kvwire.connect("127.0.0.1", proxy.port, secret=SECRET, reconnect_attempts=1,
                                      reconnect_backoff=0.01, **connect) as peer:
                assert peer.core.open_streams == [0, 1, 2]
                peer.streams[2].abort()
                for _ in range(1000):
                    if peer.core.is_given_up(2):
                        break
                    await asyncio.sleep(0.01)
                assert peer.core.is_given_up(2) and peer.core.open_streams == [0, 1]
                yield peer


async def test_active_streams_does_not_count_a_slot_given_up() -> None:
    """With a fixed count, active_streams was the number of slots: still 3 after stream 2
    was given up, while chunks went on 2.  It is the streams chunks are striped over now."""
    async with _peer_that_gave_up_slot_2(streams=3) as peer:
        assert peer.active_streams == 2


async def test_auto_streams_never_choose_more_streams_than_the_slots_left() -> None:
    """streams="auto": the controller's range was capped by the slots given up only when
    open() ended; a slot given up later left it free to grow to every slot, asking for
    streams that no longer exist.  Now its range (and the in-flight floor's stream count)
    comes down as soon as a slot is given up."""
    from kvwire.aio._send import clock
    from kvwire.control import InflightController, StreamSample

    async with _peer_that_gave_up_slot_2(streams="auto", max_streams=3) as peer:
        ctl = peer.stream_controller
        assert ctl is not None
        window_limited = StreamSample(delivery_rate_bps=1e9, window_limited=True)
        start = clock() + 100  # evaluations the controller's own loop does not interleave with
        for i in range(6):  # every stream window-limited, the total rising with each
            ctl.evaluate([window_limited] * ctl.streams, start + i)
        assert ctl.streams == 2
        assert peer.inflight.floor_bytes <= InflightController(
            streams=2, chunk_bytes=peer.options.chunk_bytes).floor_bytes


async def test_the_in_flight_floor_follows_the_streams_left_with_a_fixed_count() -> None:
    """The in-flight floor keeps two chunks queued per stream in use: with a fixed count
    it stayed sized for every slot after one was given up."""
    from kvwire.control import InflightController

    async with _peer_that_gave_up_slot_2(streams=3) as peer:
        assert peer.inflight.floor_bytes == InflightController(
            streams=2, chunk_bytes=peer.options.chunk_bytes).floor_bytes
