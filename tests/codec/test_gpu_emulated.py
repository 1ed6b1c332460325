"""The CUDA kernels run on the CPU: kvquant.cu compiled by the host C++ compiler with a
small emulation of the CUDA built-ins (a warp is 32 threads with a barrier for
``__shfl_xor_sync``), launched with the grids and arguments kvwire.codec.gpu computes.

This checks what the arithmetic tests cannot: the kernels' indexing, vector loads, the
warp reductions, int4 packing and the chunk-plan payload layout, against the numpy codecs
byte for byte, without a GPU.  (The arithmetic runs in its host form here; that the device
form keeps the same bits under CuPy's -ftz=true is checked on the PTX in
test_codec_kernels.py.)
"""

from __future__ import annotations

import ctypes
import itertools
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvwire.codec import TensorKind, get_codec, numpy_dtype
from kvwire.codec import gpu as g
from kvwire.errors import ProtocolError, UsageError
from tests.codec.emulation import as_reference, tricky_values, value_bits

_CTYPES = {np.int64: ctypes.c_longlong, np.int32: ctypes.c_int, np.uint32: ctypes.c_uint}


@pytest.fixture(scope="module")
def emu(kernel_emulation: Any) -> Any:
    return kernel_emulation


def _launch(lib: Any, launch: g.Launch, buffers: dict[str, np.ndarray[Any, Any]]) -> None:
    args: list[Any] = []
    for a in launch.args:
        if isinstance(a, str):
            args.append(ctypes.c_void_p(buffers[a].ctypes.data))
        else:
            args.append(_CTYPES[type(a)](int(a)))
    threaded = int("_encode_" in launch.kernel)
    getattr(lib, "emu_" + launch.kernel)(ctypes.c_uint(max(1, launch.blocks)), ctypes.c_uint(g.THREADS),
                                         ctypes.c_int(threaded), *args)
    assert lib.emu_errors() == 0, f"{launch.kernel}: misaligned access or divergent shuffle"


def _placed(x: np.ndarray[Any, Any], aligned: bool) -> np.ndarray[Any, Any]:
    """A copy of ``x`` starting on 16 bytes, or 2 bytes past it."""
    raw = np.empty(x.nbytes + 64, np.uint8)
    start = (-raw.ctypes.data) % 16 + (0 if aligned else 2)
    out: np.ndarray[Any, Any] = raw[start : start + x.nbytes].view(x.dtype).reshape(x.shape)
    out[...] = x
    return out


def emu_encode(lib: Any, codec: Any, x: np.ndarray[Any, Any], kind: TensorKind, chunk_tokens: int,
               dtype: str) -> tuple[list[bytes], int, str]:
    """Chunk payloads, flags and the first kernel's name, as the GPU would produce them."""
    base, _ = g.split_codec(codec)
    plan = g.plan_encode(base, g._int4_group(codec), x.shape, dtype, kind, chunk_tokens,
                         x_aligned=x.ctypes.data % 16 == 0)
    out = np.full(sum(plan.sizes), 0xAB, np.uint8)
    buffers = {"x": x, "out": out, "flags": np.zeros(1, np.uint32),
               "stats": np.empty(max(1, plan.stats_floats), np.float32)}
    for launch in plan.launches:
        _launch(lib, launch, buffers)
    offs = np.cumsum((0, *plan.sizes))
    return ([out[a:b].tobytes() for a, b in itertools.pairwise(offs)],
            int(buffers["flags"][0]), plan.launches[0].kernel)


def emu_decode(lib: Any, base: str, params: bytes, payload: bytes, out: np.ndarray[Any, Any],
               dtype: str, kind: TensorKind) -> int:
    dev = _placed(np.frombuffer(payload, np.uint8), True)
    launch = g.plan_decode(base, params, out.shape, dtype, kind, out_aligned=out.ctypes.data % 16 == 0,
                           payload_align=g.alignment(dev.ctypes.data))
    buffers = {"payload": dev, "out": out, "flags": np.zeros(1, np.uint32)}
    _launch(lib, launch, buffers)
    return int(buffers["flags"][0])


# (shape, chunk tokens): vector kernels with 16 lanes (half used and all used), 32 lanes
# with 1 and 2 vectors a lane; odd shapes and payloads the any-shape kernels take
CASES = [((40, 4, 64), 16), ((24, 2, 128), 8), ((12, 2, 256), 8), ((9, 2, 512), 4),
         ((13, 3, 40), 6), ((11, 2, 6), 4), ((7, 1, 3), 7)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}/{c[1]}")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("name", ["fp8", "int8", "int4"])
