"""KV layout (:class:`KVSpec`) and the containers a transfer yields (:class:`Layer`, :class:`KVCache`)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from kvwire.errors import UsageError

#: dtype name -> (wire id, bytes per element)
DTYPES: dict[str, tuple[int, int]] = {
    "float16": (1, 2),
    "bfloat16": (2, 2),
    "float32": (3, 4),
}
DTYPE_BY_ID: dict[int, str] = {v[0]: k for k, v in DTYPES.items()}


def model_bytes(model: object, field: str, limit: int) -> int:
    """The UTF-8 length of a spec's ``model`` name; UsageError naming ``field`` unless it
    is a str that UTF-8 can encode (no lone surrogate) in at most ``limit`` bytes."""
    if not isinstance(model, str):
        raise UsageError(f"{field} must be a str of at most {limit} UTF-8 bytes, got {type(model).__name__}")
    try:
        size = len(model.encode())
    except UnicodeEncodeError as exc:
        raise UsageError(
            f"{field} must be a str of at most {limit} UTF-8 bytes; "
            f"{model[exc.start:exc.end]!r} at {exc.start} has no UTF-8 encoding"
        ) from None
    if size > limit:
        raise UsageError(f"{field} must be a str of at most {limit} UTF-8 bytes, got {size}")
    return size


@dataclass(frozen=True, slots=True, kw_only=True)
class KVSpec:
    """The layout of one request's KV cache.

    One layer is a pair ``(k, v)`` of arrays shaped ``[tokens, num_kv_heads, head_dim]``
    of ``dtype``.  Two peers can exchange a cache only when their specs are equal; the
    :attr:`fingerprint` is what the handshake compares.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float16"
    model: str = ""

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 0xFFFF:
                raise UsageError(f"KVSpec.{name} must be an int in [1, 65535], got {value!r}")
        if self.dtype not in DTYPES:
            raise UsageError(f"KVSpec.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        model_bytes(self.model, "KVSpec.model", 255)

    @property
    def itemsize(self) -> int:
        """Bytes per element of :attr:`dtype`."""
        return DTYPES[self.dtype][1]

    @property
    def dtype_id(self) -> int:
        return DTYPES[self.dtype][0]

    def bytes_per_token(self) -> int:
        """KV bytes per token over all layers, keys and values, at :attr:`dtype`."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def fingerprint(self) -> bytes:
        """16 bytes that differ whenever the layout differs (SHA-256 of the canonical fields)."""
        canon = f"{self.num_layers}/{self.num_kv_heads}/{self.head_dim}/{self.dtype}/{self.model}"
        return hashlib.sha256(canon.encode()).digest()[:16]


#: The fields :func:`spec_differences` compares, the short ones that decide the geometry
#: first and ``model`` (long, free text) last.
_SHORT_FIELDS = ("dtype", "num_kv_heads", "head_dim", "num_layers")


def _excerpt(model: str, start: int, width: int) -> str:
    """``model[start:]`` as its ``repr`` (quotes escaped, as are backslashes and what is
    not printable), "..." inside the quotes where something was left out, in at most
    ``width`` characters (``width`` of 10 or more), sized after the escaping."""
    text = model[start:]
    n = len(text)
    while True:
        quoted = repr(text[:n])
        shown = (quoted[0] + ("..." if start else "") + quoted[1:-1]
                 + ("..." if n < len(text) else "") + quoted[-1])
        if len(shown) <= width or n == 0:
            return shown
        n = max(0, n - (len(shown) - width))  # (each character kept shows as one or more)


def _model_excerpts(here: str, sent: str, width: int) -> tuple[str, str]:
    """Both model names as ``repr``, each cut to at most ``width`` characters from a
    little before where they first differ ("..." where something was left out)."""
    same = 0
    for a, b in zip(here, sent, strict=False):
        if a != b:
            break
        same += 1
    start = max(0, same - 6)
    return _excerpt(here, start, width), _excerpt(sent, start, width)


#: What :func:`spec_differences` says of the model where there is no room to show it.
_MODEL_DIFFERS = "model differs"


def spec_differences(here: KVSpec, sent: KVSpec, limit: int = 90) -> str:
    """The fields in which ``sent`` differs from ``here``, each with both values, the
    short ones first (``"num_kv_heads 8 here, 1 sent; model '...x16/t1:m' here, '...x16:m'
    sent"``), in at most ``limit`` characters (of text, as ``WIRE_TEXT_LIMIT`` counts a
    RESET's message), ``limit`` at least 20: ``model`` values are shown as ``repr``, cut
    around where they first differ, and where there is no room for them "model differs"
    is said all the same (the short fields cut before it if need be).  Empty when the two
    are equal."""
    parts = [f"{name} {getattr(here, name)} here, {getattr(sent, name)} sent"
             for name in _SHORT_FIELDS if getattr(here, name) != getattr(sent, name)]
    text = "; ".join(parts)
    if here.model != sent.model:
        if text and len(text) + len(f"; {_MODEL_DIFFERS}") > limit:
            # (room kept to say that the model differs too)
            text = text[: max(0, limit - len(f"...; {_MODEL_DIFFERS}"))] + "..."
        lead = f"{text}; " if text else ""
        width = (limit - len(lead) - len("model  here,  sent")) // 2
        if width < 10:  # (no room to show where they differ)
            text = f"{lead}{_MODEL_DIFFERS}"
        else:
            mine, theirs = _model_excerpts(here.model, sent.model, width)
            text = f"{lead}model {mine} here, {theirs} sent"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def closest_spec(specs: tuple[KVSpec, ...] | list[KVSpec], sent: KVSpec) -> KVSpec | None:
    """The one of ``specs`` that differs from ``sent`` in fewest fields (the first of
    those tied), None if there are none."""
    def differing(spec: KVSpec) -> int:
        return sum(getattr(spec, name) != getattr(sent, name) for name in (*_SHORT_FIELDS, "model"))
    return min(specs, key=differing, default=None)


@dataclass(frozen=True, slots=True)
class Layer:
    """One complete layer of a received cache."""

    index: int
    k: Any
    v: Any


@dataclass(slots=True)
class KVCache:
    """A whole received cache: ``layers[i] == (k, v)`` of layer ``i``."""

    spec: KVSpec
    layers: list[tuple[Any, Any]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.layers[0][0].shape[0]) if self.layers else 0

    @property
    def nbytes(self) -> int:
        return sum(int(k.nbytes) + int(v.nbytes) for k, v in self.layers)
