"""Index widths of the GPU kernels for tensors of 2^31 elements and more.

A whole K or V tensor is encoded in one launch, so element indices, byte offsets and
group indices pass 2^31 for a 4 GiB float16 tensor.  Checked without allocating one: the
launch plans of kvwire.codec.gpu for such shapes (argument dtypes against the kernels'
PTX parameter widths, grid sizes), and the int4 group geometry of kvquant.cu built for the
host with -fwrapv (32-bit int arithmetic wraps as it does on the device).
"""

from __future__ import annotations

import ctypes
import re
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvwire.codec import TensorKind
from kvwire.codec import gpu as g
from kvwire.codec.int4 import group_count
from kvwire.errors import UsageError
from tests.codec.emulation import CXX, SHIM
from tests.codec.ptx import nvcc_ptx
from tests.environment import needs_nvcc

# 2M tokens x 8 heads x 128: 2^31 elements, a 4 GiB float16 tensor
BIG = (2**21, 8, 128)
DTYPES = ("float16", "bfloat16", "float32")


def _plans(shape: tuple[int, int, int], dtype: str, chunk_tokens: int) -> list[g.Launch]:
    """Every launch that encodes or decodes a ``shape`` tensor (both alignments, both kinds)."""
    launches: list[g.Launch] = []
    for aligned in (True, False):
        for base in ("fp8", "int8"):
            launches += g.plan_encode(base, 32, shape, dtype, TensorKind.K, chunk_tokens, x_aligned=aligned).launches
            launches.append(g.plan_decode(base, b"", shape, dtype, TensorKind.K, out_aligned=aligned))
        for kind in TensorKind:
            for group in (32, 3):
                launches += g.plan_encode("int4", group, shape, dtype, kind, chunk_tokens, x_aligned=aligned).launches
                launches.append(g.plan_decode("int4", bytes([group]), shape, dtype, kind, out_aligned=aligned))
    return launches


@pytest.mark.parametrize("dtype", DTYPES)
def test_big_tensor_plans_pass_64_bit_counts(dtype: str) -> None:
    tokens, heads, dim = BIG
    n = tokens * heads * dim
    for launch in _plans(BIG, dtype, tokens):
        kernel = launch.kernel
        assert 1 <= launch.blocks <= g.MAX_BLOCKS, kernel
        # tokens (and so every element or byte count derived from it) travel as int64 into
        # the kernels that index the whole tensor; the 32-bit decode kernels are only
        # chosen below 2^31 elements
        assert "_decode_vec_" not in kernel, kernel
        assert isinstance(launch.args[1], np.int64), kernel
        assert all(type(a) in (np.int64, np.int32, np.uint32, str) for a in launch.args), kernel
        assert all(a.dtype == np.int64 for a in launch.args[1:] if isinstance(a, np.integer) and int(a) > 2**31 - 1)
    # the one-launch int4 vector encoders index in 32 bits in part: not chosen here
    assert g._plan_int4_vec(32, BIG, dtype, TensorKind.V, tokens, 1, x_aligned=True) is None
    assert n >= 2**31