@pytest.mark.parametrize("kind", [TensorKind.K, TensorKind.V])
def test_emulated_kernels_match_numpy(emu: Any, case: Any, dtype: str, name: str, kind: TensorKind) -> None:
    shape, step = case
    codec = get_codec(name)
    x = tricky_values(dtype, shape, 5)
    for aligned in (True, False):
        xin = _placed(value_bits(x), aligned)
        payloads, flags, _kernel = emu_encode(emu, codec, xin, kind, step, dtype)
        assert flags == 0
        starts = range(0, shape[0], step)
        assert len(payloads) == len(starts)
        out = _placed(np.full(shape, 0xFF, value_bits(x).dtype), aligned)
        for i, s in enumerate(starts):
            part = x[s : s + step]
            ref = as_reference(codec).encode_numpy(part, kind)
            assert payloads[i] == bytes(memoryview(ref.payload).cast("B")), (aligned, i)
            sub = out[s : s + part.shape[0]]
            assert emu_decode(emu, name, ref.params, payloads[i], sub, dtype, kind) == 0
            want = as_reference(codec).decode_numpy(ref.params, ref.payload, shape=part.shape, dtype=dtype, kind=kind)
            assert sub.tobytes() == value_bits(want).tobytes(), (aligned, i)


def test_the_vector_kernels_are_the_ones_exercised(emu: Any) -> None:
    seen = set()
    for (shape, step) in CASES:
        for dtype in ("float16", "float32"):
            x = _placed(value_bits(tricky_values(dtype, shape, 1)), True)
            seen.add(emu_encode(emu, get_codec("fp8"), x, TensorKind.K, step, dtype)[2])
    assert {"kv_fp8_encode_vec_f16_16_1", "kv_fp8_encode_vec_f16_32_1", "kv_fp8_encode_vec_f16_32_2",
            "kv_fp8_encode_vec_f32_32_1", "kv_fp8_encode_vec_f32_32_4", "kv_fp8_encode_any_f16"} <= seen


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    tokens=st.integers(1, 20), heads=st.integers(1, 3), dim=st.sampled_from([1, 5, 8, 16, 24, 64]),
    step=st.integers(1, 20), group=st.integers(1, 9), seed=st.integers(0, 2**16),
    dtype=st.sampled_from(["float16", "bfloat16", "float32"]), kind=st.sampled_from([TensorKind.K, TensorKind.V]),
)
def test_emulated_int4_any_geometry(emu: Any, tokens: int, heads: int, dim: int, step: int, group: int,
                                    seed: int, dtype: str, kind: TensorKind) -> None:
    from kvwire.codec.int4 import Int4Codec

    codec = Int4Codec(group)
    x = tricky_values(dtype, (max(tokens, 6), heads, dim), seed)[:tokens]
    payloads, flags, _ = emu_encode(emu, codec, _placed(value_bits(x), True), kind, step, dtype)
    assert flags == 0
    for i, s in enumerate(range(0, tokens, max(1, min(step, tokens)))):
        ref = as_reference(codec).encode_numpy(x[s : s + step], kind)
        assert payloads[i] == bytes(memoryview(ref.payload).cast("B"))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("name", ["fp8", "int8", "int4"])
