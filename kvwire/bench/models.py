"""KV cache shapes of common models, and the deterministic caches the bench sends.

A bench cache is random fp16 data of the model's exact layout. It is generated from a
seed so that a receiver on another machine can regenerate the very same tensors and
measure the error a lossy codec introduced, without the sender shipping them twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvwire.codec import numpy_dtype
from kvwire.errors import UsageError
from kvwire.spec import KVSpec

__all__ = [
    "MODELS", "ModelShape", "bench_cache", "bench_cache_bytes", "get_model", "layer_error", "relative_error",
]


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The KV layout of one model (grouped-query attention: KV heads, not query heads)."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float16"

    def spec(self) -> KVSpec:
        return KVSpec(
            num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, dtype=self.dtype, model=self.name,
        )

    def bytes_per_token(self) -> int:
        return self.spec().bytes_per_token()


MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape("llama3-8b", 32, 8, 128),
        ModelShape("llama3-70b", 80, 8, 128),
        ModelShape("qwen2.5-72b", 80, 8, 128),
        # Small enough for tests and smoke runs: 4 KiB per token.
        ModelShape("tiny", 4, 2, 128),
    )
}


def get_model(name: str) -> ModelShape:
    try:
        return MODELS[name]
    except KeyError:
        raise UsageError(f"unknown model {name!r} (known: {', '.join(MODELS)})") from None


# Successive tensors start this many elements apart in one shared pool. A prime keeps
# the tensors from lining up with chunk boundaries, so no two chunks carry equal bytes.
_STRIDE = 1021


def bench_cache(model: ModelShape, tokens: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The layers ``(k, v)`` of a bench cache: standard normal values, as fp16.

    Every tensor is a view into one pool of about one tensor's size, so a 1 GiB cache
    costs a few MiB of memory and milliseconds to build; the same arguments give the
    same bytes on any machine.
    """
    if tokens < 1:
        raise UsageError("tokens must be >= 1")
    per_tensor = tokens * model.num_kv_heads * model.head_dim
    count = 2 * model.num_layers
    rng = np.random.default_rng(seed)
    pool = rng.standard_normal(per_tensor + count * _STRIDE, dtype=np.float32).astype(
        numpy_dtype(model.dtype)
    )
    shape = (tokens, model.num_kv_heads, model.head_dim)

    def tensor(i: int) -> np.ndarray:
        return pool[i * _STRIDE : i * _STRIDE + per_tensor].reshape(shape)

    return [(tensor(2 * i), tensor(2 * i + 1)) for i in range(model.num_layers)]


def bench_cache_bytes(model: ModelShape, tokens: int) -> int:
    """The bytes of the pool :func:`bench_cache` builds for these arguments: one tensor,
    and :data:`_STRIDE` elements more for every tensor of the model, however small the
    tensors are (a receiver checks it against what a transfer brought before building it)."""
    per_tensor = tokens * model.num_kv_heads * model.head_dim
    return (per_tensor + 2 * model.num_layers * _STRIDE) * numpy_dtype(model.dtype).itemsize


def relative_error(
    received: list[tuple[np.ndarray, np.ndarray]], sent: list[tuple[np.ndarray, np.ndarray]]
) -> float:
    """Max over layers and over K and V of ``||x^ - x|| / ||x||`` (0.0 when identical)."""
    if len(received) != len(sent):
        raise ValueError("caches have different layer counts")
    worst = 0.0
    for pair_r, pair_s in zip(received, sent, strict=True):
        for got, want in zip(pair_r, pair_s, strict=True):
            if got.shape != want.shape:
                raise ValueError(f"tensor shapes differ: {got.shape} vs {want.shape}")
            if np.array_equal(got.view(np.uint8), want.view(np.uint8)):
                continue
            g = np.asarray(got, dtype=np.float32)
            w = np.asarray(want, dtype=np.float32)
            norm = float(np.linalg.norm(w))
            diff = float(np.linalg.norm(g - w))
            worst = max(worst, diff / norm if norm > 0 else (0.0 if diff == 0 else float("inf")))
    return worst


def layer_error(
    got: tuple[np.ndarray, np.ndarray], want: tuple[np.ndarray, np.ndarray], part: int, parts: int,
) -> float:
    """One layer's :func:`relative_error`, cheaply: 0.0 when K and V are bit-identical
    (checked over every token); otherwise measured over the ``part``-th of ``parts``
    equal slices of the tokens.

    numpy converts float16 to float32 one element at a time: for a whole 32 MiB layer per
    transfer that took 0.15-0.2 of a core in ``kvwire bench``'s receiver process
    (docs/benchmarks.md), on the cores the transfer runs on. A slice that moves with every
    pass over the layers still reaches every token of every layer.
    """
    if not 0 <= part < parts:
        raise ValueError("need 0 <= part < parts")
    if all(np.array_equal(g.view(np.uint8), w.view(np.uint8)) for g, w in zip(got, want, strict=True)):
        return 0.0
    tokens = want[0].shape[0]
    lo, hi = tokens * part // parts, tokens * (part + 1) // parts
    if hi == lo:  # fewer tokens than parts: the whole layer
        lo, hi = 0, tokens
    return relative_error([(got[0][lo:hi], got[1][lo:hi])], [(want[0][lo:hi], want[1][lo:hi])])
