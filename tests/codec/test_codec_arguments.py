"""Arguments of the wrong type or value are the caller's UsageError, found before anything
is sized, allocated or decoded; a peer's payload that cannot be right is its ProtocolError."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.codec import Codec, Int4Codec, TensorKind, available_codecs, codec_by_id, get_codec
from kvwire.errors import ProtocolError, UsageError


@pytest.mark.parametrize("group", [16.0, 32.5, "32", np.float32(8), True, None, 0, 256, -1])
def test_int4_group_must_be_an_int_in_range(group: Any) -> None:
    # A float group was taken and failed at the first encode with a TypeError; a string
    # failed the range comparison with one.
    with pytest.raises(UsageError, match="group size must be an int"):
        Int4Codec(group)


@settings(max_examples=40, deadline=None)
@given(group=st.integers(1, 255), numpy_int=st.booleans())
def test_int4_group_takes_any_integer_in_range(group: int, numpy_int: bool) -> None:
    codec = Int4Codec(np.int64(group) if numpy_int else group)  # type: ignore[arg-type]
    assert type(codec.group) is int and codec.group == group
    x = np.linspace(-1, 1, 4 * 2 * 8, dtype=np.float16).reshape(4, 2, 8)
    chunk = codec.encode(x, TensorKind.K)
    assert chunk.params == bytes([group])


ENTROPY = [f"{base}+{method}" for base in ("raw", "fp8", "int8", "int4") for method in ("zstd", "lz4")]
SHAPE = (4, 2, 8)
BAD_SHAPES = [(4, 16), (4, 2, 8, 1), (4.0, 2, 8), (np.int64(4), 2, 8), (0, 2, 8), (4, -2, 8), (True, 2, 8),
              [4, 2, 8], None, "428"]


def _compressed(name: str) -> Any:
    chunk = get_codec(name).encode(np.zeros(SHAPE, np.float16), TensorKind.K)
    assert chunk.params[0] == 1  # zeros compress: the flag says the payload is compressed
    return chunk


def _decode_both_ways(name: str, shape: Any, dtype: Any, kind: Any) -> list[type]:
    """The exception type of decode and of decode_ranges (None when nothing was raised)."""
    codec = get_codec(name)
    chunk = _compressed(name)
    base = memoryview(bytearray(4 * 2 * 8 * 4))
    spans = np.array([0, 4 * 2 * 8 * 2], np.int64)
    got: list[type] = []
    for call in (
        lambda: codec.decode(chunk.params, chunk.payload, shape=shape, dtype=dtype, kind=kind),
        lambda: codec.decode_ranges(chunk.params, chunk.payload, base, spans.data, shape=shape, dtype=dtype, kind=kind),
    ):
        try:
            call()
        except Exception as exc:
            got.append(type(exc))
        else:
            got.append(type(None))
    return got


@settings(max_examples=80, deadline=None)
@given(name=st.sampled_from(ENTROPY), shape=st.sampled_from(BAD_SHAPES))
def test_entropy_decode_refuses_a_bad_shape_before_sizing_the_payload(name: str, shape: Any) -> None:
    # With the flag byte saying "compressed", the inner payload was sized from the shape
    # before anything checked it: an IndexError, TypeError, ValueError or OverflowError.
    assert _decode_both_ways(name, shape, "float16", TensorKind.K) == [UsageError, UsageError]


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(ENTROPY), kind=st.sampled_from([2, -1, "K", None, 1.5, b"\x00"]))
def test_entropy_decode_refuses_a_bad_kind_as_the_callers_mistake(name: str, kind: Any) -> None:
    # int4 sized the payload of any kind but K as a V chunk's, and the size that did not
    # match was reported as the peer's ProtocolError.
    assert _decode_both_ways(name, SHAPE, "float16", kind) == [UsageError, UsageError]


@pytest.mark.parametrize("name", ENTROPY)
@pytest.mark.parametrize("dtype", ["float64", None, "int8", ["float16"]])
def test_entropy_decode_refuses_a_bad_dtype(name: str, dtype: Any) -> None:
    assert _decode_both_ways(name, SHAPE, dtype, TensorKind.K) == [UsageError, UsageError]


@pytest.mark.parametrize("name", [n for n in ENTROPY if n.endswith("lz4")])
def test_lz4_output_too_large_for_a_block_is_a_protocol_error(name: str) -> None:
    # python-lz4 takes the output size as a C int: 2**31 bytes or more was an OverflowError.
    chunk = _compressed(name)
    with pytest.raises(ProtocolError, match="more than an lz4 block holds"):
        get_codec(name).decode(chunk.params, chunk.payload, shape=(2**31, 1, 2), dtype="float16", kind=TensorKind.K)


@pytest.mark.parametrize("name", ["int4+zstd", "int4+lz4", "fp8+zstd"])
def test_gpu_decode_checks_shape_and_kind_before_sizing_the_payload(name: str) -> None:
    # decode_into's host part sizes the compressed payload as the entropy codecs do.
    from kvwire.codec import gpu

    chunk = _compressed(name)
    with pytest.raises(UsageError):
        gpu._plain(get_codec(name), chunk.params, chunk.payload, SHAPE, "float16", "K")  # type: ignore[arg-type]
    with pytest.raises(UsageError):
        gpu._plain(get_codec(name), chunk.params, chunk.payload, (0, 2, 8), "float16", TensorKind.K)
    _base, _params, plain = gpu._plain(get_codec(name), chunk.params, chunk.payload, SHAPE, "float16", TensorKind.K)
    inner = get_codec(name.split("+")[0])
    assert bytes(plain) == bytes(memoryview(inner.encode(np.zeros(SHAPE, np.float16), TensorKind.K).payload).cast("B"))


ALL = available_codecs()


@settings(max_examples=80, deadline=None)
@given(name=st.sampled_from(ALL), params=st.sampled_from([None, "\x00", "", 1, 1.0, [0], object()]),
       reference=st.booleans())
def test_params_that_are_not_bytes_are_a_usage_error(name: str, params: Any, reference: bool) -> None:
    # int4 raised a TypeError for params=None (len) and for a str (its group was a str);
    # the entropy codecs raised one for a str (the flag byte test).
    codec = get_codec(name)
    chunk = codec.encode(np.zeros(SHAPE, np.float16), TensorKind.K)
    decode = getattr(codec, "decode_numpy", codec.decode) if reference else codec.decode
    with pytest.raises(UsageError, match="params must be a bytes-like object"):
        decode(params, chunk.payload, shape=SHAPE, dtype="float16", kind=TensorKind.K)
    base = memoryview(bytearray(4 * 2 * 8 * 2))
    spans = np.array([0, base.nbytes], np.int64)
    if type(codec).decode_ranges is not Codec.decode_ranges:
        with pytest.raises(UsageError, match="params must be a bytes-like object"):
            codec.decode_ranges(params, chunk.payload, base, spans.data, shape=SHAPE, dtype="float16", kind=TensorKind.K)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("params_type", [bytes, bytearray, memoryview])
def test_params_of_any_bytes_like_type_decode_alike(name: str, params_type: Any) -> None:
    codec = get_codec(name)
    x = np.linspace(-2, 2, 4 * 2 * 8, dtype=np.float16).reshape(SHAPE)
    chunk = codec.encode(x, TensorKind.V)
    want = codec.decode(chunk.params, chunk.payload, shape=SHAPE, dtype="float16", kind=TensorKind.V)
    got = codec.decode(params_type(chunk.params), chunk.payload, shape=SHAPE, dtype="float16", kind=TensorKind.V)
    assert got.tobytes() == want.tobytes()


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from([n for n in ALL if not n.startswith("raw")]),
       form=st.sampled_from(["bytes", "readonly view", "readonly array", "str", "none"]))
def test_decode_ranges_into_a_read_only_base_is_a_usage_error(name: str, form: str) -> None:
    # The compiled loops' argument parser raised a TypeError for a read-only base.
    codec = get_codec(name)
    x = np.zeros(SHAPE, np.float16)
    chunk = codec.encode(x, TensorKind.K)
    size = x.nbytes
    base: Any = {
        "bytes": bytes(size),
        "readonly view": memoryview(bytearray(size)).toreadonly(),
        "readonly array": np.frombuffer(bytes(size), np.uint8),
        "str": "a" * size,
        "none": None,
    }[form]
    spans = np.array([0, size], np.int64)
    with pytest.raises(UsageError, match="base"):
        codec.decode_ranges(chunk.params, chunk.payload, base, spans.data, shape=SHAPE, dtype="float16", kind=TensorKind.K)


@pytest.mark.parametrize("name", ["int4+zstd", "raw+lz4"])
def test_gpu_decode_refuses_params_that_are_not_bytes(name: str) -> None:
    from kvwire.codec import gpu

    chunk = _compressed(name)
    with pytest.raises(UsageError, match="params must be a bytes-like object"):
        gpu._plain(get_codec(name), chunk.params.decode("latin-1"), chunk.payload, SHAPE, "float16", TensorKind.K)


@pytest.mark.parametrize("shape", [(2**19, 1, 2**10), (2**19, 1, 2**11 - 1), (256, 2, 8)])
def test_lz4_size_no_block_of_its_length_reaches_is_refused_before_allocating(
    shape: tuple[int, int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The output of the claimed size was allocated before decompressing: a 24-byte payload
    # decoded as a chunk of about 1 or 2 GiB raised MemoryError under a memory limit.
    import lz4.block

    chunk = get_codec("raw+lz4").encode(np.zeros(SHAPE, np.float16), TensorKind.K)
    payload = bytes(memoryview(chunk.payload).cast("B"))
    assert 255 * len(payload) < shape[0] * shape[1] * shape[2] * 2

    def refuse(*args: Any, **kwargs: Any) -> bytes:
        raise AssertionError("lz4 was asked to decompress into an output no block of this length fills")

    monkeypatch.setattr(lz4.block, "decompress", refuse)
    with pytest.raises(ProtocolError, match="cannot decompress to"):
        get_codec("raw+lz4").decode(chunk.params, payload, shape=shape, dtype="float16", kind=TensorKind.K)


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(1, 4096), base=st.sampled_from(["raw", "fp8", "int8", "int4"]),
       dtype=st.sampled_from(["float16", "bfloat16", "float32"]))
def test_lz4_most_compressible_chunks_still_decode(tokens: int, base: str, dtype: str) -> None:
    # Zeros compress about as far as lz4 goes (close to 255 times on long runs): the bound
    # above never refuses a payload the encoder made.
    from kvwire.codec import numpy_dtype

    x = np.zeros((tokens, 2, 128), numpy_dtype(dtype))
    codec = get_codec(f"{base}+lz4")
    chunk = codec.encode(x, TensorKind.K)
    y = codec.decode(chunk.params, chunk.payload, shape=x.shape, dtype=dtype, kind=TensorKind.K)
    assert y.shape == x.shape and not y.astype(np.float32).any()


@pytest.mark.parametrize("name", [n for n in ALL if type(get_codec(n)).decode_ranges is not Codec.decode_ranges])
def test_decode_ranges_into_a_non_contiguous_base_is_a_usage_error(name: str) -> None:
    # A writable array with strides passed the base check and failed in the compiled
    # loops' argument parser (or in the alignment check) with a ValueError.
    codec = get_codec(name)
    x = np.linspace(-1, 1, 4 * 2 * 8, dtype=np.float16).reshape(SHAPE)
    chunk = codec.encode(x, TensorKind.K)
    base = np.zeros((4, 2, 16), np.float16)[:, :, ::2]
    spans = np.array([0, x.nbytes], np.int64)
    with pytest.raises(UsageError, match="base must be C-contiguous"):
        codec.decode_ranges(chunk.params, chunk.payload, base, spans.data, shape=SHAPE, dtype="float16", kind=TensorKind.K)
    assert not base.any()


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from([n for n in ALL if type(get_codec(n)).decode_ranges is not Codec.decode_ranges]),
       form=st.sampled_from(["list", "none", "str", "odd bytes", "empty", "strided"]))
def test_decode_ranges_spans_that_are_not_int64_pairs_are_a_usage_error(name: str, form: str) -> None:
    # A list raised the argument parser's TypeError.
    codec = get_codec(name)
    x = np.zeros(SHAPE, np.float16)
    chunk = codec.encode(x, TensorKind.K)
    base = bytearray(x.nbytes)
    spans: Any = {
        "list": [0, x.nbytes],
        "none": None,
        "str": "0 256",
        "odd bytes": np.array([0, x.nbytes], np.int64).tobytes()[:12],
        "empty": b"",
        "strided": np.array([0, 9, x.nbytes, 9], np.int64)[::2],
    }[form]
    with pytest.raises(UsageError, match="spans must be"):
        codec.decode_ranges(chunk.params, chunk.payload, base, spans, shape=SHAPE, dtype="float16", kind=TensorKind.K)
    assert not any(base)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("kind", [7, 2, -1, "K", None])
def test_every_codec_refuses_a_kind_other_than_k_or_v(name: str, kind: Any) -> None:
    # raw, fp8 and int8 encoded and decoded any kind (their chunks do not depend on it),
    # so fp8+zstd encoded a chunk of kind 7 and refused to decode it.
    codec = get_codec(name)
    x = np.linspace(-1, 1, 4 * 2 * 8, dtype=np.float16).reshape(SHAPE)
    with pytest.raises(UsageError, match="kind"):
        codec.encode(x, kind)
    chunk = codec.encode(x, TensorKind.V)
    with pytest.raises(UsageError, match="kind"):
        codec.decode(chunk.params, chunk.payload, shape=SHAPE, dtype="float16", kind=kind)
    reference = [getattr(codec, m) for m in ("encode_numpy", "decode_numpy") if hasattr(codec, m)]
    if reference:
        with pytest.raises(UsageError, match="kind"):
            reference[0](x, kind)
        with pytest.raises(UsageError, match="kind"):
            reference[1](chunk.params, chunk.payload, shape=SHAPE, dtype="float16", kind=kind)
    base = bytearray(x.nbytes)
    spans = np.array([0, x.nbytes], np.int64)
    if type(codec).decode_ranges is not Codec.decode_ranges and not name.startswith("raw"):
        with pytest.raises(UsageError, match="kind"):
            codec.decode_ranges(chunk.params, chunk.payload, base, spans.data, shape=SHAPE, dtype="float16", kind=kind)
    if type(codec).encode_ranges is not Codec.encode_ranges and not name.startswith("raw"):
        with pytest.raises(UsageError, match="kind"):
            codec.encode_ranges(memoryview(x.reshape(-1).view(np.uint8)), spans.data, SHAPE, "float16", kind)


@pytest.mark.parametrize("name", ALL)
def test_kind_k_and_v_as_ints_encode_as_the_enum_does(name: str) -> None:
    codec = get_codec(name)
    x = np.linspace(-1, 1, 4 * 2 * 8, dtype=np.float16).reshape(SHAPE)
    for kind in TensorKind:
        want = codec.encode(x, kind)
        got = codec.encode(x, int(kind))  # type: ignore[arg-type]
        assert (got.params, bytes(memoryview(got.payload).cast("B"))) == (want.params, bytes(memoryview(want.payload).cast("B")))
        back = codec.decode(got.params, got.payload, shape=SHAPE, dtype="float16", kind=int(kind))  # type: ignore[arg-type]
        assert back.shape == SHAPE


@pytest.mark.parametrize("name", [["fp8"], {"fp8": 1}, None, 1, b"fp8"])
def test_get_codec_of_a_non_string_is_a_usage_error(name: Any) -> None:
    # A list raised TypeError (unhashable); bytes and None fell through to 'unknown codec'.
    with pytest.raises(UsageError, match="codec name is a str"):
        get_codec(name)


@pytest.mark.parametrize("codec_id", ["1", 1.0, None, [1], True])
def test_codec_by_id_of_a_non_int_is_a_usage_error(codec_id: Any) -> None:
    # A str raised ValueError from formatting the id for the unknown-codec message.
    with pytest.raises(UsageError, match="codec id is an int"):
        codec_by_id(codec_id)


def test_codec_by_id_takes_any_integer_and_refuses_an_unknown_one_as_the_peers() -> None:
    assert codec_by_id(np.uint8(1)) is get_codec("fp8")  # type: ignore[arg-type]
    assert codec_by_id(0x11) is get_codec("fp8+zstd")
    with pytest.raises(ProtocolError, match="unknown codec id 0x7f"):
        codec_by_id(0x7F)
