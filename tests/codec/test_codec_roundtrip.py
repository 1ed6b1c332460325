"""Round trips, edge inputs, determinism, registry and malformed payloads for every codec."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import kvwire.codec as kc
from kvwire.codec import TensorKind, available_codecs, codec_by_id, get_codec, numpy_dtype
from kvwire.errors import ProtocolError, UsageError
from tests.codec.codec_helpers import DTYPES, QUANTIZERS, error_bound, group_params, output_rounding

ALL = available_codecs()
KINDS = (TensorKind.K, TensorKind.V)


def _payload_bytes(chunk: kc.EncodedChunk) -> bytes:
    return bytes(memoryview(chunk.payload).cast("B"))


def _roundtrip(name: str, x: np.ndarray[Any, Any], kind: TensorKind, dtype: str | None = None) -> tuple[kc.EncodedChunk, np.ndarray[Any, Any]]:
    chunk = get_codec(name).encode(x, kind)
    y = codec_by_id(chunk.codec_id).decode(
        chunk.params, chunk.payload, shape=x.shape, dtype=dtype or _name(x), kind=kind
    )
    return chunk, y


def _name(x: np.ndarray[Any, Any]) -> str:
    return next(n for n in DTYPES if x.dtype == numpy_dtype(n))


def _assert_within_bound(name: str, x: np.ndarray[Any, Any], kind: TensorKind) -> None:
    """The f32 decode within the codec's bound, and the decode to ``x``'s own dtype (what a
    receiver gets) within it plus half an ulp of that dtype (docs/codecs.md)."""
    base = name.split("+")[0]
    chunk, y = _roundtrip(name, x, kind, "float32")
    plain = get_codec(base).encode(x, kind)
    assert _payload_bytes(plain) == _payload_bytes(get_codec(base).encode(x, kind))
    scale, lo = group_params(base, plain.params, plain.payload, x.shape, kind)
    bound = error_bound(base, x, scale, lo)
    exact = x.astype(np.float32).astype(np.float64)
    err = np.abs(y.astype(np.float64) - exact)
    worst = np.argmax(err - bound)
    assert np.all(err <= bound), (name, x.reshape(-1)[worst], y.reshape(-1)[worst], bound.reshape(-1)[worst])
    own = _name(x)
    yd = codec_by_id(chunk.codec_id).decode(chunk.params, chunk.payload, shape=x.shape, dtype=own, kind=kind)
    err = np.abs(yd.astype(np.float64) - exact)
    bound = bound + output_rounding(own, y)
    worst = np.argmax(err - bound)
    assert np.all(err <= bound), (name, own, x.reshape(-1)[worst], yd.reshape(-1)[worst], bound.reshape(-1)[worst])


def test_registry_names_and_ids() -> None:
    expected = {"raw": 0x00, "fp8": 0x01, "int8": 0x02, "int4": 0x03}
    for base, cid in expected.items():
        assert get_codec(base).codec_id == cid
        assert get_codec(f"{base}+zstd").codec_id == cid | 0x10
        assert get_codec(f"{base}+lz4").codec_id == cid | 0x20
        assert codec_by_id(cid | 0x10).name == f"{base}+zstd"
    assert len(ALL) == 12
    with pytest.raises(ProtocolError):
        codec_by_id(0x04)
    with pytest.raises(UsageError):
        get_codec("fp4")


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_roundtrip_random(name: str, dtype: str, kind: TensorKind) -> None:
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((70, 3, 40)) * 2).astype(numpy_dtype(dtype))
    chunk, y = _roundtrip(name, x, kind)
    assert y.dtype == x.dtype and y.shape == x.shape
    if get_codec(name).lossless:
        assert y.tobytes() == x.tobytes()
    else:
        _assert_within_bound(name, x, kind)
        # decoding to a narrower dtype is the float32 decode rounded half to even
        y32 = codec_by_id(chunk.codec_id).decode(chunk.params, chunk.payload, shape=x.shape, dtype="float32", kind=kind)
        for other in DTYPES:
            yo = codec_by_id(chunk.codec_id).decode(chunk.params, chunk.payload, shape=x.shape, dtype=other, kind=kind)
            assert yo.tobytes() == y32.astype(numpy_dtype(other)).tobytes()


@pytest.mark.parametrize("base", QUANTIZERS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_decode_to_float16_or_bfloat16_is_within_the_bound_plus_half_an_ulp(
    base: str, dtype: str, kind: TensorKind,
) -> None:
    """The stated bounds are on the f32 decode; rounding it to a 16-bit spec dtype moves an
    element by up to half an ulp more (int8 on normal data: about 0.6 % of float16 and
    4 % of bfloat16 elements are past the f32 bound alone)."""
    x = np.random.default_rng(11).standard_normal((256, 8, 128)).astype(numpy_dtype(dtype))
    _assert_within_bound(base, x, kind)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("dtype", DTYPES)
def test_edge_blocks(name: str, dtype: str) -> None:
    dt = numpy_dtype(dtype)
    tiny = {"float16": 2.0**-24, "bfloat16": 2.0**-133, "float32": 2.0**-149}[dtype]
    cases = {
        "zeros": np.zeros((5, 2, 8), dt),
        "constant": np.full((5, 2, 8), -3.25, dt),
        "one_token": np.array([[[1.5, -2.0, 0.0, 7.0]]], dt),
        "subnormals": (np.arange(-40, 40).reshape(2, 4, 10) * tiny).astype(dt),
        "mixed_rows": np.stack([np.zeros((2, 6)), np.full((2, 6), 1e-3), np.linspace(-1, 1, 12).reshape(2, 6)]).astype(dt),
    }
    for label, x in cases.items():
        for kind in KINDS:
            _chunk, y = _roundtrip(name, x, kind)
            if label == "zeros" or get_codec(name).lossless:
                assert y.tobytes() == x.tobytes(), label
            else:
                _assert_within_bound(name, x, kind)
            if name.startswith("int4") and label == "constant":
                assert np.array_equal(y, x)


@pytest.mark.parametrize("name", [n for n in ALL if not n.startswith("raw")])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", DTYPES)
def test_nonfinite_rejected(name: str, bad: float, dtype: str) -> None:
    x = np.ones((4, 2, 8), numpy_dtype(dtype))
    x[2, 1, 3] = bad
    with pytest.raises(UsageError, match="NaN or infinity"):
        get_codec(name).encode(x, TensorKind.K)


@pytest.mark.parametrize("name", ["raw", "raw+zstd", "raw+lz4"])
def test_raw_carries_nonfinite_exactly(name: str) -> None:
    x = np.array([np.nan, np.inf, -np.inf, -0.0] * 4, np.float16).reshape(2, 2, 4)
    _, y = _roundtrip(name, x, TensorKind.V)
    assert y.tobytes() == x.tobytes()


def test_int4_range_overflow_is_usage_error() -> None:
    x = np.array([[[3e38, -3e38]]], np.float32).reshape(2, 1, 1)
    with pytest.raises(UsageError, match="exceeds float32"):
        get_codec("int4").encode(x, TensorKind.K)


@pytest.mark.parametrize("name", ALL)
def test_decode_into_out_and_strided_out(name: str) -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((9, 2, 16)).astype(np.float16)
    chunk = get_codec(name).encode(x, TensorKind.K)
    expected = codec_by_id(chunk.codec_id).decode(chunk.params, chunk.payload, shape=x.shape, dtype="float16", kind=TensorKind.K)
    out = np.full(x.shape, 99, np.float16)
    got = codec_by_id(chunk.codec_id).decode(chunk.params, chunk.payload, shape=x.shape, dtype="float16", kind=TensorKind.K, out=out)
    assert got is out and np.array_equal(out, expected)
    big = np.zeros((9, 2, 32), np.float16)
    view = big[:, :, ::2]
    codec_by_id(chunk.codec_id).decode(chunk.params, chunk.payload, shape=x.shape, dtype="float16", kind=TensorKind.K, out=view)
    assert np.array_equal(view, expected) and not big[:, :, 1::2].any()
    # an out of another dtype (nothing is cast) or shape (nothing is broadcast): every
    # codec, raw included, refuses it
    for wrong in (np.empty(x.shape, np.float32), np.empty((3, *x.shape), np.float16), np.empty((1, 2, 16), np.float16)):
        with pytest.raises(UsageError, match="out must be float16"):
            codec_by_id(chunk.codec_id).decode(chunk.params, chunk.payload, shape=x.shape, dtype="float16", kind=TensorKind.K, out=wrong)


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(ALL), kind=st.sampled_from(KINDS), dtype=st.sampled_from(DTYPES),
       form=st.sampled_from(["flag", "strided", "frombuffer"]), reference=st.booleans())
def test_property_read_only_out_is_a_usage_error(
    name: str, kind: TensorKind, dtype: str, form: str, reference: bool
) -> None:
    # a read-only out is refused before anything is decoded, with kvwire's UsageError on the
    # compiled path and the numpy path alike (it was a TypeError from the extension's
    # argument parsing, or numpy's ValueError)
    x = np.random.default_rng(4).standard_normal((5, 2, 6)).astype(numpy_dtype(dtype))
    codec = get_codec(name)
    chunk = codec.encode(x, kind)
    if form == "flag":
        out = np.zeros(x.shape, numpy_dtype(dtype))
        out.flags.writeable = False
    elif form == "strided":
        big = np.zeros((5, 2, 12), numpy_dtype(dtype))
        big.flags.writeable = False
        out = big[:, :, ::2]
    else:
        out = np.frombuffer(bytes(x.nbytes), numpy_dtype(dtype)).reshape(x.shape)
    decode = getattr(codec, "decode_numpy", codec.decode) if reference else codec.decode
    with pytest.raises(UsageError, match="read-only"):
        decode(chunk.params, chunk.payload, shape=x.shape, dtype=dtype, kind=kind, out=out)
    assert not out.any()


@pytest.mark.parametrize("name", ALL)
def test_an_out_that_is_not_an_array_and_a_kind_that_is_not_one_are_usage_errors(name: str) -> None:
    # They were an AttributeError ('list' object has no attribute 'shape') and, for int4,
    # a ValueError from the enum.
    x = np.random.default_rng(5).standard_normal((4, 2, 8)).astype(np.float16)
    codec = get_codec(name)
    chunk = codec.encode(x, TensorKind.K)
    for out in ([0], bytearray(x.nbytes), memoryview(bytearray(x.nbytes))):
        with pytest.raises(UsageError, match="out must be a numpy array"):
            codec.decode(chunk.params, chunk.payload, shape=x.shape, dtype="float16", kind=TensorKind.K, out=out)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=r"kind must be TensorKind\.K or TensorKind\.V"):
        TensorKind(2)
    if name.startswith("int4"):
        with pytest.raises(UsageError, match="kind must be"):
            codec.encode(x, 2)  # type: ignore[arg-type]


def test_fp8_codes_match_ml_dtypes_saturating_cast() -> None:
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((64, 4, 32)) * 50).astype(np.float32)
    x[0, 0, :4] = [1e-30, -1e-38, 2.0**-20, 0.0]
    chunk = get_codec("fp8").encode(x, TensorKind.K)
    raw = np.frombuffer(_payload_bytes(chunk), np.uint8)
    scales = raw[: 64 * 4 * 4].view("<f4").reshape(64, 4, 1)
    q = np.clip(x / np.where(scales == 0, 1, scales), -448, 448)
    ref = q.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert np.array_equal(raw[64 * 4 * 4 :].reshape(x.shape), ref)
    assert np.array_equal(scales[:, :, 0], np.abs(x).max(axis=2) / np.float32(448))


def test_entropy_stage_applied_only_when_it_shrinks() -> None:
    rng = np.random.default_rng(5)
    noise = rng.standard_normal((64, 2, 32)).astype(np.float16)
    smooth = np.zeros((64, 2, 32), np.float16)
    for name in ("raw+zstd", "raw+lz4", "fp8+zstd", "int4+lz4"):
        kept = get_codec(name).encode(smooth, TensorKind.K)
        assert kept.params[0] == 1 and len(_payload_bytes(kept)) < len(_payload_bytes(get_codec(name.split("+")[0]).encode(smooth, TensorKind.K)))
    dropped = get_codec("int4+lz4").encode(noise, TensorKind.V)
    assert dropped.params[0] == 0
    assert _payload_bytes(dropped) == _payload_bytes(get_codec("int4").encode(noise, TensorKind.V))


@pytest.mark.parametrize("shape", [(64, 8, 128), (64, 2, 80), (48, 2, 80)])
def test_encoded_size_ratio_matches_payload(shape: tuple[int, int, int]) -> None:
    """The expected size of a layer's chunks of ``shape``: the mean of its K and its V chunk
    (int4 groups K and V differently: they differ where head_dim or the token count is not
    a multiple of the group)."""
    x = np.ones(shape, np.float16)
    for name in ALL:
        codec = get_codec(name)
        base = get_codec(name.split("+")[0])
        chunks = [base.encode(x, kind) for kind in KINDS]
        actual = sum(len(_payload_bytes(c)) + len(c.params) for c in chunks) / (2 * x.nbytes)
        assert codec.encoded_size_ratio(x.shape, "float16") == pytest.approx(actual, abs=1e-4), name


@pytest.mark.parametrize("name", ALL)
def test_bad_inputs_are_usage_errors(name: str) -> None:
    """Every codec, raw included, takes only what the wire can say: a non-empty
    [tokens, heads, head_dim] array of float16, bfloat16 or float32, little-endian."""
    for bad in (np.ones((4, 4), np.float16), np.ones((2, 2, 2), np.int32), np.ones((0, 2, 2), np.float16),
                np.ones((2, 2, 2), np.float64), np.ones(3, np.float16), np.ones((2, 2, 2), ">f2"),
                np.ones((2, 2, 2), ">f4")):
        with pytest.raises(UsageError):
            get_codec(name).encode(bad, TensorKind.K)


@pytest.mark.parametrize("dtype", DTYPES)
def test_raw_payload_is_a_view_of_a_contiguous_input(dtype: str) -> None:
    """The transport's raw chunks (contiguous token ranges of checked arrays) are sent from
    the caller's memory: checking the input copies nothing."""
    x = np.arange(8 * 2 * 4, dtype=np.float32).astype(numpy_dtype(dtype)).reshape(8, 2, 4)
    part = x[2:5]
    payload = get_codec("raw").encode(part, TensorKind.K).payload
    assert np.shares_memory(np.frombuffer(payload, np.uint8), x)
    assert bytes(payload) == part.tobytes()


