"""Per-instance model profiles: prefill latency and KV size as functions of input length.

A profile is a handful of measured points ``(tokens, kv_bytes, prefill_seconds)`` for one
serving instance; values in between are interpolated linearly and values outside are
extrapolated along the nearest segment, because prefill cost and KV size are close to
affine over each measured decade and a measured curve must not be replaced by a guessed
shape. The KV size is clamped at zero; a profile whose prefill latency, so extended,
falls below zero at 0 tokens, or to zero or below by
:data:`~kvwire.scheduler.workload.MAX_TOKENS`, is refused (a prefill that takes no time
would give the model infinite capacity there), rather than clamped.

Built-in profiles (``builtin_profile(name)``):

- ``hybrid-1t``: the 1T hybrid (linear + full attention, 3:1) on one 8xH200 instance, the
  four points published with the Prefill-as-a-Service throughput model.
- ``llama-3-70b``: dense Llama-3-70B on one 8xH200 instance, derived (not measured) by
  :func:`dense_profile`: KV = 327,680 B/token (80 layers x 8 KV heads x 128 x 2 x fp16);
  prefill FLOPs = 2 x 70e9 x l (weights) + 2 x 80 x 8192 x l^2 (causal QK^T and AV);
  effective throughput 3.2 PFLOP/s (8 x 989 TFLOP/s dense BF16 at 40% utilization) plus
  a 50 ms fixed launch cost.

User profiles are JSON or TOML files::

    name = "my-model"
    tokens = [1024, 8192, 32768]
    kv_bytes = [2.0e8, 3.2e8, 7.4e8]
    prefill_s = [0.44, 0.72, 1.84]
    cache_blocks = 8192          # optional: prefix cache of one instance, 512-token blocks
"""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from kvwire.errors import UsageError
from kvwire.scheduler.workload import MAX_TOKENS, json_number, json_whole, show_json

__all__ = [
    "BUILTIN_PROFILES",
    "MIN_RELATIVE_COMPUTE",
    "ModelProfile",
    "builtin_profile",
    "dense_profile",
    "load_profile",
]

BUILTIN_PROFILES: tuple[str, ...] = ("hybrid-1t", "llama-3-70b")
_BUILTIN_FILES = {"hybrid-1t": "hybrid_1t.json", "llama-3-70b": "llama_3_70b.json"}

MIN_RELATIVE_COMPUTE = 1e-3
"""Least ``relative_compute`` :meth:`ModelProfile.scaled` takes: a local instance with a
thousandth of a remote one's compute. Below it the prefill latencies run to hours and the
fixed per-pass cost is lost to rounding."""

#: Relative error of a prefill latency extended to 0 tokens that is rounding, not a
#: negative latency: a profile through the origin (its line reaches exactly 0 s at 0
#: tokens, which is allowed) computes ``y0 - slope * x0`` a few ulps either side of 0.
_EXTENSION_ROUNDING = 1e-9


