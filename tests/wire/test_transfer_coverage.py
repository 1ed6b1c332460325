"""What a receiver counts as received (``IncomingTransfer``): K, V and, from protocol
version 2, KV chunks (a range of K and V in one frame) cover a layer together; duplicates
are by address; a KV range overlapping a K or V range, or the other way round, is a
protocol error."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.errors import ProtocolError
from kvwire.wire import KIND_K, KIND_KV, KIND_V, Chunk, ChunkAddress, ChunkVerdict, IncomingTransfer
from kvwire.wire.transfer import kinds_overlap, split_kv


def chunk(kind: int, start: int, count: int, tokens: int, layer: int = 0, codec_id: int = 0) -> Chunk:
    return Chunk(transfer_id=1, layer=layer, kind=kind, codec_id=codec_id, token_start=start, token_count=count,
                 layer_tokens=tokens, params=b"", payload=b"")


def transfer(layers: int = 1) -> IncomingTransfer:
    return IncomingTransfer(1, layers, layer_limit=layers, max_tokens=1 << 20)


def receive(t: IncomingTransfer, c: Chunk) -> ChunkVerdict:
    t.check(c)
    t.classify(c)
    return t.add(c)


def partition(draw: st.DrawFn, start: int, end: int) -> list[tuple[int, int]]:
    cuts = sorted(set(draw(st.lists(st.integers(start + 1, end - 1), max_size=4)))) if end - start > 1 else []
    bounds = [start, *cuts, end]
    return [(a, b - a) for a, b in itertools.pairwise(bounds)]


@st.composite
def layer_plans(draw: st.DrawFn) -> tuple[int, list[Chunk]]:
    """A layer's chunks in any order, with copies: segments as one KV chunk each, or as
    K and V chunks split independently."""
    tokens = draw(st.integers(1, 200))
    chunks = []
    for start, count in partition(draw, 0, tokens):
        if draw(st.booleans()):
            chunks.append(chunk(KIND_KV, start, count, tokens))
        else:
            for kind in (KIND_K, KIND_V):
                chunks += [chunk(kind, s, n, tokens) for s, n in partition(draw, start, start + count)]
    copies = draw(st.lists(st.sampled_from(chunks), max_size=3))
    return tokens, draw(st.permutations(chunks + copies))


@settings(max_examples=200, deadline=None)
@given(layer_plans())
def test_k_v_and_kv_chunks_complete_a_layer_together(plan: tuple[int, list[Chunk]]) -> None:
    _tokens, chunks = plan
    t = transfer()
    distinct = {c.address for c in chunks}
    seen = set()
    for c in chunks:
        assert not t.layer_complete(0)
        verdict = receive(t, c)
        assert verdict is (ChunkVerdict.DUPLICATE if c.address in seen else ChunkVerdict.NEW)
        seen.add(c.address)
        if seen == distinct:
            break
    assert t.layer_complete(0) and t.complete
    assert t.chunks_received == len(distinct)


@settings(max_examples=200, deadline=None)
@given(layer_plans(), st.data())
def test_a_range_overlapping_one_of_another_kind_is_refused(plan: tuple[int, list[Chunk]], data: st.DataObject) -> None:
    """A chunk overlapping a received one of a crossing kind (KV against K or V) or of
    its own kind at another start is a protocol error, and changes nothing."""
    tokens, chunks = plan
    t = transfer()
    received = data.draw(st.sampled_from(chunks))
    receive(t, received)
    if received.kind == KIND_KV:
        kind = data.draw(st.sampled_from([KIND_K, KIND_V]))
    else:
        kind = data.draw(st.sampled_from([KIND_KV, received.kind]))
    start = data.draw(st.integers(max(0, received.token_start - 5), received.token_start + received.token_count - 1))
    lo = received.token_start - start + 1  # reaches into the received range
    count = data.draw(st.integers(max(1, lo), tokens - start))
    other = chunk(kind, start, count, tokens)
    if other.address == received.address:
        return  # same address: a duplicate (or, with another count, an error checked elsewhere)
    with pytest.raises(ProtocolError, match="overlap"):
        t.classify(other)
    with pytest.raises(ProtocolError, match="overlap"):
        t.add(other)
    assert t.chunks_received == 1
    assert t.overlaps_received(0, kind, start, count)


def test_a_kv_chunk_is_raw_only() -> None:
    t = transfer()
    with pytest.raises(ProtocolError, match="raw data only"):
        t.check(chunk(KIND_KV, 0, 4, 4, codec_id=1))
    with pytest.raises(ProtocolError, match="raw data only"):
        t.check(Chunk(transfer_id=1, layer=0, kind=KIND_KV, codec_id=0, token_start=0, token_count=4,
                      layer_tokens=4, params=b"x", payload=b""))


def test_one_kv_chunk_per_layer_completes_the_transfer() -> None:
    t = transfer(3)
    for layer in range(3):
        assert receive(t, chunk(KIND_KV, 0, 16, 16, layer=layer)) is ChunkVerdict.NEW
        assert t.layer_complete(layer)
    assert t.complete and t.chunks_received == 3


def test_split_kv_gives_the_k_and_v_chunks_of_the_range() -> None:
    c = Chunk(transfer_id=1, layer=2, kind=KIND_KV, codec_id=0, token_start=4, token_count=2, layer_tokens=8,
              params=b"", payload=b"K" * 8 + b"V" * 8)
    k, v = split_kv(c)
    assert (k.kind, v.kind) == (KIND_K, KIND_V)
    assert (k.token_start, k.token_count, v.token_start, v.token_count) == (4, 2, 4, 2)
    assert bytes(k.payload) == b"K" * 8 and bytes(v.payload) == b"V" * 8
    with pytest.raises(ProtocolError, match="two equal halves"):
        split_kv(Chunk(transfer_id=1, layer=2, kind=KIND_KV, codec_id=0, token_start=4, token_count=2,
                       layer_tokens=8, params=b"", payload=b"x" * 15))


def test_kinds_overlap_is_the_coverage_rule() -> None:
    """The one rule both the coverage and the receiver's in-place reservations use: a KV
    range covers K and V, K and V do not cover each other; symmetric."""
    kinds = (KIND_K, KIND_V, KIND_KV)
    pairs = {(a, b) for a in kinds for b in kinds if kinds_overlap(a, b)}
    assert pairs == {(KIND_K, KIND_K), (KIND_V, KIND_V), (KIND_KV, KIND_KV), (KIND_K, KIND_KV),
                     (KIND_KV, KIND_K), (KIND_V, KIND_KV), (KIND_KV, KIND_V)}
    assert not kinds_overlap(7, KIND_K) and kinds_overlap(7, 7)


def test_a_complete_layer_forgets_its_ranges_and_takes_any_later_chunk_for_a_duplicate() -> None:
    """Once K and V cover the layer its ranges are dropped (a peer sending one token per
    chunk left megabytes of them per layer); a chunk for it after that, whatever its range,
    holds nothing new (as a chunk of a completed transfer)."""
    t = transfer(layers=2)
    for kind in (KIND_K, KIND_V):
        for start in range(63, -1, -1):
            assert receive(t, chunk(kind, start, 1, 64)) is ChunkVerdict.NEW
    assert t.layer_complete(0) and not t.complete
    assert not t._cov  # nothing kept for the complete layer
    for late in (chunk(KIND_K, 5, 1, 64), chunk(KIND_V, 3, 7, 64), chunk(KIND_KV, 0, 64, 64)):
        assert receive(t, late) is ChunkVerdict.DUPLICATE
    assert t.chunks_received == 128 and t.duplicates == 3
    assert receive(t, chunk(KIND_K, 0, 64, 64, layer=1)) is ChunkVerdict.NEW  # other layers as before


def test_a_layer_in_more_ranges_than_a_receiver_keeps_is_refused() -> None:
    from kvwire.errors import LimitExceededError
    from kvwire.wire.transfer import MAX_RANGES

    tokens = MAX_RANGES + 10
    t = transfer()
    for start in range(tokens - 1, tokens - 1 - MAX_RANGES, -1):
        receive(t, chunk(KIND_K, start, 1, tokens))
    with pytest.raises(LimitExceededError, match=f"more than {MAX_RANGES} chunks for one layer's K"):
        receive(t, chunk(KIND_K, 0, 1, tokens))
    assert t.chunks_received == MAX_RANGES
    assert receive(t, chunk(KIND_V, 0, tokens, tokens)) is ChunkVerdict.NEW  # per (layer, kind)



@settings(max_examples=200, deadline=None)
@given(layer_plans(), st.integers(1, 3), st.randoms(use_true_random=False))
def test_ranges_counts_what_is_remembered_and_completes_predicts_a_layers_end(
    plan: tuple[int, list[Chunk]], layers: int, rnd: random.Random,
) -> None:
    """``ranges`` is what a receiver charges its budget for: every range of a layer not yet
    complete, none of a complete one.  ``completes`` tells, before a NEW chunk is stored,
    whether it ends its layer (so it needs no budget for one more range)."""
    _tokens, chunks = plan
    t = transfer(layers)
    queues = [[dataclasses.replace(c, layer=i) for c in chunks] for i in range(layers)]
    remembered: dict[int, set[ChunkAddress]] = {i: set() for i in range(layers)}
    while any(queues):
        c = rnd.choice([q for q in queues if q]).pop(0)  # the layers interleaved
        t.check(c)
        new = t.classify(c) is ChunkVerdict.NEW
        ends = t.completes(c) if new else None
        t.add(c)
        done = t.layer_complete(c.layer)
        if new:
            remembered[c.layer].add(c.address)
            assert ends == done
        if done:
            remembered[c.layer].clear()
        assert t.ranges == sum(len(r) for r in remembered.values())
    assert t.ranges == 0 and t.complete
