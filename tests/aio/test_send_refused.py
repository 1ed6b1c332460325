"""What send() refuses before BEGIN: nothing of it reaches the receiver (no transfer that
then fails with TransferAbortedError)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

import kvwire
from kvwire.errors import UsageError
from tests.conftest import make_layers

pytestmark = pytest.mark.timeout(60)

SECRET = b"send-refused-secret"
SPEC = kvwire.KVSpec(num_layers=2, num_kv_heads=2, head_dim=16)


@pytest.mark.parametrize("layers", [42, np.float16(1.0), np.zeros((), np.float16)], ids=["int", "scalar", "0-d"])
async def test_layers_that_are_not_iterable_are_refused_before_begin(layers: Any) -> None:
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            with pytest.raises(UsageError, match="layers must be"):
                await peer.send("bad", SPEC, layers)
            receipt = await asyncio.wait_for(peer.send("good", SPEC, make_layers(2, 4, 2, 16)), 30)
            # One stream: the server read whatever went before the good transfer's chunks.
            assert receipt.transfer_id == 1
            stats = server.statistics()
            assert stats["transfers_accepted"] == 1 and stats.get("transfers_aborted_by_peer", 0) == 0
            await asyncio.wait_for(server.expect("good", timeout=30), 30)