def _interp(x: float, xs: tuple[float, ...], ys: tuple[float, ...]) -> float:
    if len(xs) == 1:
        # One point: proportional through the origin is the only shape it supports.
        return max(0.0, ys[0] * x / xs[0])
    if x <= xs[0]:
        i = 0
    elif x >= xs[-1]:
        i = len(xs) - 2
    else:
        return float(np.interp(x, xs, ys))
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelProfile:
    """Measured (or derived) points of one serving instance for one model."""

    name: str
    """Model and hardware the points describe."""
    tokens: tuple[float, ...]
    """Input lengths of the points, strictly increasing."""
    kv_bytes: tuple[float, ...]
    """KV cache (and any fixed recurrent state) a request of that length produces, bytes."""
    prefill_s: tuple[float, ...]
    """Prefill latency of one request of that length on one instance, seconds."""
    cache_blocks: int | None = None
    """Prefix-cache capacity of one instance, in 512-token blocks (LRU); ``None``: not
    stated, the simulator's default applies."""
    source: str | None = field(default=None, compare=False, repr=False)
    """The file the points were read from (:func:`load_profile`), which its errors name
    ("profile prof.json: ..."); else they name the profile (``'custom'`` for a table
    without a name)."""

    @property
    def _where(self) -> str:
        return self.source if self.source is not None else repr(self.name)

    def __post_init__(self) -> None:
        if self.cache_blocks is not None and self.cache_blocks < 0:
            raise UsageError(f"profile {self._where}: cache_blocks must be >= 0")
        n = len(self.tokens)
        if n == 0 or len(self.kv_bytes) != n or len(self.prefill_s) != n:
            raise UsageError(f"profile {self._where}: tokens, kv_bytes, prefill_s lengths differ")
        for field_name, values in (
            ("tokens", self.tokens),
            ("kv_bytes", self.kv_bytes),
            ("prefill_s", self.prefill_s),
        ):
            if not all(math.isfinite(v) for v in values):
                raise UsageError(f"profile {self._where}: {field_name} must be finite numbers")
        if any(b <= a for a, b in zip(self.tokens, self.tokens[1:], strict=False)):
            raise UsageError(f"profile {self._where}: tokens must be strictly increasing")
        if self.tokens[0] <= 0:
            raise UsageError(f"profile {self._where}: token counts must be positive")
        if any(v < 0 for v in self.kv_bytes) or any(v <= 0 for v in self.prefill_s):
            raise UsageError(f"profile {self._where}: sizes must be >= 0, latencies > 0")
        if n > 1:
            self._check_extension(self.tokens[:2], self.prefill_s[:2], 0.0)
            self._check_extension(self.tokens[-2:], self.prefill_s[-2:], float(MAX_TOKENS))

    def _check_extension(self, xs: tuple[float, ...], ys: tuple[float, ...], at: float) -> None:
        """Refuse a first (last) segment whose line, extended down to 0 tokens (up to
        :data:`MAX_TOKENS`), gives a negative (no) prefill latency."""
        (x0, x1), (y0, y1) = xs, ys
        slope = (y1 - y0) / (x1 - x0)
        value = y0 + slope * (at - x0)
        below = at < x0
        rounding = _EXTENSION_ROUNDING * (abs(y0) + abs(slope * (at - x0)))
        if (value < -rounding) if below else (value <= 0 and at > x1):
            zero = x0 - y0 / slope
            side = f"below its first point ({x0:g} tokens)" if below else f"past its last point ({x1:g} tokens)"
            raise UsageError(
                f"profile {self._where}: prefill_s extended {side} reaches 0 s at "
                f"{zero:,.0f} tokens, so a prompt of {'fewer' if below else 'more'} tokens would "
                "take no time; add a point at a length there"
            )

    def prefill_seconds(self, tokens: float) -> float:
        """Prefill latency of ``tokens`` new tokens on one instance."""
        return _interp(float(tokens), self.tokens, self.prefill_s)

    def kv_size_bytes(self, tokens: float) -> float:
        """KV bytes of a request of ``tokens`` tokens (0 tokens: the fixed state, if any)."""
        return _interp(float(tokens), self.tokens, self.kv_bytes)

    def kv_rate_bps(self, tokens: float) -> float:
        """``Phi_kv``: bits per second one instance produces while prefilling ``tokens``."""
        return 8.0 * self.kv_size_bytes(tokens) / self.prefill_seconds(tokens)

    def scaled(self, relative_compute: float, *, name: str | None = None) -> ModelProfile:
        """The same model on an instance with ``relative_compute`` times the compute.

        Only the part of the latency that grows with length is compute-bound and scales by
        ``1 / relative_compute``; the fixed per-pass cost (the latency extrapolated to zero
        tokens: launches, weight reads) is memory- and overhead-bound, and an H20 has as
        much memory bandwidth as an H200, so it is kept. KV size does not change.
        ``relative_compute`` is a finite number of at least :data:`MIN_RELATIVE_COMPUTE`.
        """
        if not (MIN_RELATIVE_COMPUTE <= relative_compute < math.inf):
            raise UsageError(
                f"relative_compute must be a finite number >= {MIN_RELATIVE_COMPUTE:g} (a "
                f"thousandth of the compute), not {relative_compute:g}"
            )
        fixed = self.prefill_seconds(0.0)
        try:
            return ModelProfile(
                name=name or f"{self.name} x{relative_compute:g} compute",
                tokens=self.tokens,
                kv_bytes=self.kv_bytes,
                prefill_s=tuple(fixed + (s - fixed) / relative_compute for s in self.prefill_s),
                cache_blocks=self.cache_blocks,
            )
        except UsageError as exc:  # the points scaled: say by what, not only whose they were
            raise UsageError(f"relative_compute {relative_compute:g}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "tokens": list(self.tokens),
            "kv_bytes": list(self.kv_bytes),
            "prefill_s": list(self.prefill_s),
        }
        if self.cache_blocks is not None:
            out["cache_blocks"] = self.cache_blocks
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str | None = None) -> ModelProfile:
        """A profile from a JSON or TOML table. ``tokens``, ``kv_bytes`` and ``prefill_s``
        are lists of numbers and ``cache_blocks`` a whole number, as a trace's values are
        read: ``"159"`` (which iterated as 1, 5, 9), ``true`` (1) or ``"8192"`` is refused,
        and ``4096.9`` blocks too, rather than rounded down. ``source``: the file the table
        was read from, which every error then names ("profile prof.json: token counts must
        be positive", not "profile 'custom': ...", the name a file without one gets)."""
        bad = f"bad profile {source}" if source is not None else "bad profile"

        def numbers(key: str) -> tuple[float, ...]:
            values = data[key]
            if not isinstance(values, list | tuple):
                raise ValueError(f"{key} must be a list of numbers, not {show_json(values)}")
            return tuple(json_number(x, f"{key}[{i}]") for i, x in enumerate(values))

        try:
            blocks = data.get("cache_blocks")
            return cls(
                name=str(data.get("name", "custom")),
                source=source,
                tokens=numbers("tokens"),
                kv_bytes=numbers("kv_bytes"),
                prefill_s=numbers("prefill_s"),
                cache_blocks=json_whole(blocks, "cache_blocks") if blocks is not None else None,
            )
        except UsageError:
            raise  # the profile's own checks say what is wrong
        except KeyError as exc:
            raise UsageError(f"{bad}: {exc.args[0]!r} missing") from None
        except (TypeError, ValueError, OverflowError) as exc:
            # OverflowError: an integer too large for a float (JSON and TOML allow any).
            raise UsageError(f"{bad}: {exc}") from None


