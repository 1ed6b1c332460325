"""Block id normalisation.

A block id reaches the registry as an ``int``, ``bytes`` (or ``bytearray``/``memoryview``)
or ``str``. Each is mapped to one canonical text key with a type tag, so ``1``, ``b"\\x01"``
and ``"1"`` are three different blocks and the mapping can be reversed exactly:

======================  ===========================  ==================
given                   canonical key                returned as
======================  ===========================  ==================
``int`` (any sign)      ``"i:" + decimal``           ``int``
``bytes``-like          ``"b:" + lowercase hex``     ``bytes``
``str`` (valid UTF-8)   ``"s:" + the string``        ``str``
======================  ===========================  ==================

``bool`` is refused (it is an ``int`` subclass, and ``True`` as a block id is a bug).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

from kvwire.errors import UsageError

BlockId = int | bytes | str
"""What callers pass as a block id (``bytearray``/``memoryview`` are accepted too)."""

BlockLike = int | bytes | bytearray | memoryview | str
"""What the registry accepts as a block id."""

MAX_KEY_CHARS = 4096
"""Longest canonical key accepted; block ids are hashes, so anything longer is a bug."""

# An int of more bits has more decimal digits than a key may hold (13654 bits: at least
# 4110 digits); checked before formatting, which Python refuses past 4300 digits by default
# (and which would be slow for a huge int anyway).
_MAX_INT_BITS = MAX_KEY_CHARS * 10 // 3


def block_key(block: object) -> str:
    """The canonical, type-tagged key of ``block``; raises :class:`UsageError` if invalid."""
    if isinstance(block, bool):
        raise UsageError("a block id cannot be a bool")
    if isinstance(block, int):
        if block.bit_length() > _MAX_INT_BITS:
            raise UsageError(f"block id too long (an int of {block.bit_length()} bits)")
        try:
            key = f"i:{block:d}"
        except ValueError as exc:  # past sys.get_int_max_str_digits(), if set below ours
            raise UsageError(f"block id too long (an int of {block.bit_length()} bits)") from exc
    elif isinstance(block, bytes | bytearray | memoryview):
        key = "b:" + bytes(block).hex()
    elif isinstance(block, str):
        try:
            block.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise UsageError("a str block id must be valid UTF-8") from exc
        key = "s:" + block
    else:
        raise UsageError(f"a block id is an int, bytes or str, not {type(block).__name__}")
    if len(key) > MAX_KEY_CHARS:
        raise UsageError(f"block id too long ({len(key)} > {MAX_KEY_CHARS} key characters)")
    return key


def block_from_key(key: str) -> BlockId:
    """The block id a canonical key stands for (inverse of :func:`block_key`).  Only the
    canonical form is one: ``i:01``, ``i:+1``, ``i: 1`` or ``b:AB`` raise
    :class:`UsageError`, so one block never travels under two keys."""
    tag, sep, body = key.partition(":")
    block: BlockId | None = None
    if sep:
        if tag == "i":  # (int() reads more than decimal: the round trip below refuses it)
            with contextlib.suppress(ValueError):
                block = int(body)
        elif tag == "b":
            with contextlib.suppress(ValueError):
                block = bytes.fromhex(body)
        elif tag == "s":
            return body
    if block is None or block_key(block) != key:
        raise UsageError(f"not a canonical block key: {key!r}")
    return block


def canonical(block: object) -> BlockId:
    """``block`` in its canonical Python type (``bytearray``/``memoryview`` become bytes)."""
    return block_from_key(block_key(block))


def unique_keys(blocks: Iterable[object]) -> list[str]:
    """The canonical keys of ``blocks``, duplicates dropped, first occurrence order kept;
    :class:`UsageError` unless ``blocks`` is an iterable of block ids (a bare id, ``None``
    and a number are refused)."""
    if isinstance(blocks, str | bytes | bytearray | memoryview):
        # A lone id would otherwise be iterated character by character.
        raise UsageError("pass a list of block ids, not a single id")
    try:
        entries = iter(blocks)
    except TypeError:
        raise UsageError(f"pass a list of block ids, not {type(blocks).__name__}") from None
    seen: dict[str, None] = {}
    for block in entries:
        seen.setdefault(block_key(block), None)
    return list(seen)


def block_pairs(pairs: Iterable[Any], name: str = "pairs") -> list[tuple[Any, Any]]:
    """The ``(block, version)`` entries of ``pairs`` (the argument called ``name``), each
    unpacked and nothing else checked; :class:`UsageError` unless ``pairs`` is an iterable
    of two-item entries (a bare ``str``/``bytes`` is refused, it would be iterated, and so is
    a ``str``/``bytes`` entry: ``"ab"`` is not the pair ``("a", "b")``)."""
    if isinstance(pairs, str | bytes | bytearray | memoryview):
        raise UsageError(f"{name} is a list of (block id, version) pairs, not a single {type(pairs).__name__}")
    try:
        entries = iter(pairs)
    except TypeError:
        raise UsageError(f"{name} is a list of (block id, version) pairs, not {type(pairs).__name__}") from None
    out: list[tuple[Any, Any]] = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, str | bytes | bytearray | memoryview):
            try:
                block, version = entry
            except (TypeError, ValueError):
                pass
            else:
                out.append((block, version))
                continue
        raise UsageError(f"{name}[{i}] is not a (block id, version) pair: {entry!r:.80}")
    return out


__all__ = [
    "MAX_KEY_CHARS",
    "BlockId",
    "BlockLike",
    "block_from_key",
    "block_key",
    "block_pairs",
    "canonical",
    "unique_keys",
]
