"""The vLLM connector's producer after the consumer restarted: the session it held ended
(the consumer's server went away), and the first request after the consumer is back is
sent on a new session, not begun on the ended one (where it was lost and the consumer
waited its whole load timeout for it)."""

from __future__ import annotations

import logging
import threading
import warnings

import pytest
import torch

from tests.integration.vllm_steps import finished_sends, producer, step
from tests.integration.vllm_workers import LAYERS, SECRET

with warnings.catch_warnings():  # vLLM's import chain trips torch's own deprecation warnings
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvwire.integrations.vllm import KvwireConnector, KvwireConnectorMetadata, _Move, _SendState

pytestmark = pytest.mark.timeout(120)


def consumer_on(port: int, caches: list[torch.Tensor], max_transfers: int | None = None) -> KvwireConnector:
    """A consumer's worker (synchronous load, 10 s load timeout) listening on ``port``
    (its server taking ``max_transfers`` transfers at once, if given)."""
    extra: dict[str, object] = {"kvwire_secret": SECRET, "kvwire_listen": f"127.0.0.1:{port}",
                                "kvwire_load_timeout": 10, "kvwire_load_async": False}
    if max_transfers is not None:
        extra["kvwire_max_transfers"] = max_transfers
    cfg = VllmConfig(
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvwireConnector", kv_connector_module_path="kvwire.integrations.vllm", kv_role="kv_consumer",
            kv_connector_extra_config=extra,
        ),
        cache_config=CacheConfig(block_size=16),
    )
    worker = KvwireConnector(cfg, KVConnectorRole.WORKER)
    worker.register_kv_caches(dict(zip(LAYERS, caches, strict=True)))
    return worker


def session_ended(worker: KvwireConnector) -> None:
    """Until the producer's session is seen ended (its ``broken`` set), at most 30 s."""
    for _ in range(600):
        if worker._peer is not None and worker._peer.broken is not None:
            return
        threading.Event().wait(0.05)
    raise AssertionError("the producer's session did not end")


@pytest.mark.parametrize("async_save", [True, False])
def test_the_first_request_after_the_consumer_restarted_is_sent_on_a_new_session(
        async_save: bool, caplog: pytest.LogCaptureFixture) -> None:
    """The consumer's server goes away with the producer idle, and a new one listens on
    its port: the producer's next request is sent on a new session (logged once, at
    WARNING, with the cause), loaded whole by the new consumer, well within its load
    timeout (with the async save once the connection is up, as the engine steps on);
    the request after it goes on that session too."""
    caches = [torch.zeros((300, 2, 16, 256)) for _ in LAYERS]
    first = consumer_on(0, caches)
    port = first.listen_port
    assert port is not None
    _, pw, pcaches = producer(port, load_timeout=30, async_save=async_save)
    second: KvwireConnector | None = None
    try:
        first.shutdown()
        session_ended(pw)
        second = consumer_on(port, caches)
        with caplog.at_level(logging.WARNING, logger="vllm.kvwire"):
            for i, (blocks, into) in enumerate((([3, 4], [1, 2]), ([5], [7]))):
                second.bind_connector_metadata(KvwireConnectorMetadata(loads=[_Move(f"r{i}", f"k{i}", into)]))
                second.start_load_kv(None)  # type: ignore[arg-type]
                step(pw, KvwireConnectorMetadata(saves=[_Move(f"r{i}", f"k{i}", blocks)]), pcaches)
                if async_save:  # the producer's engine steps on while it holds the finished request's blocks
                    assert pw.get_finished({f"r{i}"}) == (None, None)
                    assert finished_sends(pw) == {f"r{i}"}
                for name in LAYERS:
                    second.wait_for_layer_load(name)
                assert second.get_block_ids_with_load_errors() == set()
                assert not second._loading
                second.clear_connector_metadata()
                for layer, cache in enumerate(caches):
                    for src, dst in zip(blocks, into, strict=True):
                        assert torch.equal(cache[dst], pcaches[layer][src])
        renewed = [r for r in caplog.records if "session with the consumer" in r.getMessage()]
        assert len(renewed) == 1 and renewed[0].levelno == logging.WARNING
        assert "connecting again" in renewed[0].getMessage()
    finally:
        pw.shutdown()
        if second is not None:
            second.shutdown()


