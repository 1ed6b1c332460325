"""The vLLM connector's producer side driven step by step, as vLLM's worker drives it, with
real torch caches, a real kvwire server and a proxy that stalls the path: when a send's
blocks are given back to vLLM and when nothing reads them any more.  (A real engine runs
in test_vllm.py, preempting requests too; a preemption while a send is in flight cannot
be placed there at will.)  Then the scheduler side through preemption and with the
consumer's prefix cache, fed vLLM's own scheduler output objects, and a consumer worker
that loads part of a transfer and drops another, two requests of one name, and loads
waited for within one load timeout per layer (and sends behind a late one not waited for).
A consumer loading asynchronously (``kvwire_load_async``): the hit parked, its load in the
metadata, steps that do not wait for it, and what get_finished reports once it ended.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from kvwire.errors import KvwireError, TransferTimeoutError, UsageError
from kvwire.paged import DROP, PagedSource, PagedSpec, gather_layer, host_view
from kvwire.sync import Bridge, SyncPeer, SyncServer
from kvwire.testing import FaultPlan, FaultProxy, Faults
from tests.integration.vllm_steps import (
    async_consumer,
    consumer_step,
    consumer_worker,
    drops_ended,
    finished_sends,
    producer,
    step,
    until_received,
)
from tests.integration.vllm_workers import LAYERS, SECRET, config, wait_connected

with warnings.catch_warnings():  # vLLM's import chain trips torch's own deprecation warnings
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm import SamplingParams
    from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from kvwire.integrations.vllm import KvwireConnector, KvwireConnectorMetadata, _Move, _SendState

pytestmark = pytest.mark.timeout(120)

BLOCKS = list(range(3, 259))  # 256 blocks of 32 KiB per layer: 32 MiB in all, more than socket buffers hold
STALL_AT = 64 * 1024


@contextlib.contextmanager
def proxied_server(plan: FaultPlan) -> Iterator[tuple[SyncServer, FaultProxy, Bridge]]:
    """A kvwire server behind a proxy that applies ``plan`` to every connection (the proxy
    runs on a bridge of its own)."""
    bridge = Bridge("proxy")
    server = SyncServer(secret=SECRET.encode())
    proxy = FaultProxy("127.0.0.1", server.port, plan=lambda i: plan)
    bridge.run(proxy.start(), 10)
    try:
        yield server, proxy, bridge
    finally:
        bridge.run(proxy.close(), 10)
        server.close()
        bridge.close()


@pytest.fixture
def path() -> Iterator[tuple[SyncServer, FaultProxy, Bridge]]:
    """A kvwire server behind a proxy that stalls the producer's bytes after 64 KiB, until resumed."""
    with proxied_server(FaultPlan(forward=Faults(stall_at=STALL_AT))) as served:
        yield served


def resume_once_stalled(proxy: FaultProxy, bridge: Bridge, after: float = 0.0) -> None:
    """Resume the path once its stall began (a resume before it would not end it), ``after``
    seconds later, on the proxy's loop."""
    for _ in range(600):
        if proxy.statistics().stalls:
            break
        threading.Event().wait(0.05)
    assert proxy.statistics().stalls == 1, "the path never stalled"
    threading.Event().wait(after)
    bridge.call_soon(proxy.resume)


def sent_layers(caches: list[torch.Tensor]) -> list[tuple[np.ndarray, np.ndarray]]:
    spec = PagedSpec.of(caches[0], num_layers=len(caches))
    return [tuple(np.array(a) for a in gather_layer(spec, host_view(c, "float32"), BLOCKS)) for c in caches]  # type: ignore[misc]


def received(handle: Any) -> list[tuple[bytes, bytes]]:
    layers = [handle.wait_layer(i, timeout=30) for i in range(len(LAYERS))]
    return [(np.asarray(layer.k).tobytes(), np.asarray(layer.v).tobytes()) for layer in layers]


def test_blocks_are_kept_until_the_send_ended(path: Any) -> None:
    """The engine's step returns with the send in flight (the path stalled); the request,
    finished, is not reported while its send reads the blocks, and is once the receiver
    acknowledged every byte."""
    server, proxy, bridge = path
    scheduler, worker, caches = producer(proxy.port, load_timeout=60)
    handle = server.expect("kept")
    want = [(k.tobytes(), v.tobytes()) for k, v in sent_layers(caches)]
    try:
        scheduler._saving.add("r1")  # what build_connector_meta records when it schedules the save
        step(worker, KvwireConnectorMetadata(saves=[_Move("r1", "kept", BLOCKS)]), caches)
        assert proxy.statistics().bytes_forward <= STALL_AT  # the step returned, the send in flight
        assert worker.get_finished({"r1"}) == (None, None)  # the request finished; its send has not
        assert scheduler.request_finished(_Request("r1"), BLOCKS) == (True, None)  # vLLM keeps the blocks
        resume_once_stalled(proxy, bridge)
        assert received(handle) == want
        assert finished_sends(worker) == {"r1"}
    finally:
        worker.shutdown()


@pytest.mark.parametrize("async_save", [True, False])
def test_a_send_let_go_of_on_a_bridge_closed_elsewhere_waits_for_its_loop(
    path: Any, caplog: pytest.LogCaptureFixture, async_save: bool) -> None:
    """A send in flight (the path stalled) when another thread closes the connector's
    bridge, whose close gives up on its loop held up elsewhere: the send fails and the
    connection is closed to let go of the blocks, but that close is left to the loop,
    which runs until the bridge's close ended, its streams writing what they hold (from
    the blocks) meanwhile.  The send was reported ended at once (async save) or not
    waited for (the step's).  Now the request keeps its blocks until the loop ended
    (async save: not reported while it is held up, reported once it ran), or the step
    logs that its sends may still read them."""
    server, proxy, _ = path
    _, worker, caches = producer(proxy.port, load_timeout=60, async_save=async_save)
    worker._ABORT_WAIT = 0.0  # no waiting here: the loop is held up until the hook returned
    assert worker._bridge is not None
    bridge = worker._bridge
    server.expect("kept")
    gate = threading.Event()

    def close_once_stalled() -> None:
        for _ in range(600):
            if proxy.statistics().stalls:
                break
            threading.Event().wait(0.05)
        hold_and_close(bridge, gate)

    closer = threading.Thread(target=close_once_stalled)
    try:
        if async_save:
            step(worker, KvwireConnectorMetadata(saves=[_Move("r1", "kept", BLOCKS)]), caches)
            close_once_stalled()
            assert worker.get_finished({"r1"}) == (None, None)
            held = [r.getMessage() for r in caplog.records if "is not closed yet" in r.getMessage()]
            assert len(held) == 1 and "requests r1 " in held[0]
            gate.set()
            assert finished_sends(worker) == {"r1"}
        else:
            closer.start()  # while the step waits for its send
            step(worker, KvwireConnectorMetadata(saves=[_Move("r1", "kept", BLOCKS)]), caches)
            closer.join(30)
            assert any("was not closed in time" in r.getMessage() for r in caplog.records)
    finally:
        gate.set()
        if closer.is_alive():
            closer.join(30)
        worker.shutdown()


@pytest.mark.parametrize("async_save", [True, False])
def test_a_send_let_go_of_on_an_open_bridge_whose_loop_is_held_up_waits_for_its_close(
    path: Any, caplog: pytest.LogCaptureFixture, async_save: bool) -> None:
    """A send that does not end in time while kvwire's loop is held up (a callback blocks
    it; the bridge open): the connection is closed to let go of the blocks, but that close
    gives up on the loop, which still runs it once free, its streams writing what they
    hold (from the blocks) meanwhile.  The send was reported ended once the close gave
    up (async save) or not waited for (the step's).  Now the request keeps its blocks
    until the close ran (async save: not reported while the loop is held up, reported
    once it ran), or the step logs that its sends may still read them."""
    _, proxy, _ = path
    _, worker, caches = producer(proxy.port, load_timeout=0.5, async_save=async_save)
    worker._ABORT_WAIT = 0.0  # no waiting here: the loop is held up until the hook returned
    assert worker._bridge is not None
    gate = threading.Event()
    worker._bridge.call_soon(gate.wait, 30)  # the loop held up, the bridge open
    try:
        step(worker, KvwireConnectorMetadata(saves=[_Move("r1", "kept", BLOCKS)]), caches)
        if async_save:
            threading.Event().wait(0.6)  # past the send's kvwire_load_timeout
            assert worker.get_finished({"r1"}) == (None, None)
            held = [r.getMessage() for r in caplog.records if "is not closed yet" in r.getMessage()]
            assert len(held) == 1 and "requests r1 " in held[0]
            assert worker.get_finished(set()) == (None, None)  # still held up: still kept
            gate.set()
            assert finished_sends(worker) == {"r1"}
        else:
            assert any("was not closed in time" in r.getMessage() for r in caplog.records)
    finally:
        gate.set()
        worker.shutdown()


