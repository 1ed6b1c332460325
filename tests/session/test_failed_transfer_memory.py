"""What the receiving core keeps of a failed transfer: nothing that pins its memory.

A transfer that fails inside the chunk path (a store or codec raising) leaves a tombstone
and a TransferFailed event; neither may keep the raised exception's traceback (its frames
hold the chunk and the layer's buffer), context or cause."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest

from kvwire.errors import ErrorCode, ProtocolError
from kvwire.session.receiver import ByteStore, ReceiverConfig, TransferArrived, TransferFailed
from kvwire.wire import Begin, Chunk, TransferReset, chunk_frame_size
from tests.session.receiver_harness import SECRET, Harness

HEADS, HEAD_DIM = 1, 4
BPT = HEADS * HEAD_DIM * 2  # float16


class Slab(bytearray):
    """A layer buffer that can be watched with a weak reference."""


def begin(tid: int, request: str = "r") -> Begin:
    return Begin(transfer_id=tid, num_layers=2, num_kv_heads=HEADS, head_dim=HEAD_DIM, dtype_id=1,
                 model="", request_id=request, meta=b"{}")


def chunk(tid: int, tokens: int = 8) -> Chunk:
    return Chunk(transfer_id=tid, layer=0, kind=0, codec_id=0, token_start=0, token_count=tokens,
                 layer_tokens=tokens, params=b"", payload=bytes(tokens * BPT))


def _raising(kind: str) -> Any:
    def decode(c: Chunk, dest: memoryview) -> None:
        held = dest  # noqa: F841 (a local of a frame the traceback would keep)
        if kind == "kvwire":
            raise ProtocolError("this chunk does not decode")
        raise ValueError("a codec's own error")  # becomes a ProtocolError from it
    return decode


@pytest.mark.parametrize("kind", ["kvwire", "other"])
def test_a_transfer_failed_in_the_chunk_path_keeps_no_traceback_nor_its_layer(kind: str) -> None:
    slabs: list[weakref.ref[Slab]] = []

    def allocate(nbytes: int) -> memoryview:
        slab = Slab(nbytes)
        slabs.append(weakref.ref(slab))
        return memoryview(slab)

    p = Harness(ReceiverConfig(secret=SECRET), store=ByteStore(allocate, _raising(kind)))
    core = p.core
    p.client.send_begin(begin(1))
    p.pump()
    [arrived] = [e for e in p.events if isinstance(e, TransferArrived)]
    c = chunk(1)
    p.client.send_chunk(c, chunk_frame_size(0, len(c.payload)))
    p.pump()
    [failed] = [e for e in p.events if isinstance(e, TransferFailed)]
    assert failed.key == arrived.key and failed.error.code == ErrorCode.PROTOCOL_ERROR
    assert core.buffered_bytes == 0 and len(slabs) == 1
    [tombstone] = core._sessions[arrived.key[0]].tombstones.values()
    for kept in (*(tombstone if isinstance(tombstone, tuple) else (tombstone,)), failed.error):
        if isinstance(kept, BaseException):
            assert kept.__traceback__ is None and kept.__context__ is None and kept.__cause__ is None
    gc.collect()
    assert slabs[0]() is None, "the failed transfer's layer buffer is still referenced"


# -- what a tombstone and a failed transfer's error say ------------------------------------

LONG_ID = "\x00" * 65535  # a request id at its limit; its repr is 262142 characters


def _aborted_and_timed_out() -> tuple[Harness, list[TransferFailed]]:
    p = Harness(ReceiverConfig(secret=SECRET, transfer_timeout=5.0))
    core = p.core
    p.client.send_begin(begin(1, LONG_ID))
    p.client.send_begin(begin(2, LONG_ID))
    p.pump()
    keys = [e.key for e in p.events if isinstance(e, TransferArrived)]
    assert len(keys) == 2
    core.abort(keys[0], "no room for it", 1.0)
    core.handle_timer(10.0)  # the other one's deadline passed
    p.pump()
    return p, [e for e in p.events if isinstance(e, TransferFailed)]


def test_failed_transfers_quote_a_shortened_request_id_and_keep_only_wire_text() -> None:
    from kvwire.session.receiver import WIRE_TEXT_LIMIT

    p, failed = _aborted_and_timed_out()
    assert [f.error.code for f in failed] == [ErrorCode.CANCELLED, ErrorCode.TIMEOUT]
    for f in failed:
        assert f.request_id == LONG_ID  # the event names it whole; its message does not
        assert len(str(f.error)) < 2 * WIRE_TEXT_LIMIT, str(f.error)[:200]
    assert "no room for it" in str(failed[0].error)
    [tombstones] = [s.tombstones for s in p.core._sessions.values()]
    assert set(tombstones) == {1, 2}
    for _code, text in tombstones.values():
        assert isinstance(text, str) and len(text) <= WIRE_TEXT_LIMIT
    resets = [(e.transfer_id, e.code, e.message) for e in p.client_events if isinstance(e, TransferReset)]
    assert sorted(resets) == sorted((tid, code, text) for tid, (code, text) in tombstones.items())
