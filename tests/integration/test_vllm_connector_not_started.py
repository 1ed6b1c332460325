"""The vLLM connector's producer against a consumer whose buffer budget is full: the
consumer's server holds the ACCEPT of a send while its ``max_buffer_bytes`` has no room for
the transfer's first layer (docs/protocol.md 7.1), and a send that ends so, never started,
is logged as such (with what to raise), with how long it waited.  The worker-side
connector is driven step by step, as vLLM's worker drives it, over real sockets on
127.0.0.1 (helpers from tests/integration/vllm_workers.py)."""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator

import numpy as np
import pytest
import torch

import kvwire
from kvwire.sync import SyncServer
from tests.integration.vllm_workers import SECRET, produce, producer

with warnings.catch_warnings():  # vLLM's import chain trips torch's own deprecation warnings
    warnings.simplefilter("ignore", DeprecationWarning)
    from kvwire.integrations.vllm import KvwireConnector, KvwireConnectorMetadata, _Move

pytestmark = pytest.mark.timeout(180)

#: One layer of another layout, 192 KiB: sent whole on the producer's session and left
#: unclaimed, it takes most of the budget below, and the session's next first layers are
#: admitted at its size (the server's estimate of a first layer before it arrives is from
#: those the session sent): no room for one.
FILL_SPEC = kvwire.KVSpec(num_layers=1, num_kv_heads=8, head_dim=64, dtype="float32")
BUDGET = 256 * 1024


@pytest.fixture
def server() -> Iterator[SyncServer]:
    """A plain kvwire server with a small buffer budget (closed after the connectors of
    ``workers``, requested after this)."""
    with SyncServer("127.0.0.1", 0, secret=SECRET.encode(), max_buffer_bytes=BUDGET, claim_timeout=None) as srv:
        yield srv


def failed_send_line(prod: KvwireConnector, pkv: list[torch.Tensor], async_save: bool,
                     caplog: pytest.LogCaptureFixture) -> str:
    """Request B's send, one producer step (then, with the async save, steps until the
    connector gives up on it): the one log line saying that it failed."""
    meta = KvwireConnectorMetadata(saves=[_Move("B", f"B#prompt:{2:032x}", [2, 3])])
    reported = produce(prod, meta, pkv, {"B"})
    for _ in range(600):  # (with the async save a later step gives up on it)
        if reported == {"B"} or not async_save:
            break
        reported |= produce(prod, KvwireConnectorMetadata(), None)
        time.sleep(0.05)
    failed = [r.getMessage() for r in caplog.records if "sending KV of request B failed" in r.getMessage()]
    assert len(failed) == 1, failed
    return failed[0]


@pytest.mark.parametrize("async_save", [True, False])
def test_a_send_the_consumers_budget_never_took_is_logged_as_not_started(
        server: SyncServer, workers: list[KvwireConnector], caplog: pytest.LogCaptureFixture,
        async_save: bool) -> None:
    """The step's send waits for its ACCEPT past kvwire_load_timeout (1 s): its failure
    names the consumer's buffer budget and the settings to raise, and says how long it
    waited (not "after 0 s", the async save's look at a send past its time)."""
    prod, pkv = producer(server.port, {"kvwire_load_timeout": 1, "kvwire_async_save": async_save})
    workers.append(prod)
    assert prod._peer is not None
    k = np.ones((48, 8, 64), np.float32)
    prod._peer.send("filler", FILL_SPEC, [(k, k)], timeout=30)
    text = failed_send_line(prod, pkv, async_save, caplog)
    assert "not started after " in text and "has not accepted it" in text, text
    assert "buffer budget" in text and "max_buffer_bytes" in text and "kvwire_load_timeout (1 s)" in text, text
    assert "after 0 s" not in text, text


@pytest.mark.parametrize("async_save", [True, False])
def test_a_send_held_for_credit_by_the_consumers_budget_is_logged_with_the_layers_granted(
        server: SyncServer, workers: list[KvwireConnector], caplog: pytest.LogCaptureFixture,
        async_save: bool) -> None:
    """The step's send is accepted, but its layers (a 64 KiB slab each in a budget of 256
    KiB, an eighth kept for first layers) arrive and are held unread: the server grants 3
    and holds the rest past kvwire_load_timeout (1 s).  Its failure says how many layers
    were granted and names the consumer's buffer budget and the settings to raise."""
    prod, pkv = producer(server.port, {"kvwire_load_timeout": 1, "kvwire_async_save": async_save})
    workers.append(prod)
    text = failed_send_line(prod, pkv, async_save, caplog)
    assert "not acknowledged after " in text and f"has granted 3 of its {len(pkv)} layers" in text, text
    assert "buffer budget has no room" in text and "max_buffer_bytes" in text, text
    assert "kvwire_load_timeout (1 s)" in text and "after 0 s" not in text, text
