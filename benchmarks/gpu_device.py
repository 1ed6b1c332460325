"""The GPU path on a real device, in one run: tests, bit-exactness, kernel speed, transfer.

Run (on a machine with CuPy and a CUDA device; ``benchmarks/gpu_device.sh`` installs the
wheels staged in ``.whl/`` first)::

    python benchmarks/gpu_device.py [--out DIR] [--tokens 8192] [--skip-tests] [--budget 360]

1. ``pytest -m gpu`` (the GPU tests of the whole suite), log in ``DIR/pytest.log``.
2. Bit-exactness against the numpy codecs on a Llama-3-8B-like cache: 32 layers x (K, V)
   x ``[tokens, 8, 128]`` (1 GiB of float16 at 8192 tokens), chunked as the transport
   chunks it (1 MiB), for fp8, int8, int4 and float16 / bfloat16: every chunk payload
   encoded on the GPU equals numpy's (SHA-256 per chunk; numpy runs in worker
   processes), and every tensor decoded on the GPU equals numpy's decode.
3. Kernel speed with CUDA events: encode (whole tensor, one launch) and decode (per
   tensor) in GB/s of 16-bit input, against a device-to-device copy of the same bytes
   (``copy / kernel`` time ratio: 1.0 = as fast as the copy); int4 separately for keys
   and values (different kernels), with the names of the kernels that ran.
4. A loopback transfer of the CuPy-resident cache to ``serve(device="gpu")``, with the
   chunk copies overlapped with sending (pipeline depth 4) and without (depth 1).

Results: ``DIR/results.json`` and ``DIR/summary.md`` (printed last).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("KVWIRE_NO_EXTENSIONS", "1")  # the numpy codecs are the reference

from kvwire.codec import TensorKind, get_codec, numpy_dtype  # noqa: E402
from kvwire.wire.transfer import plan_chunks  # noqa: E402

LAYERS, HEADS, DIM = 32, 8, 128
CHUNK_BYTES = 1 << 20
CODECS = ("fp8", "int8", "int4")
DTYPES = ("float16", "bfloat16")

# host cache shared with the forked workers: {dtype: [(k, v), ...]}
_HOST: dict[str, list[tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]]] = {}


def make_cache(tokens: int, seed: int = 0) -> list[tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]]:
    """float32 K/V shaped like Llama-3-8B's: keys with outlier channels, values plain."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(LAYERS):
        chan = np.exp(rng.normal(0.0, 1.0, (1, HEADS, DIM))).astype(np.float32)
        k = rng.standard_normal((tokens, HEADS, DIM), dtype=np.float32) * chan
        v = rng.standard_normal((tokens, HEADS, DIM), dtype=np.float32) * np.float32(0.5)
        out.append((k, v))
    return out


def _sha(buf: Any) -> str:
    if isinstance(buf, np.ndarray):
        return hashlib.sha256(np.ascontiguousarray(buf).tobytes()).hexdigest()
    return hashlib.sha256(memoryview(buf).cast("B")).hexdigest()


def _plan(tokens: int) -> list[tuple[int, int]]:
    return plan_chunks(tokens, HEADS * DIM * 2, CHUNK_BYTES)


def _numpy_reference(job: tuple[str, str, int, int]) -> tuple[list[str], str]:
    """(sha of each chunk payload, sha of the decoded tensor) by the numpy codecs."""
    codec_name, dtype, layer, kind = job
    x = _HOST[dtype][layer][kind]
    codec = get_codec(codec_name)
    tk = TensorKind(kind)
    shas = []
    decoded = np.empty(x.shape, x.dtype)
    for s, c in _plan(x.shape[0]):
        enc = codec.encode(x[s : s + c], tk)
        shas.append(_sha(enc.payload))
        codec.decode(enc.params, enc.payload, shape=(c, HEADS, DIM), dtype=dtype, kind=tk, out=decoded[s : s + c])
    return shas, _sha(decoded)


