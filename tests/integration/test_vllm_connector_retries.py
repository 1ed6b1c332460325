"""The vLLM connector's loads that meet a failed transfer of their name, its sends the
consumer's server refuses for want of room, queued sends and a speculative drafter, the
per-step sweep of transfers named without an id, and the drops of loads that gave up.
The worker-side connectors are driven step by step, as vLLM's worker drives them, over
real sockets on 127.0.0.1 (helpers from tests/integration/vllm_workers.py)."""

from __future__ import annotations

import threading
import time
import warnings
from typing import Any

import numpy as np
import pytest
import torch

from kvwire.errors import StaleVersionError
from kvwire.paged import PagedSource, layer_rows
from kvwire.sync import Bridge, SyncPeer, SyncServer
from tests.integration.vllm_workers import (
    LAYERS,
    SECRET,
    caches,
    config,
    consume,
    consumer,
    pending,
    produce,
    producer,
    same,
    until,
)

with warnings.catch_warnings():  # vLLM's import chain trips torch's own deprecation warnings
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvwire.integrations.vllm import KvwireConnector, KvwireConnectorMetadata, _Move, _SendState

pytestmark = pytest.mark.timeout(180)


def counted_expects(worker: KvwireConnector) -> list[str]:
    """The names the worker's server is asked to expect for a load from now on (not for
    a drop)."""
    server = worker._server
    assert server is not None
    names: list[str] = []
    expect = server.expect

    def counting(request_id: str, **kwargs: Any) -> Any:
        if type(kwargs.get("into")).__name__ == "_Destination":
            names.append(request_id)
        return expect(request_id, **kwargs)

    server.expect = counting  # type: ignore[method-assign]
    return names


# -- a load whose transfer the server refuses at BEGIN ---------------------------------------


@pytest.mark.parametrize("load_async", [True, False])
def test_a_load_waiting_for_a_transfer_refused_as_stale_fails_at_once(load_async: bool) -> None:
    """A transfer refused at BEGIN as stale (STALE_VERSION) is no transfer that had failed
    before it was claimed: the load already waiting for it fails at once and is
    recomputed, instead of waiting for its name again until kvwire_load_timeout (the
    layer-wise load holding the step that long)."""
    from kvwire.aio.registry_memory import MemoryRegistry
    from kvwire.integrations.prefix import SyncRegistry, prefix_block_ids

    bridge = Bridge("registry")
    worker = KvwireConnector(config("kv_consumer", {"kvwire_listen": "127.0.0.1:0", "kvwire_load_timeout": 10,
                                                    "kvwire_load_async": load_async}), KVConnectorRole.WORKER)
    try:
        worker._bridge = bridge  # (shut down with the worker)
        registry = worker._registry = SyncRegistry(MemoryRegistry(), bridge)  # (a Redis, in a deployment)
        worker.register_kv_caches(dict(zip(LAYERS, caches(64, 0), strict=True)))
        spec = worker._spec
        assert spec is not None
        expects = counted_expects(worker)
        prefix = tuple(prefix_block_ids(list(range(33)), 16, 2))
        worker.bind_connector_metadata(KvwireConnectorMetadata(loads=[_Move("s", "s", [6, 7], prefix=prefix)]))
        worker.start_load_kv(None)
        worker.clear_connector_metadata()
        handle = worker._loading["s"].handle
        named = registry.name(list(prefix), owner="producer")
        bridge.run(registry.registry.invalidate_many(list(prefix)), 10)
        with SyncPeer("127.0.0.1", worker.listen_port or 0, secret=SECRET.encode()) as peer, \
                pytest.raises(StaleVersionError):
            peer.send("s", spec.wire_spec(), PagedSource(spec, caches(64, 7), [0, 1]), timeout=60, blocks=named)
        deadline = time.monotonic() + 60
        while handle.error is None and time.monotonic() < deadline:
            threading.Event().wait(0.02)
        assert isinstance(handle.error, StaleVersionError)
        got, errors = consume(worker)  # the step after the refusal
        while load_async and not got and time.monotonic() < deadline:  # (reported once its abort ran)
            g, e = consume(worker)
            got |= g
            errors |= e
        assert errors == {6, 7} and got == ({"s"} if load_async else set())
        assert expects == ["s"]  # not expected again
        assert not worker._loading
    finally:
        worker.shutdown()


# -- queued sends and a speculative drafter --------------------------------------------------


