"""The in-place payload sink takes only places the frame decoder can read into: a store
whose ``region()`` names anything else (a read-only member of a tuple, a view of another
format, one not contiguous) has the chunk read into a private buffer and decoded, as any
other; the connection is never failed for the store's answer."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvwire.session.receiver import LayerReady, Region
from kvwire.wire import Chunk, ChunkAcked, State
from tests.session.receiver_harness import (
    BIG,
    BPT,
    CountingStore,
    Harness,
    begin,
    chunk,
    split_after,
)


class OddRegionStore(CountingStore):
    """Names a raw payload's place as ``how`` says: not something to read into."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def region(self, key: Any, head: Chunk, buffer: Any, offset: int, nbytes: int) -> Region | None:
        place = buffer[offset : offset + nbytes]
        half = nbytes // 2
        if self.how == "a read-only member of a tuple":
            return (place[:half], place[half:].toreadonly())
        if self.how == "read-only":
            return place.toreadonly()  # type: ignore[no-any-return]
        if self.how == "float16":
            return memoryview(np.frombuffer(place, np.float16).copy())
        if self.how == "strided":
            return memoryview(np.zeros(2 * nbytes, np.uint8)[::2])
        if self.how == "an empty member of a tuple":
            return (place[:half], place[:0], place[half:])
        return (place[:half], place[half:])  # "a tuple of writable bytes": read in place


@pytest.mark.parametrize("how", ["a read-only member of a tuple", "read-only", "float16", "strided",
                                 "an empty member of a tuple"])
def test_a_region_the_decoder_cannot_read_into_is_declined_and_the_chunk_decoded(how: str) -> None:
    store = OddRegionStore(how)
    h = Harness(store=store)
    h.client.send_begin(begin(layers=1))
    h.pump()
    tokens = 2 * BIG
    h.send(chunk(layer=0, kind=0, start=0, count=tokens, tokens=tokens))  # tells the layer size
    c = chunk(layer=0, kind=1, start=0, count=tokens, tokens=tokens)
    h.send(c, split_after(40))  # a frame above 64 KiB: its payload would be read into the region
    assert h.client.state is State.OPEN
    assert store.decodes == 2  # read into a private buffer, then decoded
    half = tokens * BPT
    assert bytes(store.buffers[0][half:]) == c.payload
    assert [e.layer for e in h.of(LayerReady)] == [0]
    assert len(h.client_of(ChunkAcked)) == 2


def test_a_tuple_of_writable_byte_places_is_read_in_place() -> None:
    store = OddRegionStore("a tuple of writable bytes")
    h = Harness(store=store)
    h.client.send_begin(begin(layers=1))
    h.pump()
    tokens = 2 * BIG
    h.send(chunk(layer=0, kind=0, start=0, count=tokens, tokens=tokens))
    c = chunk(layer=0, kind=1, start=0, count=tokens, tokens=tokens)
    h.send(c, split_after(40))
    assert store.decodes == 1  # not decoded: it landed in its places
    assert bytes(store.buffers[0][tokens * BPT :]) == c.payload
    assert [e.layer for e in h.of(LayerReady)] == [0]