def test_a_consumer_that_cannot_be_reached_fails_the_send_not_the_step() -> None:
    """Nothing listens where the producer sends: the engine's step goes on, the request is
    reported finished so vLLM frees its blocks, and the connect is tried again once its
    back-off passed (not at every step: steps within it make no attempt), this time to a
    server, and the next step sends."""
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # nothing listens there now
    _, worker, caches = producer(port, load_timeout=5, connected=False)
    try:
        for _ in range(200):  # the first attempt, made when the caches were registered, fails
            worker._poll_connect()
            if worker._connect_error is not None:
                break
            threading.Event().wait(0.05)
        assert worker._connect_attempts == 1 and worker._connect_error is not None
        worker._retry_at = float("inf")  # a long back-off: no step tries again
        step(worker, KvwireConnectorMetadata(saves=[_Move("r1", "lost", BLOCKS)]), caches)
        step(worker, KvwireConnectorMetadata(saves=[_Move("r2", "lost", BLOCKS)]), caches)
        assert worker._connect_attempts == 1
        assert worker.get_finished({"r1", "r2"}) == ({"r1", "r2"}, None)
        delays = []  # each failure doubles the wait before the next attempt, up to a bound
        for attempt in range(2, 8):
            worker._retry_at = 0.0
            for _ in range(200):
                worker._poll_connect()
                if worker._connect_attempts == attempt and worker._connecting is None:
                    break
                threading.Event().wait(0.05)
            assert worker._peer is None and worker._retry_at > time.monotonic()
            delays.append(worker._retry_delay)
        assert delays == [4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
        with SyncServer(secret=SECRET.encode(), port=port) as server:
            worker._retry_at = 0.0  # the back-off passed
            wait_connected(worker)
            assert worker._connect_attempts == 8 and worker._retry_delay == worker._RETRY_FIRST
            handle = server.expect("found")
            step(worker, KvwireConnectorMetadata(saves=[_Move("r3", "found", BLOCKS)]), caches)
            assert received(handle) == [(k.tobytes(), v.tobytes()) for k, v in sent_layers(caches)]
    finally:
        worker.shutdown()


def test_a_consumer_that_never_answers_does_not_hold_the_step() -> None:
    """A consumer that accepts the TCP connection and never speaks (a hung process): the
    connect was made inside the forward (save_kv_layer), so each step with a save waited
    the handshake's timeout, and, failed, the next step tried again.  Now the connect runs
    on kvwire's loop: steps return while it is still waiting for the handshake (the one
    connection the consumer accepted is still open), their saves wait for it with their
    blocks kept, and no step opens another connection while it waits.  Once that connect
    fails (the consumer closes it), the saves end unsent and their requests are reported."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(10)
    _, worker, caches = producer(listener.getsockname()[1], load_timeout=30, connected=False)
    accepted = None
    try:
        for i in range(2):
            step(worker, KvwireConnectorMetadata(saves=[_Move(f"r{i}", f"k{i}", BLOCKS[:4])]), caches)
        accepted, _ = listener.accept()  # the connect begun when the caches were registered
        accepted.setblocking(False)
        with pytest.raises(BlockingIOError):  # the handshake is still waited for: not closed
            while accepted.recv(1 << 16):  # (the producer's hello, if it came: not the end)
                pass
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):  # and no step opened another connection
            listener.accept()
        assert worker._peer is None and worker._connect_attempts == 1
        assert worker.get_finished({"r0", "r1"}) == (None, None)  # their blocks kept meanwhile
        accepted.close()  # the consumer gives up: the connect fails
        assert finished_sends(worker) == {"r0", "r1"}
        assert worker._peer is None and worker._connect_error is not None
    finally:
        if accepted is not None:
            accepted.close()
        listener.close()
        worker.shutdown()


def welcome_held() -> contextlib.AbstractContextManager[tuple[SyncServer, FaultProxy, Bridge]]:
    """A kvwire server behind a proxy that holds its answers (the handshake's WELCOME
    first) until resumed: a producer's first connect stays under way."""
    return proxied_server(FaultPlan(backward=Faults(stall_at=0)))


@pytest.mark.parametrize("async_save", [True, False], ids=["async-save", "sync-save"])
def test_saves_wait_for_the_first_connect_and_go_once_it_is_up(async_save: bool) -> None:
    """A step's saves that found the first connect still under way (the engine's first
    request came before the consumer's WELCOME) were ended unsent, and the consumer
    recomputed that prompt.  Now they wait for the connection, their blocks kept: with the
    async save the step returns at once and the KV is sent whole once the connection is
    up; without it, wait_for_save waits for the connection and the send."""
    with welcome_held() as (server, proxy, bridge):
        _, worker, caches = producer(proxy.port, load_timeout=60, async_save=async_save, connected=False)
        handle = server.expect("late")
        want = [(k.tobytes(), v.tobytes()) for k, v in sent_layers(caches)]
        try:
            if async_save:
                step(worker, KvwireConnectorMetadata(saves=[_Move("r1", "late", BLOCKS)]), caches)
                assert worker._peer is None  # the step returned with the connect under way
                assert worker.get_finished({"r1"}) == (None, None)  # its blocks kept
                resume_once_stalled(proxy, bridge)
                assert finished_sends(worker) == {"r1"}
            else:
                resuming = threading.Thread(target=resume_once_stalled, args=(proxy, bridge))
                resuming.start()
                step(worker, KvwireConnectorMetadata(saves=[_Move("r1", "late", BLOCKS)]), caches)
                resuming.join()
            assert received(handle) == want
        finally:
            worker.shutdown()


def test_shutdown_sends_the_saves_that_wait_for_the_connection() -> None:
    """The engine shuts down right after the step whose saves wait for the first connect
    (a producer that ran one request): shutdown waits for the connection and sends them."""
    with welcome_held() as (server, proxy, bridge):
        _, worker, caches = producer(proxy.port, load_timeout=60, connected=False)
        handle = server.expect("last")
        try:
            step(worker, KvwireConnectorMetadata(saves=[_Move("r1", "last", BLOCKS)]), caches)
            resuming = threading.Thread(target=resume_once_stalled, args=(proxy, bridge))
            resuming.start()
            worker.shutdown()
            resuming.join()
            assert received(handle) == [(k.tobytes(), v.tobytes()) for k, v in sent_layers(caches)]
        finally:
            worker.shutdown()


def test_a_save_that_waits_for_the_connection_ends_unsent_when_preempted() -> None:
    """A request preempted while its save waits for the connection: its blocks are written
    by the next forward, so it ends unsent (reported finished) and is not sent once the
    connection is up."""
    with welcome_held() as (server, proxy, bridge):
        _, worker, caches = producer(proxy.port, load_timeout=60, connected=False)
        handle, after = server.expect("preempted"), server.expect("after")
        try:
            step(worker, KvwireConnectorMetadata(saves=[_Move("r1", "preempted", BLOCKS)]), caches)
            step(worker, KvwireConnectorMetadata(preempted=["r1"]), caches)
            assert worker.get_finished({"r1"}) == ({"r1"}, None)
            resume_once_stalled(proxy, bridge)
            wait_connected(worker)
            step(worker, KvwireConnectorMetadata(saves=[_Move("r2", "after", BLOCKS[:4])]), caches)
            after.wait(30)  # the connection is up and carries the next send
            assert not worker._sends_in(_SendState.DEFERRED)
            with pytest.raises(TransferTimeoutError):
                handle.wait(1)  # r1 was never sent
        finally:
            worker.shutdown()


def drafting_step(worker: KvwireConnector, meta: KvwireConnectorMetadata, caches: list[torch.Tensor]) -> None:
    """One step as vLLM runs it with speculative decoding: the target model's layers saved,
    get_finished, then the drafter's forward saves its layer (here the last of LAYERS),
    then wait_for_save."""
    worker.bind_connector_metadata(meta)
    for name, cache in zip(LAYERS[:-1], caches[:-1], strict=True):
        worker.save_kv_layer(name, cache, None)
    worker.get_finished(set())
    worker.save_kv_layer(LAYERS[-1], caches[-1], None)
    worker.wait_for_save()
    worker.clear_connector_metadata()


def test_saves_that_waited_for_the_connection_go_after_a_drafters_layers() -> None:
    """With speculative decoding vLLM calls get_finished before the drafter's forward and
    wait_for_save after it.  A get_finished that sent the saves which had waited for the
    connection also put the step's own sends in flight with their drafter's layer still to
    come: that layer was never queued, the send never ended, and past the timeout the
    connection was closed under every send."""
    with welcome_held() as (server, proxy, bridge):
        _, worker, caches = producer(proxy.port, load_timeout=60, connected=False)
        want = [(k.tobytes(), v.tobytes()) for k, v in sent_layers(caches)]
        waited, next_one = server.expect("waited"), server.expect("next")
        try:
            drafting_step(worker, KvwireConnectorMetadata(saves=[_Move("r0", "waited", BLOCKS)]), caches)
            resume_once_stalled(proxy, bridge)
            wait_connected(worker)  # up between two steps
            drafting_step(worker, KvwireConnectorMetadata(saves=[_Move("r1", "next", BLOCKS)]), caches)
            assert received(next_one) == want
            assert received(waited) == want
        finally:
            worker.shutdown()


def test_a_save_that_waited_for_the_connection_carries_the_versions_of_its_step() -> None:
    """With a registry, a save that waits for the connection names its blocks in its step,
    as a save sent in its step does: blocks invalidated while it waited (new weights) are
    then stale to the consumer.  Named when finally sent, they got versions from after the
    invalidation, and the consumer took KV of the old weights as fresh."""
    from kvwire.aio.registry_memory import MemoryRegistry
    from kvwire.integrations.prefix import SyncRegistry, prefix_block_ids

    prefix = tuple(prefix_block_ids(list(range(8 * 16)), 16, 8))
    with welcome_held() as (server, proxy, bridge):
        _, worker, caches = producer(proxy.port, load_timeout=60, connected=False)
        registry = worker._registry = SyncRegistry(MemoryRegistry(), bridge)  # (a Redis, in a deployment)
        handle = server.expect("k")
        try:
            step(worker, KvwireConnectorMetadata(saves=[_Move("r0", "k", list(range(3, 11)), None, prefix)]), caches)
            bridge.run(registry.registry.invalidate_many(list(prefix)), 10)  # while the connect is under way
            resume_once_stalled(proxy, bridge)
            wait_connected(worker)
            step(worker, KvwireConnectorMetadata(), caches)  # the save goes
            handle.wait(30)
            reason = registry.verify(list(prefix), handle.transfer.blocks)  # the consumer's check
            assert reason is not None and "stale" in reason
        finally:
            worker.shutdown()


def received_whole(handle: Any, caches: list[torch.Tensor]) -> None:
    """``handle``'s transfer arrived, and holds the first 64 blocks of every layer of ``caches``."""
    handle.wait(30)
    spec = PagedSpec.of(caches[0], num_layers=len(LAYERS))
    for i, cache in enumerate(caches):
        k, v = gather_layer(spec, host_view(cache, "float32"), BLOCKS[:64])
        got = handle.wait_layer(i, 5)
        assert np.asarray(got.k).tobytes() == np.asarray(k).tobytes()
        assert np.asarray(got.v).tobytes() == np.asarray(v).tobytes()


def test_a_send_the_consumer_aborts_fails_alone() -> None:
    """Two sends in flight; the consumer gives one up (its request was cancelled there).
    The other is received whole over the same connection, and the aborted one's request
    is reported finished once the streams wrote what they held of it (not by closing the
    connection, which would fail every send on it)."""
    bridge = Bridge("rate-proxy")
    server = SyncServer(secret=SECRET.encode())
    capped = FaultPlan(forward=Faults(rate_bps=16 * 2**20 * 8))  # 16 MiB/s: each send takes 0.5 s
    proxy = FaultProxy("127.0.0.1", server.port, plan=lambda i: capped)
    bridge.run(proxy.start(), 10)
    _, worker, caches = producer(proxy.port, load_timeout=60)
    a, b = server.expect("a"), server.expect("b")
    try:
        step(worker, KvwireConnectorMetadata(saves=[_Move("r1", "a", BLOCKS[:64]), _Move("r2", "b", BLOCKS[:64])]),
             caches)
        peer = worker._peer
        a.wait_layer(0, 30)
        a.abort("cancelled by its client")
        finished: set[str] = set()
        for i in range(600):
            done, _ = worker.get_finished({"r1", "r2"} if i == 0 else set())
            finished |= done or set()
            if finished == {"r1", "r2"}:
                break
            threading.Event().wait(0.05)
        assert finished == {"r1", "r2"}
        assert worker._peer is peer  # the connection went on
        received_whole(b, caches)
    finally:
        worker.shutdown()
        bridge.run(proxy.close(), 10)
        server.close()
        bridge.close()


def test_a_send_the_consumer_aborts_does_not_close_the_connection_a_step_waits_on() -> None:
    """``kvwire_async_save: false``: the step waits for two sends and the consumer aborts
    the first.  Its failure closed the connection, failing the second send too; now the
    step waits (within its deadline) for the streams to write what they held of the
    aborted one, and the second is received whole over the same connection."""
    bridge = Bridge("rate-proxy")
    server = SyncServer(secret=SECRET.encode())
    capped = FaultPlan(forward=Faults(rate_bps=16 * 2**20 * 8))  # 16 MiB/s: each send takes 0.5 s
    proxy = FaultProxy("127.0.0.1", server.port, plan=lambda i: capped)
    bridge.run(proxy.start(), 10)
    _, worker, caches = producer(proxy.port, load_timeout=60, async_save=False)
    a, b = server.expect("a"), server.expect("b")

    def abort_a() -> None:
        a.wait_layer(0, 30)
        a.abort("cancelled by its client")

    aborter = threading.Thread(target=abort_a)
    aborter.start()
    try:
        peer = worker._peer
        step(worker, KvwireConnectorMetadata(saves=[_Move("r1", "a", BLOCKS[:64]), _Move("r2", "b", BLOCKS[:64])]),
             caches)
        aborter.join(30)
        assert worker._peer is peer  # the connection went on
        received_whole(b, caches)
    finally:
        aborter.join(30)
        worker.shutdown()
        bridge.run(proxy.close(), 10)
        server.close()
        bridge.close()


@pytest.mark.parametrize("ends", [True, False])
def test_a_preempted_requests_send_ends_before_the_forward_reuses_its_blocks(path: Any, ends: bool) -> None:
    """vLLM preempts a request whose send is in flight: the next step's forward writes its
    blocks.  Binding that step's metadata waits for the send: if the path resumes in time
    the receiver gets the blocks as they were; if not, the send is let go of (the
    connection closed) and no transfer completes with the overwritten blocks, even once
    the path resumes."""
    server, proxy, bridge = path
    _, worker, caches = producer(proxy.port, load_timeout=30 if ends else 1)
    handle = server.expect("preempted")
    want = [(k.tobytes(), v.tobytes()) for k, v in sent_layers(caches)]
    try:
        step(worker, KvwireConnectorMetadata(saves=[_Move("r2", "preempted", BLOCKS)]), caches)
        assert proxy.statistics().bytes_forward <= STALL_AT
        if ends:
            threading.Thread(target=resume_once_stalled, args=(proxy, bridge, 0.5)).start()  # while the step waits
        worker.bind_connector_metadata(KvwireConnectorMetadata(preempted=["r2"]))
        for cache in caches:  # the forward of the step that preempted r2 reuses its blocks
            cache[BLOCKS] = 7.0
        worker.clear_connector_metadata()
        if ends:
            assert received(handle) == want
        else:
            resume_once_stalled(proxy, bridge)
            with pytest.raises(KvwireError):
                handle.wait(5)
            assert handle.layers_done() < len(LAYERS)
    finally:
        worker.shutdown()


@pytest.mark.parametrize("where", ["wait_for_save", "preempted"])
def test_sends_behind_one_that_did_not_end_in_time_are_not_waited_for(
    path: Any, monkeypatch: pytest.MonkeyPatch, where: str,
) -> None:
    """Two sends on a stalled path, waited for by the step: with ``kvwire_async_save:
    false`` in ``wait_for_save``, or both requests preempted with their sends in flight.
    The first does not end within ``kvwire_load_timeout``: the connection is closed, which
    ends the second too (sends go first come, first served: its turn never comes), so the
    step does not wait another ``kvwire_load_timeout`` for it, and both end let go of."""
    from kvwire.aio._sync import SendHandle

    given: list[float | None] = []
    real_wait = SendHandle.wait

    def wait(handle: SendHandle, timeout: float | None = None) -> Any:
        given.append(timeout)
        return real_wait(handle, timeout)

    monkeypatch.setattr(SendHandle, "wait", wait)
    _, proxy, _ = path
    _, worker, caches = producer(proxy.port, load_timeout=0.5, async_save=where == "preempted")
    try:
        step(worker, KvwireConnectorMetadata(saves=[_Move("r1", "first", BLOCKS), _Move("r2", "second", BLOCKS)]),
             caches)
        if where == "preempted":
            worker.bind_connector_metadata(KvwireConnectorMetadata(preempted=["r1", "r2"]))
            worker.clear_connector_metadata()
            assert worker.get_finished({"r1", "r2"}) == ({"r1", "r2"}, None)
        # the first one's wait (what is left of the step's 0.5 s), not the second's
        assert [t for t in given if t] == [pytest.approx(0.5, abs=0.1)]
        assert worker._peer is None and not worker._sends_in(_SendState.SENDING, _SendState.IN_FLIGHT)
    finally:
        worker.shutdown()


@pytest.mark.parametrize("where", ["wait_for_save", "preempted"])
def test_a_step_waits_for_its_sends_within_one_load_timeout_in_all(
    path: Any, monkeypatch: pytest.MonkeyPatch, where: str,
) -> None:
    """Two sends the step waits for (``wait_for_save`` with ``kvwire_async_save: false``,
    or both requests preempted with their sends in flight), each ending 0.4 s after the
    wait for it began, with a timeout of 1 s: each wait had a timeout of its own, so a
    step could wait sends x timeout.  They share one deadline now: 1.0 s for the first,
    what is left (0.6 s) for the second (the clock is fake: a wait moves it 0.4 s).  Both
    end acknowledged and the connection goes on."""
    from kvwire.aio._sync import SendHandle
    from kvwire.integrations import vllm as connector

    clock = [0.0]
    given: list[float] = []
    real_wait = SendHandle.wait

    def wait(handle: SendHandle, timeout: float | None = None) -> Any:
        if timeout:  # (a look at a send's state passes 0)
            given.append(round(timeout, 6))
            clock[0] += 0.4
            return real_wait(handle, 30)
        return real_wait(handle, timeout)

    monkeypatch.setattr(connector, "time", type("FakeTime", (), {"monotonic": staticmethod(lambda: clock[0])}))
    monkeypatch.setattr(SendHandle, "wait", wait)
    server, _, _ = path
    _, worker, caches = producer(server.port, load_timeout=1.0, async_save=where == "preempted")
    handles = [server.expect("first"), server.expect("second")]
    try:
        worker._reap = lambda: None  # type: ignore[method-assign]  # both still in flight when preempted
        step(worker, KvwireConnectorMetadata(saves=[_Move("r1", "first", BLOCKS[:4]), _Move("r2", "second", BLOCKS[:4])]),
             caches)
        if where == "preempted":
            assert given == [] and set(worker._sends_in(_SendState.IN_FLIGHT)) == {"r1", "r2"}
            worker.bind_connector_metadata(KvwireConnectorMetadata(preempted=["r1", "r2"]))
            worker.clear_connector_metadata()
        assert given == [1.0, 0.6]
        assert worker._peer is not None  # nothing was late: the connection goes on
        for handle in handles:
            handle.wait(30)
    finally:
        worker.shutdown()


def test_a_drain_asks_kvwires_loop_within_what_is_left_of_its_deadline(
    path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a send that failed on its own, a step waits (within its deadline) for the
    streams to write what they held of it, asking kvwire's loop for their write marks and
    whether they are past them; each call was given 5 s, so a held-up loop kept the step
    5 to 10 s past its deadline.  Each is now given what is left of the deadline, at least
    _LOOP_CALL_FLOOR once it has passed.  The calls are counted, not timed: one asking
    whether the streams are past their marks runs out its timeout at once (the loop held
    up) and moves the fake clock by it."""
    from kvwire.integrations import vllm as connector

    clock = [0.0]
    given: list[tuple[str, float]] = []
    real_run = Bridge.run

    def run(bridge: Bridge, coro: Any, timeout: float | None = None, **kw: Any) -> Any:
        name = getattr(getattr(coro, "cr_code", None), "co_name", None)
        if name not in ("marks", "past"):
            return real_run(bridge, coro, timeout, **kw)
        assert timeout is not None
        given.append((name, round(timeout, 6)))
        if name == "marks":
            return real_run(bridge, coro, timeout, **kw)
        coro.close()
        clock[0] += timeout
        raise TransferTimeoutError(f"not done in {timeout} s")

    server, _, _ = path
    _, worker, _ = producer(server.port, load_timeout=1.0)
    monkeypatch.setattr(connector, "time", type("FakeTime", (), {
        "monotonic": staticmethod(lambda: clock[0]), "sleep": staticmethod(lambda seconds: None)}))
    monkeypatch.setattr(Bridge, "run", run)
    try:
        assert not worker._drained(1.0)
        assert given == [("marks", 1.0), ("past", 1.0)]
        given.clear()
        assert not worker._drained(0.5)  # already past
        floor = worker._LOOP_CALL_FLOOR
        assert given == [("marks", floor), ("past", floor)]
        assert worker._peer is not None  # the drain closes nothing: its caller decides
    finally:
        monkeypatch.undo()
        worker.shutdown()


def test_sends_queued_behind_others_have_their_time_from_their_turn() -> None:
    """Going on, the engine can queue sends faster than the link carries them; they go
    first come, first served.  ``kvwire_load_timeout`` bounds each from its turn (its step,
    or the end of the send before it), not from its step: eight sends of 8 MiB over a
    path capped at 16 MiB/s (half a second each) with a 3 s timeout all arrive intact,
    though the last waits well over 3 s behind the others, and none is let go of."""
    bridge = Bridge("rate-proxy")
    server = SyncServer(secret=SECRET.encode())
    capped = FaultPlan(forward=Faults(rate_bps=16 * 2**20 * 8))
    proxy = FaultProxy("127.0.0.1", server.port, plan=lambda i: capped)
    bridge.run(proxy.start(), 10)
    _, worker, caches = producer(proxy.port, load_timeout=3)
    blocks = BLOCKS[:64]  # 8 MiB per request over the four layers
    names = [f"queued-{i}" for i in range(8)]
    handles = [server.expect(name) for name in names]
    try:
        for i, name in enumerate(names):
            step(worker, KvwireConnectorMetadata(saves=[_Move(f"r{i}", name, blocks)]), caches)
        finished: set[str] = set()
        for _ in range(600):
            done, _ = worker.get_finished({f"r{i}" for i in range(8)} if not finished else set())
            finished |= done or set()
            if len(finished) == 8:
                break
            threading.Event().wait(0.05)
        assert finished == {f"r{i}" for i in range(8)}
        assert worker._peer is not None  # never let go of: no send was late
        spec = PagedSpec.of(caches[0], num_layers=len(caches))
        want = [tuple(np.array(a).tobytes() for a in gather_layer(spec, host_view(c, "float32"), blocks)) for c in caches]
        for handle in handles:
            assert received(handle) == want
    finally:
        worker.shutdown()
        bridge.run(proxy.close(), 10)
        server.close()
        bridge.close()


class _Request:
    """What the scheduler-side connector reads of a vLLM request."""

    def __init__(self, request_id: str, prompt: list[int] | None = None, kvwire_id: str | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt
        self.kv_transfer_params = {"kvwire_id": kvwire_id} if kvwire_id else None


# -- the scheduler side through preemption, with vLLM's own scheduler output -------------------


def scheduler_side(role: str, extra: dict[str, Any] | None = None) -> KvwireConnector:
    """The scheduler's connector; a consumer's loads layer-wise unless ``extra`` says."""
    cfg = config(role, {"kvwire_peer": "127.0.0.1:1", "kvwire_listen": "127.0.0.1:0", "kvwire_load_async": False,
                        **(extra or {})})
    return KvwireConnector(cfg, KVConnectorRole.SCHEDULER)


def named(kvwire_id: str, prompt: list[int], block_size: int = 16) -> str:
    """The transfer name of a request: its kvwire_id and a digest of its full blocks' tokens."""
    import hashlib

    n = (len(prompt) - 1) // block_size * block_size
    return f"{kvwire_id}#prompt:" + hashlib.sha256(np.array(prompt[:n], "<i8").tobytes()).hexdigest()[:32]


def new_request(req_id: str, prompt: list[int], block_ids: list[int], kvwire_id: str) -> NewRequestData:
    return NewRequestData(
        req_id=req_id, prompt_token_ids=prompt, mm_features=[],
        sampling_params=SamplingParams(extra_args={"kv_transfer_params": {"kvwire_id": kvwire_id}}),
        pooling_params=None, block_ids=(block_ids,), num_computed_tokens=0, lora_request=None,
    )


def schedule(*, new: list[NewRequestData] | None = None, cached: list[tuple[str, list[int] | None, int]] | None = None,
             resumed: set[str] | None = None, scheduled: dict[str, int] | None = None,
             preempted: set[str] | None = None) -> SchedulerOutput:
    """A step's scheduler output: new requests, cached ones as (id, new block ids, tokens
    computed), those of them resumed from preemption, tokens scheduled, requests preempted."""
    out = SchedulerOutput.make_empty()
    cached = cached or []
    out.scheduled_new_reqs = list(new or [])
    out.scheduled_cached_reqs = CachedRequestData(
        req_ids=[r for r, _, _ in cached], resumed_req_ids=set(resumed or ()), new_token_ids=[], all_token_ids={},
        new_block_ids=[None if ids is None else (ids,) for _, ids, _ in cached],
        num_computed_tokens=[c for _, _, c in cached], num_output_tokens=[0 for _ in cached],
    )
    out.num_scheduled_tokens = dict(scheduled or {})
    out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
    out.preempted_req_ids = set(preempted or ())
    return out


def test_a_request_preempted_in_its_chunked_prefill_is_sent_from_its_new_blocks() -> None:
    """Prefilled in chunks, a request's full blocks are sent once computed.  One preempted
    before that loses its blocks; resumed, vLLM gives it all its blocks anew
    (``resumed_req_ids``), and its send names those, not the freed ones; one not
    preempted is sent from the blocks it had and those added since."""
    sched = scheduler_side("kv_producer")
    prompt = list(range(100))  # 6 full blocks of 16 are sent, the last 4 tokens not
    meta = sched.build_connector_meta(schedule(
        new=[new_request("p", prompt, [10, 11, 12, 13], "pre"), new_request("q", prompt, [20, 21, 22, 23], "kept")],
        scheduled={"p": 64, "q": 64},
    ))
    assert meta.saves == []  # 64 of 96 tokens computed: not yet
    meta = sched.build_connector_meta(schedule(preempted={"p"}, cached=[("q", [24, 25, 26], 64)], scheduled={"q": 36}))
    assert [(m.req_id, m.key, m.block_ids) for m in meta.saves] == [("q", named("kept", prompt), [20, 21, 22, 23, 24, 25])]
    assert meta.preempted == []  # no send of p's was scheduled
    meta = sched.build_connector_meta(schedule(
        cached=[("p", [40, 41, 42, 43, 44, 45, 46], 0)], resumed={"p"}, scheduled={"p": 100},
    ))
    assert [(m.req_id, m.key, m.block_ids) for m in meta.saves] == [("p", named("pre", prompt), [40, 41, 42, 43, 44, 45])]
    # resumed with no blocks named: nothing of it is sent, now or later
    sched.build_connector_meta(schedule(new=[new_request("s", prompt, [50, 51], "none")], scheduled={"s": 32}))
    assert sched.build_connector_meta(schedule(cached=[("s", None, 0)], resumed={"s"}, scheduled={"s": 16})).saves == []
    assert sched.build_connector_meta(schedule(cached=[("s", [60, 61, 62, 63, 64, 65], 16)],
                                               scheduled={"s": 84})).saves == []


def test_a_request_sent_then_preempted_is_not_sent_again_when_resumed_as_new() -> None:
    """vLLM's model runner V2 lists a resumed request among the new ones, with all its
    (new) blocks. One whose send was scheduled before it was preempted is not sent again:
    a second send would read its new blocks after get_finished reported it (its first
    send's end) and vLLM reused them. Until it finishes; then a new request of that id is."""
    sched = scheduler_side("kv_producer")
    prompt = list(range(33))  # 2 full blocks
    meta = sched.build_connector_meta(schedule(new=[new_request("p", prompt, [10, 11, 12], "x")], scheduled={"p": 33}))
    assert [(m.req_id, m.block_ids) for m in meta.saves] == [("p", [10, 11])]
    meta = sched.build_connector_meta(schedule(preempted={"p"}))
    assert meta.preempted == ["p"]
    meta = sched.build_connector_meta(schedule(new=[new_request("p", prompt, [40, 41, 42], "x")], scheduled={"p": 33}))
    assert meta.saves == []
    assert sched.request_finished(_Request("p"), [40, 41, 42]) == (True, None)  # type: ignore[arg-type]
    meta = sched.build_connector_meta(schedule(new=[new_request("p", prompt, [50, 51, 52], "x")], scheduled={"p": 33}))
    assert [(m.req_id, m.block_ids) for m in meta.saves] == [("p", [50, 51])]


def test_a_request_preempted_after_its_load_is_computed_when_resumed() -> None:
    """A consumer's request loads its prompt's blocks once; preempted afterwards (its
    blocks freed) and back in the queue, it reports no external hit, so vLLM computes it
    (its transfer was taken; a hit would have its new blocks taken as loaded)."""
    sched = scheduler_side("kv_consumer")
    prompt = list(range(100))
    request = _Request("c", prompt, "loaded")
    assert sched.get_num_new_matched_tokens(request, 0) == (96, False)
    sched.update_state_after_alloc(request, None, 96)  # type: ignore[arg-type]
    meta = sched.build_connector_meta(schedule(new=[new_request("c", prompt, list(range(7)), "loaded")],
                                               scheduled={"c": 4}))
    assert [(m.req_id, m.key, m.block_ids) for m in meta.loads] == [("c", named("loaded", prompt), list(range(6)))]
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)  # preempted, back in the queue
    other = _Request("d", prompt, "other")
    assert sched.get_num_new_matched_tokens(other, 0) == (96, False)  # others still load


def test_a_transfer_is_named_by_its_prompt_too() -> None:
    """One kvwire_id given to two prompts (an id reused, or a transfer left over from
    another prompt): the producer's send of one and the consumer's load of the other had
    the same name, the id, so the consumer loaded the other prompt's KV without an error.
    The name now carries a digest of the full blocks' tokens, alike on both sides for the
    same prompt, different for another; the tokens past the full blocks do not count."""
    producer_side, consumer_side = scheduler_side("kv_producer"), scheduler_side("kv_consumer")
    p1, p2 = list(range(100)), list(range(1000, 1100))

    def send_key(prompt: list[int]) -> str:
        meta = producer_side.build_connector_meta(schedule(new=[new_request("s", prompt, list(range(7)), "x")],
                                                           scheduled={"s": len(prompt)}))
        producer_side.request_finished(_Request("s"), [])  # type: ignore[arg-type]
        return meta.saves[0].key

    def load_key(prompt: list[int]) -> str:
        request = _Request("l", prompt, "x")
        assert consumer_side.get_num_new_matched_tokens(request, 0) == (96, False)
        consumer_side.update_state_after_alloc(request, None, 96)  # type: ignore[arg-type]
        meta = consumer_side.build_connector_meta(schedule(new=[new_request("l", prompt, list(range(7)), "x")],
                                                           scheduled={"l": 4}))
        consumer_side.request_finished(request, [])  # type: ignore[arg-type]
        return meta.loads[0].key

    assert send_key(p1) == load_key(p1) == named("x", p1)
    assert load_key(p2) != send_key(p1)
    assert send_key([*p1[:-1], 7]) == send_key(p1)  # the last, partial block is not sent


def test_blocks_in_the_consumers_prefix_cache_are_not_loaded() -> None:
    """With vLLM's prefix cache on, a consumer's request whose first blocks are cached
    here reports only the rest as its hit, and its load names DROP for the cached blocks
    (their part of the transfer is dropped on arrival).  One whose full blocks are all
    cached loads nothing, and its transfer is dropped as it comes instead of waiting on the
    server until the claim timeout; each once."""
    sched = scheduler_side("kv_consumer")
    prompt = list(range(100))  # 6 full blocks of 16
    part, whole, gone = _Request("p", prompt, "part"), _Request("w", prompt, "whole"), _Request("g", prompt, "gone")
    trimmed = _Request("t", prompt, "trimmed")
    assert sched.get_num_new_matched_tokens(part, 64) == (32, False)
    sched.update_state_after_alloc(part, None, 32)  # type: ignore[arg-type]
    assert sched.get_num_new_matched_tokens(whole, 96) == (0, False)
    sched.update_state_after_alloc(whole, None, 0)  # type: ignore[arg-type]
    sched.update_state_after_alloc(gone, None, 0)  # type: ignore[arg-type]
    # vLLM may take less of a hit than reported (it computes the rest): those blocks too
    # are dropped, not written under its computation
    assert sched.get_num_new_matched_tokens(trimmed, 32) == (64, False)
    sched.update_state_after_alloc(trimmed, None, 32)  # type: ignore[arg-type]
    meta = sched.build_connector_meta(schedule(
        new=[new_request("p", prompt, list(range(10, 17)), "part"), new_request("w", prompt, list(range(20, 27)), "whole"),
             new_request("t", prompt, list(range(30, 37)), "trimmed")],
        scheduled={"p": 4, "w": 4, "t": 36},
    ))
    assert [(m.req_id, m.key, m.block_ids) for m in meta.loads] == [
        ("p", named("part", prompt), [DROP] * 4 + [14, 15]),
        ("t", named("trimmed", prompt), [DROP] * 2 + [32, 33] + [DROP] * 2),
    ]
    assert [(m.req_id, m.key, m.block_ids) for m in meta.drops] == [("w", named("whole", prompt), [DROP] * 6)]
    # finished before it was scheduled: its transfer, sent all the same, is dropped (once)
    sched.request_finished(gone, [])
    meta = sched.build_connector_meta(schedule(new=[new_request("g", prompt, [1, 2], "gone")]))
    assert [(m.req_id, m.key, m.block_ids) for m in meta.drops] == [("g", named("gone", prompt), [DROP] * 6)]
    assert sched.build_connector_meta(schedule()).drops == []
    # preempted and back in the queue: the one transfer was taken, nothing loads or drops
    assert sched.get_num_new_matched_tokens(part, 0) == (0, False)
    sched.update_state_after_alloc(whole, None, 0)  # type: ignore[arg-type]
    meta = sched.build_connector_meta(schedule(new=[new_request("w", prompt, [30, 31], "whole")]))
    assert meta.loads == [] and meta.drops == []


def test_a_consumer_loads_the_blocks_it_lacks_and_drops_the_rest() -> None:
    """A consumer worker given a load whose first blocks are DROP and a drop: the load's
    blocks hold the sent blocks' bytes, no other block changes, and both transfers (the
    dropped one arrived before the worker named it, the loaded one after) are taken off
    the server, leaving nothing pending there."""
    gen = torch.Generator().manual_seed(1)
    caches = [torch.randn((64, 2, 16, 64), generator=gen) for _ in LAYERS]
    before = [c.clone() for c in caches]
    src = [torch.randn((64, 2, 16, 64), generator=gen) for _ in LAYERS]
    worker, spec = consumer_worker(caches)
    sent = [5, 9, 2, 30, 17, 8]

    def pending() -> int:
        stats = worker.server_statistics()
        assert stats is not None
        return int(stats["pending_arrivals"])

    try:
        with SyncPeer("127.0.0.1", worker.listen_port, secret=SECRET.encode(), streams=2) as peer:
            peer.send("whole", spec.wire_spec(), PagedSource(spec, src, sent), timeout=30)
            assert pending() == 1
            worker.bind_connector_metadata(KvwireConnectorMetadata(
                loads=[_Move("p", "part", [DROP] * 4 + [40, 41])], drops=[_Move("w", "whole", [DROP] * 6)],
            ))
            worker.start_load_kv(None)  # type: ignore[arg-type]
            peer.send("part", spec.wire_spec(), PagedSource(spec, src, sent), timeout=30)
            for name in LAYERS:
                worker.wait_for_layer_load(name)
            worker.clear_connector_metadata()
            drops_ended(worker)
        assert not worker._dropping and pending() == 0
        for layer in range(len(LAYERS)):
            for b in range(64):
                want = {40: src[layer][17], 41: src[layer][8]}.get(b, before[layer][b])
                assert torch.equal(caches[layer][b], want), (layer, b)
    finally:
        worker.shutdown()


def test_requests_that_share_a_name_each_take_a_transfer_of_it() -> None:
    """Requests of one name (``kvwire_load_all`` names a request by its full blocks, and a
    prompt sampled n ways shares its ``kvwire_id``): a drop waiting for its transfer, then
    a load of the same name. Each takes one of the two transfers sent under that name, in
    the order they were named: the load is not refused for the drop waiting before it."""
    gen = torch.Generator().manual_seed(2)
    caches = [torch.randn((16, 2, 16, 64), generator=gen) for _ in LAYERS]
    first, second = ([torch.randn((16, 2, 16, 64), generator=gen) for _ in LAYERS] for _ in range(2))
    worker, spec = consumer_worker(caches)
    try:
        worker.bind_connector_metadata(KvwireConnectorMetadata(drops=[_Move("b", "shared", [DROP] * 3)]))
        worker.start_load_kv(None)  # type: ignore[arg-type]
        worker.clear_connector_metadata()
        worker.bind_connector_metadata(KvwireConnectorMetadata(loads=[_Move("c", "shared", [DROP, 4, 5])]))
        worker.start_load_kv(None)  # type: ignore[arg-type]
        with SyncPeer("127.0.0.1", worker.listen_port, secret=SECRET.encode()) as peer:
            for src in (first, second):
                peer.send("shared", spec.wire_spec(), PagedSource(spec, src, [0, 1, 2]), timeout=30)
            for name in LAYERS:
                worker.wait_for_layer_load(name)
            worker.clear_connector_metadata()
            assert worker.get_block_ids_with_load_errors() == set()
            drops_ended(worker)
        stats = worker.server_statistics()
        assert not worker._dropping and stats is not None and stats["pending_arrivals"] == 0
        for layer in range(len(LAYERS)):  # the load took the second transfer, the drop the first
            assert torch.equal(caches[layer][4], second[layer][1]) and torch.equal(caches[layer][5], second[layer][2])
    finally:
        worker.shutdown()


def test_a_load_given_up_before_its_transfer_came_drops_the_transfer_when_it_does() -> None:
    """A consumer's request finishes (cancelled by its client) before its transfer came:
    the transfer that comes afterwards is taken and dropped, not left on the server until
    the claim timeout, and it writes none of the blocks the request had (vLLM freed them)."""
    gen = torch.Generator().manual_seed(3)
    caches = [torch.randn((16, 2, 16, 64), generator=gen) for _ in LAYERS]
    before = [c.clone() for c in caches]
    src = [torch.randn((16, 2, 16, 64), generator=gen) for _ in LAYERS]
    worker, spec = consumer_worker(caches)
    try:
        worker.bind_connector_metadata(KvwireConnectorMetadata(loads=[_Move("c", "late", [4, 5, 6])]))
        worker.start_load_kv(None)  # type: ignore[arg-type]
        worker.clear_connector_metadata()
        worker.get_finished({"c"})  # finished before its transfer came
        with SyncPeer("127.0.0.1", worker.listen_port, secret=SECRET.encode()) as peer:
            peer.send("late", spec.wire_spec(), PagedSource(spec, src, [0, 1, 2]), timeout=30)
            drops_ended(worker)
        stats = worker.server_statistics()
        assert not worker._dropping and stats is not None and stats["pending_arrivals"] == 0
        assert all(torch.equal(c, b) for c, b in zip(caches, before, strict=True))
    finally:
        worker.shutdown()


def test_a_layer_waits_for_its_loads_within_one_load_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two requests load: the first one's transfer never comes, the second one's is in.
    ``wait_for_layer_load`` gives the step one ``kvwire_load_timeout`` for all of them, not
    one per request: the first wait takes all of it (the clock is fake: it moves by what a
    wait that ran out was given), and the second gets what is left, nothing; its layer is
    there, so it loads all the same, and only the first request's blocks are recomputed."""
    from kvwire.aio._sync import ReceiveHandle
    from kvwire.integrations import vllm as connector

    clock = [0.0]
    given: list[float | None] = []
    real_wait_layer = ReceiveHandle.wait_layer

    def wait_layer(handle: ReceiveHandle, index: int, timeout: float | None = None) -> Any:
        given.append(timeout)
        try:
            return real_wait_layer(handle, index, timeout)
        except TransferTimeoutError:
            clock[0] += timeout or 0.0
            raise

    monkeypatch.setattr(connector, "time", type("FakeTime", (), {"monotonic": staticmethod(lambda: clock[0])}))
    monkeypatch.setattr(ReceiveHandle, "wait_layer", wait_layer)
    gen = torch.Generator().manual_seed(4)
    caches = [torch.randn((16, 2, 16, 64), generator=gen) for _ in LAYERS]
    src = [torch.randn((16, 2, 16, 64), generator=gen) for _ in LAYERS]
    worker, spec = consumer_worker(caches, load_timeout=0.5)
    try:
        worker.bind_connector_metadata(KvwireConnectorMetadata(
            loads=[_Move("never", "never-sent", [1, 2]), _Move("in", "arrived", [4, 5])],
        ))
        worker.start_load_kv(None)  # type: ignore[arg-type]
        with SyncPeer("127.0.0.1", worker.listen_port, secret=SECRET.encode()) as peer:
            peer.send("arrived", spec.wire_spec(), PagedSource(spec, src, [0, 1]), timeout=30)
        worker._loading["in"].handle.wait(30)  # every layer of it is in before the step waits
        worker.wait_for_layer_load(LAYERS[0])
        assert given == [0.5, 0.0]  # one deadline for the layer's loads
        for name in LAYERS[1:]:
            worker.wait_for_layer_load(name)
        worker.clear_connector_metadata()
        assert worker.get_block_ids_with_load_errors() == {1, 2}
        assert not worker._loading
        for layer in range(len(LAYERS)):
            assert torch.equal(caches[layer][4], src[layer][0]) and torch.equal(caches[layer][5], src[layer][1])
    finally:
        worker.shutdown()


def trickling_layers(monkeypatch: pytest.MonkeyPatch) -> tuple[list[float], list[float]]:
    """A fake clock for the connector, and layers that come 0.4 s after the one before:
    each wait_layer records its timeout (in ``given``) and moves the clock 0.4 s when the
    layer comes in time, or by its whole timeout when it does not (TransferTimeoutError)."""
    from kvwire.aio._sync import ReceiveHandle
    from kvwire.integrations import vllm as connector

    clock = [0.0]
    given: list[float] = []
    real_wait_layer = ReceiveHandle.wait_layer

    def wait_layer(handle: ReceiveHandle, index: int, timeout: float | None = None) -> Any:
        assert timeout is not None
        given.append(round(timeout, 6))
        if timeout < 0.4:
            clock[0] += timeout
            raise TransferTimeoutError("not in time")
        clock[0] += 0.4
        return real_wait_layer(handle, index, 30)

    monkeypatch.setattr(connector, "time", type("FakeTime", (), {"monotonic": staticmethod(lambda: clock[0])}))
    monkeypatch.setattr(ReceiveHandle, "wait_layer", wait_layer)
    return clock, given


def loading_consumer(seed: int, load_timeout: float) -> tuple[KvwireConnector, list[torch.Tensor], list[torch.Tensor]]:
    """A consumer worker in a step that loads request "r" into blocks 4 and 5 of its
    caches, the transfer of ``src``'s blocks 0 and 1 sent (the layers' waits are up to the
    test); the worker, its caches and ``src``."""
    gen = torch.Generator().manual_seed(seed)
    caches = [torch.randn((16, 2, 16, 64), generator=gen) for _ in LAYERS]
    src = [torch.randn((16, 2, 16, 64), generator=gen) for _ in LAYERS]
    worker, spec = consumer_worker(caches, load_timeout=load_timeout)
    try:
        worker.bind_connector_metadata(KvwireConnectorMetadata(loads=[_Move("r", "r", [4, 5])]))
        worker.start_load_kv(None)  # type: ignore[arg-type]
        with SyncPeer("127.0.0.1", worker.listen_port, secret=SECRET.encode()) as peer:
            peer.send("r", spec.wire_spec(), PagedSource(spec, src, [0, 1]), timeout=30)
    except BaseException:
        worker.shutdown()
        raise
    return worker, caches, src


def test_a_step_waits_for_its_loads_within_one_load_timeout_in_all(monkeypatch: pytest.MonkeyPatch) -> None:
    """A transfer whose layers trickle in, each 0.4 s after the one before, with a load
    timeout of 1 s: each layer's wait had a timeout of its own, so the step was held for
    up to layers x timeout.  The deadline is set when the step's loads start
    (start_load_kv) and shared by every layer's wait: the layers get 1.0, 0.6 and 0.2 s
    (the clock is fake: it moves 0.4 s per layer that came, or by the whole wait of one
    that did not), the third does not come in what is left and the load fails, its
    blocks reported for recomputation; the last layer waits for nothing."""
    _, given = trickling_layers(monkeypatch)
    worker, _, _ = loading_consumer(5, load_timeout=1.0)
    try:
        for name in LAYERS:
            worker.wait_for_layer_load(name)
        worker.clear_connector_metadata()
        assert given == [1.0, 0.6, 0.2]
        assert worker.get_block_ids_with_load_errors() == {4, 5}
        assert not worker._loading
    finally:
        worker.shutdown()


def test_a_load_carried_into_a_step_without_loads_gets_a_deadline_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step started a load and waited for its first layer only, so the load carried into
    the next step, which started none: that step's waits reused the first step's deadline,
    long passed, each got no time at all and the load failed.  The deadline ends with its
    step (clear_connector_metadata); the next one sets its own at its first wait, and the
    layers, each 0.4 s after the one before with a load timeout of 2 s, get 2.0, 1.6 and
    1.2 s and come in (the clock is fake: it moves 0.4 s per layer that came, by the whole
    wait of one that did not, and 10 s between the steps)."""
    clock, given = trickling_layers(monkeypatch)
    worker, caches, src = loading_consumer(7, load_timeout=2.0)
    try:
        worker.wait_for_layer_load(LAYERS[0])  # this step's forward waits for no other layer
        worker.clear_connector_metadata()
        assert given == [2.0] and "r" in worker._loading
        clock[0] += 10.0  # the first step's deadline is long past
        worker.bind_connector_metadata(KvwireConnectorMetadata())  # a step without loads
        worker.start_load_kv(None)  # type: ignore[arg-type]
        for name in LAYERS[1:]:
            worker.wait_for_layer_load(name)
        worker.clear_connector_metadata()
        assert given == [2.0, 2.0, 1.6, 1.2]
        assert worker.get_block_ids_with_load_errors() == set()
        assert not worker._loading
        for layer in range(len(LAYERS)):
            assert torch.equal(caches[layer][4], src[layer][0]) and torch.equal(caches[layer][5], src[layer][1])
    finally:
        worker.shutdown()


def test_the_aborts_of_one_hook_wait_for_kvwires_loop_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three loading requests finish while kvwire's loop is held up: each abort waited up
    to 5 s for the loop, so get_finished took 15 s.  They are issued together and waited
    for once (here 0.5 s); each is still logged as not stopped in time, and once the loop
    runs again all three are stopped.  The hook's waits are counted, not timed: one that
    may block (a timeout above 0) is recorded and given no time, the loop being held up
    until the hook returns, so it ends as it would after its timeout."""
    gen = torch.Generator().manual_seed(6)
    caches = [torch.randn((16, 2, 16, 64), generator=gen) for _ in LAYERS]
    worker, _ = consumer_worker(caches)
    worker._ABORT_WAIT = 0.5
    gate = threading.Event()
    try:
        worker.bind_connector_metadata(KvwireConnectorMetadata(
            loads=[_Move("a", "ka", [1, 2]), _Move("b", "kb", [3, 4]), _Move("c", "kc", [5, 6])],
        ))
        worker.start_load_kv(None)  # type: ignore[arg-type]
        worker.clear_connector_metadata()
        handles = [load.handle for load in worker._loading.values()]
        assert worker._server is not None
        worker._server.bridge.call_soon(gate.wait, 30)  # the loop held up
        hook = threading.get_ident()
        waits: list[float | None] = []
        real_wait = threading.Event.wait

        def wait(event: threading.Event, timeout: float | None = None) -> bool:
            if threading.get_ident() != hook or timeout == 0:
                return real_wait(event, timeout)
            waits.append(timeout)
            return real_wait(event, 0)

        with monkeypatch.context() as patched:
            patched.setattr(threading.Event, "wait", wait)
            worker.get_finished({"a", "b", "c"})
        assert waits == [0.5]  # one wait of _ABORT_WAIT for the three, not one of 5 s each
        held = [r.getMessage() for r in caplog.records if "was not stopped in time" in r.getMessage()]
        assert sorted(m.split()[5] for m in held) == ["a", "b", "c"]
        gate.set()
        for handle in handles:
            with pytest.raises(KvwireError, match="aborted"):
                handle.wait(5)
    finally:
        gate.set()
        worker.shutdown()


# -- a consumer loading asynchronously (kvwire_load_async) -------------------------------------


def kv_blocks(ids: list[int]) -> Any:
    """The blocks vLLM allocated for a request, as its scheduler hands them to the connector."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    return KVCacheBlocks(blocks=([KVCacheBlock(i) for i in ids],))


def test_load_async_is_a_true_or_false_setting() -> None:
    assert KvwireConnector(connector_config({}, "kv_consumer"), KVConnectorRole.WORKER)._load_async is True
    for text, value in (("false", False), ("true", True), (True, True)):
        made = KvwireConnector(connector_config({"kvwire_load_async": text}, "kv_consumer"), KVConnectorRole.WORKER)
        assert made._load_async is value
    with pytest.raises(UsageError, match="kvwire_load_async must be true or false"):
        KvwireConnector(connector_config({"kvwire_load_async": "maybe"}, "kv_consumer"), KVConnectorRole.WORKER)


def test_an_async_consumer_parks_a_hit_and_loads_it_through_the_metadata() -> None:
    """With kvwire_load_async the scheduler side reports a hit to be loaded asynchronously
    (vLLM parks the request, its blocks allocated, until the worker reports its KV in): the
    parked request is not scheduled, so its load, into the blocks vLLM allocated less
    those cached here, goes in that step's metadata from update_state_after_alloc, once.
    A request with no hit (all its full blocks cached here) waits for nothing: it is
    scheduled and its transfer dropped as without the setting.  Scheduled once its KV is
    in, the loaded request loads nothing more and is no hit again; vLLM, not the
    connector, keeps a parked request's blocks when it finishes."""
    sched = scheduler_side("kv_consumer", {"kvwire_load_async": True})
    prompt = list(range(100))  # 6 full blocks of 16
    part, whole = _Request("p", prompt, "part"), _Request("w", prompt, "whole")
    assert sched.get_num_new_matched_tokens(part, 64) == (32, True)
    sched.update_state_after_alloc(part, kv_blocks(list(range(10, 17))), 32)
    assert sched.get_num_new_matched_tokens(whole, 96) == (0, False)
    sched.update_state_after_alloc(whole, kv_blocks(list(range(20, 27))), 0)
    meta = sched.build_connector_meta(schedule())  # p is parked, w not scheduled yet
    assert [(m.req_id, m.key, m.block_ids) for m in meta.loads] == [("p", named("part", prompt), [DROP] * 4 + [14, 15])]
    assert meta.drops == []
    meta = sched.build_connector_meta(schedule(new=[new_request("w", prompt, list(range(20, 27)), "whole")],
                                               scheduled={"w": 4}))
    assert meta.loads == []
    assert [(m.req_id, m.key, m.block_ids) for m in meta.drops] == [("w", named("whole", prompt), [DROP] * 6)]
    # its KV in, vLLM schedules p (as a new request): nothing more to load for it
    meta = sched.build_connector_meta(schedule(new=[new_request("p", prompt, list(range(10, 17)), "part")],
                                               scheduled={"p": 4}))
    assert meta.loads == [] and meta.drops == []
    assert sched.get_num_new_matched_tokens(part, 0) == (0, False)  # preempted later: computed here
    assert sched.request_finished(part, []) == (False, None)  # type: ignore[arg-type]


def pending_arrivals(worker: KvwireConnector) -> int:
    stats = worker.server_statistics()
    assert stats is not None
    return int(stats["pending_arrivals"])


def test_an_async_load_does_not_hold_the_step_and_is_reported_once_its_kv_is_in() -> None:
    """A consumer's step starts a load whose transfer has not come (its prefill still
    running): the step returns without waiting for it (nothing of it is sent until the
    steps below returned, so a step that waited would have seen it fail) and reports
    nothing, nor do the steps after it; once the transfer came, get_finished reports the
    request received, once, its load's blocks holding exactly the sent blocks' bytes and
    no other block changed (the cached block's part dropped)."""
    worker, spec, caches, before, src = async_consumer(8)
    try:
        assert consumer_step(worker, KvwireConnectorMetadata(loads=[_Move("r", "r", [DROP, 4, 5])])) == (set(), set())
        assert consumer_step(worker) == (set(), set())
        assert "r" in worker._loading
        with SyncPeer("127.0.0.1", worker.listen_port, secret=SECRET.encode()) as peer:
            peer.send("r", spec.wire_spec(), PagedSource(spec, src, [0, 1, 2]), timeout=30)
        assert until_received(worker) == ({"r"}, set())
        assert consumer_step(worker) == (set(), set())  # reported once
        assert not worker._loading and pending_arrivals(worker) == 0
        for layer in range(len(LAYERS)):
            for b in range(16):
                want = {4: src[layer][1], 5: src[layer][2]}.get(b, before[layer][b])
                assert torch.equal(caches[layer][b], want), (layer, b)
    finally:
        worker.shutdown()


@pytest.mark.parametrize("how", ["times-out", "fails"])
def test_an_async_load_that_fails_or_times_out_reports_its_blocks(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """A load whose transfer does not come within kvwire_load_timeout of its start (the
    clock is fake: steps at 0.6 s and 0.99 s report nothing, the one at 1.0 s reports it:
    its time counts from its start, not from a step), or whose transfer fails (the
    producer aborts it after a layer): the request is reported received, as vLLM needs to
    take it out of its wait, with its blocks as load errors (vLLM recomputes them); the
    cached block's is not one of them.  A transfer that comes after the load timed out is
    dropped: it writes none of the blocks."""
    from kvwire.integrations import vllm as connector
    from kvwire.paged import layer_rows

    clock = [0.0]
    monkeypatch.setattr(connector, "time", type("FakeTime", (), {"monotonic": staticmethod(lambda: clock[0])}))
    worker, spec, caches, before, src = async_consumer(9, load_timeout=1.0)
    try:
        with SyncPeer("127.0.0.1", worker.listen_port, secret=SECRET.encode()) as peer:
            assert consumer_step(worker, KvwireConnectorMetadata(loads=[_Move("r", "r", [DROP, 4, 5])])) == (set(), set())
            handle = worker._loading["r"].handle
            if how == "times-out":
                for clock[0] in (0.6, 0.99):
                    assert consumer_step(worker) == (set(), set())
                clock[0] = 1.0
            else:
                send = peer.begin("r", spec.wire_spec())
                send.send_layer(*layer_rows(spec, src[0], [0, 1, 2]))
                for _ in range(600):  # the transfer came, and its first layer
                    if handle.layers_done():
                        break
                    threading.Event().wait(0.05)
                assert handle.layers_done() == 1
                send.abort()
            assert until_received(worker) == ({"r"}, {4, 5})
            assert not worker._loading and not worker._unstopped
            if how == "times-out":
                peer.send("r", spec.wire_spec(), PagedSource(spec, src, [0, 1, 2]), timeout=30)
                drops_ended(worker)
                assert not worker._dropping and pending_arrivals(worker) == 0
                assert all(torch.equal(c, b) for c, b in zip(caches, before, strict=True))
    finally:
        worker.shutdown()


def test_an_async_load_of_a_request_that_finished_is_aborted_and_reported() -> None:
    """A request cancelled while it waits for its KV: vLLM keeps its blocks until the
    worker reports it received, so get_finished aborts its receive and reports it (no
    blocks to recompute: the request is gone), once; the transfer that comes afterwards is
    dropped, writes none of the blocks, and nothing of it is left on the server."""
    worker, spec, caches, before, src = async_consumer(10)
    try:
        consumer_step(worker, KvwireConnectorMetadata(loads=[_Move("r", "r", [4, 5])]))
        handle = worker._loading["r"].handle
        got, errors = consumer_step(worker, finished={"r"})
        if not got:
            got, errors = until_received(worker)
        assert (got, errors) == ({"r"}, set())
        with pytest.raises(KvwireError, match="aborted"):
            handle.wait(5)
        assert consumer_step(worker) == (set(), set())
        with SyncPeer("127.0.0.1", worker.listen_port, secret=SECRET.encode()) as peer:
            peer.send("r", spec.wire_spec(), PagedSource(spec, src, [0, 1]), timeout=30)
            drops_ended(worker)
        assert not worker._loading and not worker._unstopped and not worker._dropping
        assert pending_arrivals(worker) == 0
        assert all(torch.equal(c, b) for c, b in zip(caches, before, strict=True))
    finally:
        worker.shutdown()


def test_an_async_load_aborted_while_kvwires_loop_is_held_up_is_reported_once_stopped(
    caplog: pytest.LogCaptureFixture) -> None:
    """A load aborted (its request finished) while kvwire's loop is held up: the hook
    does not wait for the loop, and the request is not reported received, so vLLM keeps
    its blocks, as long as the receive may still write into them (said once in the log);
    once the loop runs again and has stopped it, the next step reports it."""
    worker, _, _, _, _ = async_consumer(11)
    worker._ABORT_WAIT = 0.0  # say at once that the receive is not stopped yet
    gate = threading.Event()
    try:
        consumer_step(worker, KvwireConnectorMetadata(loads=[_Move("r", "r", [4, 5])]))
        handle = worker._loading["r"].handle
        assert worker._server is not None
        worker._server.bridge.call_soon(gate.wait, 30)  # the loop held up
        assert consumer_step(worker, finished={"r"}) == (set(), set())
        for _ in range(3):
            assert consumer_step(worker) == (set(), set())
        held = [r.getMessage() for r in caplog.records if "is not stopped yet" in r.getMessage()]
        assert len(held) == 1 and "request r " in held[0]
        gate.set()
        assert until_received(worker) == ({"r"}, set())
        with pytest.raises(KvwireError, match="aborted"):
            handle.wait(5)
    finally:
        gate.set()
        worker.shutdown()


def hold_and_close(bridge: Bridge, gate: threading.Event) -> None:
    """Hold ``bridge``'s loop up until ``gate`` is set, and close the bridge from another
    thread meanwhile: its close gives up on the loop (0.1 s a step), which runs on until
    the gate opens."""
    bridge.call_soon(gate.wait, 30)
    closer = threading.Thread(target=bridge.close, args=(0.1,))
    closer.start()
    closer.join(30)
    assert bridge.closed and not closer.is_alive()


@pytest.mark.parametrize("load_async", [True, False])
def test_a_load_aborted_on_a_bridge_closed_elsewhere_waits_for_its_loop(
    caplog: pytest.LogCaptureFixture, load_async: bool) -> None:
    """A load whose first layer is in, aborted (its request finished) after another thread
    closed the server's bridge, whose close gave up on its loop held up elsewhere: the
    loop runs until that close ended and may write the transfer's next chunks into the
    blocks.  The aborted load was taken as stopped at once (no mark could be queued on a
    closed bridge): reported received (async) or not waited for (layer-wise).  Now it
    waits for the loop as on an open bridge: not reported while the loop is held up
    (async; reported once it ran), logged as not stopped in time (layer-wise)."""
    from kvwire.paged import layer_rows

    gen = torch.Generator().manual_seed(13)
    caches = [torch.randn((16, 2, 16, 64), generator=gen) for _ in LAYERS]
    src = [torch.randn((16, 2, 16, 64), generator=gen) for _ in LAYERS]
    worker, spec = consumer_worker(caches, load_async=load_async)
    worker._ABORT_WAIT = 0.0  # no waiting here: the loop is held up until the hook returned
    gate = threading.Event()
    try:
        with SyncPeer("127.0.0.1", worker.listen_port, secret=SECRET.encode()) as peer:
            if load_async:
                consumer_step(worker, KvwireConnectorMetadata(loads=[_Move("r", "r", [4, 5])]))
            else:
                worker.bind_connector_metadata(KvwireConnectorMetadata(loads=[_Move("r", "r", [4, 5])]))
                worker.start_load_kv(None)  # type: ignore[arg-type]
                worker.clear_connector_metadata()
            handle = worker._loading["r"].handle
            send = peer.begin("r", spec.wire_spec())
            send.send_layer(*layer_rows(spec, src[0], [0, 1]))
            handle.wait_layer(0, 30)  # the transfer came, and its first layer
            assert worker._server is not None
            hold_and_close(worker._server.bridge, gate)
            if load_async:
                assert consumer_step(worker, finished={"r"}) == (set(), set())
                held = [r.getMessage() for r in caplog.records if "is not stopped yet" in r.getMessage()]
                assert len(held) == 1 and "request r " in held[0]
                gate.set()
                assert until_received(worker) == ({"r"}, set())
            else:
                worker.get_finished({"r"})
                held = [r.getMessage() for r in caplog.records if "was not stopped in time" in r.getMessage()]
                assert len(held) == 1 and "request r " in held[0]
                gate.set()
            with pytest.raises(KvwireError, match="aborted"):
                handle.wait(5)
            send.abort()
    finally:
        gate.set()
        worker.shutdown()


def test_a_load_given_up_on_a_closed_bridge_before_its_transfer_came_is_reported() -> None:
    """An async load whose transfer has not come, its request finished after the server's
    bridge was closed: giving it up dropped the transfer to come, expecting it on the
    closed server, whose ConnectionLostError was raised out of get_finished.  There is
    nothing to drop: the load is reported (its request gone, no blocks to recompute)."""
    worker, _, _, _, _ = async_consumer(14)
    try:
        consumer_step(worker, KvwireConnectorMetadata(loads=[_Move("r", "r", [4, 5])]))
        assert worker._server is not None
        worker._server.bridge.close()
        got, errors = consumer_step(worker, finished={"r"})
        if not got:
            got, errors = until_received(worker)
        assert (got, errors) == ({"r"}, set())
        assert not worker._loading and not worker._dropping
    finally:
        worker.shutdown()


@pytest.mark.parametrize("load_async", [True, False])
def test_a_load_started_on_a_closed_bridge_fails_the_load_not_the_step(
    caplog: pytest.LogCaptureFixture, load_async: bool) -> None:
    """A step's loads started after the server's bridge was closed: expecting their
    transfers raised ConnectionLostError out of start_load_kv, failing vLLM's step.  Each
    load fails instead, logged, its blocks reported as load errors (async: with the
    request in finished_recving, which takes it out of vLLM's wait; layer-wise: in the
    same step, the layers not waited for).  Async: the other load's request, finished
    meanwhile, is reported with no blocks (none to recompute)."""
    gen = torch.Generator().manual_seed(15)
    caches = [torch.randn((16, 2, 16, 64), generator=gen) for _ in LAYERS]
    worker, _ = consumer_worker(caches, load_async=load_async)
    try:
        assert worker._server is not None
        worker._server.bridge.close()
        worker.bind_connector_metadata(KvwireConnectorMetadata(loads=[_Move("r", "r", [4, DROP, 5]),
                                                                      _Move("gone", "gone", [6])]))
        worker.start_load_kv(None)  # type: ignore[arg-type]
        for name in LAYERS:
            worker.wait_for_layer_load(name)
        _, recving = worker.get_finished({"gone"})
        assert worker.get_block_ids_with_load_errors() == ({4, 5} if load_async else {4, 5, 6})
        worker.clear_connector_metadata()
        assert recving == ({"r", "gone"} if load_async else None)
        failed = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
        assert any("request r failed" in m for m in failed) and not worker._loading
        assert worker.get_finished(set()) == (None, None)  # reported once
        assert worker.get_block_ids_with_load_errors() == set()
    finally:
        worker.shutdown()


def test_an_async_load_whose_cache_is_stale_in_the_registry_is_refused() -> None:
    """With a registry, two requests load caches whose prefix blocks the producer named;
    one's blocks are invalidated before the consumer checks them.  The check runs once the
    transfer is in, on kvwire's loop (the hook does not wait for it): the fresh cache is
    reported received and used, the stale one refused, its blocks reported as load
    errors, and both requests reported received."""
    from kvwire.aio.registry_memory import MemoryRegistry
    from kvwire.integrations.prefix import SyncRegistry, prefix_block_ids

    bridge = Bridge("registry")
    worker, spec, caches, _, src = async_consumer(12)
    try:
        # what kvwire_registry would connect to (a Redis), in this process
        registry = worker._registry = SyncRegistry(MemoryRegistry(), bridge)
        fresh, stale = (tuple(prefix_block_ids(list(range(s, s + 33)), 16, 2)) for s in (0, 100))
        consumer_step(worker, KvwireConnectorMetadata(loads=[
            _Move("f", "f", [4, 5], prefix=fresh), _Move("s", "s", [6, 7], prefix=stale),
        ]))
        with SyncPeer("127.0.0.1", worker.listen_port, secret=SECRET.encode()) as peer:
            for key, blocks in (("f", fresh), ("s", stale)):
                named = registry.name(list(blocks), owner="producer")
                peer.send(key, spec.wire_spec(), PagedSource(spec, src, [0, 1]), timeout=30, blocks=named)
        bridge.run(registry.registry.invalidate_many(list(stale)), 10)
        assert until_received(worker, want=2) == ({"f", "s"}, {6, 7})
        for layer in range(len(LAYERS)):
            assert torch.equal(caches[layer][4], src[layer][0]) and torch.equal(caches[layer][5], src[layer][1])
    finally:
        worker.shutdown()
        bridge.close()


def test_a_kv_cache_of_several_groups_is_refused() -> None:
    """vLLM's hybrid KV cache manager (enabled explicitly) gives each group of layers a
    block table of its own; the connector moves one table for every layer, so it refuses
    such a cache at once, saying how to run, on both sides."""
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float32)
    two = KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(LAYERS[:2], spec), KVCacheGroupSpec(LAYERS[2:], spec)])
    one = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)])
    cfg = config("kv_both", {})
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(UsageError, match=r"2 groups.*--disable-hybrid-kv-cache-manager"):
            KvwireConnector(cfg, role, two)
    KvwireConnector(cfg, KVConnectorRole.SCHEDULER, one)


