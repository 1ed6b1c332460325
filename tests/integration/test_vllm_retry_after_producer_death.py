"""The vLLM connector's consumer when the producer dies mid-transfer (SIGKILLed after its
first layer, the consumer's load having written it) and its prefill is retried, the same
name sent again whole by a new process: the async load loads the retry; a load that
fails on the lost transfer (the layer-wise load) drops the retry as it comes, rather than
leaving it on the server, holding its bytes and a slot of max_transfers, until the
claim timeout."""

from __future__ import annotations

import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import kvwire
from kvwire.paged import PagedSpec
from tests.integration.vllm_steps import (
    async_consumer,
    consumer_step,
    consumer_worker,
    drops_ended,
    until_received,
)
from tests.integration.vllm_workers import LAYERS, SECRET

with warnings.catch_warnings():  # vLLM's import chain trips torch's own deprecation warnings
    warnings.simplefilter("ignore", DeprecationWarning)
    from kvwire.integrations.vllm import KvwireConnector, KvwireConnectorMetadata, _Move

pytestmark = pytest.mark.timeout(180)

ROWS = [0, 1, 2]  # the producer's blocks sent
INTO = [4, 5, 6]  # the consumer's blocks loaded into

#: a producer process: its caches (seeded), a session to the consumer; then ``{body}``
CHILD = """
import pickle, sys, time, torch
from kvwire.paged import PagedSource, layer_rows
from kvwire.sync import SyncPeer
spec = pickle.loads({spec!r})
gen = torch.Generator().manual_seed(11)
src = [torch.randn((16, 2, 16, 64), generator=gen) for _ in range({layers})]
peer = SyncPeer("127.0.0.1", {port}, secret={secret!r})
{body}
"""
#: sends layer 0 of "r", then waits to be killed
PARTIAL = """
s = peer.begin("r", spec.wire_spec())
s.send_layer(*layer_rows(spec, src[0], {rows}))
print("sent layer 0", flush=True)
time.sleep(120)
"""
#: sends "r" whole (the prefill retried)
WHOLE = """
peer.send("r", spec.wire_spec(), PagedSource(spec, src, {rows}), timeout=60)
print("sent whole", flush=True)
time.sleep(120)
"""


def source() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randn((16, 2, 16, 64), generator=gen) for _ in LAYERS]


@pytest.fixture
def producers() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(30)
        assert p.stdout is not None
        p.stdout.close()


def producer(started: list[subprocess.Popen[str]], port: int, spec: PagedSpec, body: str) -> str:
    """Start a producer process running ``body``; the first line it printed (empty if it
    ended without one: a failed send)."""
    code = CHILD.format(spec=pickle.dumps(spec), layers=len(LAYERS), port=port, secret=SECRET.encode(),
                        body=body.format(rows=ROWS))
    env = {**os.environ, "PYTHONPATH": str(Path(kvwire.__file__).resolve().parents[1])}
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    started.append(p)
    assert p.stdout is not None
    return p.stdout.readline().strip()  # (the child's send has a timeout: bounded)


def producer_dies_after_layer_0(worker: KvwireConnector, started: list[subprocess.Popen[str]],
                                spec: PagedSpec) -> None:
    """A producer sends layer 0 of "r" and is SIGKILLed once the consumer's load took it."""
    port = worker.listen_port
    assert port is not None
    assert producer(started, port, spec, PARTIAL) == "sent layer 0"
    handle = worker._loading["r"].handle
    for _ in range(600):
        if handle.layers_done():
            break
        threading.Event().wait(0.05)
    assert handle.layers_done() and worker._loading["r"].dest.used
    started[-1].send_signal(signal.SIGKILL)
    started[-1].wait(30)


def server_holds(worker: KvwireConnector) -> dict[str, int]:
    stats = worker.server_statistics()
    assert stats is not None
    return {k: int(stats[k]) for k in ("pending_arrivals", "buffered_bytes", "held_transfers")}


def test_an_async_load_whose_producer_died_mid_transfer_loads_the_retried_prefill(
        producers: list[subprocess.Popen[str]]) -> None:
    """The async load's transfer is lost after its first layer was written (the producer
    SIGKILLed, its session not resumed: the server fails it once its resume timeout
    passed), and the prefill retried sends the name whole: the load expects the name
    again once the lost receive stopped, and is reported received, without load errors,
    every block holding the retry's bytes; nothing is left on the server."""
    worker, spec, caches, _, _ = async_consumer(21, load_timeout=60)
    src = source()
    try:
        assert consumer_step(worker, KvwireConnectorMetadata(loads=[_Move("r", "r", INTO)])) == (set(), set())
        producer_dies_after_layer_0(worker, producers, spec)
        assert worker.listen_port is not None
        assert producer(producers, worker.listen_port, spec, WHOLE) == "sent whole"
        # (the lost transfer fails after the server's resume timeout, 10 s)
        assert until_received(worker) == ({"r"}, set())
        for layer in range(len(LAYERS)):
            for s, d in zip(ROWS, INTO, strict=True):
                assert torch.equal(caches[layer][d], src[layer][s])
        assert server_holds(worker) == {"pending_arrivals": 0, "buffered_bytes": 0, "held_transfers": 0}
    finally:
        worker.shutdown()


