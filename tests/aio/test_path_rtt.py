"""The handshake times the path's round trip, and ``auto``'s choice before any estimate
follows it: the most compact codec across a long path.  (That a short path starts raw is
the chooser's unit test: on a loaded host no upper bound on a loopback round trip holds.)"""

from __future__ import annotations

import kvwire
from kvwire.bench.emulator import LinkEmulator
from kvwire.control.codec_choice import LONG_PATH_RTT
from tests.conftest import SECRET


async def test_a_long_path_starts_compact() -> None:
    assert LONG_PATH_RTT < 0.019
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, codec="auto") as peer:
            assert peer.core.path_rtt is not None and peer.core.path_rtt >= 0
        async with LinkEmulator("127.0.0.1", server.port, delay=0.010) as link, \
                kvwire.connect("127.0.0.1", link.port, secret=SECRET, codec="auto", streams=2) as peer:
            assert peer.core.path_rtt is not None and peer.core.path_rtt >= 0.019  # 10 ms each way
            assert peer.chooser is not None and peer.chooser.choose(None).codec == "int4"
