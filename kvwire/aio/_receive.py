"""Where received layers live: pooled host arrays, GPU arrays, or the caller's memory.

:class:`ArrayStore` is the :class:`~kvwire.session.receiver.LayerStore` of the asyncio
server: the session core decides when a layer is allocated and when a verified chunk is
stored; this module only allocates, decodes (on the host or the GPU) and names the region
a raw payload can be read straight into.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvwire.aio._gpu import GpuReceiver
from kvwire.aio._pool import default_pool, size_class
from kvwire.codec import TensorKind, codec_by_id, numpy_dtype
from kvwire.errors import KvwireError, ProtocolError, UsageError
from kvwire.session.receiver import Key, LayerStore, Region
from kvwire.spec import KVSpec
from kvwire.wire import KIND_K, KIND_KV, KIND_V, Chunk

INTO = object()
"""The buffer of a layer received into the caller's memory (``Server.expect(into=...)``)."""


@dataclass(eq=False)
class _Target:
    spec: KVSpec
    dtype: Any
    into: Any = None
    checked: bool = False
    layer_tokens: int | None = None
    name: str = ""
    """The transfer's request id, quoted for a message (given with its destination)."""

    @property
    def row_bytes(self) -> int:
        """Bytes of one token of K (or of V): a row of ``[heads, head_dim]``."""
        return self.spec.num_kv_heads * self.spec.head_dim * int(self.dtype.itemsize)


#: The tensors a chunk of each kind holds (a KV chunk: K's range, then V's).
_KINDS = {KIND_K: (TensorKind.K,), KIND_V: (TensorKind.V,), KIND_KV: (TensorKind.K, TensorKind.V)}