def test_a_send_queued_in_a_step_is_not_begun_before_its_drafters_layer() -> None:
    """With speculative decoding vLLM runs get_finished before the drafter's forward and
    wait_for_save after it.  A send queued in the step (the consumer's server takes 2 at
    once) whose turn comes as an earlier send ends is begun by wait_for_save, with the
    drafter's layer computed, not by get_finished, which would read that layer (its last)
    from the registered caches before the drafter wrote it."""
    bridge = Bridge("consumer")
    kv = caches(64, 1)
    worker = KvwireConnector(config("kv_producer", {"kvwire_peer": "127.0.0.1:1", "kvwire_load_timeout": 60}),
                             KVConnectorRole.WORKER)
    held = threading.Event()
    server = None
    try:
        worker._retry_at = float("inf")  # (no connect until the server's port is known)
        worker.register_kv_caches(dict(zip(LAYERS, kv, strict=True)))
        spec = worker._spec
        assert spec is not None
        server = SyncServer("127.0.0.1", 0, secret=SECRET.encode(), spec=spec.wire_spec(), bridge=bridge,
                            max_transfers=2)
        worker._peer_port, worker._retry_at = server.port, 0.0
        deadline = time.monotonic() + 60
        while worker._peer is None and time.monotonic() < deadline:
            worker._poll_connect()
            threading.Event().wait(0.02)
        assert worker._peer is not None, worker._connect_error
        receives = {name: server.expect(name) for name in ("A", "r0", "r1")}
        bridge.call_soon(held.wait)  # the consumer's loop is busy: nothing is acknowledged yet
        produce(worker, KvwireConnectorMetadata(saves=[_Move("rA", "A", [40, 41])]), kv)
        for cache in kv:
            cache[[2, 3, 4, 5]] = 0.5  # the target model's layers of r0's and r1's blocks
        kv[-1][[2, 3, 4, 5]] = 0.0  # the drafter's layer: not computed yet
        worker.bind_connector_metadata(KvwireConnectorMetadata(saves=[_Move("r0", "r0", [2, 3]),
                                                                      _Move("r1", "r1", [4, 5])]))
        for name, cache in zip(LAYERS[:-1], kv[:-1], strict=True):
            worker.save_kv_layer(name, cache, None)
        assert list(worker._sends_in(_SendState.QUEUED)) == ["r1"]
        held.set()
        first = worker._sends_in(_SendState.IN_FLIGHT)["rA"].handle
        assert first is not None
        first.wait(60)  # rA ended: r1's turn has come
        worker.get_finished(set())
        if "r1" not in worker._sends_in(_SendState.QUEUED):  # begun: let it go out before the drafter writes its layer
            receives["r1"].wait(60)
        kv[-1][[2, 3, 4, 5]] = 1.0  # the drafter's forward
        worker.save_kv_layer(LAYERS[-1], kv[-1], None)
        worker.wait_for_save()
        worker.clear_connector_metadata()
        for name in ("r0", "r1"):
            receives[name].wait(60)
            layer = receives[name].wait_layer(len(LAYERS) - 1, 0)
            assert float(np.asarray(layer.k).min()) == 1.0, name  # the drafter's layer as computed
            assert float(np.asarray(receives[name].wait_layer(0, 0).k).max()) == 0.5, name
    finally:
        held.set()
        worker.shutdown()
        if server is not None:
            server.close()
        bridge.close()


# -- sends the consumer's server refuses for want of room ------------------------------------


@pytest.mark.parametrize("async_save", [True, False])
def test_sends_refused_while_the_consumer_holds_transfers_not_yet_loaded_are_sent_later(
        workers: list[KvwireConnector], async_save: bool) -> None:
    """The usual disaggregated flow: prefills end before their decode requests reach the
    consumer, whose server counts the transfers arrived that no request loaded yet against
    its max_transfers (4 here).  The sends past that, refused at BEGIN (LIMIT_EXCEEDED),
    wait their turn again and go once loads made room (without the async save, within
    their step), instead of failing (their loads then waiting a whole kvwire_load_timeout
    and recomputing).  The consumer's steps run on a thread of their own, as on another
    instance."""
    n, room = 6, 4
    cons, ckv = consumer({"kvwire_load_timeout": 30, "kvwire_max_transfers": room})
    prod, pkv = producer(cons.listen_port or 0, {"kvwire_load_timeout": 60, "kvwire_async_save": async_save})
    workers[:] = [prod, cons]
    names = [f"r{i}#prompt:{i:032x}" for i in range(n)]
    saves = [_Move(f"r{i}", names[i], [2 * i + 1, 2 * i]) for i in range(n)]
    everyone = {m.req_id for m in saves}
    deadline = time.monotonic() + 60
    ended = produce(prod, KvwireConnectorMetadata(saves=saves[:room]), pkv, {m.req_id for m in saves[:room]})
    while pending(cons) < room and time.monotonic() < deadline:  # arrived whole, none loaded yet
        ended |= produce(prod, KvwireConnectorMetadata(), None)
        threading.Event().wait(0.05)
    assert pending(cons) == room
    got: set[str] = set()
    errors: set[int] = set()

    def refused() -> int:
        stats = cons.server_statistics()
        assert stats is not None
        return int(stats["transfers_refused"])

    def decode() -> None:  # the decode requests reach the consumer once a send was refused
        while not refused() and time.monotonic() < deadline:
            threading.Event().wait(0.02)
        loads = [_Move(f"r{i}", names[i], [20 + 2 * i, 21 + 2 * i]) for i in range(n)]
        g, e = consume(cons, KvwireConnectorMetadata(loads=loads))
        got.update(g)
        errors.update(e)
        while got != everyone and time.monotonic() < deadline:
            g, e = consume(cons)
            got.update(g)
            errors.update(e)
            threading.Event().wait(0.05)

    loader = threading.Thread(target=decode)
    loader.start()
    try:
        ended |= produce(prod, KvwireConnectorMetadata(saves=saves[room:]), pkv, {m.req_id for m in saves[room:]})
        while async_save and ended != everyone and time.monotonic() < deadline:
            ended |= produce(prod, KvwireConnectorMetadata(), None)
            threading.Event().wait(0.05)
    finally:
        loader.join()
    assert refused() >= 1
    assert got == everyone and not errors
    for i in range(n):
        assert same(ckv, [20 + 2 * i, 21 + 2 * i], pkv, [2 * i + 1, 2 * i]), i
    assert not async_save or ended == everyone


