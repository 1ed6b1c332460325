"""The BEGIN the log tests send, and the characters a peer's text may forge a line with."""

from __future__ import annotations

from kvwire.wire import Begin

#: What a peer's text may hold to forge or hide a line: line breaks, an escape sequence,
#: Unicode line and paragraph separators, a bidirectional override.
FORGERS = ("\n", "\r", "\x1b", "\x85", "\u2028", "\u2029", "\u202e")


def begin(tid: int, request_id: str) -> Begin:
    return Begin(transfer_id=tid, num_layers=2, num_kv_heads=2, head_dim=16, dtype_id=1, model="",
                 request_id=request_id, meta=b"")