def _encoded(name: str) -> tuple[kc.EncodedChunk, tuple[int, int, int]]:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((33, 2, 24)).astype(np.float16)
    return get_codec(name).encode(x, TensorKind.V), x.shape  # type: ignore[return-value]


@pytest.mark.parametrize("name", ALL)
def test_malformed_payloads_raise_protocol_error(name: str) -> None:
    chunk, shape = _encoded(name)
    codec = codec_by_id(chunk.codec_id)
    data = _payload_bytes(chunk)
    variants: list[tuple[bytes, bytes]] = [
        (chunk.params, data[:-1]),
        (chunk.params, data + b"\0"),
        (chunk.params, b""),
        (chunk.params + b"\x07", data),
    ]
    if chunk.params:
        variants.append((chunk.params[:-1], data))
    if "+" in name:
        variants.append((bytes([0xFF]) + chunk.params[1:], data))
    if name.startswith("int4"):
        variants.append((chunk.params[:-1] + b"\0", data))
    for params, payload in variants:
        with pytest.raises(ProtocolError):
            codec.decode(params, payload, shape=shape, dtype="float16", kind=TensorKind.V)
    with pytest.raises(ProtocolError):
        codec.decode(chunk.params, data, shape=(shape[0] + 1, shape[1], shape[2]), dtype="float16", kind=TensorKind.V)


