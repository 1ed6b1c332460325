"""The compiled int4 loops (``_hostcodec.int4_encode``/``int4_decode``, private) with any
positive group size: a group larger than what it groups (a K group than the chunk's
tokens, a V group than a head's channels) is one group of them, the numpy reference's
bytes for that group, up to a group of 2**63 - 1, where the group count once overflowed
to 0 (so empty scale buffers passed and the loops wrote past them).  Without the
extension there is nothing compiled to check (``Int4Codec`` takes groups 1..255 only)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.codec import Int4Codec, TensorKind, _host
from kvwire.codec.int4 import group_count
from tests.conftest import needs_extension

EXT = "kvwire.codec._hostcodec"
pytestmark = needs_extension(_host.ext is not None, EXT)
HUGE = [256, 1 << 31, 1 << 62, (1 << 63) - 2, (1 << 63) - 1]


@settings(max_examples=120, deadline=None)
@given(
    tokens=st.integers(1, 40), heads=st.integers(1, 3), dim=st.integers(1, 40),
    group=st.one_of(st.integers(1, 300), st.sampled_from(HUGE)),
    kind=st.sampled_from([TensorKind.K, TensorKind.V]), seed=st.integers(0, 2**32 - 1),
)
def test_any_group_size_gives_the_reference_bytes_of_the_group_used(
    tokens: int, heads: int, dim: int, group: int, kind: TensorKind, seed: int,
) -> None:
    ext = _host.ext
    assert ext is not None
    shape = (tokens, heads, dim)
    is_v = kind == TensorKind.V
    used = min(group, dim if is_v else tokens)  # at most 40: a group the reference takes
    ref = Int4Codec(used)
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    want = bytes(memoryview(ref.encode_numpy(x, kind).payload).cast("B"))
    ng = group_count(shape, kind, used)
    n = tokens * heads * dim
    sc, mn, pk = np.zeros(4 * ng, np.uint8), np.zeros(4 * ng, np.uint8), np.zeros((n + 1) // 2, np.uint8)
    assert ext.int4_encode(x.reshape(-1).view(np.uint8), 2, tokens, heads, dim, group, is_v, sc, mn, pk) == 0
    assert sc.tobytes() + mn.tobytes() + pk.tobytes() == want
    out = np.zeros(shape, np.float32)
    assert ext.int4_decode(sc, mn, pk, tokens, heads, dim, group, is_v, 2, out.reshape(-1).view(np.uint8)) == 0
    ref_out = ref.decode_numpy(bytes([used]), want, shape=shape, dtype="float32", kind=kind)
    assert out.tobytes() == ref_out.tobytes()


@pytest.mark.parametrize("group", HUGE)
@pytest.mark.parametrize("is_v", [False, True])
def test_a_huge_group_is_one_group(group: int, is_v: bool) -> None:
    """4 tokens of 1 head of 64 channels: one K group per channel, or one V group per
    token (the group count was 0 for the largest groups: buffers of the right size were
    refused, empty ones taken)."""
    ext = _host.ext
    assert ext is not None
    x = np.linspace(-2, 2, 4 * 64, dtype=np.float32).reshape(4, 1, 64)
    ng = 4 if is_v else 64
    sc, mn, pk = np.zeros(4 * ng, np.uint8), np.zeros(4 * ng, np.uint8), bytearray(128)
    assert ext.int4_encode(x.reshape(-1).view(np.uint8), 2, 4, 1, 64, group, is_v, sc, mn, pk) == 0
    whole = Int4Codec(64 if is_v else 4).encode_numpy(x, TensorKind.V if is_v else TensorKind.K)
    assert sc.tobytes() + mn.tobytes() + bytes(pk) == bytes(memoryview(whole.payload).cast("B"))
    out = bytearray(4 * 64 * 4)
    assert ext.int4_decode(sc, mn, bytes(pk), 4, 1, 64, group, is_v, 2, out) == 0
    with pytest.raises(ValueError, match="scales is 0 bytes"):
        ext.int4_encode(x.reshape(-1).view(np.uint8), 2, 4, 1, 64, group, is_v,
                        np.empty(0, np.uint8), np.empty(0, np.uint8), bytearray(128))
    with pytest.raises(ValueError, match="scales is 0 bytes"):
        ext.int4_decode(b"", b"", bytes(128), 4, 1, 64, group, is_v, 2, bytearray(4 * 64 * 4))
