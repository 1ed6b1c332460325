"""Layer credit within the server's buffer budget, as a property (docs/protocol.md 8.2):
whatever the budget, the windows, the number of transfers, their sizes and when each
begins, an application that reads the transfers one after another, each to its end,
in the order they began, is never stalled: the layer it waits for always arrives
from a sender that keeps to its credit (and waits for ACCEPT).  The layers held and
granted never exceed the budget, and no transfer fails at all, its first layer included:
with every transfer of one layout, a transfer is accepted only once the room left holds
its first layer at the footprint of the first layers seen, and waits to start until then."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.session.receiver import LayerReady, TransferFailed
from kvwire.wire import TransferAccepted
from tests.session.budget_helpers import harness, limit, send_layer, take, within_budget
from tests.session.receiver_harness import begin, chunk


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[int, int, list[int], list[bool]]:
    budget = draw(st.integers(2, 10))
    window = draw(st.integers(1, budget))
    sizes = draw(st.lists(st.integers(1, 8), min_size=2, max_size=6))  # layers of each transfer
    # Before each step of the application: whether the next transfer begins now.
    arrivals = draw(st.lists(st.booleans(), min_size=0, max_size=60))
    return budget, window, sizes, arrivals


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_a_reader_taking_transfers_one_after_another_is_never_stalled(
    scenario: tuple[int, int, list[int], list[bool]],
) -> None:
    budget, window, sizes, arrivals = scenario
    h = harness(budget, window)
    tids = list(range(1, len(sizes) + 1))
    layers = dict(zip(tids, sizes, strict=True))
    started: list[int] = []
    sent = dict.fromkeys(tids, 0)
    first_k = dict.fromkeys(tids, False)  # K of its layer 0 sent (V not yet)
    taken = dict.fromkeys(tids, 0)

    def accepted(tid: int) -> bool:
        return any(e.transfer_id == tid for e in h.client_of(TransferAccepted))

    def start(tid: int) -> None:
        h.client.send_begin(begin(tid=tid, layers=layers[tid], request=f"r{tid}"))
        h.pump()
        started.append(tid)

    def client_sends() -> None:  # a sender keeping to its credit sends all it may
        for tid in started:
            if not accepted(tid):
                continue  # it waits for ACCEPT
            if not sent[tid] and not first_k[tid]:
                h.send(chunk(tid=tid, layer=0, kind=0))  # its first chunk: the layer size known
                first_k[tid] = True
            while sent[tid] < limit(h, tid):
                send_layer(h, tid, sent[tid], k=not first_k[tid])
                first_k[tid] = False
                sent[tid] += 1

    pending = list(tids)
    start(pending.pop(0))
    # The first of all, its first layer received whole: the first layer seen (a first
    # layer's size is learned once the layer is whole).
    send_layer(h, tids[0], 0)
    sent[tids[0]] = 1
    steps = iter(arrivals)
    while True:
        while pending and next(steps, True):
            start(pending.pop(0))
        client_sends()
        within_budget(h)
        assert not h.of(TransferFailed), [(e.key[1], str(e.error)) for e in h.of(TransferFailed)]
        reading = next((t for t in started if taken[t] < layers[t]), None)
        if reading is None:
            if not pending:
                break
            continue
        # Every transfer before it is taken: it has started (its first layer has room).
        assert accepted(reading), f"transfer {reading} never started"
        ready = {(e.key[1], e.layer) for e in h.of(LayerReady)}
        assert (reading, taken[reading]) in ready, (
            f"transfer {reading} stalled at layer {taken[reading]}"
        )
        take(h, reading, taken[reading])
        taken[reading] += 1
    assert h.core.buffered_bytes - h.core.kept_bytes == 0 and h.core.reserved_bytes == 0
    assert h.core.waiting_for_room == 0 and h.core.waiting_to_start == 0