@pytest.mark.parametrize("base", QUANTIZERS)
def test_forged_scales_raise_protocol_error(base: str) -> None:
    chunk, shape = _encoded(base)
    data = bytearray(_payload_bytes(chunk))
    for value in (np.nan, np.inf, -1.0, 1e30):
        forged = bytearray(data)
        forged[0:4] = np.float32(value).tobytes()
        with pytest.raises(ProtocolError):
            get_codec(base).decode(chunk.params, bytes(forged), shape=shape, dtype="float16", kind=TensorKind.V)
    if base == "int4":
        with pytest.raises(ProtocolError):
            get_codec(base).decode(b"\x00", bytes(data), shape=shape, dtype="float16", kind=TensorKind.V)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzzed_payloads_only_raise_protocol_error(data: st.DataObject) -> None:
    name = data.draw(st.sampled_from(ALL))
    shape = data.draw(st.tuples(st.integers(1, 6), st.integers(1, 3), st.integers(1, 9)))
    params = data.draw(st.binary(max_size=4))
    size = data.draw(st.integers(0, 2 * 6 * 3 * 9 * 4 + 64))
    payload = data.draw(st.binary(min_size=size, max_size=size))
    try:
        y = codec_by_id(get_codec(name).codec_id).decode(params, payload, shape=shape, dtype="float16", kind=TensorKind.K)
    except ProtocolError:
        return
    assert y.shape == shape