def test_a_load_failed_on_a_transfer_lost_mid_way_drops_the_retried_prefill(
        producers: list[subprocess.Popen[str]]) -> None:
    """The layer-wise load's transfer is lost after its first layer was written, and the
    prefill retried sends the name whole meanwhile: the load fails (its blocks reported
    as load errors) and the retry, which no load takes, is dropped, not held on the
    server until kvwire_claim_timeout (600 s)."""
    caches = [torch.zeros((16, 2, 16, 64)) for _ in LAYERS]
    worker, spec = consumer_worker(caches, load_timeout=60)
    try:
        worker.bind_connector_metadata(KvwireConnectorMetadata(loads=[_Move("r", "r", INTO)]))
        worker.start_load_kv(None)  # type: ignore[arg-type]
        producer_dies_after_layer_0(worker, producers, spec)
        assert worker.listen_port is not None
        assert producer(producers, worker.listen_port, spec, WHOLE) == "sent whole"
        for name in LAYERS:  # (the lost transfer fails after the server's resume timeout, 10 s)
            worker.wait_for_layer_load(name)
        assert worker.get_block_ids_with_load_errors() == set(INTO)
        worker.clear_connector_metadata()
        drops_ended(worker)
        assert not worker._dropping
        assert server_holds(worker) == {"pending_arrivals": 0, "buffered_bytes": 0, "held_transfers": 0}
    finally:
        worker.shutdown()