def restart_mid_step(async_save: bool, caches: list[torch.Tensor]
                     ) -> tuple[KvwireConnector, KvwireConnector, list[torch.Tensor]]:
    """A producer's step saves r0 (blocks [3]) and r1 ([5]) to a consumer taking one
    transfer at once (r1 waits its turn, queued), and the consumer restarts after the
    step's first layer: the rest of the step runs on the ended session.  The producer's
    worker, the new consumer's, and the producer's caches."""
    first = consumer_on(0, caches, max_transfers=1)
    port = first.listen_port
    assert port is not None
    _, pw, pcaches = producer(port, load_timeout=10, async_save=async_save)
    pw.bind_connector_metadata(KvwireConnectorMetadata(saves=[_Move("r0", "k0", [3]), _Move("r1", "k1", [5])]))
    pw.save_kv_layer(LAYERS[0], pcaches[0], None)
    assert pw._sends["r1"].state is _SendState.QUEUED
    first.shutdown()
    session_ended(pw)
    second = consumer_on(port, caches, max_transfers=1)
    for name, cache in zip(LAYERS[1:], pcaches[1:], strict=True):
        pw.save_kv_layer(name, cache, None)
    pw.wait_for_save()
    pw.clear_connector_metadata()
    return pw, second, pcaches


def test_with_the_sync_save_a_send_queued_when_the_session_ended_mid_step_ends_unsent() -> None:
    """Synchronous save: a send waiting its turn when the session ended mid-step is not
    kept for the new connection past wait_for_save (vLLM frees its blocks then, and reuses
    them: one sent later from the caches carries another request's KV); it ends unsent,
    and the consumer's load of it fails (a load error), it is not loaded with the KV the
    block holds now."""
    caches = [torch.zeros((300, 2, 16, 256)) for _ in LAYERS]
    pw, second, pcaches = restart_mid_step(False, caches)
    try:
        assert not pw._sends_in(_SendState.DEFERRED, _SendState.QUEUED, _SendState.REFUSED)
        assert pw.get_finished({"r0", "r1"}) == (None, None)  # vLLM frees blocks 3 and 5 now
        for cache in pcaches:
            cache[5].fill_(7.0)  # block 5 reused: another request's forward writes it
        second.bind_connector_metadata(KvwireConnectorMetadata(loads=[_Move("r1", "k1", [9])]))
        second.start_load_kv(None)  # type: ignore[arg-type]
        for _ in range(20):  # the engine steps on (no saves)
            step(pw, KvwireConnectorMetadata(), None)
            pw.get_finished(set())
            threading.Event().wait(0.05)
        for name in LAYERS:
            second.wait_for_layer_load(name)
        assert second.get_block_ids_with_load_errors() == {9}
        assert not any(bool(torch.any(cache[9] == 7.0)) for cache in caches)
    finally:
        pw.shutdown()
        second.shutdown()


def test_with_the_async_save_a_send_queued_when_the_session_ended_mid_step_is_sent_on_the_new_one() -> None:
    """Async save: the send begun on the ended session fails there, and the one waiting
    its turn waits for the new connection (the producer keeps its blocks): it is sent on
    it and loaded whole by the new consumer; both requests are reported finished sending
    once."""
    caches = [torch.zeros((300, 2, 16, 256)) for _ in LAYERS]
    pw, second, pcaches = restart_mid_step(True, caches)
    try:
        second.bind_connector_metadata(KvwireConnectorMetadata(loads=[_Move("r1", "k1", [9])]))
        second.start_load_kv(None)  # type: ignore[arg-type]
        reported = pw.get_finished({"r0", "r1"})[0] or set()
        reported |= finished_sends(pw, want=2 - len(reported))
        assert reported == {"r0", "r1"}
        for name in LAYERS:
            second.wait_for_layer_load(name)
        assert second.get_block_ids_with_load_errors() == set()
        for layer, cache in enumerate(caches):
            assert torch.equal(cache[9], pcaches[layer][5])
    finally:
        pw.shutdown()
        second.shutdown()