def environment() -> dict[str, Any]:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    smi = ""
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20,
        ).stdout.strip()
    except Exception as exc:
        smi = f"nvidia-smi failed: {exc}"
    return {
        "device": name,
        "compute_capability": f"{props['major']}.{props['minor']}",
        "nvidia_smi": smi,
        "driver_cuda": cupy.cuda.runtime.driverGetVersion(),
        "runtime_cuda": cupy.cuda.runtime.runtimeGetVersion(),
        "nvrtc": list(cupy.cuda.nvrtc.getVersion()),
        "cupy": cupy.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
    }


def run_tests(out: Path) -> dict[str, Any]:
    log = out / "pytest.log"
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "tests", "-q", "-p", "no:cacheprovider",
           "--continue-on-collection-errors"]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=150)
        stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        stderr, rc = "timed out after 150 s", -1
    log.write_text(stdout + "\n" + stderr)
    tail = [line for line in stdout.splitlines() if line.strip()][-1:] or [""]
    return {"returncode": rc, "summary": tail[0], "seconds": round(time.perf_counter() - t0, 1)}


def _device_cache(dtype: str) -> list[tuple[Any, Any]]:
    """The cache on the GPU (bfloat16 as its uint16 bits)."""
    import cupy

    if dtype == "bfloat16":
        return [(cupy.asarray(k.view(np.uint16)), cupy.asarray(v.view(np.uint16))) for k, v in _HOST[dtype]]
    return [(cupy.asarray(k), cupy.asarray(v)) for k, v in _HOST[dtype]]


def poisoned(shape: tuple[int, ...], dtype: str) -> Any:
    """A CuPy array of ``shape`` for chunks of ``dtype`` to be decoded into, every element's
    bits set (NaN), of the type ``decode_into`` takes for ``dtype``: float16, float32, or
    bfloat16's uint16 bits."""
    import cupy

    if dtype == "float32":
        return cupy.full(shape, 0xFFFFFFFF, cupy.uint32).view(cupy.float32)
    bits = cupy.full(shape, 0xFFFF, cupy.uint16)
    return bits.view(cupy.float16) if dtype == "float16" else bits


def exactness(pool: Any, tokens: int) -> dict[str, Any]:
    import cupy

    from kvwire.codec import gpu

    results: dict[str, Any] = {}
    plan = _plan(tokens)
    step = plan[0][1]
    for dtype in DTYPES:
        dev = _device_cache(dtype)
        for codec_name in CODECS:
            t0 = time.perf_counter()
            jobs = [(codec_name, dtype, layer, kind) for layer in range(LAYERS) for kind in (0, 1)]
            refs = pool.map_async(_numpy_reference, jobs)
            codec = get_codec(codec_name)
            gpu_shas: list[list[str]] = []
            gpu_dec: list[str] = []
            for layer in range(LAYERS):
                for kind in (0, 1):
                    enc = gpu.encode_tensor(codec, dev[layer][kind], TensorKind(kind), step, dtype=dtype)
                    enc.check()
                    host = cupy.asnumpy(enc.buffer)
                    gpu_shas.append([_sha(host[o : o + n]) for o, n in zip(enc.offsets, enc.sizes, strict=True)])
                    out = poisoned((tokens, HEADS, DIM), dtype)
                    for i, (s, c) in enumerate(plan):
                        payload = host[enc.offsets[i] : enc.offsets[i] + enc.sizes[i]]
                        gpu.decode_into(codec, enc.params, payload, out[s : s + c], dtype=dtype, kind=TensorKind(kind))
                    gpu_dec.append(_sha(cupy.asnumpy(out)))
            ref = refs.get(timeout=600)
            chunks = sum(len(s) for s in gpu_shas)
            bad_chunks = sum(a != b for g, (r, _d) in zip(gpu_shas, ref, strict=True) for a, b in zip(g, r, strict=True))
            bad_dec = sum(g != r[1] for g, r in zip(gpu_dec, ref, strict=True))
            results[f"{codec_name}/{dtype}"] = {
                "chunks": chunks, "chunks_differing": bad_chunks,
                "tensors": len(gpu_dec), "decoded_tensors_differing": bad_dec,
                "seconds": round(time.perf_counter() - t0, 1),
            }
            print(f"exactness {codec_name}/{dtype}: {bad_chunks}/{chunks} chunks differ, "
                  f"{bad_dec}/{len(gpu_dec)} decoded tensors differ", flush=True)
        del dev
    return results