def send_while_loading(consumer: KvwireConnector, producer_worker: KvwireConnector, sent: list[torch.Tensor],
                       save: _Move) -> Any:
    """The consumer starts loading request "c" (name "k") into blocks 1 and 2; the producer,
    its caches ``sent`` registered and connected, sends ``save`` in a step: its send's handle."""
    producer_worker.register_kv_caches(dict(zip(LAYERS, sent, strict=True)))
    wait_connected(producer_worker)
    consumer.bind_connector_metadata(KvwireConnectorMetadata(loads=[_Move("c", "k", [1, 2])]))
    consumer.start_load_kv(None)  # type: ignore[arg-type]
    consumer.clear_connector_metadata()
    # The send's handle as it is made: a refusal may end the send within the step, which
    # then no longer holds it in flight.
    peer = producer_worker._peer
    assert peer is not None
    begun: list[Any] = []
    real_begin = peer.begin

    def begin(*args: Any, **kwargs: Any) -> Any:
        begun.append(real_begin(*args, **kwargs))
        return begun[-1]

    peer.begin = begin  # type: ignore[method-assign]
    step(producer_worker, KvwireConnectorMetadata(saves=[save]), sent)
    [handle] = begun
    return handle


def test_sides_of_different_block_sizes_do_not_exchange_blocks() -> None:
    """A producer run with blocks of 32 tokens and a consumer with blocks of 16: a block's
    shape holds its size, so the layouts differ and the send fails at BEGIN: nothing of it
    waits on the consumer's server for a claim, and no block of the consumer is written."""
    from kvwire.errors import IncompatiblePeerError

    caches = [torch.randn((8, 2, 16, 64)) for _ in LAYERS]
    before = [c.clone() for c in caches]
    consumer, _ = consumer_worker(caches)
    cfg = connector_config({"kvwire_peer": f"127.0.0.1:{consumer.listen_port}", "kvwire_load_timeout": 30})
    cfg.cache_config = CacheConfig(block_size=32)
    producer_worker = KvwireConnector(cfg, KVConnectorRole.WORKER)
    sent = [torch.randn((8, 2, 32, 64)) for _ in LAYERS]
    try:
        # named by the tokens of its own full blocks: for most prompts not the consumer's name
        handle = send_while_loading(consumer, producer_worker, sent, _Move("p", "k-32", [3]))
        with pytest.raises(IncompatiblePeerError, match="does not accept KV layout"):
            handle.wait(30)
        stats = consumer.server_statistics()
        assert stats is not None and stats["pending_arrivals"] == 0 and stats["buffered_bytes"] == 0
        consumer.get_finished({"c"})  # the request gives up its load
        assert all(torch.equal(c, b) for c, b in zip(caches, before, strict=True))
    finally:
        producer_worker.shutdown()
        consumer.shutdown()


