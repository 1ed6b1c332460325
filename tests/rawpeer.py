"""What a test that talks to a server over a plain socket needs: a frame read off the
socket, and a wait for a condition to hold."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from kvwire.wire import FrameDecoder


async def read_one_frame(reader: asyncio.StreamReader, timeout: float = 5.0) -> Any:
    """The next frame the server sends, alone in what one read gets, within ``timeout``
    seconds."""
    dec = FrameDecoder(1 << 20)
    async def go() -> Any:
        while True:
            data = await reader.read(65536)
            assert data, "server closed before sending a frame"
            got = dec.feed(data)
            if got:
                assert len(got) == 1, got
                return got[0][0]
    return await asyncio.wait_for(go(), timeout)


async def wait_until(cond: Callable[[], bool], timeout: float = 5.0) -> bool:
    """True once ``cond()`` holds, polled every 20 ms; False after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() > end:
            return False
        await asyncio.sleep(0.02)
    return True
