"""Worker-side vLLM connectors over real sockets on 127.0.0.1, driven step by step as vLLM's
worker drives them: a consumer and producers made from one config, one producer or consumer
step, and the checks the connector tests share; the test secret, the layers, the config and
the wait for a producer's connection are these, vllm_steps.py's too (the ``workers``
fixture that shuts them down is in conftest.py)."""

from __future__ import annotations

import threading
import time
import warnings
from typing import Any

import torch

with warnings.catch_warnings():  # vLLM's import chain trips torch's own deprecation warnings
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvwire.integrations.vllm import KvwireConnector, KvwireConnectorMetadata


SECRET = "connector-test-secret"
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]


def config(role: str, extra: dict[str, Any], **more: Any) -> VllmConfig:
    """A config of the connector in ``role`` (16-token blocks), with SECRET and ``extra``
    as its kv_connector_extra_config, and ``more`` of VllmConfig's fields (a
    parallel_config)."""
    return VllmConfig(
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvwireConnector", kv_connector_module_path="kvwire.integrations.vllm",
            kv_role=role, kv_connector_extra_config={"kvwire_secret": SECRET, **extra}),
        cache_config=CacheConfig(block_size=16), **more)


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
    wait_connected(worker)
    return worker, kv


def wait_connected(worker: KvwireConnector) -> None:
    """Until the worker's connection (made on kvwire's loop) is up, at most 30 s."""
    for _ in range(600):
        worker._poll_connect()
        if worker._peer is not None:
            return
        threading.Event().wait(0.05)
    raise AssertionError(f"not connected: {worker._connect_error}")


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


def pending(worker: KvwireConnector) -> int:
    stats = worker.server_statistics()
    assert stats is not None
    return int(stats["pending_arrivals"])


def until(what: Any, worker: KvwireConnector, seconds: float = 60.0) -> bool:
    """Step the consumer until ``what()`` holds, at most ``seconds``."""
    deadline = time.monotonic() + seconds
    while not what():
        if time.monotonic() >= deadline:
            return False
        consume(worker)
        threading.Event().wait(0.05)
    return True