def test_chunk_payload_offsets_are_64_bit() -> None:
    """Chunk c's payload starts at c * chunk_bytes: past 2^31 bytes for the last chunks."""
    tokens, heads, _dim = BIG
    plan = g.plan_encode("int8", 32, BIG, "float16", TensorKind.K, 4096, x_aligned=True)
    launch = plan.launches[0]
    assert launch.args[5] == np.int64(plan.sizes[0]) and isinstance(launch.args[5], np.int64)
    assert (len(plan.sizes) - 1) * plan.sizes[0] > 2**31
    assert launch.blocks == -(-(tokens * heads * 16) // g.THREADS)  # 16 lanes a row of 16 vectors


@pytest.mark.parametrize(
    "shape", [(1, 2**31, 1), (1, 1, 2**31), (2**31, 1, 1)], ids=["heads", "head_dim", "chunk_tokens"]
)
def test_counts_past_int32_are_refused_with_usage_error(shape: tuple[int, int, int]) -> None:
    """heads, head_dim and the tokens of a chunk go to the kernels as 32-bit ints."""
    for base in ("fp8", "int8", "int4"):
        with pytest.raises(UsageError, match="up to 2147483647"):
            g.plan_encode(base, 32, shape, "float16", TensorKind.V, shape[0], x_aligned=False)
    if shape[0] == 1:
        # fp8 and int8 decode take rows (an int64), not heads: only head_dim is refused there
        refused = (("int4", b"\x20"),) + ((("fp8", b""),) if shape[2] > 1 else ())
        for base, params in refused:
            with pytest.raises(UsageError, match="up to 2147483647"):
                g.plan_decode(base, params, shape, "float16", TensorKind.V, out_aligned=False)
    # tokens themselves are int64: a plan with 2^31 tokens in chunks of 2^20 is fine
    plan = g.plan_encode("fp8", 32, shape if shape[0] > 1 else (2**31, 1, 1), "float16", TensorKind.K, 2**20,
                         x_aligned=False)
    assert plan.launches[0].args[1] == 2**31


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_int8_decode_plans_any_heads(dtype: str) -> None:
    """fp8 and int8 decode pass rows = tokens * heads as an int64 and never heads: 2^31
    heads of one channel plan as they did before the int32 checks (nothing allocated)."""
    shape = (1, 2**31, 1)
    for base in ("fp8", "int8"):
        for aligned in (True, False):
            launch = g.plan_decode(base, b"", shape, dtype, TensorKind.K, out_aligned=aligned, payload_align=16)
            suffix = g._SUFFIX[dtype]
            assert launch.kernel == f"kv_{base}_decode_any_{suffix}"
            assert launch.args[1] == 2**31 and isinstance(launch.args[1], np.int64)
            assert launch.args[2] == 1 and isinstance(launch.args[2], np.int32)
            assert launch.blocks == 2**31 // g.THREADS
    # int4 decode takes heads as a 32-bit int: still refused
    with pytest.raises(UsageError, match="heads up to 2147483647"):
        g.plan_decode("int4", b"\x20", shape, dtype, TensorKind.K, out_aligned=False)


def test_grid_past_cuda_limit_is_refused_with_usage_error() -> None:
    """One warp a row over 2^34 rows is 2^31 blocks: more than gridDim.x takes."""
    with pytest.raises(UsageError, match="more than a launch takes"):
        g.plan_encode("fp8", 32, (2**34, 1, 1), "float16", TensorKind.K, 2**20, x_aligned=False)
    plan = g.plan_encode("fp8", 32, (2**34 - 8, 1, 1), "float16", TensorKind.K, 2**20, x_aligned=False)
    assert plan.launches[0].blocks == g.MAX_BLOCKS


_PARAM = re.compile(r"\.param \.(u64|u32|s64|s32|b64|b32|align \d+ \.b8)\s+\w+")


@needs_nvcc
def test_launch_arguments_match_the_kernels_ptx_parameters(tmp_path: Path) -> None:
    """Every argument a plan passes has the width of the kernel parameter it lands in (a
    numpy int64 in a 32-bit parameter, or the other way round, would shift the rest)."""
    text = nvcc_ptx(tmp_path, g.kernel_source(), "kvquant_widths")
    entries = {name: _PARAM.findall(body) for name, body in re.findall(r"\.entry (\w+)\s*\(([^)]*)\)", text)}
    width = {np.int64: "64", np.int32: "32", np.uint32: "32"}
    seen = set()
    for dtype in DTYPES:
        for shape, chunk in ((BIG, 4096), ((64, 4, 128), 16), ((5, 3, 7), 2)):
            for launch in _plans(shape, dtype, chunk):
                params = entries[launch.kernel]
                assert len(params) == len(launch.args), launch.kernel
                for arg, param in zip(launch.args, params, strict=True):
                    want = "64" if isinstance(arg, str) else width[type(arg)]
                    assert param.endswith(want), (launch.kernel, arg, param)
                seen.add(launch.kernel)
    assert any("_vec_" in k for k in seen) and any("_any_" in k for k in seen)
    assert any("stats" in k for k in seen) and any("int4_decode_f" in k for k in seen)


@needs_nvcc
def test_int4_key_vector_encoders_count_token_blocks_in_32_bits(tmp_path: Path) -> None:
    """The token blocks of a chunk, (chunk_tokens - 1) / group + 1, is a 32-bit division in
    kv_int4_encode_k_vec_*: in 64 bits it took kv_int4_encode_k_vec_f32_4_2 from 48 to 56
    registers on sm_90 (nvcc 13.0).  Its operands fit: the plan picks these kernels only
    under 2^31 elements, and a 64-bit spelling buys nothing there."""
    text = nvcc_ptx(tmp_path, g.kernel_source(), "kvquant_kvec")
    bodies = dict(re.findall(r"\.entry (kv_int4_encode_k_vec_\w+)\s*\((.*?)\n}\n", text, re.S))
    assert len(bodies) == 15
    for name, body in bodies.items():
        assert re.search(r"\bdiv\.s32\b", body), name


GEOMETRY = r"""
extern "C" long long t_groups(long long cnt, int heads, int dim, int group, int is_v) {
    return kv_int4_groups(cnt, heads, dim, group, is_v);
}
extern "C" long long t_group_of(long long e, int heads, int dim, int group, int is_v) {
    return kv_int4_group_of(e, heads, dim, group, is_v);
}
extern "C" void t_group(long long gg, long long cnt, int heads, int dim, int group, int is_v, long long* out) {
    const KvGroup g = kv_int4_group(gg, cnt, heads, dim, group, is_v);
    out[0] = g.first; out[1] = g.stride; out[2] = g.count;
}
"""


@pytest.fixture(scope="module")
def geometry(tmp_path_factory: pytest.TempPathFactory) -> Any:
    if CXX is None:
        pytest.fail("no C++ compiler found to build the kernel geometry")
    build = tmp_path_factory.mktemp("kvquant_geometry")
    (build / "geo.cpp").write_text(SHIM + g.kernel_source() + GEOMETRY)
    lib = build / "libkvgeo.so"
    # -fwrapv: a 32-bit int overflow wraps, as add.s32 does on the device
    subprocess.run([CXX, "-std=c++20", "-O1", "-fwrapv", "-ffp-contract=off", "-shared", "-fPIC", "-pthread",
                    str(build / "geo.cpp"), "-o", str(lib)], check=True, capture_output=True)
    so = ctypes.CDLL(str(lib))
    i64, i32 = ctypes.c_longlong, ctypes.c_int
    so.t_groups.restype = so.t_group_of.restype = i64
    so.t_groups.argtypes = [i64, i32, i32, i32, i32]
    so.t_group_of.argtypes = [i64, i32, i32, i32, i32]
    so.t_group.argtypes = [i64, i64, i32, i32, i32, i32, ctypes.POINTER(i64)]
    return so


@pytest.mark.parametrize("dim", [2**31 - 1, 2**31 - 200, 1000])
@pytest.mark.parametrize("group", [255, 128, 1])
def test_int4_value_group_geometry_for_head_dim_near_int32(geometry: Any, dim: int, group: int) -> None:
    """V groups of ``group`` channels: head_dim + group - 1 must not be formed in 32 bits
    (a [2, 1, 2^31 - 1] float16 tensor is 8 GiB)."""
    tokens, heads = 2, 1
    runs = -(-dim // group)
    assert geometry.t_groups(tokens, heads, dim, group, 1) == group_count((tokens, heads, dim), TensorKind.V, group)
    n = tokens * heads * dim
    for e in (0, dim - 1, dim, n - 1):
        row, d = divmod(e, dim)
        assert geometry.t_group_of(e, heads, dim, group, 1) == row * runs + d // group, e
    out = (ctypes.c_longlong * 3)()
    last = tokens * heads * runs - 1
    geometry.t_group(last, tokens, heads, dim, group, 1, out)
    assert list(out) == [(tokens * heads - 1) * dim + (runs - 1) * group, 1, dim - (runs - 1) * group]


def test_int4_key_group_geometry_past_2_31_elements(geometry: Any) -> None:
    """K groups over tokens: element and group indices past 2^31 in a 4 GiB chunk."""
    tokens, heads, dim = BIG
    hd, group = heads * dim, 32
    groups = geometry.t_groups(tokens, heads, dim, group, 0)
    assert groups == group_count(BIG, TensorKind.K, group)
    e = tokens * hd - 1
    assert geometry.t_group_of(e, heads, dim, group, 0) == (tokens - 1) // group * hd + hd - 1
    out = (ctypes.c_longlong * 3)()
    geometry.t_group(groups - 1, tokens, heads, dim, group, 0, out)
    assert list(out) == [(tokens - group) * hd + hd - 1, hd, group]
