"""The vLLM connector's two sides as the connector tests make and step them: a producer's
scheduler and worker sides (32 KiB blocks), a consumer's worker side, synchronous or
loading asynchronously, and the engine steps that poll them until sends or loads end (the
secret, layers, config and connection wait are vllm_workers.py's)."""

from __future__ import annotations

import threading
import warnings

import torch

from kvwire.paged import PagedSpec

with warnings.catch_warnings():  # vLLM's import chain trips torch's own deprecation warnings
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvwire.integrations.vllm import KvwireConnector, KvwireConnectorMetadata
    from tests.integration.vllm_workers import LAYERS, config, wait_connected


def producer(port: int, load_timeout: float, async_save: bool = True,
             connected: bool = True) -> tuple[KvwireConnector, KvwireConnector, list[torch.Tensor]]:
    """The scheduler-side and worker-side connectors of a producer, the worker's caches
    registered (and, with ``connected``, its connection to the consumer up: it is made on
    kvwire's loop, and a step's saves that find none end unsent)."""
    cfg = config("kv_producer", {"kvwire_peer": f"127.0.0.1:{port}", "kvwire_load_timeout": load_timeout,
                                 "kvwire_async_save": async_save})
    scheduler = KvwireConnector(cfg, KVConnectorRole.SCHEDULER)
    worker = KvwireConnector(cfg, KVConnectorRole.WORKER)
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn((300, 2, 16, 256), generator=gen) for _ in LAYERS]  # 32 KiB blocks
    worker.register_kv_caches(dict(zip(LAYERS, caches, strict=True)))
    if connected:
        wait_connected(worker)
    return scheduler, worker, caches


def step(worker: KvwireConnector, meta: KvwireConnectorMetadata, caches: list[torch.Tensor] | None) -> None:
    """One engine step: the metadata bound, the forward (each layer saved), wait_for_save."""
    worker.bind_connector_metadata(meta)
    if caches is not None:
        for name, cache in zip(LAYERS, caches, strict=True):
            worker.save_kv_layer(name, cache, None)
    worker.wait_for_save()
    worker.clear_connector_metadata()


def finished_sends(worker: KvwireConnector, want: int = 1) -> set[str]:
    """What ``get_finished`` reports as sends ended, polled (each after an empty step,
    as vLLM runs while it holds a finished request's blocks) until at least ``want``
    requests, at most 30 s."""
    finished: set[str] = set()
    for _ in range(600):
        step(worker, KvwireConnectorMetadata(), None)  # a step with no forward, as vLLM runs
        done, _ = worker.get_finished(set())
        finished |= done or set()
        if len(finished) >= want:
            break
        threading.Event().wait(0.05)
    return finished


def consumer_worker(caches: list[torch.Tensor], load_timeout: float = 30,
                    load_async: bool = False) -> tuple[KvwireConnector, PagedSpec]:
    """A consumer's worker-side connector with ``caches`` registered (its server listening),
    loading asynchronously with ``load_async``."""
    cfg = config("kv_consumer", {"kvwire_listen": "127.0.0.1:0", "kvwire_load_timeout": load_timeout,
                                 "kvwire_load_async": load_async})
    worker = KvwireConnector(cfg, KVConnectorRole.WORKER)
    worker.register_kv_caches(dict(zip(LAYERS, caches, strict=True)))
    assert worker.listen_port is not None and worker._spec is not None
    return worker, worker._spec  # its layout, as a producer of the same vLLM and model has it


def drops_ended(worker: KvwireConnector) -> None:
    """Step the worker (get_finished) until its drops were let go of, at most 10 s."""
    for _ in range(200):
        worker.get_finished(set())
        if not worker._dropping:
            return
        threading.Event().wait(0.05)


def consumer_step(worker: KvwireConnector, meta: KvwireConnectorMetadata | None = None,
                  finished: set[str] | None = None) -> tuple[set[str], set[int]]:
    """One engine step of a consumer, as vLLM's model runner drives it when the step has no
    load to wait for: the metadata bound, the forward (each layer's wait_for_layer_load),
    the step's loads started after it; what get_finished reports received
    (finished_recving) and the blocks reported as load errors."""
    worker.bind_connector_metadata(meta or KvwireConnectorMetadata())
    for name in LAYERS:
        worker.wait_for_layer_load(name)
    worker.start_load_kv(None)  # type: ignore[arg-type]
    _, recving = worker.get_finished(finished or set())
    errors = worker.get_block_ids_with_load_errors()
    worker.clear_connector_metadata()
    return recving or set(), errors


def until_received(worker: KvwireConnector, want: int = 1,
                   meta: KvwireConnectorMetadata | None = None) -> tuple[set[str], set[int]]:
    """Consumer steps, the first with ``meta``, until get_finished reported ``want``
    requests received, at most 30 s: those requests and the blocks reported as load
    errors meanwhile (a load whose transfer had arrived may be reported by the step that
    starts it)."""
    got: set[str] = set()
    errors: set[int] = set()
    for _ in range(600):
        received, failed = consumer_step(worker, meta)
        meta = None
        got |= received
        errors |= failed
        if len(got) >= want:
            break
        threading.Event().wait(0.05)
    return got, errors


def async_consumer(seed: int, load_timeout: float = 30) -> tuple[KvwireConnector, PagedSpec, list[torch.Tensor],
                                                                  list[torch.Tensor], list[torch.Tensor]]:
    """A consumer worker loading asynchronously: it, its layout, its caches, a copy of them
    as they were, and a producer's caches to send from."""
    gen = torch.Generator().manual_seed(seed)
    caches = [torch.randn((16, 2, 16, 64), generator=gen) for _ in LAYERS]
    src = [torch.randn((16, 2, 16, 64), generator=gen) for _ in LAYERS]
    worker, spec = consumer_worker(caches, load_timeout=load_timeout, load_async=True)
    return worker, spec, caches, [c.clone() for c in caches], src