def test_emulated_flags_match_the_numpy_refusals(emu: Any, dtype: str, name: str) -> None:
    shape = (16, 2, 64)
    codec = get_codec(name)
    x = tricky_values(dtype, shape, 9)
    x[7, 1, 33] = np.nan
    with pytest.raises(UsageError):
        as_reference(codec).encode_numpy(x, TensorKind.K)
    _, flags, _ = emu_encode(emu, codec, _placed(value_bits(x), True), TensorKind.K, 8, dtype)
    with pytest.raises(UsageError, match="NaN or infinity"):
        g._check_flags(flags, name)
    x = tricky_values(dtype, shape, 9)
    ref = as_reference(codec).encode_numpy(x, TensorKind.K)
    raw = bytearray(memoryview(ref.payload).cast("B"))
    out = _placed(np.empty(shape, value_bits(x).dtype), True)
    if name != "int4":
        bad = bytearray(raw)
        bad[4 * 32 + 5] = 0x7F if name == "fp8" else 0x80
        with pytest.raises(ProtocolError):
            as_reference(codec).decode_numpy(b"", bytes(bad), shape=shape, dtype=dtype, kind=TensorKind.K)
        with pytest.raises(ProtocolError):
            g._check_flags(emu_decode(emu, name, b"", bytes(bad), out, dtype, TensorKind.K), name)
    big = bytearray(raw)
    big[0:4] = np.float32(3e38).tobytes()
    with pytest.raises(ProtocolError):
        as_reference(codec).decode_numpy(ref.params, bytes(big), shape=shape, dtype=dtype, kind=TensorKind.K)
    with pytest.raises(ProtocolError):
        g._check_flags(emu_decode(emu, name, ref.params, bytes(big), out, dtype, TensorKind.K), name)
    with pytest.raises(ProtocolError):
        g.validate_payload(name, ref.params, memoryview(bytes(raw[:-1])), shape, TensorKind.K)
    neg = bytearray(raw)
    neg[3] |= 0x80
    with pytest.raises(ProtocolError):
        g.validate_payload(name, ref.params, memoryview(bytes(neg)), shape, TensorKind.K)


def test_int4_range_beyond_float32_is_flagged(emu: Any) -> None:
    x = np.ones((32, 1, 8), np.float32)
    x[0, 0, 0], x[1, 0, 0] = 3e38, -3e38
    with pytest.raises(UsageError, match="range"):
        as_reference(get_codec("int4")).encode_numpy(x, TensorKind.K)
    _, flags, _ = emu_encode(emu, get_codec("int4"), _placed(x, True), TensorKind.K, 32, "float32")
    with pytest.raises(UsageError, match="range"):
        g._check_flags(flags, "int4")


def _near_boundaries(base: str, rows: int, seed: int) -> np.ndarray[Any, Any]:
    """float32 rows whose quotients x / scale fall within a few ulp of the points where the
    code changes (E4M3 midpoints, int8 half-integers): where any shortcut for the division
    (a reciprocal, a fused multiply-add) would round the other way."""
    rng = np.random.default_rng(seed)
    limit = 448.0 if base == "fp8" else 127.0
    if base == "fp8":
        mids = np.array([(1 + (2 * k + 1) / 16) * 2.0**e for e in range(-6, 9) for k in range(8)])
    else:
        mids = np.arange(127) + 0.5
    mids = mids[mids < limit * 0.98]
    out = np.empty((rows, 1, 128), np.float32)
    for r in range(rows):
        a0 = np.float32(rng.uniform(0.5, 2.0) * 2.0 ** rng.integers(-30, 30))
        scale = a0 / np.float32(limit)
        m = rng.choice(mids, 127)
        x = (m * np.float64(scale)).astype(np.float32)
        x = np.nextafter(x, np.float32(np.inf) * rng.choice([-1, 1], 127), dtype=np.float32) if r % 3 else x
        steps = rng.integers(-24, 25, 127)
        bits = x.view(np.int32) + steps.astype(np.int32)
        x = np.minimum(np.abs(bits.view(np.float32)), a0) * rng.choice([-1, 1], 127).astype(np.float32)
        out[r, 0, 0] = a0
        out[r, 0, 1:] = x
    return out


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_emulated_codes_near_rounding_points(emu: Any, name: str) -> None:
    x = _near_boundaries(name, 64, 3)
    codec = get_codec(name)
    payloads, flags, kernel = emu_encode(emu, codec, _placed(x, True), TensorKind.K, 64, "float32")
    assert flags == 0 and "_encode_vec_" in kernel
    assert payloads[0] == bytes(memoryview(as_reference(codec).encode_numpy(x, TensorKind.K).payload).cast("B"))


def _control(lib: Any, name: str, out: np.ndarray[Any, Any], grid: int = 2, threaded: int = 1) -> int:
    getattr(lib, "emu_kv_emu_control_" + name)(ctypes.c_uint(grid), ctypes.c_uint(g.THREADS), ctypes.c_int(threaded),
                                               ctypes.c_void_p(out.ctypes.data))
    return int(lib.emu_errors())