def _events_ms(fn: Any, reps: int) -> float:
    import cupy

    fn()
    cupy.cuda.get_current_stream().synchronize()
    times = []
    for _ in range(reps):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(cupy.cuda.get_elapsed_time(a, b))
    return float(np.median(times))


def _copy_all(dst: list[Any], src: list[Any]) -> None:
    for d, t in zip(dst, src, strict=True):
        d.data.copy_from_device_async(t.data, t.nbytes)


def _encode_all(codec: Any, tensors: list[Any], step: int, dtype: str) -> list[Any]:
    from kvwire.codec import gpu

    return [gpu.encode_tensor(codec, t, TensorKind(i % 2), step, dtype=dtype) for i, t in enumerate(tensors)]


def _encode_all_as(codec: Any, tensors: list[Any], step: int, dtype: str, kind: int) -> list[Any]:
    from kvwire.codec import gpu

    return [gpu.encode_tensor(codec, t, TensorKind(kind), step, dtype=dtype) for t in tensors]


def _decode_all(base: str, whole: list[Any], dst: list[Any], dtype: str, flags: Any, kind: int | None = None) -> None:
    from kvwire.codec import gpu

    for i, (e, d) in enumerate(zip(whole, dst, strict=True)):
        k = TensorKind(i % 2 if kind is None else kind)
        gpu.launch_decode(base, e.params, e.buffer, d, dtype=dtype, kind=k, flags=flags)


def _kernels(codec_name: str, shape: tuple[int, int, int], dtype: str, kind: int, step: int, aligned: bool) -> list[str]:
    """The kernels that encode and decode a ``shape`` tensor (what the timings measured)."""
    from kvwire.codec import gpu

    group = gpu._int4_group(get_codec(codec_name))
    plan = gpu.plan_encode(codec_name, group, shape, dtype, TensorKind(kind), step, x_aligned=aligned)
    dec = gpu.plan_decode(codec_name, bytes([group]) if codec_name == "int4" else b"", shape, dtype,
                          TensorKind(kind), out_aligned=aligned)
    return [launch.kernel for launch in plan.launches] + [dec.kernel]


