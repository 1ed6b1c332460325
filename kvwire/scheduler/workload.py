"""Workloads: request traces (Mooncake format), synthetic log-normal traffic, and the
input-length distributions the throughput model integrates over."""

from __future__ import annotations

import gzip
import json
import math
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist

import numpy as np
import numpy.typing as npt

from kvwire.errors import UsageError
from kvwire.scheduler._checks import check_whole

__all__ = [
    "BLOCK_TOKENS",
    "MAX_TIMESTAMP_MS",
    "MAX_TOKENS",
    "LengthDistribution",
    "TraceRequest",
    "incremental_lengths",
    "load_trace",
    "synthetic_trace",
]

BLOCK_TOKENS = 512
"""Tokens per prefix block in the Mooncake trace format and in the consistency registry."""
MAX_TOKENS = 1 << 27
"""Longest input or output a request may have: 134,217,728 tokens (128M, far beyond any
model's context), so that no length can make the simulation's numbers overflow."""
MAX_TIMESTAMP_MS = 1e15
"""Largest trace timestamp, in either direction: 10^15 ms (about 31,700 years, so epoch
milliseconds fit with room to spare)."""
#: The fields a trace record cannot do without (``hash_ids`` is optional).
_REQUIRED_FIELDS = ("timestamp", "input_length", "output_length")


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceRequest:
    """One request of a trace."""

    arrival_s: float
    """Arrival time, seconds from the start of the trace."""
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] = ()
    """Prefix block ids (BLOCK_TOKENS tokens each); equal ids at equal positions share KV."""


def load_trace(path: str | Path, *, limit: int | None = None) -> tuple[TraceRequest, ...]:
    """Read a Mooncake-format JSONL trace (``timestamp`` ms, ``input_length``,
    ``output_length``, ``hash_ids``), sorted by arrival. A ``.gz`` file (any case) is decompressed;
    UTF-8, with or without a byte-order mark.
    Lengths and hash ids are whole numbers (``4000`` or ``4000.0``; not ``1000.7``, ``true``
    or ``"4000"``), the timestamp any number, ``hash_ids`` (optional) a list.
    Timestamps must be finite and at most :data:`MAX_TIMESTAMP_MS` either side of 0, and
    lengths between 0 and :data:`MAX_TOKENS`; a bad record is reported by path and line.
    ``limit``: keep the first ``limit`` records in file order (then sort them); a whole
    number (``2`` or ``2.0``), at least 1."""
    if limit is not None:
        limit = check_whole("limit", limit, at_least=1)
    out: list[TraceRequest] = []
    try:
        with (
            # utf-8-sig: a byte-order mark before the first record (as some Windows tools
            # write) is skipped; it failed the first line as "not a trace record".
            gzip.open(path, "rt", encoding="utf-8-sig")
            if str(path).lower().endswith(".gz")
            else open(path, encoding="utf-8-sig")
        ) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                    if not isinstance(obj, dict):
                        raise ValueError(f"a record is a JSON object, not {type(obj).__name__}")
                    hash_ids = obj.get("hash_ids", [])
                    if not isinstance(hash_ids, list):
                        raise ValueError(f"hash_ids must be a list, not {json.dumps(hash_ids)}")
                    req = TraceRequest(
                        arrival_s=json_number(obj["timestamp"], "timestamp") / 1000.0,
                        input_length=json_whole(obj["input_length"], "input_length"),
                        output_length=json_whole(obj["output_length"], "output_length"),
                        hash_ids=tuple(json_whole(h, "a hash id") for h in hash_ids),
                    )
                except KeyError as exc:
                    # name the missing field (a KeyError's str() is only the key's repr)
                    raise UsageError(
                        f"{path}:{lineno}: missing field {exc.args[0]!r} (a record needs "
                        f"{', '.join(_REQUIRED_FIELDS)})"
                    ) from None
                except (TypeError, ValueError, OverflowError, RecursionError) as exc:
                    # RecursionError: JSON nested deeper than the parser follows.
                    raise UsageError(f"{path}:{lineno}: not a trace record ({exc})") from None
                if not math.isfinite(req.arrival_s):
                    raise UsageError(f"{path}:{lineno}: timestamp must be a finite number")
                if not abs(req.arrival_s) <= MAX_TIMESTAMP_MS / 1000.0:
                    raise UsageError(
                        f"{path}:{lineno}: timestamp must be within {MAX_TIMESTAMP_MS:.0e} ms of 0"
                    )
                if req.input_length < 0 or req.output_length < 0:
                    raise UsageError(f"{path}:{lineno}: input_length and output_length must be >= 0")
                if req.input_length > MAX_TOKENS or req.output_length > MAX_TOKENS:
                    raise UsageError(
                        f"{path}:{lineno}: input_length and output_length must be at most "
                        f"{MAX_TOKENS:,} tokens"
                    )
                out.append(req)
                if limit is not None and len(out) >= limit:
                    break
    except (OSError, EOFError, UnicodeDecodeError, zlib.error) as exc:
        # zlib.error: a .gz file whose compressed data is corrupt (not an OSError).
        raise UsageError(f"cannot read trace {path}: {exc}") from None
    if not out:
        raise UsageError(f"trace {path} holds no requests")
    out.sort(key=lambda r: r.arrival_s)
    return tuple(out)