_SHAPES = st.tuples(st.integers(1, 40), st.integers(1, 3), st.integers(1, 40))


@st.composite
def _chunks(draw: st.DrawFn) -> np.ndarray[Any, Any]:
    dtype = draw(st.sampled_from(DTYPES))
    dt = numpy_dtype(dtype)
    shape = draw(_SHAPES)
    width = {"float16": 16, "bfloat16": 32, "float32": 32}[dtype]
    magnitude = draw(st.sampled_from([1e-30, 1e-6, 1.0, 1e3, 6e4]))
    if dtype == "float16":
        magnitude = min(magnitude, 6e4)
    base = draw(hnp.arrays(np.float32, shape, elements=st.floats(-1, 1, width=32)))
    x = (base.astype(np.float64) * magnitude).astype(np.float32)
    extremes = draw(hnp.arrays(np.float32, shape, elements=st.floats(allow_nan=False, allow_infinity=False, width=width)))
    use = draw(hnp.arrays(np.bool_, shape, elements=st.booleans()))
    x = np.where(use & draw(st.booleans()), extremes, x)
    return x.astype(dt)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=_chunks(), base=st.sampled_from(QUANTIZERS), kind=st.sampled_from(KINDS))
def test_property_error_bound_and_determinism(x: np.ndarray[Any, Any], base: str, kind: TensorKind) -> None:
    if not np.all(np.isfinite(x.astype(np.float32))):
        return  # float32 extremes can round to infinity in float16 and bfloat16
    try:
        _assert_within_bound(base, x, kind)
    except UsageError:
        # only int4 may refuse finite input: a group spanning more than float32's range
        assert base == "int4"
        xf = x.astype(np.float64)
        assert np.ptp(xf) > np.finfo(np.float32).max
        return
    a = get_codec(base).encode(x, kind)
    b = get_codec(base).encode(x.copy(), kind)
    assert a.params == b.params and _payload_bytes(a) == _payload_bytes(b)


