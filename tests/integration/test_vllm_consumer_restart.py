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

from tests.integration.test_vllm_connector import LAYERS, SECRET, finished_sends, producer, step

with warnings.catch_warnings():  # vLLM's import chain trips torch's own deprecation warnings
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvwire.integrations.vllm import KvwireConnector, KvwireConnectorMetadata, _Move

pytestmark = pytest.mark.timeout(120)


def consumer_on(port: int, caches: list[torch.Tensor]) -> KvwireConnector:
    """A consumer's worker (synchronous load, 10 s load timeout) listening on ``port``."""
    cfg = VllmConfig(
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvwireConnector", kv_connector_module_path="kvwire.integrations.vllm", kv_role="kv_consumer",
            kv_connector_extra_config={"kvwire_secret": SECRET, "kvwire_listen": f"127.0.0.1:{port}",
                                       "kvwire_load_timeout": 10, "kvwire_load_async": False},
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