class ArrayStore(LayerStore):
    """Layer arrays (K, V) of ``[layer_tokens, heads, head_dim]`` per transfer: the two
    halves of one ``[2, layer_tokens, heads, head_dim]`` array, so a KV chunk of the whole
    layer is read straight into it."""

    def __init__(self, device: str) -> None:
        self.gpu = GpuReceiver(device) if device != "cpu" else None
        self._targets: dict[Key, _Target] = {}
        self.decoded: dict[int, list[int]] = {}
        """By codec id: ``[elements, thread CPU nanoseconds]`` decoded so far (a GPU's
        decode counts the host's share: launches and copies)."""
        self.allocated_ns = 0
        """Thread CPU nanoseconds spent allocating layers so far: a slab the pool has not
        held before is faulted in as it is made, once, not per byte received."""

    def opened(self, key: Key, spec: KVSpec) -> None:
        self._targets[key] = _Target(spec, numpy_dtype(spec.dtype))

    def closed(self, key: Key) -> None:
        self._targets.pop(key, None)

    def attachable(self, key: Key) -> None:
        """Raise :class:`~kvwire.UsageError` unless the transfer ``key`` can be given a
        destination: it is still receiving and has none yet."""
        tg = self._targets.get(key)
        if tg is None:
            raise UsageError("the transfer has ended: no layer of it is left to receive into a destination")
        if tg.into is not None:
            raise UsageError("the transfer already has a destination: its layers go there, a second one is refused")

    def attach(self, key: Key, into: Any, name: str) -> None:
        """Layers allocated from now on are ``into``'s, for the transfer ``name`` (its
        quoted request id); raises :class:`~kvwire.KvwireError` (see
        :func:`destination_call`) if it cannot hold the cache.  The caller checked
        :meth:`attachable` first (its error leaves the transfer as it was; this one's
        fails it)."""
        tg = self._targets[key]
        with destination_call(name, "check", "refused the cache"):
            into.check(tg.spec, tg.layer_tokens)
        tg.into, tg.name = into, name
        tg.checked = tg.layer_tokens is not None

    def footprint(self, nbytes: int) -> int:
        """A host layer takes a pool slab: its size class, at least 64 KiB."""
        return nbytes if self.gpu is not None else size_class(nbytes)

    def allocate(self, key: Key, chunk: Chunk, nbytes: int) -> Any:
        tg = self._targets[key]
        tg.layer_tokens = chunk.layer_tokens
        if tg.into is not None:
            if not tg.checked:
                with destination_call(tg.name, "check", "refused the cache"):
                    tg.into.check(tg.spec, chunk.layer_tokens)
                tg.checked = True
            return INTO
        spec = tg.spec
        shape = (2, chunk.layer_tokens, spec.num_kv_heads, spec.head_dim)
        t0 = time.thread_time_ns()
        try:
            if self.gpu is not None:
                return self.gpu.empty(shape, spec.dtype)
            return default_pool().empty(shape, tg.dtype)  # reused, pre-faulted: no page faults per transfer
        finally:
            self.allocated_ns += time.thread_time_ns() - t0

    def _out(self, tg: _Target, chunk: Chunk, buffer: Any) -> Any:
        if buffer is INTO:
            return _view(tg, chunk.layer, chunk.kind, chunk.token_start, chunk.token_count, chunk.layer_tokens)
        return buffer[chunk.kind][chunk.token_start : chunk.token_start + chunk.token_count]

    def decode(self, key: Key, chunk: Chunk, buffer: Any, offset: int, nbytes: int) -> None:
        tg = self._targets[key]
        t0 = time.thread_time_ns()
        self._decode(tg, chunk, buffer)
        tally = self.decoded.setdefault(chunk.codec_id, [0, 0])
        tally[0] += chunk.token_count * tg.spec.num_kv_heads * tg.spec.head_dim
        tally[1] += time.thread_time_ns() - t0

    def _decode(self, tg: _Target, chunk: Chunk, buffer: Any) -> None:
        spec = tg.spec
        codec = codec_by_id(chunk.codec_id)
        if self.gpu is not None:
            out = self._out(tg, chunk, buffer)
            self.gpu.decode(codec, chunk.params, chunk.payload, out, spec.dtype, TensorKind(chunk.kind))
            return
        # A raw chunk goes where its payload would have been read in place (regions()),
        # whether it was or not.  Others into the destination's ranges where it names
        # them, even for a chunk inside one block: a dropped block's range is skipped (its
        # view would be scratch, decoded for nothing).
        if buffer is INTO and (self._copy_to_regions(tg, chunk) or self._decode_ranges(tg, chunk, codec)):
            return
        out = self._out(tg, chunk, buffer)
        if out is None:  # not one contiguous region of the caller's memory: decode, then scatter
            out = np.empty((chunk.token_count, spec.num_kv_heads, spec.head_dim), tg.dtype)
        codec.decode(chunk.params, chunk.payload_buffer, shape=out.shape, dtype=spec.dtype,
                     kind=TensorKind(chunk.kind), out=out)
        if buffer is INTO:
            with destination_call(tg.name, "write", f"failed to take layer {chunk.layer}"):
                tg.into.write(chunk.layer, chunk.kind, chunk.token_start, out, chunk.layer_tokens)

    @staticmethod
    def _decode_ranges(tg: _Target, chunk: Chunk, codec: Any) -> bool:
        """Decode a chunk straight into its destination's byte ranges (the rows of a paged
        cache's blocks) when the destination names them and the codec can; False when
        nothing was written."""
        ranges = getattr(tg.into, "ranges", None)
        what = f"failed to take layer {chunk.layer}"
        with destination_call(tg.name, "ranges", what):
            where = None if ranges is None else ranges(
                chunk.layer, chunk.kind, chunk.token_start, chunk.token_count, chunk.layer_tokens)
        if where is None:
            return False
        base, spans, problem = _ranges_checked(where, tg.row_bytes, chunk.token_count, tg.dtype.itemsize)
        if problem:
            raise destination_returned(tg.name, "ranges", what, problem, "a ByteRanges of one writable buffer "
                                       "(int64 (start, size) pairs of whole rows, start -1 for rows written "
                                       "nowhere) holding the chunk's rows, or None")
        shape = (chunk.token_count, tg.spec.num_kv_heads, tg.spec.head_dim)
        return bool(codec.decode_ranges(chunk.params, chunk.payload_buffer, base, spans,
                                        shape=shape, dtype=tg.spec.dtype, kind=TensorKind(chunk.kind)))

    @staticmethod
    def _copy_to_regions(tg: _Target, chunk: Chunk) -> bool:
        """Copy a raw chunk (K or V) out of its frame into the places its destination's
        ``regions()`` names, as it would have been read in place; False (nothing written)
        for another codec or a destination that names none."""
        if chunk.codec_id != 0 or chunk.params or getattr(tg.into, "regions", None) is None:
            return False
        places = _regions(tg, chunk.layer, chunk.kind, chunk.token_start, chunk.token_count, chunk.layer_tokens)
        if places is None:
            return False
        payload = memoryview(chunk.payload_buffer).cast("B")
        want = sum(p.nbytes for p in places)
        if payload.nbytes != want:
            raise ProtocolError(f"raw payload of {payload.nbytes} bytes, expected {want}")
        at = 0
        for place in places:
            place[:] = payload[at : at + place.nbytes]
            at += place.nbytes
        return True

    def region(self, key: Key, head: Chunk, buffer: Any, offset: int, nbytes: int) -> Region | None:
        tg = self._targets.get(key)
        if tg is None or self.gpu is not None:
            return None
        kinds = _KINDS[head.kind]
        if buffer is INTO:
            places = self._into_places(tg, head, kinds)
        elif head.kind == KIND_KV and head.token_start == 0 and head.token_count == head.layer_tokens:
            places = [_bytes(buffer)]  # K and V of the whole layer lie together
        else:  # K's range, then V's for a KV chunk of part of the layer
            end = head.token_start + head.token_count
            places = [_bytes(buffer[kind][head.token_start : end]) for kind in kinds]
        if places is None:
            return None
        total = 0
        for p in places:
            if p is None:
                return None
            total += p.nbytes
        if total != nbytes:
            return None
        return places[0] if len(places) == 1 else tuple(places)

    @staticmethod
    def _into_places(tg: _Target, head: Chunk, kinds: tuple[TensorKind, ...]) -> list[Any] | None:
        """The caller's places for a chunk: its destination's ``regions()`` where it has
        them (a range over several blocks), else the one ``view()``."""
        has_regions = getattr(tg.into, "regions", None) is not None
        places: list[Any] = []
        for kind in kinds:
            args = (head.layer, int(kind), head.token_start, head.token_count, head.layer_tokens)
            if has_regions:
                got = _regions(tg, *args)
                if got is None:
                    return None
                places.extend(got)
            else:
                places.append(_bytes(_view(tg, *args)))
        return places


