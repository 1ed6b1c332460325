"""Sending torch tensors, CuPy arrays, or anything else that speaks DLPack.

``peer.send()`` takes each layer's ``k`` and ``v`` as a numpy array or as any object with
``__dlpack__``: a torch tensor (CPU or CUDA), a CuPy array, a JAX array... Host tensors are
read in place through DLPack; device arrays are copied to host memory before encoding.
The receiver always gets numpy arrays; this example turns them back into the sender's
framework (``torch.from_dlpack``, ``cupy.asarray``) and checks they are bit-identical.

Cases, each run only where its framework is installed (the output says which were skipped):

- a minimal DLPack producer written here (no framework: always runs),
- numpy bfloat16 (through ml_dtypes, which kvwire depends on: always runs),
- torch CPU tensors, float16 and bfloat16 (numpy has no bfloat16 in DLPack: kvwire reads
  the bits as int16 and reinterprets them),
- torch CUDA tensors and CuPy arrays, where a CUDA device is present.

    python examples/torch_cupy_interop.py
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import kvwire
import kvwire.aio
from kvwire.codec import numpy_dtype

SECRET = b"example-shared-secret"
NUM_LAYERS, HEADS, HEAD_DIM = 4, 8, 128


class DLPackOnly:
    """The smallest DLPack producer: kvwire sees only ``__dlpack__``/``__dlpack_device__``,
    not a numpy array, so this exercises the same path as a framework's tensor."""

    def __init__(self, array: np.ndarray) -> None:
        self._array = array

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._array.__dlpack_device__()


@dataclass
class Case:
    name: str
    dtype: str
    make: Callable[[np.ndarray], Any]
    """numpy array of the spec dtype -> the object handed to send()."""
    back: Callable[[np.ndarray], Any]
    """received numpy array -> the sender's framework (shows the way back)."""
    bits: Callable[[Any], np.ndarray]
    """an object of either kind -> its raw bits as a host numpy array, to compare."""


def host_bits(a: Any) -> np.ndarray:
    arr = a if isinstance(a, np.ndarray) else np.from_dlpack(a)
    return np.ascontiguousarray(arr).view(np.uint8)


def build_cases() -> tuple[list[Case], list[str]]:
    cases = [
        Case("DLPack-only producer, float16", "float16", DLPackOnly, lambda a: a, host_bits),
        Case("numpy bfloat16 (ml_dtypes)", "bfloat16", lambda a: a, lambda a: a, host_bits),
    ]
    skipped: list[str] = []
    if importlib.util.find_spec("torch") is not None:
        import torch

        def torch_bits(t: Any) -> np.ndarray:
            if isinstance(t, np.ndarray):
                return host_bits(t)
            # numpy cannot hold torch's bfloat16 via DLPack; compare the 16-bit patterns.
            return np.asarray(t.detach().cpu().contiguous().view(torch.int16).numpy()).view(np.uint8)

        def to_torch(a: np.ndarray) -> Any:
            if a.dtype == numpy_dtype("bfloat16"):
                return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
            return torch.from_dlpack(a)

        def from_numpy_cpu(a: np.ndarray) -> Any:
            return to_torch(a).clone()

        cases.append(Case("torch CPU float16", "float16", from_numpy_cpu, to_torch, torch_bits))
        cases.append(Case("torch CPU bfloat16", "bfloat16", from_numpy_cpu, to_torch, torch_bits))
        if torch.cuda.is_available():
            cases.append(Case(
                "torch CUDA float16", "float16", lambda a: from_numpy_cpu(a).cuda(),
                lambda a: to_torch(a).cuda(), torch_bits,
            ))
        else:
            skipped.append("torch CUDA tensors (torch is installed, no CUDA device)")
    else:
        skipped.append("torch CPU and CUDA tensors (torch is not installed)")
    cupy_ok = False
    if importlib.util.find_spec("cupy") is not None:
        try:
            import cupy

            cupy_ok = cupy.cuda.runtime.getDeviceCount() > 0
        except Exception:
            cupy_ok = False
        if cupy_ok:
            cases.append(Case(
                "CuPy float16", "float16", cupy.asarray, cupy.asarray,
                lambda x: host_bits(cupy.asnumpy(x) if not isinstance(x, np.ndarray) else x),
            ))
        else:
            skipped.append("CuPy arrays (CuPy is installed, no CUDA device)")
    else:
        skipped.append("CuPy arrays (CuPy is not installed)")
    return cases, skipped


async def run_case(peer: kvwire.Peer, server: kvwire.Server, case: Case, tokens: int, index: int) -> bool:
    spec = kvwire.KVSpec(num_layers=NUM_LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM, dtype=case.dtype)
    rng = np.random.default_rng(index)
    dt = numpy_dtype(case.dtype)
    originals = [
        tuple(case.make(rng.standard_normal((tokens, HEADS, HEAD_DIM), dtype=np.float32).astype(dt)) for _ in "kv")
        for _ in range(NUM_LAYERS)
    ]
    rid = f"interop-{index}"
    receiving = asyncio.create_task(server.expect(rid, timeout=30))
    receipt = await peer.send(rid, spec, originals)
    cache = await (await receiving).collect(timeout=30)
    ok = all(
        np.array_equal(case.bits(sent), case.bits(got))
        for (sk, sv), (gk, gv) in zip(originals, cache.layers, strict=True)
        for sent, got in ((sk, gk), (sv, gv))
    )
    back = case.back(cache.layers[0][0])
    print(f"  {case.name:34s} sent {type(originals[0][0]).__module__}.{type(originals[0][0]).__name__}, "
          f"{receipt.kv_bytes / 2**20:.1f} MiB; received numpy {cache.layers[0][0].dtype} -> "
          f"{type(back).__module__}.{type(back).__name__}: " + ("verified bit-identical" if ok else "MISMATCH"))
    return ok


async def main(args: argparse.Namespace) -> None:
    cases, skipped = build_cases()
    print(f"{len(cases)} case(s) to run, {len(skipped)} skipped", flush=True)
    failures = 0
    async with (
        kvwire.serve("127.0.0.1", 0, secret=SECRET) as server,
        kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer,
    ):
        for i, case in enumerate(cases):
            failures += not await run_case(peer, server, case, args.tokens, i)
    for what in skipped:
        print(f"  skipped: {what}")
    if failures:
        raise SystemExit(f"{failures} case(s) did not round-trip")
    print(f"all {len(cases)} case(s) verified")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=64)
    return p.parse_args()


if __name__ == "__main__":
    kvwire.aio.run(main(parse_args()))
