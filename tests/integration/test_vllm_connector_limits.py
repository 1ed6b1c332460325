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
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvwire.errors import UsageError

with warnings.catch_warnings():  # vLLM's import chain trips torch's own deprecation warnings
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvwire.integrations.vllm import KvwireConnector, KvwireConnectorMetadata, _Move

pytestmark = pytest.mark.timeout(180)

SECRET = "connector-test-secret"
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]


def config(role: str, extra: dict[str, Any]) -> VllmConfig:
    return VllmConfig(
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvwireConnector", kv_connector_module_path="kvwire.integrations.vllm",
            kv_role=role, kv_connector_extra_config={"kvwire_secret": SECRET, **extra}),
        cache_config=CacheConfig(block_size=16))


def caches(num_blocks: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn((num_blocks, 2, 16, 64), generator=gen) for _ in LAYERS]


def consumer(extra: dict[str, Any] | None = None, num_blocks: int = 64) -> tuple[KvwireConnector, list[torch.Tensor]]:
    kv = caches(num_blocks, 0)
    worker = KvwireConnector(config("kv_consumer", {"kvwire_listen": "127.0.0.1:0", **(extra or {})}),
                             KVConnectorRole.WORKER)
    worker.register_kv_caches(dict(zip(LAYERS, kv, strict=True)))
    return worker, kv


def producer(port: int, extra: dict[str, Any] | None = None,
             num_blocks: int = 64) -> tuple[KvwireConnector, list[torch.Tensor]]:
    kv = caches(num_blocks, 1)
    worker = KvwireConnector(config("kv_producer", {"kvwire_peer": f"127.0.0.1:{port}", **(extra or {})}),
                             KVConnectorRole.WORKER)
    worker.register_kv_caches(dict(zip(LAYERS, kv, strict=True)))
    for _ in range(600):  # its connection is made on kvwire's loop
        worker._poll_connect()
        if worker._peer is not None:
            break
        threading.Event().wait(0.05)
    assert worker._peer is not None, worker._connect_error
    return worker, kv


@pytest.fixture
def workers() -> Iterator[list[KvwireConnector]]:
    """Connectors to shut down at the end of the test (producers first)."""
    made: list[KvwireConnector] = []
    yield made
    for worker in made:
        worker.shutdown()


def produce(worker: KvwireConnector, meta: KvwireConnectorMetadata, kv: list[torch.Tensor] | None,
            finished: set[str] | None = None) -> set[str]:
    """One producer step: the metadata bound, each layer saved, wait_for_save, get_finished
    (the requests whose send ended)."""
    worker.bind_connector_metadata(meta)
    if kv is not None:
        for name, cache in zip(LAYERS, kv, strict=True):
            worker.save_kv_layer(name, cache, None)
    worker.wait_for_save()
    sent, _ = worker.get_finished(finished or set())
    worker.clear_connector_metadata()
    return sent or set()


def consume(worker: KvwireConnector, meta: KvwireConnectorMetadata | None = None,
            finished: set[str] | None = None) -> tuple[set[str], set[int]]:
    """One consumer step (async load): the loads it starts, get_finished (the requests
    whose load ended) and the blocks that failed to load."""
    worker.bind_connector_metadata(meta or KvwireConnectorMetadata())
    worker.start_load_kv(None)
    for name in LAYERS:
        worker.wait_for_layer_load(name)
    _, recving = worker.get_finished(finished or set())
    errors = worker.get_block_ids_with_load_errors()
    worker.clear_connector_metadata()
    return recving or set(), errors


def same(kv_a: list[torch.Tensor], a: list[int], kv_b: list[torch.Tensor], b: list[int]) -> bool:
    return all(torch.equal(x[a], y[b]) for x, y in zip(kv_a, kv_b, strict=True))


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
    assert not prod._queued and not prod._in_flight


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

