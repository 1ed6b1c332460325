"""An error kept and raised again at every call (a broken peer's, a failed transfer's)
must not gather the frames of every call that raised it: their locals (the caller's
arrays) would live as long as the error is kept."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

import kvwire
from tests.conftest import SECRET

pytestmark = pytest.mark.timeout(60)

SPEC = kvwire.KVSpec(num_layers=1, num_kv_heads=2, head_dim=16)


async def test_a_broken_peers_error_keeps_no_earlier_callers_arrays() -> None:
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server, kvwire.connect(
        "127.0.0.1", server.port, secret=SECRET, reconnect_attempts=0,
    ) as peer:
        await server.close()  # the session is lost: the peer is broken for good
        refs: list[weakref.ref[np.ndarray]] = []
        for _ in range(3):
            k = np.zeros((64, 2, 16), dtype=np.float16)
            refs.append(weakref.ref(k))
            with pytest.raises(kvwire.ConnectionLostError) as info:
                await peer.send("r", SPEC, [(k, k)], timeout=10)
            assert "session has ended" in str(info.value)
            del k, info
        gc.collect()
        # A new error each time, holding nothing of an earlier call: only the last call's
        # frames may still be held (by what raised it last).
        assert [r() is None for r in refs[:2]] == [True, True]
