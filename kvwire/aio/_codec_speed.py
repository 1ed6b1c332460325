"""Encode and decode speeds of the quantizing codecs, measured once on this host.

``auto`` weighs a codec's CPU cost on both ends against the wire time it saves. The
receiver does not report its decode speed, so the sender measures decode here and uses
it for the receiver's, and seeds its encode estimate the same way (later encodes refine
it). Lossless raw costs nothing on either end and is not measured.
"""

from __future__ import annotations

import time
from functools import cache

import numpy as np

from kvwire.codec import TensorKind, get_codec

__all__ = ["codec_speeds"]

#: 2 MiB of fp16, the size of a chunk's work: a smaller sample is timed mostly on the
#: per-call overhead and undervalues the compiled loops (on a 512 KiB sample fp8 measured
#: 2.8 GB/s encode and 6.8 decode where 4 MiB chunks run at 6.0 and 18)
_SHAPE = (1024, 8, 128)


@cache
def _sample() -> np.ndarray:
    """The fp16 tensor every codec is timed on, made once (about 10 ms)."""
    return np.random.default_rng(0).standard_normal(_SHAPE, dtype=np.float32).astype(np.float16)


@cache
def codec_speeds(name: str) -> tuple[float | None, float | None]:
    """``(encode, decode)`` speed of codec ``name`` in fp16 bytes/s; ``None`` for lossless."""
    codec = get_codec(name)
    if codec.lossless:
        return None, None
    x = _sample()
    out = np.empty(_SHAPE, np.float16)
    enc_best = dec_best = float("inf")
    for _ in range(3):  # best of three: the first run pays imports and page faults
        t0 = time.thread_time()  # CPU time, as the transport measures encodes and decodes
        enc = codec.encode(x, TensorKind.K)
        t1 = time.thread_time()
        codec.decode(enc.params, enc.payload, shape=_SHAPE, dtype="float16", kind=TensorKind.K, out=out)
        t2 = time.thread_time()
        enc_best, dec_best = min(enc_best, t1 - t0), min(dec_best, t2 - t1)
    return x.nbytes / max(enc_best, 1e-9), x.nbytes / max(dec_best, 1e-9)