def _speed_one(dtype: str, tokens: int, reps: int) -> dict[str, Any]:
    """Kernel time on the whole cache as one tensor (one launch per kernel: what the
    kernels can do) and per K/V tensor (64 launches: what a layer-by-layer sender sees,
    Python launch overhead included)."""
    import cupy

    res: dict[str, Any] = {}
    dev = _device_cache(dtype)
    tensors = [t for kv in dev for t in kv]
    nbytes = sum(int(t.nbytes) for t in tensors)
    big = cupy.concatenate(tensors, axis=0)  # [64 * tokens, 8, 128]
    del dev
    dst = [cupy.empty_like(t) for t in tensors]
    big_dst = cupy.empty_like(big)
    copy_ms = _events_ms(lambda: _copy_all([big_dst], [big]), reps)
    copy_each_ms = _events_ms(lambda: _copy_all(dst, tensors), reps)
    res[f"copy/{dtype}"] = {"ms": copy_ms, "input_GBps": nbytes / copy_ms / 1e6,
                            "per_tensor_ms": copy_each_ms}
    step = _plan(tokens)[0][1]
    aligned = big.data.ptr % 16 == 0
    # int4 keys and values take different kernels: both timed, the whole cache as each
    runs = [(c, None) for c in CODECS if c != "int4"] + [("int4", 0), ("int4", 1)]
    for codec_name, kind in runs:
        codec = get_codec(codec_name)
        label = codec_name if kind is None else f"{codec_name} {'KV'[kind]}"
        k = 0 if kind is None else kind
        enc_ms = _events_ms(lambda codec=codec, k=k: _encode_all_as(codec, [big], step, dtype, k), reps)
        enc_each_ms = _events_ms(lambda codec=codec: _encode_all(codec, tensors, step, dtype), reps)
        # decode: the payload as one chunk, straight into the destination
        whole = _encode_all_as(codec, [big], int(big.shape[0]), dtype, k)
        flags = cupy.zeros(1, cupy.uint32)
        dec_ms = _events_ms(lambda base=codec_name, whole=whole, flags=flags, k=k:
                            _decode_all(base, whole, [big_dst], dtype, flags, k), reps)
        for e in whole:
            e.check()
        if int(flags.get()[0]):
            raise AssertionError(f"decode flags {int(flags.get()[0])} on valid payloads")
        del whole
        res[f"{label}/{dtype}"] = {
            "encode_ms": enc_ms, "encode_input_GBps": nbytes / enc_ms / 1e6,
            "encode_vs_copy": copy_ms / enc_ms,
            "decode_ms": dec_ms, "decode_output_GBps": nbytes / dec_ms / 1e6,
            "decode_vs_copy": copy_ms / dec_ms,
            "encode_per_tensor_ms": enc_each_ms, "encode_per_tensor_GBps": nbytes / enc_each_ms / 1e6,
            "kernels": _kernels(codec_name, tuple(big.shape), dtype, k, step, aligned),
        }
        print(f"speed {label}/{dtype}: encode {nbytes / enc_ms / 1e6:.0f} GB/s ({copy_ms / enc_ms:.2f}x copy; "
              f"64 launches {nbytes / enc_each_ms / 1e6:.0f} GB/s), decode {nbytes / dec_ms / 1e6:.0f} GB/s "
              f"({copy_ms / dec_ms:.2f}x copy); kernels {res[f'{label}/{dtype}']['kernels']}", flush=True)
    return res


def kernel_speed(tokens: int, reps: int) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for dtype in DTYPES:
        res.update(_speed_one(dtype, tokens, reps))
    return res


async def _transfer(codec: str, depth: int, on_gpu: bool) -> dict[str, Any]:
    import kvwire
    from kvwire.aio import _gpu

    _gpu.PIPELINE_DEPTH = depth
    spec = kvwire.KVSpec(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, dtype="float16")
    layers: list[tuple[Any, Any]] = _HOST["float16"]
    if on_gpu:
        import cupy

        layers = [(cupy.asarray(k), cupy.asarray(v)) for k, v in layers]
    secret = b"gpu-device-bench"
    async with kvwire.serve("127.0.0.1", 0, secret=secret, device="gpu" if on_gpu else "cpu") as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=secret, codec=codec) as peer:

            async def receive() -> Any:
                return await (await server.accept()).collect(timeout=25)

            t0 = time.perf_counter()
            receipt, cache = await asyncio.gather(peer.send("bench", spec, layers, timeout=25), receive())
            seconds = time.perf_counter() - t0
    assert len(cache.layers) == LAYERS
    return {
        "codec": codec, "source": "cupy -> gpu server" if on_gpu else "numpy -> cpu server",
        "pipeline_depth": depth if on_gpu else None, "seconds": round(seconds, 3),
        "kv_GBps": receipt.kv_bytes / seconds / 1e9, "wire_bytes": receipt.wire_bytes,
        "chunks": receipt.chunks,
    }


def transfers(tokens: int) -> list[dict[str, Any]]:
    out = []
    runs = [("raw", 1, False), ("fp8", 1, False)]
    runs += [(codec, depth, True) for codec in ("raw", "fp8", "int4") for depth in (1, 4)]
    for codec, depth, on_gpu in runs:
        try:
            r = asyncio.run(asyncio.wait_for(_transfer(codec, depth, on_gpu), 30))
        except Exception as exc:
            r = {"codec": codec, "pipeline_depth": depth, "source": "gpu" if on_gpu else "cpu", "error": repr(exc)}
        print(f"transfer {r}", flush=True)
        out.append(r)
    return out


