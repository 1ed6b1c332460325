"""A session whose first layer the server acknowledged before it sends GOAWAY."""

from __future__ import annotations

import asyncio
from typing import Any

import kvwire

#: 2 MiB of K and of V a layer: written in several pieces, so that a write follows the reset.
SPEC = kvwire.KVSpec(num_layers=3, num_kv_heads=8, head_dim=128)
TOKENS = 1024


async def wait_first_layer_acked(peer: Any) -> None:
    async def acked() -> None:
        while not any((t := peer.core.transfer(tid)) is not None and t.kv_bytes_acked > 0
                      for tid in list(peer.sends)):
            await asyncio.sleep(0.01)
    await asyncio.wait_for(acked(), 20)