def show_json(value: object) -> str:
    """``value`` as JSON writes it (``true``, ``"4000"``), or its repr where JSON cannot (a
    TOML date in a profile)."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def json_number(value: object, what: str) -> float:
    """A JSON (or TOML) number as a float (a boolean or a string is not one)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{what} must be a number, not {show_json(value)}")
    return float(value)


def json_whole(value: object, what: str) -> int:
    """A JSON (or TOML) number with a whole value (``4000`` or ``4000.0``) as an int;
    ``1000.7``, ``true`` or ``"4000"`` is refused rather than rounded or converted."""
    if (isinstance(value, bool) or not isinstance(value, int | float)
            or (isinstance(value, float) and not value.is_integer())):
        raise ValueError(f"{what} must be a whole number, not {show_json(value)}")
    return int(value)


def synthetic_trace(
    rng: np.random.Generator,
    *,
    requests: int = 4000,
    rate_rps: float = 1.0,
    mu: float = 9.90,
    sigma: float = 1.00,
    min_tokens: int = 128,
    max_tokens: int = 131072,
    output_tokens: int = 1024,
    clip: bool = False,
) -> tuple[TraceRequest, ...]:
    """Poisson arrivals with log-normal input lengths truncated to ``[min_tokens,
    max_tokens]`` (the case-study workload: mu 9.90, sigma 1.00, [128, 128K], 1024 output
    tokens; ``clip=True`` clips instead, piling the tails onto the bounds). No shared
    prefixes: every request gets fresh block ids."""
    if requests <= 0 or not rate_rps > 0:
        raise UsageError("requests and rate must be positive")
    if max(min_tokens, max_tokens, output_tokens) > MAX_TOKENS:
        raise UsageError(f"lengths must be at most {MAX_TOKENS:,} tokens")
    with np.errstate(over="ignore", invalid="ignore"):  # a rate so low the times overflow
        gaps = rng.exponential(1.0 / rate_rps, size=requests)
        arrivals = np.cumsum(gaps) - gaps[0]
    if not np.all(np.isfinite(arrivals)):
        raise UsageError(f"at {rate_rps:g} requests/s the arrival times overflow: arrival times must be finite")
    if clip:
        raw = rng.lognormal(mu, sigma, size=requests)
    else:
        lo, hi = _lognormal_cdf_range(mu, sigma, min_tokens, max_tokens)
        nd = NormalDist(mu, sigma)
        raw = np.asarray([math.exp(nd.inv_cdf(u)) for u in rng.uniform(lo, hi, size=requests)])
    lengths = np.clip(np.rint(raw), min_tokens, max_tokens)
    out: list[TraceRequest] = []
    next_block = 0
    for t, n in zip(arrivals.tolist(), lengths.astype(np.int64).tolist(), strict=True):
        blocks = -(-n // BLOCK_TOKENS)
        out.append(
            TraceRequest(
                arrival_s=float(t),
                input_length=int(n),
                output_length=output_tokens,
                hash_ids=tuple(range(next_block, next_block + blocks)),
            )
        )
        next_block += blocks
    return tuple(out)


def _lognormal_cdf_range(
    mu: float, sigma: float, min_tokens: float, max_tokens: float
) -> tuple[float, float]:
    """``(F(min), F(max))`` of the log-normal, kept inside (0, 1) for ``inv_cdf``."""
    if sigma <= 0 or not 0 < min_tokens < max_tokens:
        raise UsageError("need sigma > 0 and 0 < min_tokens < max_tokens")
    nd = NormalDist(mu, sigma)
    eps = 1e-12
    lo = min(max(nd.cdf(math.log(min_tokens)), eps), 1 - eps)
    hi = min(max(nd.cdf(math.log(max_tokens)), eps), 1 - eps)
    if hi <= lo:
        raise UsageError("the length bounds leave no probability mass")
    return lo, hi


def incremental_lengths(
    requests: Iterable[TraceRequest], *, block_tokens: int = BLOCK_TOKENS
) -> npt.NDArray[np.float64]:
    """Each request's length after the longest prefix hit in an unbounded prefix cache that
    has seen every request that arrived before it: the lengths the model's threshold
    applies to.  Requests are taken in arrival order (those arriving at the same time in
    the order given), whatever the order of ``requests``; the lengths come back in the
    order given."""
    reqs = list(requests)
    seen: set[int] = set()
    out = np.zeros(len(reqs), dtype=np.float64)
    for i in sorted(range(len(reqs)), key=lambda i: reqs[i].arrival_s):  # stable: ties as given
        r = reqs[i]
        hit = 0
        for h in r.hash_ids:
            if h not in seen:
                break
            hit += 1
        seen.update(r.hash_ids)
        out[i] = float(max(0, r.input_length - hit * block_tokens))
    return out


class LengthDistribution:
    """An empirical distribution of (incremental) input lengths with O(log n) tail queries:
    ``p = P(L > t)``, ``E[L | L > t]`` and ``E[L | L <= t]``."""

    __slots__ = ("_cum", "_sorted")

    def __init__(self, lengths: Sequence[float] | npt.NDArray[np.float64]) -> None:
        arr = np.sort(np.asarray(lengths, dtype=np.float64))
        if arr.size == 0 or not np.all(np.isfinite(arr)) or arr[0] < 0:
            raise UsageError("a length distribution needs finite, non-negative lengths")
        self._sorted = arr
        self._cum = np.concatenate(([0.0], np.cumsum(arr)))

    @classmethod
    def lognormal(
        cls,
        mu: float = 9.90,
        sigma: float = 1.00,
        *,
        min_tokens: float = 128,
        max_tokens: float = 131072,
        points: int = 20000,
        clip: bool = False,
    ) -> LengthDistribution:
        """A log-normal truncated to ``[min_tokens, max_tokens]`` (conditioned on the
        range, as the case study describes it), or clipped to it with ``clip=True``;
        represented by ``points`` equally likely quantiles (no sampling noise, so the
        optimizer's answer is reproducible)."""
        nd = NormalDist(mu, sigma)
        if clip:
            lo, hi = 0.0, 1.0
        else:
            lo, hi = _lognormal_cdf_range(mu, sigma, min_tokens, max_tokens)
        qs = [math.exp(nd.inv_cdf(lo + (hi - lo) * (i + 0.5) / points)) for i in range(points)]
        return cls(np.clip(np.asarray(qs), min_tokens, max_tokens))

    @classmethod
    def from_trace(
        cls, requests: Sequence[TraceRequest], *, incremental: bool = True
    ) -> LengthDistribution:
        """Lengths of a trace, after prefix hits (``incremental=True``) or raw."""
        if incremental:
            return cls(incremental_lengths(requests))
        return cls(np.asarray([r.input_length for r in requests], dtype=np.float64))

    @property
    def lengths(self) -> npt.NDArray[np.float64]:
        """The sorted lengths (read-only view)."""
        view = self._sorted.view()
        view.flags.writeable = False
        return view

    @property
    def mean(self) -> float:
        return float(self._cum[-1] / self._sorted.size)

    @property
    def max(self) -> float:
        return float(self._sorted[-1])

    def quantile(self, q: float) -> float:
        return float(np.quantile(self._sorted, q))

    def _split(self, threshold: float) -> int:
        return int(np.searchsorted(self._sorted, threshold, side="right"))

    def fraction_above(self, threshold: float) -> float:
        """``p = P(L > t)``."""
        return 1.0 - self._split(threshold) / self._sorted.size

    def mean_above(self, threshold: float) -> float:
        """``l_long = E[L | L > t]`` (0 when nothing is above)."""
        k = self._split(threshold)
        n = self._sorted.size - k
        return float((self._cum[-1] - self._cum[k]) / n) if n else 0.0

    def mean_at_most(self, threshold: float) -> float:
        """``l_short = E[L | L <= t]`` (0 when nothing is at or below)."""
        k = self._split(threshold)
        return float(self._cum[k] / k) if k else 0.0