@pytest.mark.parametrize("setting", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_tensor_and_pipeline_parallelism_are_refused(setting: str) -> None:
    """Every rank's worker makes a connector holding its shard of the KV cache: a consumer's
    ranks all bound kvwire_listen (rank 1 failed with an OS error) and a producer's sent
    every shard under one name. Refused on every role, naming the setting."""
    from vllm.config import ParallelConfig

    cfg = config("kv_consumer", {"kvwire_listen": "127.0.0.1:0"}, parallel_config=ParallelConfig(**{setting: 2}))
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(UsageError, match=f"{setting} is 2.*{setting}=1"):
            KvwireConnector(cfg, role)


def test_a_data_parallel_consumer_is_refused_and_a_data_parallel_producer_is_not() -> None:
    """A producer sends to one kvwire_peer (one engine) while vLLM places each request on
    any of a data-parallel consumer's engines, whose ranks on one host would also all bind
    kvwire_listen: refused on a consumer (and kv_both), naming the setting.  A producer's
    engines each send by name to the consumer: accepted."""
    from vllm.config import ParallelConfig

    def made(role: str, extra: dict[str, Any]) -> KvwireConnector:
        return KvwireConnector(config(role, extra, parallel_config=ParallelConfig(data_parallel_size=2)),
                               KVConnectorRole.SCHEDULER)

    for role in ("kv_consumer", "kv_both"):
        with pytest.raises(UsageError, match="data_parallel_size is 2 on a consumer"):
            made(role, {"kvwire_listen": "127.0.0.1:0", "kvwire_peer": "127.0.0.1:7070"})
    assert made("kv_producer", {"kvwire_peer": "127.0.0.1:7070"})._producer


def connector_config(extra: dict[str, Any], role: str = "kv_producer") -> VllmConfig:
    return config(role, extra)


@pytest.mark.parametrize(("extra", "says"), [
    ({"kvwire_codec": "bogus"}, "unknown codec 'bogus'"),
    ({"kvwire_streams": "x"}, "kvwire_streams must be"), ({"kvwire_streams": 0}, "kvwire_streams must be"),
    ({"kvwire_secret": "short"}, "at least 8 bytes"),
    ({"kvwire_chunk_bytes": "big"}, "kvwire_chunk_bytes must be"), ({"kvwire_chunk_bytes": -1}, "must be > 0"),
    ({"kvwire_load_timeout": "abc"}, "kvwire_load_timeout must be a number"),
    ({"kvwire_load_timeout": float("nan")}, "kvwire_load_timeout must be a finite number"),
    ({"kvwire_claim_timeout": -1}, "kvwire_claim_timeout must be > 0"),
    ({"kvwire_async_save": "maybe"}, "kvwire_async_save must be true or false"),
    ({"kvwire_chunk_bytes": 0}, "must be > 0"), ({"kvwire_chunk_bytes": "0"}, "must be > 0"),
    ({"kvwire_chunk_bytes": 2.5}, "kvwire_chunk_bytes must be a number of bytes"),
    ({"kvwire_secret": None, "kvwire_secret_file": "/nonexistent/kvwire-secret"}, "cannot read kvwire_secret_file"),
    ({"kvwire_peer": "decode-host"}, "kvwire_peer must be HOST:PORT"),
    ({"kvwire_peer": "decode-host:http"}, "kvwire_peer must be HOST:PORT"),
    ({"kvwire_peer": "[::1]:99999"}, "kvwire_peer's port must be in 1-65535"),
    ({"kvwire_peer": "decode-host:0"}, "kvwire_peer's port must be in 1-65535"),
    ({"kvwire_listen": "0.0.0.0:70000"}, "kvwire_listen's port must be in 0-65535"),
    ({"kvwire_listen": ":7070"}, "kvwire_listen must be HOST:PORT"),
])
def test_settings_are_checked_when_the_connector_is_made(extra: dict[str, Any], says: str) -> None:
    """A bad setting found only at the first connect left every request unsent, step after
    step, logged as a network error (a malformed kvwire_peer raised out of the forward
    pass); a short secret failed on one side only; a chunk size of 0 was taken as unset."""
    role = "kv_consumer" if "kvwire_listen" in extra else "kv_producer"  # the role that uses it
    with pytest.raises(UsageError, match=says):
        KvwireConnector(connector_config(extra, role), KVConnectorRole.WORKER)


def test_each_address_is_checked_on_the_role_that_uses_it() -> None:
    """A consumer listens and a producer connects: a configuration shared by both roles
    may carry the other's address (a consumer's port 0 to listen on, say), which neither
    refuses; kv_both checks both."""
    shared = {"kvwire_peer": "127.0.0.1:0", "kvwire_listen": "127.0.0.1:0"}
    assert KvwireConnector(connector_config(shared, "kv_consumer"), KVConnectorRole.WORKER)._listen == ("127.0.0.1", 0)
    with pytest.raises(UsageError, match="kvwire_peer's port"):
        KvwireConnector(connector_config(shared, "kv_producer"), KVConnectorRole.WORKER)
    with pytest.raises(UsageError, match="kvwire_peer's port"):
        KvwireConnector(connector_config(shared, "kv_both"), KVConnectorRole.WORKER)
    producer = KvwireConnector(connector_config({"kvwire_peer": "127.0.0.1:7070", "kvwire_listen": "bad"}, "kv_producer"),
                               KVConnectorRole.WORKER)
    assert (producer._peer_host, producer._peer_port) == ("127.0.0.1", 7070)


def test_boolean_settings_given_as_text_mean_what_they_say() -> None:
    # bool("false") is True: async save was on and the consumer expected KV for every request
    for text, value in (("false", False), ("False", False), ("0", False), ("true", True), ("yes", True)):
        c = KvwireConnector(connector_config({"kvwire_async_save": text, "kvwire_load_all": text}),
                            KVConnectorRole.WORKER)
        assert c._async_save is value and c._load_all is value
    assert KvwireConnector(connector_config({"kvwire_streams": "4"}), KVConnectorRole.WORKER)._streams == 4
    assert KvwireConnector(connector_config({"kvwire_streams": "auto"}), KVConnectorRole.WORKER)._streams == "auto"


def test_an_ipv6_address_in_brackets() -> None:
    from kvwire.integrations.vllm import _split_addr

    assert _split_addr("[::1]:7070") == ("::1", 7070)
    assert _split_addr("127.0.0.1:7070") == ("127.0.0.1", 7070)
    assert _split_addr("0.0.0.0:0", any_port=True) == ("0.0.0.0", 0)
    for text in ("[::1]", "[decode-host]:7070"):  # (brackets enclose an IPv6 address, as for kvwire.connect)
        with pytest.raises(UsageError, match="HOST:PORT"):
            _split_addr(text)
    for unbracketed in ("::1", "::1:7070", "fe80::1:7070"):  # ("::1" was host ":", port 1)
        with pytest.raises(UsageError, match=r"IPv6 host in brackets \(\[::1\]:7070\)"):
            _split_addr(unbracketed)


def test_a_cache_whose_first_axis_is_not_the_block_index_is_refused() -> None:
    """[2, num_blocks, ...] (K and V in leading planes, as GPU flash attention lays it out):
    its "blocks" would be the K and V planes; it is refused when the caches are registered,
    not found out by a UsageError raised into the engine's forward (or, with block ids 0
    and 1 only, wrong data sent without an error)."""
    spec = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=64, dtype=torch.float32)
    kv_config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                              kv_cache_groups=[KVCacheGroupSpec(layer_names=LAYERS, kv_cache_spec=spec)])
    worker = KvwireConnector(connector_config({"kvwire_peer": "127.0.0.1:9"}), KVConnectorRole.WORKER, kv_config)
    with pytest.raises(UsageError, match="first axis must be the block index"):
        worker.register_kv_caches({n: torch.zeros((2, 64, 16, 4, 64)) for n in LAYERS})
    fine = KvwireConnector(connector_config({"kvwire_peer": "127.0.0.1:9"}), KVConnectorRole.WORKER, kv_config)
    fine.register_kv_caches({n: torch.zeros((64, 2, 16, 4, 64)) for n in LAYERS})
    fine.shutdown()  # (its connect, under way on kvwire's loop, and its bridge closed)