#: What a destination (``into=``) must have: ``expect()`` and ``attach()`` refuse one without them.
DESTINATION_METHODS = ("check", "view", "write", "layer")


def check_destination(into: object) -> None:
    """:class:`~kvwire.UsageError` unless ``into`` is None or has a destination's methods
    (:data:`DESTINATION_METHODS`): refused at once, not when a transfer comes."""
    if into is not None and (lacks := [m for m in DESTINATION_METHODS if not callable(getattr(into, m, None))]):
        raise UsageError(f"into= must be a destination (with check(), view(), write() and layer()), "
                         f"got {into!r:.80} without {', '.join(m + '()' for m in lacks)}")


def destination_error(transfer: str, method: str, what: str, exc: Exception) -> KvwireError:
    """The error a destination (``into=``) failing in its ``method()`` fails the transfer
    ``transfer`` (its quoted request id) with, on both sides: a :class:`KvwireError` of
    the destination's own as it is; anything else as a :class:`KvwireError`
    (``INTERNAL_ERROR``, not the peer's undecodable chunk) saying which transfer, which
    call and what it raised, the original as its cause."""
    if isinstance(exc, KvwireError):
        return exc
    error = KvwireError(f"the destination of transfer {transfer} {what}: its {method}() raised {exc!r}")
    error.__cause__ = exc
    return error


def destination_returned(transfer: str, method: str, what: str, problem: str, wanted: str) -> KvwireError:
    """The error a destination whose ``method()`` returned something unusable
    (``problem``, where ``wanted`` is what it must return) fails the transfer with, on
    both sides: a :class:`KvwireError` (``INTERNAL_ERROR``) naming the transfer and the
    call, as :func:`destination_error` does for one that raised; never the peer's
    malformed chunk, never a broken connection."""
    return KvwireError(f"the destination of transfer {transfer} {what}: its {method}() returned {problem}; "
                       f"it must return {wanted}")


@contextmanager
def destination_call(transfer: str, method: str, what: str) -> Iterator[None]:
    """A call into a destination: what it raises is raised as :func:`destination_error`."""
    try:
        yield
    except KvwireError:
        raise
    except Exception as exc:
        raise destination_error(transfer, method, what, exc) from exc