def test_an_async_load_whose_producer_died_with_no_retry_fails_once_the_retry_window_passed(
        producers: list[subprocess.Popen[str]], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The async load's transfer is lost after its first layer (the producer SIGKILLed)
    and the prefill is not retried: the load waits for a retry for the retry window
    only (1 s here), not for its whole kvwire_load_timeout (120 s): it is reported
    failed, its blocks load errors, by the retry window's timeout; a drop it leaves for
    a late retry ends with the window (counted from the loss, not from the failure; not
    kvwire_claim_timeout)."""
    monkeypatch.setattr(KvwireConnector, "_RETRY_WINDOW", 1.0)
    worker, spec, _, _, _ = async_consumer(21, load_timeout=120)
    try:
        assert consumer_step(worker, KvwireConnectorMetadata(loads=[_Move("r", "r", INTO)])) == (set(), set())
        load = worker._loading["r"]
        producer_dies_after_layer_0(worker, producers, spec)
        with caplog.at_level(logging.ERROR, logger="vllm.kvwire"):
            # (the lost transfer fails after the server's resume timeout, 10 s): at most
            # 60 s, twice until_received's 30
            got, errors = until_received(worker)
            if not got:
                got, more = until_received(worker)
                errors |= more
        assert (got, errors) == ({"r"}, set(INTO))
        assert any("not sent again within 1 s" in r.getMessage() for r in caplog.records)
        drop = worker._dropping.get("r")  # (none: the window had passed when the load failed)
        assert drop is None or (drop.given_up is not None and drop.given_up[1] is not None
                                and drop.given_up[1] <= load.retry_by)
        drops_ended(worker)
        assert not worker._dropping
    finally:
        worker.shutdown()


def test_a_new_request_of_a_lost_transfers_name_sent_after_the_retry_window_is_loaded(
        producers: list[subprocess.Popen[str]], monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer-wise load's transfer is lost mid-way and the load fails; the drop it sets
    for the retry lasts the retry window (1 s here), not kvwire_claim_timeout: once it
    passed, a new request of the same name (a reused kvwire_id), sent whole before its
    load starts, is loaded by that load, not dropped."""
    monkeypatch.setattr(KvwireConnector, "_RETRY_WINDOW", 1.0)
    caches = [torch.zeros((16, 2, 16, 64)) for _ in LAYERS]
    worker, spec = consumer_worker(caches, load_timeout=30)
    src = source()
    try:
        worker.bind_connector_metadata(KvwireConnectorMetadata(loads=[_Move("r", "r", INTO)]))
        worker.start_load_kv(None)  # type: ignore[arg-type]
        producer_dies_after_layer_0(worker, producers, spec)
        for name in LAYERS:  # (the lost transfer fails after the server's resume timeout, 10 s)
            worker.wait_for_layer_load(name)
        assert worker.get_block_ids_with_load_errors() == set(INTO)
        worker.clear_connector_metadata()
        worker.get_finished({"r"})
        drops_ended(worker)
        assert not worker._dropping
        assert worker.listen_port is not None
        assert producer(producers, worker.listen_port, spec, WHOLE) == "sent whole"
        worker.bind_connector_metadata(KvwireConnectorMetadata(loads=[_Move("r2", "r", [7, 8, 9])]))
        worker.start_load_kv(None)  # type: ignore[arg-type]
        for name in LAYERS:
            worker.wait_for_layer_load(name)
        assert worker.get_block_ids_with_load_errors() == set()
        for layer in range(len(LAYERS)):
            for s, d in zip(ROWS, [7, 8, 9], strict=True):
                assert torch.equal(caches[layer][d], src[layer][s])
    finally:
        worker.shutdown()


def restarted(worker: KvwireConnector) -> None:
    """Consumer steps until the async load of "r", its transfer lost, expects its name again
    (the lost receive stopped), at most 30 s."""
    load = worker._loading["r"]
    for _ in range(600):  # (the lost transfer fails after the server's resume timeout, 10 s)
        assert consumer_step(worker) == (set(), set())
        if load.restarted and load.restarting is None:
            return
        threading.Event().wait(0.05)
    raise AssertionError("the load was not restarted")


def test_an_async_load_aborted_in_the_retry_window_drops_the_retry_until_the_window_ends(
        producers: list[subprocess.Popen[str]], monkeypatch: pytest.MonkeyPatch) -> None:
    """The async load's transfer is lost mid-way and the load waits for the retry; its
    request finishes (a client aborts it) before the retry began: the drop it sets for the
    retry ends when the load's retry window does (counted from the loss), not a retry
    window after the abort, and then ends."""
    monkeypatch.setattr(KvwireConnector, "_RETRY_WINDOW", 5.0)
    worker, spec, _, _, _ = async_consumer(21, load_timeout=120)
    try:
        assert consumer_step(worker, KvwireConnectorMetadata(loads=[_Move("r", "r", INTO)])) == (set(), set())
        producer_dies_after_layer_0(worker, producers, spec)
        restarted(worker)
        load = worker._loading["r"]
        threading.Event().wait(1.0)
        consumer_step(worker, finished={"r"})
        assert "r" not in worker._loading
        drop = worker._dropping.get("r")
        assert drop is not None and drop.given_up is not None
        ends = drop.given_up[1]
        assert ends is not None and ends <= load.retry_by
        drops_ended(worker)
        assert not worker._dropping
    finally:
        worker.shutdown()


def test_an_async_load_aborted_while_its_retry_is_healthy_sets_up_no_drop(
        producers: list[subprocess.Popen[str]]) -> None:
    """The async load's transfer is lost mid-way; the prefill retried begins (its first
    layer written, its producer alive) and the request then finishes (a client aborts
    it): nothing is sent again, so no drop is set up, and a new request of the same name
    (a reused kvwire_id) whose transfer comes before its load starts, within the retry
    window, is loaded whole, not dropped."""
    worker, spec, caches, _, _ = async_consumer(21, load_timeout=60)
    src = source()
    try:
        assert consumer_step(worker, KvwireConnectorMetadata(loads=[_Move("r", "r", INTO)])) == (set(), set())
        producer_dies_after_layer_0(worker, producers, spec)
        restarted(worker)
        load = worker._loading["r"]
        assert worker.listen_port is not None
        assert producer(producers, worker.listen_port, spec, PARTIAL) == "sent layer 0"  # the retry, healthy
        for _ in range(600):
            assert consumer_step(worker) == (set(), set())
            if load.handle.transfer is not None and load.handle.layers_done():
                break
            threading.Event().wait(0.05)
        assert load.handle.transfer is not None and load.handle.error is None
        got, errors = consumer_step(worker, finished={"r"})
        assert "r" not in worker._loading and "r" not in worker._dropping
        if not got:  # (reported once kvwire's loop stopped its receive: maybe a later step)
            got, errors = until_received(worker)
        assert (got, errors) == ({"r"}, set())
        assert producer(producers, worker.listen_port, spec, WHOLE) == "sent whole"
        # (its transfer in already, the load may be reported by the step that starts it)
        assert until_received(worker, meta=KvwireConnectorMetadata(loads=[_Move("r2", "r", [7, 8, 9])])) \
            == ({"r2"}, set())
        for layer in range(len(LAYERS)):
            for s, d in zip(ROWS, [7, 8, 9], strict=True):
                assert torch.equal(caches[layer][d], src[layer][s])
    finally:
        worker.shutdown()