def test_a_send_that_fails_for_one_request_does_not_fail_the_step(
    path: tuple[SyncServer, FaultProxy, Bridge],
) -> None:
    """A request whose blocks are out of the cache's range: its send ends unsent with an
    error logged; the step, and the other request's send, go on."""
    server, _proxy, _bridge = path
    _scheduler, worker, caches = producer(server.port, load_timeout=30)
    bad = _Move(req_id="bad", key="bad", block_ids=[1, 500])
    good = _Move(req_id="good", key="good", block_ids=BLOCKS[:4])
    handle = server.expect("good")
    try:
        step(worker, KvwireConnectorMetadata(saves=[bad, good]), caches)
        assert "bad" not in worker._sends_in(_SendState.SENDING, _SendState.IN_FLIGHT)
        assert len(received(handle)) == len(LAYERS)
    finally:
        worker.shutdown()


def test_the_connector_asks_for_piecewise_cuda_graphs() -> None:
    """Its per-layer hooks are Python around the attention op: a full CUDA graph's replay
    would skip them, so vLLM must capture piecewise graphs (it asks the connector)."""
    assert KvwireConnector.requires_piecewise_for_cudagraph({}) is True
    assert KvwireConnector.requires_piecewise_for_cudagraph({"kvwire_async_save": False}) is True


