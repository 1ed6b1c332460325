"""A destination for arriving transfers that records every call made to it, and the
outcome of a receive."""

from __future__ import annotations

from typing import Any

import kvwire


class Destination:
    """A destination that records every call: one for a transfer that failed before it
    was claimed is never called."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def check(self, spec: Any, layer_tokens: int) -> None:
        self.calls.append("check")

    def view(self, *args: Any) -> Any:
        self.calls.append("view")
        raise AssertionError("never")

    def write(self, *args: Any) -> None:
        self.calls.append("write")

    def layer(self, index: int) -> Any:
        self.calls.append("layer")
        raise AssertionError("never")


async def received(server: kvwire.Server, request_id: str) -> Any:
    """The receiver's outcome: the collected cache or the error it failed with."""
    transfer = await server.expect(request_id, timeout=20)
    try:
        return await transfer.collect(timeout=20)
    except kvwire.KvwireError as exc:
        return exc
