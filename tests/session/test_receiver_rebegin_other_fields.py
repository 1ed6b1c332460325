"""A BEGIN repeating a transfer's id and request id is a re-send only if it is the same
BEGIN: with any other field different (layout, model, meta, prefix blocks) it is refused
with DUPLICATE_TRANSFER naming what differs, and the transfer already there goes on
(docs/protocol.md 7.1); a re-send that is the same BEGIN is answered with ACCEPT again,
while the transfer is in progress, once its data is taken, and once only its id is kept."""

from __future__ import annotations

from typing import Any

import pytest

from kvwire.errors import ErrorCode
from kvwire.session.receiver import LayerReady, TransferFailed
from kvwire.wire import TransferAccepted, TransferReset
from kvwire.wire.frames import BlockVersion
from tests.session.receiver_harness import Harness, begin, chunk

OTHER = [
    ({"layers": 3}, "num_layers 3, not 2"),
    ({"num_kv_heads": 4}, "num_kv_heads 4, not 2"),
    ({"head_dim": 8}, "head_dim 8, not 4"),
    ({"dtype_id": 2}, "dtype_id 2, not 1"),
    ({"model": "other"}, "model 'other', not ''"),
    ({"meta": b'{"a": 1}'}, "meta"),
    ({"blocks": (BlockVersion(block=b"k", version=1),)}, "blocks"),
]


def answers(h: Harness) -> list[Any]:
    return [e for e in h.client_events if isinstance(e, TransferAccepted | TransferReset)]


@pytest.mark.parametrize(("other", "said"), OTHER, ids=[s.split()[0] for _, s in OTHER])
def test_a_begin_with_the_same_ids_and_another_field_is_a_duplicate(other: dict[str, Any], said: str) -> None:
    h = Harness()
    h.client.send_begin(begin(1, layers=2, request="r"))
    h.pump()
    key = h.key
    h.client.send_begin(begin(1, layers=2, request="r"))  # the same BEGIN: a re-send
    h.pump()
    assert [type(a) for a in answers(h)] == [TransferAccepted, TransferAccepted]
    h.client_events.clear()
    h.client.send_begin(begin(1, **{"layers": 2, **other}, request="r"))
    h.pump()
    [reset] = answers(h)
    assert isinstance(reset, TransferReset) and reset.code == ErrorCode.DUPLICATE_TRANSFER
    assert said in reset.message and "same request id" in reset.message, reset.message
    # The transfer already there goes on, as it was begun.
    assert not h.of(TransferFailed)
    assert h.core._sessions[key[0]].transfers[1].begin == begin(1, layers=2, request="r")
    assert h.core.counters["transfers_refused"] == 1


def test_a_begin_with_the_same_ids_and_another_layout_names_every_difference() -> None:
    h = Harness()
    h.client.send_begin(begin(1, layers=2, request="r"))
    h.pump()
    h.client_events.clear()
    h.client.send_begin(begin(1, layers=7, num_kv_heads=3, request="r"))
    h.pump()
    [reset] = answers(h)
    assert reset.code == ErrorCode.DUPLICATE_TRANSFER
    assert "num_layers 7, not 2" in reset.message and "num_kv_heads 3, not 2" in reset.message, reset.message


def complete_and_take(h: Harness, meta: bytes = b"{}") -> tuple[bytes, int]:
    h.client.send_begin(begin(1, layers=1, request="r", meta=meta))
    h.pump()
    key = h.key
    h.core.claim(key, h.now)
    h.send(chunk(layer=0, kind=0))
    h.send(chunk(layer=0, kind=1))
    assert h.of(LayerReady) and not h.of(TransferFailed)
    h.core.pop_layer(key, 0, h.now)  # its meta and blocks let go: a digest of its BEGIN kept
    return key


@pytest.mark.parametrize("forgotten", [False, True], ids=["taken", "only its id kept"])
def test_a_completed_transfers_begin_again_is_a_re_send_only_if_it_is_the_same(forgotten: bool) -> None:
    h = Harness()
    complete_and_take(h, meta=b'{"x": 1}')
    if forgotten:
        h.client.send_begin(begin(2, layers=1, request="later"))  # forgets transfer 1 but its id
        h.pump()
        assert 1 in h.core._sessions[h.key[0]].completed
    for other, said in [({"meta": b"{}"}, "meta"), ({"layers": 2}, "num_layers" if not forgotten else "layout")]:
        h.client_events.clear()
        h.client.send_begin(begin(1, request="r", **{"layers": 1, "meta": b'{"x": 1}', **other}))
        h.pump()
        [reset] = answers(h)
        assert isinstance(reset, TransferReset) and reset.code == ErrorCode.DUPLICATE_TRANSFER, reset
        assert said in reset.message and "same request id" in reset.message, reset.message
    h.client_events.clear()
    h.client.send_begin(begin(1, layers=1, request="r", meta=b'{"x": 1}'))  # the same BEGIN
    h.pump()
    [accept] = answers(h)
    assert isinstance(accept, TransferAccepted) and accept.layer_limit == 1