def test_the_documented_consumer_recomputes_a_failed_load() -> None:
    """A failed load's blocks go to get_block_ids_with_load_errors; vLLM recomputes them
    only with kv_load_failure_policy="recompute" (its default, "fail", fails the request).
    The consumer configuration in docs/integrations.md, evaluated as written, sets it."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).parents[2] / "docs" / "integrations.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if 'kv_role="kv_consumer"' in b]
    assert len(blocks) == 1
    call = blocks[0][blocks[0].index("KVTransferConfig("):].rstrip().removesuffix(")")  # drop LLM(...)'s ")"
    transfer_config = eval(call, {"KVTransferConfig": KVTransferConfig})  # the docs' own example, as written
    assert transfer_config.kv_load_failure_policy == "recompute"
    assert transfer_config.is_kv_consumer


def with_layers(cfg: VllmConfig, isa: str | None, backend: str = "CPU_ATTN") -> VllmConfig:
    """``cfg`` with attention layers as vLLM's model runner leaves them before it registers
    the caches: each names its backend, and the CPU backend's carry the ISA it picked."""
    from types import SimpleNamespace

    def layer() -> Any:
        made = SimpleNamespace(attn_backend=SimpleNamespace(get_name=lambda: backend))
        if isa is not None:
            made.isa = isa
        return made

    cfg.compilation_config.static_forward_context = {n: layer() for n in LAYERS}
    return cfg


