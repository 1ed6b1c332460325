"""``Codec.decode_ranges()`` into a buffer that holds the payload itself (a chunk received
into the region it is decoded into): the rows written are :meth:`Codec.decode`'s, as
where the payload lies elsewhere, however the ranges overlap it.  The compiled loops read
such a payload from a copy (``decode()`` does the same, ``_host._target``); without the
extension ``decode_ranges`` returns False with nothing written and the caller decodes."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.codec import Codec, Int4Codec, TensorKind, _host, get_codec, numpy_dtype

CODECS = ["fp8", "int8", "int4/1", "int4/3", "int4/32"]


def codec_named(name: str) -> Codec:
    if name.startswith("int4/"):
        return Int4Codec(int(name.split("/")[1]))
    return get_codec(name)


@st.composite
def cases(draw: st.DrawFn) -> tuple[str, TensorKind, str, tuple[int, int, int], int, int, list[int], list[bool], int]:
    name = draw(st.sampled_from(CODECS))
    kind = draw(st.sampled_from([TensorKind.K, TensorKind.V]))
    dtype = draw(st.sampled_from(["float16", "bfloat16", "float32"]))
    shape = (draw(st.integers(1, 9)), draw(st.integers(1, 2)), draw(st.sampled_from([2, 4, 8, 16, 64])))
    item = numpy_dtype(dtype).itemsize
    row = shape[1] * shape[2] * item  # one token's bytes
    src = draw(st.integers(0, 3 * row))  # where the payload lies
    dst = draw(st.integers(0, 3 * row // item)) * item  # where the first token goes
    # the tokens cut into ranges (one after the other from dst), some of them skipped
    cuts = sorted(draw(st.sets(st.integers(1, shape[0] - 1), max_size=4))) if shape[0] > 1 else []
    skips = draw(st.lists(st.booleans(), min_size=len(cuts) + 1, max_size=len(cuts) + 1))
    seed = draw(st.integers(0, 2**32 - 1))
    return name, kind, dtype, shape, src, dst, cuts, skips, seed


@settings(max_examples=150, deadline=None)
@given(case=cases())
def test_a_payload_inside_the_destination_decodes_as_decode_does(
    case: tuple[str, TensorKind, str, tuple[int, int, int], int, int, list[int], list[bool], int],
) -> None:
    name, kind, dtype, shape, src, dst, cuts, skips, seed = case
    codec = codec_named(name)
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    chunk = codec.encode(x, kind)
    payload = bytes(memoryview(chunk.payload).cast("B"))
    want_rows = codec.decode(chunk.params, payload, shape=shape, dtype=dtype, kind=kind)
    row = want_rows[0].nbytes
    store = np.zeros(max(src + len(payload), dst + shape[0] * row) + 16, np.uint8)  # aligned
    store[src : src + len(payload)] = np.frombuffer(payload, np.uint8)
    want = store.copy()
    spans = []
    for a, b, skip in zip([0, *cuts], [*cuts, shape[0]], skips, strict=True):
        spans.append((-1 if skip else dst + a * row, (b - a) * row))
        if not skip:
            want[dst + a * row : dst + b * row] = np.frombuffer(want_rows[a:b].tobytes(), np.uint8)
    before = store.copy()
    base = memoryview(store)
    done = codec.decode_ranges(
        chunk.params, base[src : src + len(payload)], base, np.array(spans, np.int64).tobytes(),
        shape=shape, dtype=dtype, kind=kind,
    )
    if not done:  # nothing written: the caller decodes
        assert _host.ext is None
        assert bytes(store) == bytes(before)
        return
    assert bytes(store) == bytes(want)


def test_the_row_codecs_decode_over_their_own_payload() -> None:
    """The case as found: int8 rows decoded to where their payload starts."""
    codec = get_codec("int8")
    x = np.random.default_rng(0).standard_normal((4, 2, 64)).astype(np.float32)
    chunk = codec.encode(x, TensorKind.K)
    payload = bytes(memoryview(chunk.payload).cast("B"))
    ref = codec.decode(b"", payload, shape=x.shape, dtype="float32", kind=TensorKind.K)
    store = np.zeros(8 * 64 * 4 + len(payload), np.uint8)
    store[: len(payload)] = np.frombuffer(payload, np.uint8)
    base = memoryview(store)
    done = codec.decode_ranges(b"", base[: len(payload)], base, np.array([0, 8 * 64 * 4], np.int64).tobytes(),
                               shape=x.shape, dtype="float32", kind=TensorKind.K)
    assert done is (_host.ext is not None)
    if done:
        assert np.array_equal(store[: 8 * 64 * 4].view(np.float32).reshape(x.shape), ref)

