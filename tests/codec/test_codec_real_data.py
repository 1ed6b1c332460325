"""Error and size bounds on the real MiniLM KV sample (whole cache, every layer)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvwire.codec import TensorKind, get_codec

# Carried by the repository (provenance in tests/data/README.md).
SAMPLE = Path(__file__).resolve().parents[1] / "data" / "minilm_kv.npz"
BOUNDS = {"raw": (0.0, 1.0), "fp8": (0.03, 0.57), "int8": (0.01, 0.57), "int4": (0.12, 0.38)}


@pytest.fixture(scope="module")
def sample() -> dict[str, np.ndarray]:
    assert SAMPLE.exists(), f"real KV sample missing: {SAMPLE}"
    with np.load(SAMPLE) as data:
        return {"k": data["k"], "v": data["v"]}


@pytest.mark.parametrize("name", sorted(BOUNDS))
def test_whole_cache_error_and_size(sample: dict[str, np.ndarray], name: str) -> None:
    codec = get_codec(name)
    err2 = ref2 = 0.0
    wire = fp16 = 0
    for key, kind in (("k", TensorKind.K), ("v", TensorKind.V)):
        cache = sample[key]
        assert cache.shape == (6, 2, 512, 12, 32) and cache.dtype == np.float16
        for layer in range(6):
            for seq in range(2):
                x = cache[layer, seq]
                chunk = codec.encode(x, kind)
                y = codec.decode(chunk.params, chunk.payload, shape=x.shape, dtype="float16", kind=kind)
                xf = x.astype(np.float64)
                err2 += float(((y.astype(np.float64) - xf) ** 2).sum())
                ref2 += float((xf**2).sum())
                wire += len(chunk.params) + memoryview(chunk.payload).nbytes
                fp16 += x.size * 2
    rel, ratio = (err2 / ref2) ** 0.5, wire / fp16
    max_rel, max_ratio = BOUNDS[name]
    assert rel <= max_rel and ratio <= max_ratio, (rel, ratio)
    if name == "raw":
        assert rel == 0.0
