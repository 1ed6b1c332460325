"""How a layer's tokens are split into chunks."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvwire.wire import plan_chunks


@given(
    tokens=st.integers(0, 20_000), bpt=st.integers(1, 65_536), chunk=st.integers(1, 8 << 20),
    align=st.sampled_from([1, 16, 32, 64]), lead=st.integers(0, 1 << 20),
)
def test_ranges_cover_the_layer_in_order_and_aligned(tokens: int, bpt: int, chunk: int, align: int, lead: int) -> None:
    plan = plan_chunks(tokens, bpt, chunk, align=align, lead_bytes=lead)
    start = 0
    for s, c in plan:
        assert s == start and c > 0
        start += c
    assert start == tokens
    per = max(1, chunk // bpt)
    if per >= align:
        assert all(c % align == 0 for _, c in plan[:-1])  # block-grouped codecs see whole blocks
    plain = plan_chunks(tokens, bpt, chunk, align=align)
    if lead and plan != plain:
        # only the first range was split, into a small lead and the rest of it
        first = max(align, lead // bpt // align * align)
        assert plan[0] == (0, first) and plan[1] == (first, plain[0][1] - first)
        assert plan[2:] == plain[1:]
    elif plain:
        assert not lead or plain[0][1] <= max(align, lead // bpt // align * align)


def test_a_lead_chunk_of_64_kib() -> None:
    # 2 KiB per token: a 4 MiB chunk is 2048 tokens, the lead 32 of them
    assert plan_chunks(5000, 2048, 4 << 20, lead_bytes=64 << 10) == [(0, 32), (32, 2016), (2048, 2048), (4096, 904)]
    assert plan_chunks(5000, 2048, 4 << 20) == [(0, 2048), (2048, 2048), (4096, 904)]
    assert plan_chunks(20, 2048, 4 << 20, lead_bytes=64 << 10) == [(0, 20)]  # already small
    assert plan_chunks(0, 2048, 4 << 20, lead_bytes=64 << 10) == []


@given(tokens=st.integers(1, 1 << 20), bpt=st.integers(1, 4096), chunk=st.integers(1, 1 << 16),
       align=st.sampled_from([1, 32]), lead=st.sampled_from([0, 64 << 10]))
def test_a_plan_never_has_more_ranges_than_a_receiver_keeps(tokens: int, bpt: int, chunk: int, align: int,
                                                            lead: int) -> None:
    from kvwire.wire.transfer import MAX_RANGES

    plan = plan_chunks(tokens, bpt, chunk, align=align, lead_bytes=lead)
    assert len(plan) <= MAX_RANGES
    assert sum(c for _, c in plan) == tokens
    if -(-tokens // (MAX_RANGES - 1)) > max(1, chunk // bpt) and not lead:  # stretched: still aligned
        assert all(c % align == 0 for _, c in plan[:-1])
