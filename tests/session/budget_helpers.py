"""Transfers of one-layer-sized chunks against a receiver's buffer budget: begin, send and
take them, and check what the budget holds."""

from __future__ import annotations

from typing import Any

from kvwire.session.receiver import (
    ReceiverConfig,
    TransferArrived,
)
from kvwire.wire import CreditGranted, TransferAccepted
from tests.session.receiver_harness import BPT, SECRET, Harness, begin, chunk

LAYER = 2 * 8 * BPT  # 8 tokens of K and V: what each layer of these transfers takes


def harness(budget_layers: int, window_layers: int) -> Harness:
    return Harness(ReceiverConfig(secret=SECRET, max_buffer_bytes=budget_layers * LAYER,
                                  transfer_buffer_bytes=window_layers * LAYER, claim_timeout=None))


def limit(h: Harness, tid: int) -> int:
    """The layer limit the client has for ``tid`` (ACCEPT's, raised by every CREDIT)."""
    granted = [e.layer_limit for e in h.client_events
               if isinstance(e, TransferAccepted | CreditGranted) and e.transfer_id == tid]
    return max(granted)


def key(h: Harness, tid: int) -> tuple[bytes, int]:
    return next(e.key for e in h.of(TransferArrived) if e.key[1] == tid)  # type: ignore[no-any-return]


def within_budget(h: Harness) -> None:
    """Layers held and layers granted never take more than the budget."""
    core = h.core
    assert core.buffered_bytes - core.kept_bytes + core.reserved_bytes <= core.config.max_buffer_bytes
    assert core.reserved_bytes == sum(t.reserved for t in core._live.values())


def begin_all(h: Harness, layers: int, *tids: int) -> None:
    for tid in tids:
        h.client.send_begin(begin(tid=tid, layers=layers, request=f"r{tid}"))
    h.pump()


def send_layer(h: Harness, tid: int, layer: int, *, k: bool = True) -> None:
    if k:
        h.send(chunk(tid=tid, layer=layer, kind=0))
    h.send(chunk(tid=tid, layer=layer, kind=1))
    within_budget(h)


def take(h: Harness, tid: int, layer: int) -> Any:
    buf = h.core.pop_layer(key(h, tid), layer, h.now)
    h.pump()
    within_budget(h)
    return buf
