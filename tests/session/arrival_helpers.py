"""Transfers that arrive complete at a receiver and are left unclaimed."""

from __future__ import annotations

from kvwire.session.receiver import (
    TransferArrived,
)
from tests.session.receiver_harness import Harness, begin


def arrive(h: Harness, tid: int, request: str, **kw: object) -> tuple[bytes, int]:
    h.client.send_begin(begin(tid=tid, layers=1, request=request, **kw))
    h.pump()
    return next(e.key for e in h.of(TransferArrived) if e.key[1] == tid)  # type: ignore[no-any-return]
