"""Calls that ``mypy --strict`` must reject (checked by tests/test_typing.py; never run)."""

from __future__ import annotations

import kvwire


async def misuse(spec: kvwire.KVSpec) -> None:
    kvwire.serve(secret=b"0123456789", windw=1)  # expect: unexpected-keyword
    kvwire.connect("h", 1, secret=b"0123456789", streams="4")  # expect: streams
    kvwire.serve(secret=b"0123456789", window="32MiB")  # expect: window type
    kvwire.connect("h", 1, secret=b"0123456789", chunk_byts=1)  # expect: unexpected-keyword
    async with kvwire.connect("h", 1, secret=b"0123456789") as peer:
        await peer.send("a", spec, 42)  # expect: layers
        await peer.send("a", spec, [(1, 2)])  # expect: layers