def test_the_emulation_refuses_what_a_gpu_would(emu: Any) -> None:
    # a well-formed warp reduction: every lane gets its warp's maximum, xor partners swap
    out = np.zeros(2 * g.THREADS, np.uint32)
    assert _control(emu, "shuffle", out) == 0
    t = np.arange(g.THREADS, dtype=np.uint32)
    assert np.array_equal(out[: g.THREADS], (t | 31) + 1000 * (t ^ 3))
    # a lane that returns before a shuffle, a shuffle outside a warp, a misaligned access
    assert _control(emu, "divergent", np.zeros(2 * g.THREADS, np.uint32)) > 0
    assert _control(emu, "shuffle", np.zeros(2 * g.THREADS, np.uint32), threaded=0) > 0
    assert _control(emu, "misaligned", np.zeros(8 * g.THREADS, np.uint8)) > 0


# Llama-like and other common geometries: int4 takes the one-launch vector kernels
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("shape", [(8192, 8, 128), (1000, 32, 128), (300, 4, 64), (77, 2, 256)])
@pytest.mark.parametrize("group", [8, 16, 32, 64])
@pytest.mark.parametrize("kind", [TensorKind.K, TensorKind.V])
def test_int4_common_shapes_encode_in_one_vector_launch(dtype: str, shape: tuple[int, int, int], group: int,
                                                        kind: TensorKind) -> None:
    plan = g.plan_encode("int4", group, shape, dtype, kind, 512, x_aligned=True)
    assert len(plan.launches) == 1 and plan.stats_floats == 0
    assert plan.launches[0].kernel.startswith(f"kv_int4_encode_{'v' if kind == TensorKind.V else 'k'}_vec_")
    dec = g.plan_decode("int4", bytes([group]), (512, *shape[1:]), dtype, kind, out_aligned=True)
    assert dec.kernel.startswith("kv_int4_decode_vec_")
    # unaligned input, groups the vector kernels do not take: the two-step kernels
    assert len(g.plan_encode("int4", group, shape, dtype, kind, 512, x_aligned=False).launches) == 2
    if kind == TensorKind.V:
        assert len(g.plan_encode("int4", 3, shape, dtype, kind, 512, x_aligned=True).launches) == 2
        # 3 or 6 vectors a group: one launch while a lane holds one vector of the row
        one_vector = shape[2] <= (128 if dtype == "float32" else 256)
        assert len(g.plan_encode("int4", 24, shape, dtype, kind, 512, x_aligned=True).launches) == (
            1 if one_vector or shape[2] <= 24 else 2)
    else:  # keys: any group size in one launch
        for big in (65, 128, 200, 255):
            assert len(g.plan_encode("int4", big, shape, dtype, kind, 512, x_aligned=True).launches) == 1


STYLES = ("normal", "subnormal", "zeros", "ties", "constant", "mixed")


