"""A send waited for while the interpreter exits (a serving engine's shutdown runs from an
atexit hook and waits for the sends in flight): the default thread pool refuses work then,
and a codec's encodes, which run on it, failed the send ("layer producer failed:
RuntimeError(...)").  They are now encoded on the loop instead, and the send completes."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)

SCRIPT = textwrap.dedent("""
    import atexit, sys
    import numpy as np
    import kvwire
    from kvwire.sync import Bridge, PendingPeer, SyncServer

    SECRET = b"s" * 32
    spec = kvwire.KVSpec(num_layers=4, num_kv_heads=8, head_dim=128, dtype="float16")
    server = SyncServer("127.0.0.1", 0, secret=SECRET)
    bridge = Bridge("exit")
    pending = PendingPeer(bridge, "127.0.0.1", server.port, secret=SECRET)
    assert pending.wait(30)
    peer = pending.result()
    expected = server.expect("r")
    k = np.random.default_rng(0).standard_normal((2048, 8, 128)).astype(np.float16)
    handle = peer.begin("r", spec, codec=sys.argv[1])

    def finish() -> None:  # what an engine's shutdown hook does: wait for the send in flight
        try:
            receipt = handle.wait(60)
            layer = expected.wait_layer(3, timeout=60)
            print("sent", receipt.kv_bytes, receipt.wire_bytes, np.asarray(layer.k).shape, flush=True)
        except Exception as exc:
            print("failed", repr(exc), flush=True)
        bridge.close()
        server.close()

    atexit.register(finish)
    for _ in range(4):
        handle.send_layer(k, k)
    sys.exit(0)  # the send goes on while the interpreter exits
""")


@pytest.mark.parametrize("codec", ["fp8", "int4", "int8+lz4"])
def test_a_send_waited_for_at_exit_still_encodes(codec: str) -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT, codec], capture_output=True, text=True, timeout=100,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    words = out.stdout.split()
    assert words[:1] == ["sent"], out.stdout + out.stderr[-3000:]
    kv_bytes, wire_bytes = int(words[1]), int(words[2])
    assert kv_bytes == 4 * 2 * 2048 * 8 * 128 * 2 and 0 < wire_bytes < kv_bytes
