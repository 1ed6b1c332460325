"""The vLLM connector's drops of loads that gave up, with names shared between requests
(kvwire_load_all's ``prompt:<digest>``, a reused kvwire_id): a later load of the name
goes before them.  The worker-side connector is driven step by step, as vLLM's worker
drives it, over real sockets on 127.0.0.1 (helpers from tests/integration/vllm_workers.py)."""

from __future__ import annotations

import threading
import time
import warnings

import pytest

from kvwire.paged import PagedSource
from kvwire.sync import SyncPeer
from tests.integration.vllm_workers import (
    LAYERS,
    SECRET,
    caches,
    consume,
    consumer,
    pending,
    same,
    until,
)

with warnings.catch_warnings():  # vLLM's import chain trips torch's own deprecation warnings
    warnings.simplefilter("ignore", DeprecationWarning)
    from kvwire.integrations.vllm import KvwireConnector, KvwireConnectorMetadata, _Move

pytestmark = pytest.mark.timeout(300)

NAME = "prompt:" + "ab" * 16  # (kvwire_load_all: every request of the prompt has this name)


def load(cons: KvwireConnector, req_id: str, blocks: list[int], sends: list[PagedSource]) -> tuple[bool, set[int]]:
    """One request's load, started in a step, while each of ``sends`` is sent (in order,
    each acknowledged, after the load started): whether it loaded, and the failed blocks."""
    spec = cons._spec
    assert spec is not None

    def send() -> None:
        with SyncPeer("127.0.0.1", cons.listen_port or 0, secret=SECRET.encode()) as peer:
            for source in sends:
                peer.send(NAME, spec.wire_spec(), source, timeout=60)

    cons.bind_connector_metadata(KvwireConnectorMetadata(loads=[_Move(req_id, NAME, blocks)]))
    cons.start_load_kv(None)
    sender = threading.Thread(target=send)
    sender.start()
    try:
        for name in LAYERS:  # (the layer-wise load waits here)
            cons.wait_for_layer_load(name)
        _, recving = cons.get_finished(set())
        errors = cons.get_block_ids_with_load_errors()
        cons.clear_connector_metadata()
    finally:
        sender.join()
    got = recving or set()
    deadline = time.monotonic() + 90
    while cons._load_async and req_id not in got and time.monotonic() < deadline:
        g, e = consume(cons)
        got |= g
        errors |= e
        threading.Event().wait(0.05)
    return req_id not in cons._loading and not errors, errors


def give_up(cons: KvwireConnector) -> None:
    """Request r1 (blocks 2, 3) waits for a transfer that never comes (its prefill's send
    failed) and gives up at its kvwire_load_timeout; the later loads get more time."""
    loaded, errors = load(cons, "r1", [2, 3], [])
    assert not loaded and errors == {2, 3}
    assert len(cons._dropping) == 1  # (the drop of its transfer, should it come)
    cons._timeout = 60.0


@pytest.mark.parametrize("load_async", [True, False])
def test_each_later_request_of_a_name_loads_its_own_transfer_after_a_load_gave_up(
        workers: list[KvwireConnector], load_async: bool) -> None:
    """A load given up drops its transfer should it come later; the next request of that
    name, whose transfer is sent after its load started, loads it (the drop goes after
    it), and so does every one after, instead of each losing its transfer to the drop
    left by the one before and failing at its kvwire_load_timeout."""
    cons, ckv = consumer({"kvwire_load_timeout": 1, "kvwire_load_all": True, "kvwire_load_async": load_async})
    workers[:] = [cons]
    spec = cons._spec
    assert spec is not None
    give_up(cons)
    for i in range(2, 6):
        src = caches(64, i)
        loaded, errors = load(cons, f"r{i}", [2 * i, 2 * i + 1], [PagedSource(spec, src, [0, 1])])
        assert loaded and not errors, f"r{i} did not load its transfer"
        assert same(ckv, [2 * i, 2 * i + 1], src, [0, 1])
    assert pending(cons) == 0
    assert len(cons._dropping) == 1  # r1's, still waiting (let go of at its claim timeout)


@pytest.mark.parametrize("load_async", [True, False])
def test_a_transfer_later_than_its_given_up_load_goes_to_the_next_load_and_its_own_is_dropped(
        workers: list[KvwireConnector], load_async: bool) -> None:
    """The transfer of the load given up comes after all, once the next load of its name
    started: that load takes it, and the drop, behind it, takes the next load's own
    transfer: nothing is left on the server."""
    cons, ckv = consumer({"kvwire_load_timeout": 1, "kvwire_load_all": True, "kvwire_load_async": load_async})
    workers[:] = [cons]
    spec = cons._spec
    assert spec is not None
    give_up(cons)
    late, own = caches(64, 7), caches(64, 8)
    loaded, errors = load(cons, "r2", [4, 5], [PagedSource(spec, late, [0, 1]), PagedSource(spec, own, [0, 1])])
    assert loaded and not errors
    assert same(ckv, [4, 5], late, [0, 1])
    assert until(lambda: pending(cons) == 0 and not cons._dropping, cons), "the second transfer was not dropped"
    assert same(ckv, [4, 5], late, [0, 1])