def _adversarial(style: str, dtype: str, shape: tuple[int, int, int], seed: int) -> np.ndarray[Any, Any]:
    """Data where a shortcut in the int4 kernels would show: subnormal values and ranges,
    -0 next to +0 as group extremes, quotients exactly halfway between two codes (with a
    group range of 15 units, (x - lo) / scale is x itself), groups of one repeated value
    (scale 0), and a mix of all of them element by element."""
    rng = np.random.default_rng(seed)
    tiny = {"float16": 2.0**-20, "bfloat16": 2.0**-130, "float32": 2.0**-140}[dtype]
    normal = rng.standard_normal(shape) * np.exp2(rng.integers(-8, 8, (shape[0], shape[1], 1)))
    kinds = {
        "normal": normal,
        "subnormal": rng.standard_normal(shape) * tiny,
        "zeros": rng.choice(np.array([0.0, -0.0, tiny, -tiny]), shape),
        "ties": rng.choice(np.arange(31) / 2, shape, p=np.r_[0.3, np.full(29, 0.4 / 29), 0.3])
        * np.exp2(float(rng.integers(-10, 10))) - np.float32(rng.choice([0.0, 4.0])),
        "constant": np.broadcast_to(rng.choice([-0.0, 0.0, 1.5, -tiny], (1, shape[1], 1)), shape),
    }
    if style == "mixed":
        pick = rng.integers(0, 5, shape)
        x = np.choose(pick, [kinds[k] for k in ("normal", "subnormal", "zeros", "ties", "constant")])
    else:
        x = kinds[style]
    return np.ascontiguousarray(x).astype(numpy_dtype(dtype))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    tokens=st.integers(1, 40), heads=st.integers(1, 3), dim=st.sampled_from([4, 8, 16, 24, 40, 64, 128, 256]),
    step=st.integers(1, 40), group=st.sampled_from([1, 2, 3, 4, 5, 7, 8, 12, 16, 31, 32, 33, 64, 65, 100, 128, 255]),
    style=st.sampled_from(STYLES), seed=st.integers(0, 2**16), aligned=st.booleans(),
    dtype=st.sampled_from(["float16", "bfloat16", "float32"]), kind=st.sampled_from([TensorKind.K, TensorKind.V]),
    poison=st.sampled_from([None, None, np.nan, np.inf, -np.inf]), fast=st.booleans(),
    fast_dim=st.sampled_from([8, 16, 24, 40, 64, 128, 192, 256, 512]), fast_group=st.sampled_from([8, 16, 24, 32, 40, 48, 64, 96, 128, 255]),
)
def test_emulated_int4_kernels_match_the_numpy_reference(
    emu: Any, tokens: int, heads: int, dim: int, step: int, group: int, style: str, seed: int, aligned: bool,
    dtype: str, kind: TensorKind, poison: float | None, fast: bool, fast_dim: int, fast_group: int,
) -> None:
    from kvwire.codec.int4 import Int4Codec

    if fast:  # a geometry the one-launch vector kernels take (keys: any group)
        dim, aligned = fast_dim, True
        if kind == TensorKind.V:
            group = fast_group if fast_group < 255 or dim < 255 else 128
            epv = 4 if dtype == "float32" else 8
            if group < dim and (group // epv) & (group // epv - 1):
                dim = min(dim, 32 * epv)  # any number of vectors a group: one vector a lane
    codec = Int4Codec(group)
    shape = (tokens, heads, dim)
    x = _adversarial(style, dtype, shape, seed)
    if poison is not None:
        x.reshape(-1)[seed % x.size] = poison
    payloads, flags, kernel = emu_encode(emu, codec, _placed(value_bits(x), aligned), kind, step, dtype)
    event(kernel.rsplit("_", 2)[0] if "_vec_" in kernel else kernel)
    assert not fast or kernel.startswith("kv_int4_encode_"), kernel
    if poison is not None:
        with pytest.raises(UsageError):
            as_reference(codec).encode_numpy(x, kind)
        assert flags & g.FLAG_NONFINITE
        return
    assert flags == 0
    step = max(1, min(step, tokens))
    out = _placed(np.full(shape, 0xFF, value_bits(x).dtype), aligned)
    for i, s in enumerate(range(0, tokens, step)):
        part = x[s : s + step]
        ref = as_reference(codec).encode_numpy(part, kind)
        assert payloads[i] == bytes(memoryview(ref.payload).cast("B")), (i, s)
        sub = out[s : s + part.shape[0]]
        assert emu_decode(emu, "int4", ref.params, payloads[i], sub, dtype, kind) == 0
        want = as_reference(codec).decode_numpy(ref.params, ref.payload, shape=part.shape, dtype=dtype, kind=kind)
        assert sub.tobytes() == value_bits(want).tobytes(), (i, s)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize(("dim", "group"), [(128, 24), (128, 40), (120, 48), (64, 24), (256, 72), (40, 24)])
def test_emulated_int4_value_groups_of_any_number_of_vectors(emu: Any, dtype: str, dim: int, group: int) -> None:
    # 3, 5, 6 or 9 vectors a group (float32: twice as many, or a whole row): gathered lane
    # by lane with indexed shuffles, the last group of a row shorter
    from kvwire.codec.int4 import Int4Codec

    codec = Int4Codec(group)
    x = _adversarial("mixed", dtype, (11, 3, dim), dim * group)
    payloads, flags, kernel = emu_encode(emu, codec, _placed(value_bits(x), True), TensorKind.V, 5, dtype)
    one_vector = dim <= (128 if dtype == "float32" else 256)
    assert kernel.startswith("kv_int4_encode_v_vec_") == one_vector and flags == 0
    for i, s in enumerate(range(0, 11, 5)):
        assert payloads[i] == bytes(memoryview(as_reference(codec).encode_numpy(x[s : s + 5], TensorKind.V).payload).cast("B"))


@pytest.mark.parametrize("style", ["normal", "zeros", "mixed"])
@pytest.mark.parametrize(("dim", "group"), [(192, 192), (192, 255), (200, 250), (240, 64)])
def test_emulated_int4_value_groups_over_several_vectors_of_a_lane(emu: Any, style: str, dim: int, group: int) -> None:
    # float32 rows of 48-60 vectors: 32 lanes with 2 vectors each, and a group that spans
    # both of a lane's vectors (merged in registers before the shuffles)
    from kvwire.codec.int4 import Int4Codec

    codec = Int4Codec(group)
    x = _adversarial(style, "float32", (9, 3, dim), dim + group)
    payloads, flags, kernel = emu_encode(emu, codec, _placed(x, True), TensorKind.V, 4, "float32")
    assert kernel == "kv_int4_encode_v_vec_f32_32_2" and flags == 0
    for i, s in enumerate(range(0, 9, 4)):
        assert payloads[i] == bytes(memoryview(as_reference(codec).encode_numpy(x[s : s + 4], TensorKind.V).payload).cast("B"))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize(("group", "step", "kernel"), [(64, 300, "4_16"), (100, 250, "8_16"), (128, 300, "8_16"),
                                                       (255, 300, "16_16"), (255, 600, "16_16")])
def test_emulated_int4_key_groups_of_many_tokens(emu: Any, dtype: str, group: int, step: int, kernel: str) -> None:
    # full blocks of 64-255 tokens: 4, 8 or 16 token lanes with 16 tokens each
    from kvwire.codec.int4 import Int4Codec

    codec = Int4Codec(group)
    x = _adversarial("mixed", dtype, (530, 2, 24), group + step)
    payloads, flags, name = emu_encode(emu, codec, _placed(value_bits(x), True), TensorKind.K, step, dtype)
    assert name == f"kv_int4_encode_k_vec_{g._SUFFIX[dtype]}_{kernel}" and flags == 0
    for i, s in enumerate(range(0, 530, step)):
        assert payloads[i] == bytes(memoryview(as_reference(codec).encode_numpy(x[s : s + step], TensorKind.K).payload).cast("B"))


@pytest.mark.parametrize("kind", [TensorKind.K, TensorKind.V])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_emulated_int4_vector_kernels_flag_range_and_nonfinite(emu: Any, kind: TensorKind, dtype: str) -> None:
    from kvwire.codec.int4 import Int4Codec

    codec = Int4Codec(32)
    x = _adversarial("normal", dtype, (40, 2, 64), 3)
    plan = g.plan_encode("int4", 32, x.shape, dtype, kind, 16, x_aligned=True)
    assert "_vec_" in plan.launches[0].kernel
    if dtype == "float32":
        x[33, 1, 60], x[34, 1, 60] = 3e38, -3e38  # a group range beyond float32 (keys)
        x[35, 0, 40], x[35, 0, 41] = 3e38, -3e38  # (values)
        with pytest.raises(UsageError, match="range"):
            as_reference(codec).encode_numpy(x, kind)
        _, flags, _ = emu_encode(emu, codec, _placed(x, True), kind, 16, dtype)
        assert flags == g.FLAG_RANGE
    x = _adversarial("normal", dtype, (40, 2, 64), 3)
    x[39, 1, 63] = np.inf  # the very last element of the last (short) chunk
    _, flags, _ = emu_encode(emu, codec, _placed(value_bits(x), True), kind, 16, dtype)
    assert flags & g.FLAG_NONFINITE


def test_emulated_int4_decode_flags_values_outside_the_dtype(emu: Any) -> None:
    from kvwire.codec.int4 import Int4Codec

    codec = Int4Codec(32)
    x = _adversarial("normal", "float16", (16, 2, 64), 4)
    for kind in (TensorKind.K, TensorKind.V):
        ref = as_reference(codec).encode_numpy(x, kind)
        raw = bytearray(memoryview(ref.payload).cast("B"))
        raw[0:4] = np.float32(1e4).tobytes()  # 15 * 1e4 + lo leaves float16
        with pytest.raises(ProtocolError):
            as_reference(codec).decode_numpy(ref.params, bytes(raw), shape=x.shape, dtype="float16", kind=kind)
        out = _placed(np.empty(x.shape, np.uint16), True)
        assert g.plan_decode("int4", ref.params, x.shape, "float16", kind, out_aligned=True).kernel == "kv_int4_decode_vec_f16"
        flags = emu_decode(emu, "int4", ref.params, bytes(raw), out, "float16", kind)
        assert flags == g.FLAG_OUTSIDE


@pytest.mark.parametrize("kind", [TensorKind.K, TensorKind.V])
@pytest.mark.parametrize(("shape", "group", "step"), [((32, 2, 64), 8, 16), ((40, 2, 64), 32, 32), ((7, 1, 6), 3, 4)])
def test_emulated_int4_top_code_near_float32_maximum(
    emu: Any, kind: TensorKind, shape: tuple[int, int, int], group: int, step: int
) -> None:
    """Groups of float32 inputs whose top code decodes past float32 unless the scale steps
    down (kv_int4_fit, with a large positive minimum and a maximum at float32's largest
    value or an ulp below): the vector kernels and the any-shape ones give numpy's bytes,
    and the chunks decode, to finite values."""
    from kvwire.codec.int4 import Int4Codec

    codec = Int4Codec(group)
    rng = np.random.default_rng(17)
    n = shape[0] * shape[1] * shape[2]
    hi = (0x7F7FFFFF - rng.integers(0, 2, n)).astype(np.uint32).view(np.float32).reshape(shape)
    x = np.minimum(rng.integers(0x7C000000, 0x7F7FFFFF, n), 0x7F7FFFFE).astype(np.uint32).view(np.float32)
    x = x.reshape(shape).copy()
    if kind == TensorKind.K:
        x[1::group] = hi[1::group]  # each key group: one token at the top
    else:
        x[:, :, 1::group] = hi[:, :, 1::group]  # each value run: one channel at the top
    payloads, flags, _kernel = emu_encode(emu, codec, _placed(x, True), kind, step, "float32")
    assert flags == 0
    out = _placed(np.full(shape, np.nan, np.float32), True)
    for i, s0 in enumerate(range(0, shape[0], step)):
        part = x[s0 : s0 + step]
        ref = as_reference(codec).encode_numpy(part, kind)
        assert payloads[i] == bytes(memoryview(ref.payload).cast("B")), i
        sub = out[s0 : s0 + part.shape[0]]
        assert emu_decode(emu, "int4", ref.params, payloads[i], sub, "float32", kind) == 0
        want = as_reference(codec).decode_numpy(ref.params, ref.payload, shape=part.shape, dtype="float32", kind=kind)
        assert sub.tobytes() == want.tobytes() and np.all(np.isfinite(sub))


def _at(data: bytes, shift: int) -> np.ndarray[Any, Any]:
    """``data`` in memory starting ``shift`` bytes past a 16-byte boundary."""
    raw = np.empty(len(data) + 64, np.uint8)
    start = (-raw.ctypes.data) % 16 + shift
    out: np.ndarray[Any, Any] = raw[start : start + len(data)]
    out[...] = np.frombuffer(data, np.uint8)
    return out


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("name", ["fp8", "int8", "int4"])
def test_emulated_decode_of_a_payload_at_any_address(emu: Any, dtype: str, name: str) -> None:
    """A payload at each address from a 16-byte boundary to 15 past it (a chunk decoded
    where it lies in a buffer of several): the launch plan_decode picks for its
    alignment makes no access a GPU would refuse, and gives numpy's values; the vector
    kernel where the payload allows it, the any-shape one elsewhere."""
    codec = get_codec(name)
    shape = (6, 2, 16)
    x = tricky_values(dtype, shape, 7)
    ref = as_reference(codec).encode_numpy(x, TensorKind.K)
    data = bytes(memoryview(ref.payload).cast("B"))
    want = value_bits(as_reference(codec).decode_numpy(ref.params, ref.payload, shape=shape, dtype=dtype, kind=TensorKind.K))
    vector: dict[int, bool] = {}
    for shift in range(16):
        payload = _at(data, shift)
        out = _placed(np.full(shape, 0xFF, want.dtype), True)
        launch = g.plan_decode(name, ref.params, shape, dtype, TensorKind.K, out_aligned=True,
                               payload_align=g.alignment(payload.ctypes.data))
        flags = np.zeros(1, np.uint32)
        _launch(emu, launch, {"payload": payload, "out": out, "flags": flags})  # no misaligned access
        assert int(flags[0]) == 0 and out.tobytes() == want.tobytes(), shift
        vector[shift] = "_vec_" in launch.kernel
    need = 4 if name == "int4" or dtype == "float32" else 8
    assert vector == {shift: shift % need == 0 for shift in range(16)}


def test_alignment_of_an_address() -> None:
    assert [g.alignment(p) for p in (0, 1, 2, 4, 6, 8, 12, 16, 36, 256, 0x7F000010)] == [
        16, 1, 2, 4, 2, 8, 4, 16, 4, 16, 16]