def summary(results: dict[str, Any]) -> str:
    lines = ["# GPU device run", "", "```", json.dumps(results.get("environment", {}), indent=1), "```", ""]
    t = results.get("tests")
    if t:
        lines += [f"tests: `pytest -m gpu tests`: {t['summary']} (rc {t['returncode']}, {t['seconds']} s)", ""]
    ex = results.get("exactness")
    if ex:
        lines += ["| codec/dtype | chunks differing | decoded tensors differing |", "|---|---|---|"]
        lines += [f"| {k} | {v['chunks_differing']} / {v['chunks']} | {v['decoded_tensors_differing']} / {v['tensors']} |" for k, v in ex.items()]
        lines.append("")
    sp = results.get("speed")
    if sp:
        lines += ["| kernel | encode GB/s | encode / copy | encode, 64 launches GB/s | decode GB/s | decode / copy | kernels |",
                  "|---|---|---|---|---|---|---|"]
        for k, v in sp.items():
            if k.startswith("copy/"):
                lines.append(f"| device copy {k[5:]} | {v['input_GBps']:.0f} | 1.00 | | | | |")
            else:
                lines.append(f"| {k} | {v['encode_input_GBps']:.0f} | {v['encode_vs_copy']:.2f} | "
                             f"{v['encode_per_tensor_GBps']:.0f} | {v['decode_output_GBps']:.0f} | {v['decode_vs_copy']:.2f} | "
                             f"{', '.join(v.get('kernels', []))} |")
        lines.append("")
    tr = results.get("transfer")
    if tr:
        lines += ["| loopback | codec | pipeline depth | seconds | KV GB/s |", "|---|---|---|---|---|"]
        for r in tr:
            if "error" in r:
                lines.append(f"| {r['source']} | {r['codec']} | {r['pipeline_depth']} | error: {r['error'][:80]} | |")
            else:
                lines.append(f"| {r['source']} | {r['codec']} | {r['pipeline_depth']} | {r['seconds']} | {r['kv_GBps']:.2f} |")
    for name, err in results.get("errors", {}).items():
        lines += ["", f"{name} failed:", "```", err[-1500:], "```"]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_results"))
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--skip-exactness", action="store_true")
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--budget", type=float, default=360.0,
                    help="seconds after which the remaining steps are skipped (the run stays under 8 minutes)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    results: dict[str, Any] = {"command": " ".join(sys.argv), "tokens": args.tokens, "errors": {}}
    if not args.skip_tests:
        try:
            results["tests"] = run_tests(out)
            print(f"tests: {results['tests']}", flush=True)
        except Exception:
            results["errors"]["tests"] = traceback.format_exc()
    # the host cache exists before CUDA is touched, so forked workers share it
    f32 = make_cache(args.tokens)
    for dtype in DTYPES:
        _HOST[dtype] = [(k.astype(numpy_dtype(dtype)), v.astype(numpy_dtype(dtype))) for k, v in f32]
    del f32
    pool = mp.get_context("fork").Pool(args.workers)
    steps: list[tuple[str, Any, tuple[Any, ...]]] = [("environment", environment, ())]
    if not args.skip_exactness:
        steps.append(("exactness", exactness, (pool, args.tokens)))
    steps += [("speed", kernel_speed, (args.tokens, args.reps)), ("transfer", transfers, (args.tokens,))]
    for name, fn, fargs in steps:
        if time.perf_counter() - t_start > args.budget:
            results["errors"][name] = f"skipped: the run had used its {args.budget} s budget"
            print(results["errors"][name], flush=True)
            continue
        try:
            results[name] = fn(*fargs)
        except Exception:
            results["errors"][name] = traceback.format_exc()
            print(f"{name} failed:\n{results['errors'][name]}", flush=True)
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    pool.terminate()
    results["seconds"] = round(time.perf_counter() - t_start, 1)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    text = summary(results)
    (out / "summary.md").write_text(text)
    print(text, flush=True)


if __name__ == "__main__":
    main()
