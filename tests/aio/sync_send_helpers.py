"""A blocking send waiting for credit from a server whose buffer budget has no room."""

from __future__ import annotations

import time
from collections.abc import Callable

import kvwire
from kvwire.sync import SendHandle, SyncPeer
from tests.conftest import make_layers

SPEC = kvwire.KVSpec(num_layers=4, num_kv_heads=1, head_dim=64, dtype="float32")


BUDGET = 256 * 1024


def until(predicate: Callable[[], bool], what: str) -> None:
    for _ in range(2000):
        if predicate():
            return
        time.sleep(0.005)
    raise AssertionError(f"never: {what}")


def waiting_for_credit(peer: SyncPeer) -> SendHandle:
    """Transfer "d" (4 layers of 16 KiB, a 64 KiB slab each in the budget of 256 KiB, an
    eighth kept for first layers) begun and all its layers given: the server grants 3, which
    arrive and are held unread, so its last layer waits for credit."""
    s = peer.begin("d", SPEC, timeout=30)
    for k, v in make_layers(4, 64, 1, 64, "float32"):
        s.send_layer(k, v)
    # (waiting for credit with 3 granted: before the window's CREDIT it waits for layer 1's)
    until(lambda: s.waiting_for_credit and s.layers_granted == 3, "d waits for credit")
    return s
