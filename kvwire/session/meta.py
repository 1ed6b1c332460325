"""BEGIN meta on the wire (docs/protocol.md 2, 4.5): what a receiver takes, and what a
sender therefore refuses before anything is sent."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator

from kvwire.errors import ProtocolError

__all__ = ["meta_footprint", "parse_meta"]


class _BeyondDouble(ValueError):
    pass


def _refuse_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _BeyondDouble(text)
    return value


def _double_int(text: str) -> int:
    if len(text.lstrip("-")) > 309:  # more digits than the largest double has
        raise _BeyondDouble(text)
    value = int(text)
    if abs(value) > sys.float_info.max:
        raise _BeyondDouble(text)
    return value


def _nodes(value: object) -> Iterator[object]:
    """Every value of a parsed JSON value, itself included: dict keys and values, list
    items, all the way down (without recursion: JSON nests deeper than Python's stack)."""
    stack = [value]
    while stack:
        v = stack.pop()
        yield v
        if isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)


def _not_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _has_lone_surrogate(value: object) -> bool:
    """Whether a parsed JSON value holds a string (key or value) with a lone surrogate (an
    escape such as ``\\ud800`` not paired): text that is no Unicode, which no UTF-8 encoder
    takes back (the application could not log it, store it or send it on)."""
    return any(isinstance(v, str) and _not_unicode(v) for v in _nodes(value))


def parse_meta(meta: bytes) -> dict[str, object]:
    """BEGIN meta as the application gets it: empty is ``{}``, else a JSON object in UTF-8
    (docs/protocol.md 2, 4.5).  ProtocolError for anything else: bytes that are not strict
    UTF-8 (``json.loads`` of bytes would guess UTF-16 or UTF-32 and let encoded surrogates
    through), text that is not JSON (Python's ``NaN``, ``Infinity``, ``-Infinity`` included),
    a number beyond a double, a string with a lone surrogate, or a value other than an object."""
    if not meta:
        return {}
    try:
        text = bytes(meta).decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolError("BEGIN meta is not UTF-8") from None
    try:
        value = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float, parse_int=_double_int)
    except _BeyondDouble:
        raise ProtocolError("BEGIN meta holds a number beyond a double") from None
    except (ValueError, RecursionError):
        raise ProtocolError("BEGIN meta is not JSON") from None
    if not isinstance(value, dict):
        raise ProtocolError("BEGIN meta is not a JSON object")
    if _has_lone_surrogate(value):
        raise ProtocolError("BEGIN meta holds a string that is not Unicode (a lone surrogate)")
    return value


def meta_footprint(value: object) -> int:
    """Bytes a parsed meta takes in memory, about: every object of it at ``sys.getsizeof``
    (an object met twice, such as a small int or a repeated key, is counted twice).  Parsed
    JSON can take twenty times its text (``[{},{},...]``: an empty dict for 3 bytes)."""
    return sum(sys.getsizeof(v) for v in _nodes(value))