def _view(tg: _Target, layer: int, kind: int, start: int, count: int, layer_tokens: int) -> np.ndarray | None:
    """The destination's ``view()`` of a token range of K or V, checked: None, or a
    writable numpy array ``[count, heads, head_dim]`` of the cache's dtype (its memory,
    where the chunk is decoded or read); anything else fails the transfer
    (:func:`destination_returned`)."""
    what = f"failed to take layer {layer}"
    with destination_call(tg.name, "view", what):
        out = tg.into.view(layer, kind, start, count, layer_tokens)
    if out is None:
        return None
    shape = (count, tg.spec.num_kv_heads, tg.spec.head_dim)
    if not isinstance(out, np.ndarray):
        problem = f"a {type(out).__name__!r} object, not a numpy array"
    elif out.shape != shape or out.dtype != tg.dtype:
        problem = f"an array of {out.dtype} shaped {out.shape}"
    elif not out.flags.writeable:
        problem = "a read-only array"
    else:
        return out
    raise destination_returned(tg.name, "view", what, problem,
                               f"a writable numpy array of {tg.spec.dtype} {shape} (the chunk's rows), or None")


def _regions(tg: _Target, layer: int, kind: int, start: int, count: int, layer_tokens: int) -> list[memoryview] | None:
    """The destination's ``regions()`` for a token range of K or V, checked: None, or its
    places as byte memoryviews (empty ones left out), each writable, 1-D and contiguous,
    the range's bytes in all; anything else fails the transfer
    (:func:`destination_returned`)."""
    what = f"failed to take layer {layer}"
    with destination_call(tg.name, "regions", what):
        got = tg.into.regions(layer, kind, start, count, layer_tokens)
    if got is None:
        return None
    nbytes = count * tg.row_bytes
    places: list[memoryview] = []
    problem = None
    if not isinstance(got, (list, tuple)):
        problem = f"a {type(got).__name__!r} object, not a list"
    else:
        for i, p in enumerate(got):
            if not isinstance(p, memoryview):
                problem = f"a {type(p).__name__!r} object as place {i}, not a memoryview"
            elif p.readonly:
                problem = f"a read-only memoryview as place {i}"
            elif p.ndim != 1 or p.itemsize != 1:
                problem = f"a memoryview of format {p.format!r} and shape {p.shape} as place {i}, not 1-D bytes"
            elif not p.c_contiguous:
                problem = f"a memoryview that is not contiguous as place {i}"
            elif p.nbytes:
                places.append(p if p.format == "B" else p.cast("B"))
            if problem:
                break
        else:
            if (total := sum(p.nbytes for p in places)) != nbytes:
                problem = f"places of {total} bytes in all, for a range of {nbytes}"
    if problem:
        raise destination_returned(tg.name, "regions", what, problem,
                                   f"a list of writable 1-D byte memoryviews of {nbytes} bytes in all, or None")
    return places


def _ranges_checked(where: Any, row_bytes: int, count: int, itemsize: int) -> tuple[Any, Any, str | None]:
    """A destination's ``ranges()`` answer as (base, spans, None), or what is wrong with
    it: not a base and spans, a base that is not a writable contiguous buffer, spans that
    are not int64 (start, size) pairs of whole rows inside it (start -1: rows written
    nowhere) holding ``count`` rows in all."""
    base, spans = getattr(where, "base", None), getattr(where, "spans", None)
    if base is None or spans is None:
        return None, None, f"a {type(where).__name__!r} object without base and spans"
    try:
        b, s = memoryview(base), memoryview(spans)
    except TypeError:
        return None, None, "a base or spans that is not a buffer"
    if b.readonly or not b.c_contiguous:
        return None, None, "a base that is read-only or not contiguous"
    if not s.c_contiguous or not s.nbytes or s.nbytes % 16:
        return None, None, "spans that are not one or more int64 (start, size) pairs"
    pairs = np.frombuffer(s.cast("B"), np.int64).reshape(-1, 2)
    starts, sizes = pairs[:, 0], pairs[:, 1]
    want = count * row_bytes
    kept = starts != -1
    bad = (sizes <= 0) | (sizes > want) | (sizes % row_bytes != 0)
    bad |= kept & ((starts < 0) | (starts > b.nbytes - np.maximum(sizes, 0)) | (starts % itemsize != 0))
    if bad.any():
        i = int(np.argmax(bad))
        return None, None, (f"range {i} ({int(starts[i])}, {int(sizes[i])}), not whole rows of {row_bytes} "
                            f"bytes in its {b.nbytes}-byte base")
    if (total := int(sizes.sum())) != want:
        return None, None, f"ranges of {total} bytes in all, for a range of {want}"
    return base, spans, None


def _bytes(out: Any) -> memoryview | None:
    """A C-contiguous array as a flat writable byte view (None: none, or not contiguous)."""
    if out is None or not out.flags.c_contiguous:
        return None
    return memoryview(out.reshape(-1).view(np.uint8))


__all__ = ["INTO", "ArrayStore", "destination_call", "destination_error", "destination_returned"]