def test_codec_package_is_sans_io() -> None:
    forbidden = {"asyncio", "socket", "ssl", "selectors", "time", "threading", "uvloop", "kvwire.aio"}
    root = Path(kc.__file__).parent
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for mod in names:
                assert mod.split(".")[0] not in forbidden and not mod.startswith("kvwire.aio"), (path, mod)


@pytest.mark.parametrize("name", ["fp8", "int8", "int4"])
@pytest.mark.parametrize("kind", [TensorKind.K, TensorKind.V])
def test_float32_maximum_decodes_finite(name: str, kind: TensorKind) -> None:
    # The scale of a row (group) holding float32's largest value would decode the largest
    # code past float32; it steps down one ulp instead, in the numpy reference and the
    # compiled loops alike, so the receiver never sees an overflowing scale.
    top = np.finfo(np.float32).max
    x = np.zeros((4, 2, 32), np.float32)
    x[0, 0, 3] = top
    x[1, 1, 5] = -top
    x[2, 0, :] = top
    x[3, 1, 7] = np.nextafter(top, np.float32(0))
    codec = get_codec(name)
    chunk = codec.encode(x, kind)
    reference = codec.encode_numpy(x, kind)  # type: ignore[attr-defined]
    assert bytes(chunk.payload) == bytes(reference.payload)
    y = codec_by_id(chunk.codec_id).decode(chunk.params, chunk.payload, shape=x.shape, dtype="float32", kind=kind)
    assert np.all(np.isfinite(y))
    assert abs(float(y[0, 0, 3])) >= 0.99 * float(top)
    _assert_within_bound(name, x, kind)


@settings(max_examples=200, deadline=None)
@given(
    hi_ulps=st.integers(0, 3),
    lo_bits=st.integers(0x74000000, 0x7F7FFFFF),
    between=st.lists(st.integers(0, 1 << 30), max_size=6),
    kind=st.sampled_from(KINDS),
    seed=st.integers(0, 2**32 - 1),
)
def test_property_int4_top_code_near_float32_maximum_decodes(
    hi_ulps: int, lo_bits: int, between: list[int], kind: TensorKind, seed: int
) -> None:
    # int4 decodes code * s + lo: with a large positive minimum and a maximum at (or an ulp
    # or so below) float32's largest value, 15 * s + lo can round past it even where 15 * s
    # does not (about one such group in seven here); the scale steps down until it does not,
    # so every chunk the encoder makes decodes, to finite values, on both decode paths
    hi_bits = 0x7F7FFFFF - hi_ulps
    lo_bits = min(lo_bits, hi_bits)
    bits = [lo_bits, hi_bits] + [lo_bits + b % (hi_bits - lo_bits + 1) for b in between]
    values = np.random.default_rng(seed).permutation(np.array(bits, np.uint32)).view(np.float32)
    x = values.reshape((-1, 1, 1) if kind == TensorKind.K else (1, 1, -1))
    codec = get_codec("int4")
    chunk = codec.encode(x, kind)
    assert _payload_bytes(chunk) == _payload_bytes(codec.encode_numpy(x, kind))  # type: ignore[attr-defined]
    for decode in (codec.decode, codec.decode_numpy):  # type: ignore[attr-defined]
        y = decode(chunk.params, chunk.payload, shape=x.shape, dtype="float32", kind=kind)
        assert np.all(np.isfinite(y))
        assert float(y.max()) >= 0.99 * float(np.finfo(np.float32).max)
    _assert_within_bound("int4", x, kind)
