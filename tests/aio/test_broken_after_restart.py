"""A peer whose server restarted (killed, then started again on its port) resumes, and the
new server answers UNKNOWN_SESSION: ``peer.broken`` says what that means (the server no
longer has this session), as a transfer failing for it does, not only the server's bare
"no such session"; of the same class as before, and the same object at every look."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import kvwire
from kvwire.errors import ErrorCode
from kvwire.session.sender import SESSION_GONE

pytestmark = pytest.mark.timeout(120)

SECRET = b"r" * 32
ROOT = str(Path(__file__).resolve().parents[2])

_SERVER = """
import asyncio, sys
import kvwire

async def main() -> None:
    async with kvwire.serve("127.0.0.1", int(sys.argv[1]), secret=b"r" * 32) as server:
        print(server.port, flush=True)
        await asyncio.Event().wait()

asyncio.run(main())
"""


@contextlib.asynccontextmanager
async def _server(port: int) -> AsyncIterator[tuple[int, asyncio.subprocess.Process]]:
    """A kvwire server in a process of its own on ``port`` (0: a free one): its port and
    the process, which the test may kill (no goodbye to its peers)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _SERVER, str(port), stdout=subprocess.PIPE, env=env
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        assert line, "the server process did not start"
        yield int(line), proc
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


async def _until(cond: object, limit: float = 60.0) -> None:
    """Poll ``cond()`` (a bound on how long a broken test waits, not a timing claim)."""
    async with asyncio.timeout(limit):
        while not cond():  # type: ignore[operator]
            await asyncio.sleep(0.01)


async def test_broken_says_the_restarted_server_no_longer_has_the_session() -> None:
    async with _server(0) as (port, first):
        # Enough attempts (0.05 s, doubling) to outlast the restart.
        peer = kvwire.connect("127.0.0.1", port, secret=SECRET, reconnect_attempts=14)
        async with peer:
            assert peer.broken is None
            first.kill()  # no goodbye: the stream breaks, the peer resumes
            await first.wait()
            async with _server(port):
                await _until(lambda: peer.broken is not None)
                broken = peer.broken
                assert broken is not None
                assert broken.code == ErrorCode.UNKNOWN_SESSION, repr(broken)
                assert isinstance(broken, kvwire.ConnectionLostError), repr(broken)
                text = str(broken)
                assert SESSION_GONE in text, text
                assert "no such session" in text, text  # the server's own word, kept
                assert peer.broken is broken  # one error, not a new one at each look
                # send() says the same, and that the peer must connect again.
                with pytest.raises(kvwire.ConnectionLostError) as info:
                    spec = kvwire.KVSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16")
                    await peer.send("a", spec, [], timeout=10)
                assert SESSION_GONE in str(info.value), str(info.value)
                assert "close it and connect() again" in str(info.value), str(info.value)