def dense_profile(
    *,
    name: str,
    kv_bytes_per_token: float,
    params: float,
    num_layers: int,
    hidden_size: int,
    effective_flops: float,
    fixed_s: float = 0.05,
    tokens: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072),
) -> ModelProfile:
    """A dense transformer's profile from a FLOPs model (derived, not measured).

    FLOPs(l) = 2 * params * l + 2 * num_layers * hidden_size * l^2: the weight matmuls plus
    causal attention (QK^T and AV, each l^2 * hidden / 2 multiply-adds per layer).
    Latency = fixed_s + FLOPs / effective_flops. KV = kv_bytes_per_token * l (no fixed state).
    """
    lat = tuple(
        fixed_s
        + (2.0 * params * t + 2.0 * num_layers * hidden_size * float(t) ** 2) / effective_flops
        for t in tokens
    )
    return ModelProfile(
        name=name,
        tokens=tuple(float(t) for t in tokens),
        kv_bytes=tuple(kv_bytes_per_token * t for t in tokens),
        prefill_s=lat,
    )


def llama_3_70b_profile(effective_flops: float = 3.2e15) -> ModelProfile:
    """Dense Llama-3-70B on 8xH200 (see the module docstring for the assumptions)."""
    return dense_profile(
        name="llama-3-70b (8xH200, derived)",
        kv_bytes_per_token=327_680.0,
        params=70e9,
        num_layers=80,
        hidden_size=8192,
        effective_flops=effective_flops,
    )


def builtin_profile(name: str) -> ModelProfile:
    """One of :data:`BUILTIN_PROFILES`, read from the package's ``profiles/`` folder."""
    try:
        filename = _BUILTIN_FILES[name]
    except KeyError:
        raise UsageError(
            f"unknown profile {name!r}; built-in: {', '.join(BUILTIN_PROFILES)}"
        ) from None
    text = resources.files("kvwire.scheduler").joinpath("profiles", filename).read_text("utf-8")
    return ModelProfile.from_dict(json.loads(text))


def load_profile(source: str | Path) -> ModelProfile:
    """A built-in profile by name, or a user profile from a ``.json`` or ``.toml`` file
    (UTF-8, with or without a byte-order mark)."""
    if isinstance(source, str) and source in _BUILTIN_FILES:
        return builtin_profile(source)
    path = Path(source)
    if not path.is_file():
        raise UsageError(
            f"profile {str(source)!r} is neither a file nor a built-in ({', '.join(BUILTIN_PROFILES)})"
        )
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read profile {path}: {exc}") from None
    try:
        data: Any = tomllib.loads(raw.decode("utf-8-sig")) if path.suffix == ".toml" else json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read profile {path}: {exc}") from None
    if not isinstance(data, dict):
        raise UsageError(f"profile {path} must be a table/object")
    return ModelProfile.from_dict(data, source=str(path))