def test_sides_whose_blocks_differ_in_layout_do_not_exchange_them() -> None:
    """vLLM's CPU backend writes a block in an ISA-dependent layout ("amx" on one host,
    "vec" on another) with the same shape, and two models of one geometry have blocks of
    the same shape: the spec's fingerprint held only shape and dtype, so such sides
    exchanged blocks the other could not read, without an error.  The model, the backend,
    its layout, the cache dtype and the vLLM version are in the spec now: a producer on
    an "amx" host sending to a "vec" consumer fails at BEGIN, naming both layouts'
    fingerprints, and no block of the consumer is written."""
    from types import SimpleNamespace

    from kvwire.errors import IncompatiblePeerError

    def made(isa: str | None, extra: dict[str, Any], role: str, backend: str = "CPU_ATTN",
             model: str | None = None) -> KvwireConnector:
        cfg = with_layers(connector_config(extra, role), isa, backend)
        connector = KvwireConnector(cfg, KVConnectorRole.WORKER)
        if model is not None:
            connector._vllm_config = SimpleNamespace(  # what _identity reads of the config
                model_config=SimpleNamespace(model=model), compilation_config=cfg.compilation_config,
                cache_config=cfg.cache_config)
        return connector

    def fingerprint(isa: str | None, backend: str = "CPU_ATTN", model: str | None = None,
                    extra: dict[str, Any] | None = None) -> bytes:
        c = made(isa, {"kvwire_peer": "127.0.0.1:9", **(extra or {})}, "kv_producer", backend, model)
        try:
            c.register_kv_caches({n: torch.zeros((4, 2, 16, 64)) for n in LAYERS})
            assert c._spec is not None
            return c._spec.wire_spec().fingerprint
        finally:
            c.shutdown()

    assert fingerprint("amx") == fingerprint("amx")
    assert fingerprint("amx") != fingerprint("vec")
    assert fingerprint(None, "FLASH_ATTN") != fingerprint(None, "FLASHINFER")
    assert fingerprint("vec", model="org/model-a") != fingerprint("vec", model="org/model-b")
    # kvwire_model names the model (the same weights at other paths), the layout still counts
    named = {"kvwire_model": "llama"}
    assert fingerprint("vec", model="/a/llama", extra=named) == fingerprint("vec", model="/b/llama", extra=named)
    assert fingerprint("vec", extra=named) != fingerprint("amx", extra=named)

    caches = [torch.randn((8, 2, 16, 64)) for _ in LAYERS]
    before = [c.clone() for c in caches]
    consumer = made("vec", {"kvwire_listen": "127.0.0.1:0", "kvwire_load_timeout": 30}, "kv_consumer")
    consumer.register_kv_caches(dict(zip(LAYERS, caches, strict=True)))
    producer_worker = made("amx", {"kvwire_peer": f"127.0.0.1:{consumer.listen_port}", "kvwire_load_timeout": 30},
                           "kv_producer")
    sent = [torch.randn((8, 2, 16, 64)) for _ in LAYERS]
    try:
        handle = send_while_loading(consumer, producer_worker, sent, _Move("p", "k", [3, 4]))
        assert producer_worker._spec is not None and consumer._spec is not None
        # the refusal leads with the fingerprints (its text on the wire is cut to 160 characters)
        sent_fp = producer_worker._spec.wire_spec().fingerprint.hex()[:12]
        accepted_fp = consumer._spec.wire_spec().fingerprint.hex()[:12]
        refused = rf"does not accept KV layout {sent_fp} \(it accepts {accepted_fp}\)"
        with pytest.raises(IncompatiblePeerError, match=refused):
            handle.wait(30)
        consumer.get_finished({"c"})  # the request gives up its load
        assert all(torch.equal(c, b) for c, b in zip(caches, before, strict=True))
    finally:
        producer_worker.shutdown()
        consumer.shutdown()
