"""``Codec.encode_ranges()`` (fp8, int8, int4) checks its arguments as ``decode_ranges``
does, with :class:`~kvwire.UsageError`, with the compiled loops or without them: a base
that is not a C-contiguous buffer, spans that are not one or more int64 ``(start,
size)`` pairs (another element type of the right length was read as int64 pairs) of
whole rows inside the base holding the chunk's rows, a bad shape or dtype.  The compiled
path raised the extension's ValueError, BufferError or TypeError where the fallback
returned None; now both refuse the same arguments with the same exception type, and
otherwise give the gathered rows' payload (compiled) or None (the caller gathers)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.codec import Codec, Int4Codec, TensorKind, _host, get_codec, numpy_dtype
from kvwire.errors import UsageError
from tests.conftest import needs_extension

CODECS = ["fp8", "int8", "int4"]
# bytes below 0x40 are finite float16, bfloat16 and float32 values however they are read
STORE = np.random.default_rng(0).integers(0, 0x40, 4096, dtype=np.uint8)


def codec_named(name: str) -> Codec:
    return Int4Codec(2) if name == "int4" else get_codec(name)


def base_of(how: str) -> Any:
    store = STORE.copy()
    return {
        "array": memoryview(store),
        "bytes": bytes(store),  # read-only: fine for an encode
        "2-D": memoryview(store.reshape(64, 64)),
        "float32 view": memoryview(store.view(np.float32)),
        "not contiguous": memoryview(store)[::2],
        "misaligned": memoryview(bytearray(b"\0") + store.tobytes())[1:],
        "list": list(store[:8]),
        "None": None,
    }[how]


def spans_of(how: str, pairs: list[tuple[int, int]]) -> Any:
    arr = np.array(pairs, np.int64)
    return {
        "int64": arr,
        "bytes": arr.tobytes(),
        "memoryview": memoryview(arr),
        "uint64": arr.astype(np.uint64),
        "int32": np.array(pairs + pairs, np.int32),  # as many bytes as the int64 pairs
        "float64": arr.astype(np.float64),
        "list": [x for p in pairs for x in p],
        "not contiguous": np.repeat(arr, 2, axis=0)[::2],
        "empty": b"",
        "odd length": arr.tobytes()[:-8],
        "None": None,
    }[how]


@st.composite
def arguments(draw: st.DrawFn) -> tuple[str, str, str, Any, str, Any]:
    name = draw(st.sampled_from(CODECS))
    base = draw(st.sampled_from(["array", "array", "array", "bytes", "2-D", "float32 view", "not contiguous",
                                 "misaligned", "list", "None"]))
    dtype = draw(st.sampled_from(["float16", "bfloat16", "float32", "float16", "int8"]))
    item = numpy_dtype(dtype).itemsize if dtype != "int8" else 1
    tokens, heads, dim = draw(st.integers(1, 6)), draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, 3, 8]))
    row = dim * item
    rows = tokens * heads
    # the rows in runs at row-aligned places, maybe with odd pairs in among them
    cuts = sorted(draw(st.sets(st.integers(1, rows - 1), max_size=3))) if rows > 1 else []
    pairs = []
    for a, b in zip([0, *cuts], [*cuts, rows], strict=True):
        at = draw(st.integers(0, (1024 - (b - a) * row) // row)) * row
        pairs.append((at, (b - a) * row))
    odd = draw(st.sampled_from([None, None, None, "outside", "negative", "empty", "not rows", "misaligned",
                                "too few", "too many"]))
    if odd == "outside":
        pairs[0] = (4096 - row + item, pairs[0][1])
    elif odd == "negative":
        pairs[0] = (-row, pairs[0][1])
    elif odd == "empty":
        pairs[0] = (pairs[0][0], 0)
    elif odd == "not rows" and row > 1:
        pairs[0] = (pairs[0][0], pairs[0][1] - 1)
    elif odd == "misaligned" and item > 1:
        pairs[0] = (pairs[0][0] + 1, pairs[0][1])
    elif odd == "too few" and len(pairs) > 1:
        pairs = pairs[1:]
    elif odd == "too many":
        pairs.append((0, row))
    spans = draw(st.sampled_from(["int64", "int64", "bytes", "memoryview", "uint64", "int32", "float64", "list",
                                  "not contiguous", "empty", "odd length", "None"]))
    shape: Any = draw(st.sampled_from([(tokens, heads, dim)] * 4 + [(0, heads, dim), [tokens, heads, dim],
                                                                      (2**40, 2**20, 64), (tokens, heads)]))
    kind: Any = draw(st.sampled_from([TensorKind.K, TensorKind.V, int(TensorKind.V), 7]))
    return name, base, dtype, shape, spans, (pairs, kind)


def outcome(codec: Codec, base: Any, spans: Any, shape: Any, dtype: str, kind: Any) -> Any:
    try:
        return codec.encode_ranges(base, spans, shape, dtype, kind)
    except Exception as exc:  # the type is what is compared
        return type(exc)


@needs_extension(_host.ext is not None, "kvwire.codec._hostcodec")
@settings(max_examples=400, deadline=None)
@given(args=arguments())
def test_compiled_and_fallback_refuse_the_same_arguments_alike(args: tuple[str, str, str, Any, str, Any]) -> None:
    name, base_how, dtype, shape, spans_how, (pairs, kind) = args
    codec = codec_named(name)
    base, spans = base_of(base_how), spans_of(spans_how, pairs)
    compiled = outcome(codec, base, spans, shape, dtype, kind)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_host, "ext", None)
        fallback = outcome(codec, base, spans, shape, dtype, kind)
    if isinstance(compiled, type):
        assert issubclass(compiled, UsageError)
        assert fallback is compiled
        return
    assert fallback is None
    if compiled is not None:  # the rows' payload, as encode() gives for them gathered
        raw = np.frombuffer(memoryview(base).cast("B"), np.uint8)
        rows = np.concatenate([raw[s : s + n] for s, n in np.frombuffer(memoryview(spans).cast("B"), np.int64)
                               .reshape(-1, 2).tolist()])
        want = codec.encode(rows.view(numpy_dtype(dtype)).reshape(shape), kind)
        assert bytes(memoryview(compiled.payload).cast("B")) == bytes(memoryview(want.payload).cast("B"))


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize(("base", "spans", "says"), [
    pytest.param(bytes(64), np.array([0, 32, 0, 32], np.int32), "elements of format 'i'", id="int32 spans"),
    pytest.param(bytes(64), [0, 32], "spans must be a bytes-like", id="a list of spans"),
    pytest.param(memoryview(bytes(128))[::2], np.array([0, 32], np.int64), "C-contiguous", id="strided base"),
    pytest.param(bytes(64), np.array([0, 32, 0, 32], np.int64)[::2], "contiguous buffer", id="strided spans"),
    pytest.param(bytes(64), np.array([48, 32], np.int64), "not whole rows", id="outside the base"),
    pytest.param(bytes(64), np.array([0, 16], np.int64), "ranges of 16 bytes in all, for a chunk of 32",
                 id="too few rows"),
])
def test_bad_ranges_are_a_usage_error(name: str, base: Any, spans: Any, says: str) -> None:
    with pytest.raises(UsageError, match=says):
        codec_named(name).encode_ranges(base, spans, (2, 1, 8), "float16", TensorKind.K)


@pytest.mark.parametrize("name", CODECS)
def test_decode_ranges_refuses_spans_of_another_element_type(name: str) -> None:
    codec = codec_named(name)
    x = np.ones((2, 1, 8), np.float16)
    chunk = codec.encode(x, TensorKind.K)
    with pytest.raises(UsageError, match="elements of format 'i'"):
        codec.decode_ranges(chunk.params, chunk.payload, bytearray(64), np.array([0, 32, 0, 0], np.int32),
                            shape=(2, 1, 8), dtype="float16", kind=TensorKind.K)
