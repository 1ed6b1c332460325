"""A destination for arriving transfers that records every call made to it."""

from __future__ import annotations

from typing import Any


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
