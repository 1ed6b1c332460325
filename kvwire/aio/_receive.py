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
from kvwire.errors import KvwireError, UsageError
from kvwire.session.receiver import Key, LayerStore, Region
from kvwire.spec import KVSpec
from kvwire.wire import KIND_KV, Chunk

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
            with destination_call(tg.name, "view", f"failed to take layer {chunk.layer}"):
                return tg.into.view(chunk.layer, chunk.kind, chunk.token_start, chunk.token_count, chunk.layer_tokens)
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
        # Into the destination's ranges where it names them, even for a chunk inside one
        # block: a dropped block's range is skipped (its view would be scratch, decoded for
        # nothing).
        if buffer is INTO and self._decode_ranges(tg, chunk, codec):
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
        with destination_call(tg.name, "ranges", f"failed to take layer {chunk.layer}"):
            where = None if ranges is None else ranges(
                chunk.layer, chunk.kind, chunk.token_start, chunk.token_count, chunk.layer_tokens)
        if where is None:
            return False
        shape = (chunk.token_count, tg.spec.num_kv_heads, tg.spec.head_dim)
        return bool(codec.decode_ranges(chunk.params, chunk.payload_buffer, where.base, where.spans,
                                        shape=shape, dtype=tg.spec.dtype, kind=TensorKind(chunk.kind)))

    def region(self, key: Key, head: Chunk, buffer: Any, offset: int, nbytes: int) -> Region | None:
        tg = self._targets.get(key)
        if tg is None or self.gpu is not None:
            return None
        kinds = (TensorKind.K, TensorKind.V) if head.kind == KIND_KV else (TensorKind(head.kind),)
        if buffer is INTO:
            places = self._into_places(tg, head, kinds)
        elif head.kind == KIND_KV and head.token_start == 0 and head.token_count == head.layer_tokens:
            places = [_bytes(buffer)]  # K and V of the whole layer lie together
        else:  # K's range, then V's for a KV chunk of part of the layer
            end = head.token_start + head.token_count
            places = [_bytes(buffer[kind][head.token_start : end]) for kind in kinds]
        if places is None or any(p is None for p in places) or sum(p.nbytes for p in places) != nbytes:
            return None
        return places[0] if len(places) == 1 else tuple(places)

    @staticmethod
    def _into_places(tg: _Target, head: Chunk, kinds: tuple[TensorKind, ...]) -> list[Any] | None:
        """The caller's places for a chunk: its destination's ``regions()`` where it has
        them (a range over several blocks), else the one ``view()``."""
        into = tg.into
        regions = getattr(into, "regions", None)
        places: list[Any] = []
        for kind in kinds:
            args = (head.layer, int(kind), head.token_start, head.token_count, head.layer_tokens)
            if regions is not None:
                got = regions(*args)
                if got is None:
                    return None
                places.extend(got)
            else:
                places.append(_bytes(into.view(*args)))
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


@contextmanager
def destination_call(transfer: str, method: str, what: str) -> Iterator[None]:
    """A call into a destination: what it raises is raised as :func:`destination_error`."""
    try:
        yield
    except KvwireError:
        raise
    except Exception as exc:
        raise destination_error(transfer, method, what, exc) from exc


def _bytes(out: Any) -> memoryview | None:
    """A C-contiguous array as a flat writable byte view (None: none, or not contiguous)."""
    if out is None or not out.flags.c_contiguous:
        return None
    return memoryview(out.reshape(-1).view(np.uint8))


__all__ = ["INTO", "ArrayStore", "destination_call", "destination_error"]
