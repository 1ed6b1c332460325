"""The vLLM connector under many requests at once and with transfers nobody loads: a
producer step that completes more prefills than the consumer's server takes at once
(``max_transfers``), the consumer's ``kvwire_max_transfers``, transfers of requests the
consumer finished before their load was scheduled or never loads, a load whose first
transfer of its name had failed, and the settings' checks.  The worker-side connectors
are driven step by step, as vLLM's worker drives them, over real sockets on 127.0.0.1.
"""

from __future__ import annotations

import threading
import time
import uuid
import warnings
from typing import Any

import pytest
import torch

from kvwire.errors import UsageError
from kvwire.paged import DROP, PagedSource, layer_rows
from kvwire.sync import SyncPeer
from tests.integration.vllm_workers import (
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
    from vllm.v1.core.sched.output import SchedulerOutput

    from kvwire.integrations.vllm import KvwireConnector, KvwireConnectorMetadata, _Move, _SendState

pytestmark = pytest.mark.timeout(180)


# -- more sends than the consumer's server takes at once ------------------------------------


@pytest.mark.parametrize("async_save", [True, False])
def test_a_step_with_more_sends_than_the_server_takes_sends_them_all(
        workers: list[KvwireConnector], async_save: bool) -> None:
    """A producer step completing 80 prefills, the consumer's server taking 64 transfers of
    a session at once: the sends past 64 wait their turn (begun as earlier ones end) instead
    of failing at once with LimitExceededError, and every load gets its KV."""
    n = 80
    cons, ckv = consumer({"kvwire_load_timeout": 60}, num_blocks=2 * n + 8)
    prod, pkv = producer(cons.listen_port or 0, {"kvwire_load_timeout": 60, "kvwire_async_save": async_save},
                         num_blocks=2 * n + 8)
    workers[:] = [prod, cons]
    names = [f"r{i}#prompt:{i:032x}" for i in range(n)]
    loads = [_Move(f"r{i}", names[i], [2 * i, 2 * i + 1]) for i in range(n)]
    saves = [_Move(f"r{i}", names[i], [2 * i + 1, 2 * i]) for i in range(n)]
    got, errors = consume(cons, KvwireConnectorMetadata(loads=loads))
    # (without the async save each step's sends ended in its wait_for_save: none is reported)
    sent = produce(prod, KvwireConnectorMetadata(saves=saves), pkv, {m.req_id for m in saves})
    want = {m.req_id for m in saves} if async_save else set()
    deadline = time.monotonic() + 120
    while (len(got) < n or sent != want) and not errors and time.monotonic() < deadline:
        g, e = consume(cons)
        got |= g
        errors |= e
        sent |= produce(prod, KvwireConnectorMetadata(), None)
        threading.Event().wait(0.02)
    assert not errors, f"{len({b // 2 for b in errors})} loads failed"
    assert got == {m.req_id for m in loads}
    assert sent == want
    assert all(same(ckv, [2 * i, 2 * i + 1], pkv, [2 * i + 1, 2 * i]) for i in range(n))
    assert not prod._sends_in(_SendState.QUEUED, _SendState.IN_FLIGHT)


def test_kvwire_max_transfers_is_the_consumer_servers_limit(workers: list[KvwireConnector]) -> None:
    """``kvwire_max_transfers`` is the consumer's server's max_transfers; a producer learns
    it at the handshake and keeps no more sends open at once (the rest wait their turn)."""
    n = 10
    cons, ckv = consumer({"kvwire_max_transfers": 3, "kvwire_load_timeout": 60})
    prod, pkv = producer(cons.listen_port or 0, {"kvwire_load_timeout": 60})
    workers[:] = [prod, cons]
    assert cons._server is not None and cons._server.server.options.max_transfers == 3
    assert prod._send_limit() == 3
    names = [f"m{i}#prompt:{i:032x}" for i in range(n)]
    got, errors = consume(cons, KvwireConnectorMetadata(loads=[_Move(f"m{i}", names[i], [i]) for i in range(n)]))
    produce(prod, KvwireConnectorMetadata(saves=[_Move(f"m{i}", names[i], [20 + i]) for i in range(n)]), pkv)
    deadline = time.monotonic() + 120
    while len(got) < n and not errors and time.monotonic() < deadline:
        g, e = consume(cons)
        got |= g
        errors |= e
        produce(prod, KvwireConnectorMetadata(), None)
        threading.Event().wait(0.02)
    assert not errors and len(got) == n
    assert all(same(ckv, [i], pkv, [20 + i]) for i in range(n))


@pytest.mark.parametrize("value", [0, -1, "x", 2.5, True, 2**32])
def test_kvwire_max_transfers_is_checked(value: object) -> None:
    with pytest.raises(UsageError, match="kvwire_max_transfers"):
        KvwireConnector(config("kv_consumer", {"kvwire_max_transfers": value}), KVConnectorRole.SCHEDULER)


def test_kvwire_max_transfers_takes_a_whole_number_as_text() -> None:
    connector = KvwireConnector(config("kv_consumer", {"kvwire_max_transfers": "256"}), KVConnectorRole.SCHEDULER)
    assert connector._max_transfers == 256


@pytest.mark.parametrize("value", [0, -1, "x", 2.5, True, 65536])
def test_kvwire_registry_max_connections_is_checked(value: object) -> None:
    with pytest.raises(UsageError, match="kvwire_registry_max_connections"):
        KvwireConnector(config("kv_consumer", {"kvwire_registry_max_connections": value}), KVConnectorRole.SCHEDULER)


@pytest.mark.parametrize(("setting", "size"), [({}, 100), ({"kvwire_registry_max_connections": 7}, 7),
                                               ({"kvwire_registry_max_connections": "3"}, 3)])
@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_kvwire_registry_max_connections_sizes_the_registrys_pool(
        redis_url: str, role: str, setting: dict[str, Any], size: int) -> None:
    """The connections the registry's calls share, on a real Redis: the setting (the URL's
    own max_connections giving way to it), unset the registry's default."""
    url = redis_url + "?max_connections=50"
    worker = KvwireConnector(config(role, {"kvwire_listen": "127.0.0.1:0", "kvwire_peer": "127.0.0.1:9",
                                           "kvwire_registry": url, "kvwire_registry_namespace": f"t-{uuid.uuid4().hex}",
                                           **setting}),
                             KVConnectorRole.WORKER)
    try:
        worker._connect_registry()
        assert worker._registry is not None
        assert worker._registry.registry.client.connection_pool.max_connections == size
        assert worker._registry.name([b"b" * 32], owner="test") != []  # (it answers)
    finally:
        worker.shutdown()


# -- transfers no request will load ------------------------------------------------------------


class _Request:
    """What the connector's scheduler side reads of a vLLM request."""

    def __init__(self, req_id: str, prompt: list[int], params: dict[str, Any] | None) -> None:
        self.request_id, self.prompt_token_ids, self.kv_transfer_params = req_id, prompt, params


@pytest.mark.parametrize("load_all", [False, True])
def test_a_request_finished_before_its_load_was_scheduled_has_its_transfer_dropped(load_all: bool) -> None:
    """A decode request aborted after get_num_new_matched_tokens, before vLLM allocated its
    blocks (or before the scheduler looked at it at all): the next step's metadata drops its
    transfer (every block DROP), which the producer sent all the same."""
    extra = {"kvwire_listen": "127.0.0.1:0", "kvwire_load_all": load_all}
    sched = KvwireConnector(config("kv_consumer", extra), KVConnectorRole.SCHEDULER)
    prompt = list(range(100))  # 6 full blocks of 16
    waited = _Request("d1", prompt, {"kvwire_id": "req-1"})
    never_looked_at = _Request("d2", prompt[:50], {"kvwire_id": "req-2"})
    plain = _Request("d3", prompt, None)  # loaded only with kvwire_load_all
    assert sched.get_num_new_matched_tokens(waited, 0) == (96, True)
    for request in (waited, never_looked_at, plain):
        assert sched.request_finished(request, []) == (False, None)
    out = SchedulerOutput.make_empty()
    out.finished_req_ids = {"d1", "d2", "d3"}
    meta = sched.build_connector_meta(out)
    assert isinstance(meta, KvwireConnectorMetadata) and not meta.loads
    want = [_Move("d1", sched._key(prompt, waited.kv_transfer_params), [DROP] * 6),
            _Move("d2", sched._key(prompt[:50], never_looked_at.kv_transfer_params), [DROP] * 3)]
    if load_all:
        want.append(_Move("d3", sched._key(prompt, None), [DROP] * 6))
    assert meta.drops == want
    assert not sched.build_connector_meta(SchedulerOutput.make_empty()).drops  # once


def test_a_request_loaded_or_dropped_already_schedules_no_second_drop() -> None:
    """A request whose load was scheduled is not dropped again when it finishes (the
    worker's get_finished gives its load up, and drops a transfer still to come)."""
    sched = KvwireConnector(config("kv_consumer", {"kvwire_listen": "127.0.0.1:0"}), KVConnectorRole.SCHEDULER)
    request = _Request("d1", list(range(100)), {"kvwire_id": "req-1"})
    sched.get_num_new_matched_tokens(request, 0)

    class _Blocks:
        def get_block_ids(self) -> tuple[list[int], ...]:
            return (list(range(10, 17)),)

    sched.update_state_after_alloc(request, _Blocks(), 96)  # type: ignore[arg-type]
    meta = sched.build_connector_meta(SchedulerOutput.make_empty())
    assert isinstance(meta, KvwireConnectorMetadata) and [m.req_id for m in meta.loads] == ["d1"]
    sched.request_finished(request, list(range(10, 17)))
    assert not sched.build_connector_meta(SchedulerOutput.make_empty()).drops


def test_a_transfer_later_than_its_given_up_load_is_still_dropped(workers: list[KvwireConnector]) -> None:
    """A load given up (not in within kvwire_load_timeout) drops its transfer when it
    comes, also later than one more kvwire_load_timeout: the drop waits as long as the
    server would keep the transfer (kvwire_claim_timeout)."""
    cons, _ = consumer({"kvwire_load_timeout": 0.5})
    workers[:] = [cons]
    assert cons._spec is not None
    name = "late#prompt:" + "cd" * 16
    got, errors = consume(cons, KvwireConnectorMetadata(loads=[_Move("late", name, [10, 11])]))
    deadline = time.monotonic() + 60
    while not got and time.monotonic() < deadline:
        g, e = consume(cons)
        got |= g
        errors |= e
        threading.Event().wait(0.05)
    assert got == {"late"} and errors == {10, 11}  # timed out: recomputed
    threading.Event().wait(2.0)  # past one more kvwire_load_timeout after it gave up
    src = caches(64, 7)
    with SyncPeer("127.0.0.1", cons.listen_port or 0, secret=SECRET.encode()) as peer:
        peer.send(name, cons._spec.wire_spec(), PagedSource(cons._spec, src, [1, 2]), timeout=60)
    assert until(lambda: pending(cons) == 0 and not cons._dropping, cons), "the late transfer was not dropped"


def test_transfers_named_without_an_id_do_not_fill_the_producers_session(workers: list[KvwireConnector]) -> None:
    """A producer sends every request's KV, those without a kvwire_id too, which a
    consumer without kvwire_load_all never loads: it drops them as they come, so they do
    not hold the producer's session's slots (64) until kvwire_claim_timeout and a request
    the consumer does load still gets its KV."""
    cons, ckv = consumer({"kvwire_load_timeout": 30})
    prod, pkv = producer(cons.listen_port or 0, {"kvwire_load_timeout": 30})
    workers[:] = [prod, cons]
    n = 64
    ended: set[str] = set()
    for i in range(n):
        ended |= produce(prod, KvwireConnectorMetadata(saves=[_Move(f"plain{i}", f"prompt:{i:032x}", [i % 60])]),
                         pkv, {f"plain{i}"})
    deadline = time.monotonic() + 60
    while len(ended) < n and time.monotonic() < deadline:
        ended |= produce(prod, KvwireConnectorMetadata(), None)
        threading.Event().wait(0.05)
    assert len(ended) == n
    assert until(lambda: pending(cons) == 0, cons), "the transfers no request loads stay on the server"
    name = "wanted#prompt:" + "ef" * 16
    got, errors = consume(cons, KvwireConnectorMetadata(loads=[_Move("wanted", name, [10, 11])]))
    produce(prod, KvwireConnectorMetadata(saves=[_Move("wanted", name, [3, 4])]), pkv)
    deadline = time.monotonic() + 60
    while not got and time.monotonic() < deadline:
        g, e = consume(cons)
        got |= g
        errors |= e
        produce(prod, KvwireConnectorMetadata(), None)
        threading.Event().wait(0.05)
    assert got == {"wanted"} and not errors
    assert same(ckv, [10, 11], pkv, [3, 4])


def test_a_consumer_with_load_all_keeps_transfers_named_without_an_id(workers: list[KvwireConnector]) -> None:
    """With kvwire_load_all such a transfer is a request's to load: it waits for it."""
    cons, ckv = consumer({"kvwire_load_all": True, "kvwire_load_timeout": 30})
    workers[:] = [cons]
    assert cons._spec is not None
    name = "prompt:" + "12" * 16
    src = caches(64, 7)
    with SyncPeer("127.0.0.1", cons.listen_port or 0, secret=SECRET.encode()) as peer:
        peer.send(name, cons._spec.wire_spec(), PagedSource(cons._spec, src, [1, 2]), timeout=60)
    for _ in range(3):  # steps, each of which would drop it without kvwire_load_all
        consume(cons)
    assert pending(cons) == 1 and not cons._dropping
    got, errors = consume(cons, KvwireConnectorMetadata(loads=[_Move("all", name, [10, 11])]))
    assert until(lambda: bool(got.update(consume(cons)[0]) or got), cons)
    assert got == {"all"} and not errors and same(ckv, [10, 11], src, [1, 2])


def test_each_step_drops_the_transfers_named_without_an_id_that_arrived(workers: list[KvwireConnector]) -> None:
    """Without kvwire_load_all the worker looks once per step (get_finished, which asks
    kvwire's loop without waiting and drops at the next step what it listed): each arrived
    transfer named without a kvwire_id gets one drop, whatever its number of blocks and
    however many share its name, one that failed before it was claimed too; nothing of
    them is written into the caches, and a step does not drop a transfer twice."""
    cons, ckv = consumer({"kvwire_load_timeout": 30})
    workers[:] = [cons]
    spec = cons._spec
    assert spec is not None
    before = [c.clone() for c in ckv]
    src = caches(64, 7)
    twice, other, failed = ("prompt:" + d * 16 for d in ("ab", "cd", "0f"))
    with SyncPeer("127.0.0.1", cons.listen_port or 0, secret=SECRET.encode()) as peer:
        peer.send(twice, spec.wire_spec(), PagedSource(spec, src, [1, 2]), timeout=60)
        peer.send(twice, spec.wire_spec(), PagedSource(spec, src, [3, 4, 5]), timeout=60)
        peer.send(other, spec.wire_spec(), PagedSource(spec, src, [6]), timeout=60)
        send = peer.begin(failed, spec.wire_spec())
        send.send_layer(*layer_rows(spec, src[0], [7, 8]))
        deadline = time.monotonic() + 30
        while pending(cons) < 4 and time.monotonic() < deadline:  # (no step: nothing is dropped)
            threading.Event().wait(0.05)
        send.abort()
        while cons.server_statistics()["failed_arrivals"] < 1 and time.monotonic() < deadline:  # type: ignore[index]
            threading.Event().wait(0.05)
    assert pending(cons) == 4 and not cons._dropping
    consume(cons)  # one step asks kvwire's loop which arrived, without waiting
    assert cons._sweep_ask is not None
    cons._sweep_ask[0].result(30)
    consume(cons)  # the next drops each of those
    assert cons._swept == 4 and sorted(d.handle.request_id for d in cons._dropping.values()) == sorted(
        [twice, twice, other, failed])
    handles = [d.handle for d in cons._dropping.values()]
    assert until(lambda: pending(cons) == 0 and not cons._dropping, cons), "the transfers were not dropped"
    assert cons._swept == 4  # (steps meanwhile began no second drop)
    assert sum(h.done for h in handles) == 3 and sum(h.error is not None for h in handles) == 1
    assert all(torch.equal(a, b) for a, b in zip(before, ckv, strict=True))
    assert cons.server_statistics()["transfers_unclaimed"] == 0  # type: ignore[index]


def test_a_step_counts_the_drops_of_a_name_not_yet_handed_their_transfer(workers: list[KvwireConnector]) -> None:
    """A drop begun that may not have been handed its transfer yet takes one arrival of
    its name: the step begins a drop only for each arrival beyond those (two arrived, one
    drop begun: the step begins one, whether or not that drop took its transfer yet)."""
    cons, _ = consumer({"kvwire_load_timeout": 30})
    workers[:] = [cons]
    spec = cons._spec
    assert spec is not None
    name = "prompt:" + "5a" * 16
    src = caches(64, 7)
    with SyncPeer("127.0.0.1", cons.listen_port or 0, secret=SECRET.encode()) as peer:
        for blocks in ([1], [2, 3]):
            peer.send(name, spec.wire_spec(), PagedSource(spec, src, blocks), timeout=60)
    assert pending(cons) == 2
    cons._drop("begun", name, None)
    assert until(lambda: cons._swept >= 1, cons)  # ("begun" may have ended, and been let go of, already)
    assert cons._swept == 1
    assert until(lambda: pending(cons) == 0 and not cons._dropping, cons), "not dropped"
    assert cons._swept == 1


# -- a load whose name's first transfer had failed ---------------------------------------------


def failed_then_whole(worker: KvwireConnector, name: str, src: list[torch.Tensor]) -> None:
    """A send of ``name`` that fails mid-way (one layer, then aborted) before any request
    claimed it, then a retried prefill's send of that name, arrived whole."""
    spec = worker._spec
    assert spec is not None
    with SyncPeer("127.0.0.1", worker.listen_port or 0, secret=SECRET.encode()) as first:
        send = first.begin(name, spec.wire_spec())
        send.send_layer(*layer_rows(spec, src[0], [1, 2]))
        assert until(lambda: pending(worker) == 1, worker, 30)
        send.abort()
        assert until(lambda: worker.server_statistics()["failed_arrivals"] == 1, worker, 30)  # type: ignore[index]
    with SyncPeer("127.0.0.1", worker.listen_port or 0, secret=SECRET.encode()) as second:
        second.send(name, spec.wire_spec(), PagedSource(spec, src, [1, 2]), timeout=60)
    assert pending(worker) == 2


@pytest.mark.parametrize("load_async", [True, False])
def test_a_load_takes_the_good_transfer_after_a_failed_one_of_its_name(
        workers: list[KvwireConnector], load_async: bool) -> None:
    """The decode request's load is handed the failed transfer first (oldest first); as
    nothing of it was written into the blocks, the load expects the name again and loads
    the good one, instead of recomputing its blocks and leaving the good transfer on the
    server until kvwire_claim_timeout."""
    cons, ckv = consumer({"kvwire_load_timeout": 60, "kvwire_load_async": load_async})
    workers[:] = [cons]
    name = "req-42#prompt:" + "ab" * 16
    src = caches(64, 7)
    failed_then_whole(cons, name, src)
    got, errors = consume(cons, KvwireConnectorMetadata(loads=[_Move("decode-1", name, [10, 11])]))
    if load_async:
        deadline = time.monotonic() + 60
        while not got and not errors and time.monotonic() < deadline:
            g, e = consume(cons)
            got |= g
            errors |= e
            threading.Event().wait(0.05)
        assert got == {"decode-1"}
    assert not errors
    assert not cons._loading
    assert same(ckv, [10, 11], src, [1, 2])
    assert pending(cons) == 0


# -- the settings' keys ------------------------------------------------------------------------------


@pytest.mark.parametrize(("key", "meant"), [
    ("kvwire_load_timout", "kvwire_load_timeout"),
    ("kvwire_load_asynch", "kvwire_load_async"),
    ("kvwire_claim_timeout_s", "kvwire_claim_timeout"),
    ("kvwire_codecs", "kvwire_codec"),
    ("kvwire_peers", "kvwire_peer"),
    ("kvwire_zzz", None),
])
@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_an_unknown_kvwire_setting_is_refused(key: str, meant: str | None, role: str) -> None:
    """A misspelled kvwire_* key is a UsageError naming it (and the setting it may mean),
    on the scheduler and the worker, not a setting silently left at its default."""
    for side in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(UsageError, match=f"unknown setting '{key}'") as caught:
            KvwireConnector(config(role, {key: 5}), side)
        if meant is None:
            assert "did you mean" not in str(caught.value)
        else:
            assert f"did you mean '{meant}'" in str(caught.value)


def test_keys_not_kvwire_settings_are_left_alone() -> None:
    """Keys without the kvwire_ prefix may be vLLM's or another connector's."""
    connector = KvwireConnector(config("kv_consumer", {"shared_storage_path": "/tmp/x", "kvwire_load_timeout": 5,
                                                       "kvwire_max_transfers": 8, "kvwire_registry_ttl": 10}),
                                KVConnectorRole.SCHEDULER)
    assert connector._timeout == 5