# -- the per-step look for transfers no request loads --------------------------------------------


def test_the_look_for_transfers_no_request_loads_does_not_wait_for_kvwires_loop(
        workers: list[KvwireConnector]) -> None:
    """A consumer without kvwire_load_all asks kvwire's loop once per step which transfers
    named without an id arrived: get_finished does not wait for the answer (a loop held
    up, by a large decode or a slow registry call, would hold the engine step), and the
    next step drops those it listed."""
    cons, ckv = consumer({"kvwire_load_timeout": 30})
    workers[:] = [cons]
    spec, server = cons._spec, cons._server
    assert spec is not None and server is not None
    cons._SWEEP_WAIT = 120.0  # type: ignore[attr-defined]  # (how long a hook that waited would wait)
    name = "prompt:" + "9c" * 16
    src = caches(64, 7)
    with SyncPeer("127.0.0.1", cons.listen_port or 0, secret=SECRET.encode()) as peer:
        peer.send(name, spec.wire_spec(), PagedSource(spec, src, [1, 2]), timeout=60)
    assert pending(cons) == 1
    held = threading.Event()
    server.bridge.call_soon(held.wait)  # kvwire's loop is held up
    step = threading.Thread(target=consume, args=(cons,))
    try:
        step.start()
        step.join(60)
        assert not step.is_alive(), "the step waited for kvwire's loop"
    finally:
        held.set()
        step.join()
    before = [c.clone() for c in ckv]
    assert until(lambda: pending(cons) == 0 and not cons._dropping, cons), "not dropped"
    assert cons._swept == 1
    assert all(torch.equal(a, b) for a, b in zip(before, ckv, strict=True))


# -- a load handed several failed transfers of its name --------------------------------------------


@pytest.mark.parametrize("load_async", [True, False])
def test_failed_transfers_handed_to_a_load_do_not_use_up_its_retries(
        workers: list[KvwireConnector], load_async: bool) -> None:
    """Four sends of a name fail mid-way before any request claims them (a prefill retried
    again and again), then one arrives whole: the load is handed each failed one in turn,
    and then loads the good one (its deadline bounds it), instead of giving up after three
    and leaving the good transfer on the server."""
    cons, ckv = consumer({"kvwire_load_timeout": 60, "kvwire_load_async": load_async})
    workers[:] = [cons]
    spec = cons._spec
    assert spec is not None
    name = "req-7#prompt:" + "ab" * 16
    src = caches(64, 7)

    def failed_arrivals() -> int:
        stats = cons.server_statistics()
        assert stats is not None
        return int(stats["failed_arrivals"])

    for i in range(4):
        with SyncPeer("127.0.0.1", cons.listen_port or 0, secret=SECRET.encode()) as peer:
            send = peer.begin(name, spec.wire_spec())
            send.send_layer(*layer_rows(spec, src[0], [1, 2]))
            deadline = time.monotonic() + 30
            while pending(cons) < i + 1 and time.monotonic() < deadline:
                threading.Event().wait(0.02)
            send.abort()
            while failed_arrivals() < i + 1 and time.monotonic() < deadline:
                threading.Event().wait(0.02)
    with SyncPeer("127.0.0.1", cons.listen_port or 0, secret=SECRET.encode()) as peer:
        peer.send(name, spec.wire_spec(), PagedSource(spec, src, [1, 2]), timeout=60)
    assert pending(cons) == 5 and failed_arrivals() == 4
    got, errors = consume(cons, KvwireConnectorMetadata(loads=[_Move("decode-1", name, [10, 11])]))
    deadline = time.monotonic() + 60
    while load_async and not got and time.monotonic() < deadline:
        g, e = consume(cons)
        got |= g
        errors |= e
        threading.Event().wait(0.05)
    assert got == ({"decode-1"} if load_async else set()) and not errors
    assert same(ckv, [10, 11], src, [1, 2])
    assert pending(cons) == 0
