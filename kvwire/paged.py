"""Paged KV caches: send a request's blocks out of per-layer cache tensors, receive into them.

Serving engines keep KV in *paged* caches: per layer one big tensor whose first axis is the
block index, and a block table that maps a request's tokens to blocks.  The layout inside a
block (K/V interleaving, heads, ISA-dependent tiling) differs between engines and even
between CPU kernels, so kvwire treats a block as **opaque**: block ``i`` of layer ``l`` is
``prod(block_shape)`` contiguous elements of ``dtype``, nothing more.

On the wire a paged cache is an ordinary cache whose :class:`~kvwire.KVSpec` is derived by
:meth:`PagedSpec.wire_spec`: each block travels as ``rows_per_block`` "tokens" of its first
half (sent as K) and as many of its second half (sent as V), each row ``row_elems`` elements
wide, blocks in block-table order.  By default a row is the block's last dimension (or
the largest divisor of half a block that fits): one head's vector, whatever the layout.
Given ``token_axis=1`` (the axis of ``block_shape`` that holds the block's tokens), a
block ``[2, block_size, *heads, head_size]`` of more than one head (K and V planes of
tokens, vLLM's NHD layout) travels as one row per cache token, its heads as the wire
heads (:attr:`PagedSpec.row_shape`), so per-head codec groups (int4 keys per channel over
tokens, fp8/int8 scales per token and head) never mix heads.  Every other block keeps
the default rows: an HND block ``[2, heads, block_size, head_size]`` (``token_axis=2``)
among them, since one token's heads are not contiguous there.  The block geometry (and
the token rule, when it applies) is part of the spec's ``model`` field, so the
fingerprint the handshake compares differs whenever the two sides disagree on it.

- :func:`gather_layer` / :class:`PagedSource`: the ``(k, v)`` layers of a request, gathered
  from the cache by block id (one copy, in the array's own library: numpy, torch, CuPy).
- :class:`PagedDestination`: given to ``Server.expect(request_id, into=...)``; a raw
  chunk goes straight into the blocks it spans (``regions()``: a place per block), a
  large one read from the socket, a small one copied out of its frame; an fp8/int8/int4
  chunk is decoded straight into them by the compiled codecs (``ranges()``); any other
  chunk is decoded straight into its block when it lies inside one (``view()``),
  otherwise into scratch, whose rows ``write()`` scatters into the blocks.  A destination
  block id of ``DROP`` (-1) receives that block of the incoming cache and drops it: the
  receiver already holds it (found in its own prefix cache, for instance) or does not
  want it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvwire.codec import numpy_dtype
from kvwire.errors import IncompatiblePeerError, UsageError
from kvwire.spec import DTYPES, KVSpec, model_bytes
from kvwire.wire.frames import ByteRanges

_MAX_ROW = 0xFFFF

#: A destination block id: that block of the incoming cache is received and dropped.
DROP = -1


@dataclass(frozen=True, slots=True, kw_only=True)
class PagedSpec:
    """The geometry of a paged KV cache: ``num_layers`` tensors ``[num_blocks, *block_shape]``.

    Only the shape of one block matters (the number of blocks in each cache is local to
    each side).  ``model`` names the model as in :class:`~kvwire.KVSpec`; it travels behind
    the geometry (``paged:<block_shape>:<model>``; ``paged:<block_shape>/t1:<model>`` when
    the rows are tokens, see :attr:`tokens_are_rows`; 255 UTF-8 bytes in all), so it may
    be 255 bytes less that prefix.

    ``token_axis`` (optional) is the axis of ``block_shape`` that holds the block's cache
    tokens (an int in ``range(len(block_shape))``).  With ``token_axis=1`` and a block
    ``[2, block_size, *heads, head_dim]`` of more than one head, the wire rows are the
    block's tokens (:attr:`tokens_are_rows`); in every other case (no ``token_axis``, the
    tokens on another axis as in HND ``[2, heads, block_size, head_dim]``, whose tokens'
    heads are not contiguous) the rows are opaque (one head's vector).  The shape alone
    cannot tell ``[2, block_size, heads, head_dim]`` from ``[2, heads, block_size,
    head_dim]`` (nor can a count when ``heads == block_size``), so only the caller can say.
    """

    num_layers: int
    block_shape: tuple[int, ...]
    dtype: str = "float16"
    model: str = ""
    token_axis: int | None = None

    def __post_init__(self) -> None:
        if (not isinstance(self.num_layers, int) or isinstance(self.num_layers, bool)
                or not 1 <= self.num_layers <= 0xFFFF):
            raise UsageError(f"PagedSpec.num_layers must be an int in [1, 65535], got {self.num_layers!r}")
        try:
            shape = tuple(self.block_shape)
        except TypeError:
            shape = ()
        if not shape or any(not isinstance(d, int) or isinstance(d, bool) or d < 1 for d in shape):
            raise UsageError(f"PagedSpec.block_shape must be positive ints, got {self.block_shape!r}")
        object.__setattr__(self, "block_shape", shape)
        if self.dtype not in DTYPES:
            raise UsageError(f"PagedSpec.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.block_elems % 2:
            raise UsageError(f"a block must have an even number of elements, got {self.block_elems}")
        axis = self.token_axis
        if axis is not None and (not isinstance(axis, int) or isinstance(axis, bool)
                                 or not 0 <= axis < len(shape)):
            raise UsageError(
                f"PagedSpec.token_axis must be None or an axis of block_shape {shape} "
                f"(an int in [0, {len(shape)})), got {axis!r}"
            )
        # The wire spec's model field is 'paged:<geometry>[/t1]:<model>', at most 255 UTF-8 bytes.
        prefix = len(self._model_prefix())
        if prefix > 255:
            raise UsageError(f"PagedSpec.block_shape {shape} has too many dimensions to name in the wire spec")
        model_bytes(self.model, "PagedSpec.model", 255 - prefix)
        self.wire_spec()  # validates the derived layout

    @property
    def block_elems(self) -> int:
        """Elements in one block of one layer."""
        return math.prod(self.block_shape)

    @property
    def block_bytes(self) -> int:
        return self.block_elems * DTYPES[self.dtype][1]

    @property
    def tokens_are_rows(self) -> bool:
        """Whether a wire row is one cache token (:attr:`row_shape`): ``token_axis`` is 1
        and the block is ``[2, block_size, *heads, head_dim]`` (at least one heads
        dimension) of more than one head, with a token's elements fitting one row.

        With one head the opaque rows already are one token each (the same rows, bytes
        and fingerprint), so nothing changes.  ``token_axis=2`` (HND ``[2, heads,
        block_size, head_dim]``) keeps the opaque rows: one token's heads are not
        contiguous there."""
        shape = self.block_shape
        return (self.token_axis == 1 and len(shape) >= 4 and shape[0] == 2
                and math.prod(shape[2:-1]) > 1 and math.prod(shape[2:]) <= _MAX_ROW)

    @property
    def row_shape(self) -> tuple[int, int]:
        """``(heads, head_dim)`` of one wire row (a wire token).

        With ``token_axis=1`` and a block ``[2, block_size, *heads, head_dim]`` of more than
        one head (K and V planes of tokens, vLLM's NHD ``[2, block_size, num_kv_heads,
        head_size]``; :attr:`tokens_are_rows`), a row is one cache token: its heads (the
        product of the dimensions between) by ``head_dim``, so the codecs' per-head groups
        stay inside one head, as for an unpaged cache (int4 keys are grouped per channel
        over tokens, not over heads).  Any other block (``token_axis`` not given or not 1,
        HND ``[2, heads, block_size, head_dim]`` included, one head, no leading axis of 2,
        fewer than four dimensions, a row too wide) travels as opaque rows of one head:
        the block's last dimension when it tiles half a block, else the largest divisor
        that fits."""
        shape, half = self.block_shape, self.block_elems // 2
        if self.tokens_are_rows:
            return math.prod(shape[2:-1]), shape[-1]
        last = shape[-1]
        if last <= _MAX_ROW and half % last == 0:
            return 1, last
        for width in range(min(half, _MAX_ROW), 0, -1):
            if half % width == 0:
                return 1, width
        return 1, 1  # pragma: no cover - width 1 always divides

    @property
    def row_elems(self) -> int:
        """Width of one wire row (a wire token's elements: ``heads * head_dim`` of :attr:`row_shape`)."""
        heads, dim = self.row_shape
        return heads * dim

    @property
    def rows_per_block(self) -> int:
        """Wire tokens per block (of each of the two halves)."""
        return self.block_elems // 2 // self.row_elems

    def _model_prefix(self) -> str:
        # '/t1' marks rows of one cache token (the tokens on axis 1): a peer on the opaque
        # rows of the same block shape then differs in the model text as well as in the
        # fingerprint.  Only when the rows differ: with one head they are the same.
        rule = f"/t{self.token_axis}" if self.tokens_are_rows else ""
        return "paged:" + "x".join(str(d) for d in self.block_shape) + rule + ":"

    def wire_spec(self) -> KVSpec:
        """The :class:`~kvwire.KVSpec` this cache travels as; its fingerprint covers the geometry."""
        heads, dim = self.row_shape
        return KVSpec(
            num_layers=self.num_layers, num_kv_heads=heads, head_dim=dim,
            dtype=self.dtype, model=self._model_prefix() + self.model,
        )

    def tokens(self, num_blocks: int) -> int:
        """Wire tokens per layer for ``num_blocks`` blocks."""
        return num_blocks * self.rows_per_block

    @classmethod
    def of(cls, cache: Any, *, num_layers: int, model: str = "", token_axis: int | None = None) -> PagedSpec:
        """The spec of caches shaped like ``cache`` (``[num_blocks, *block_shape]``);
        ``token_axis``: the axis of ``block_shape`` that holds the block's tokens, as in
        :class:`PagedSpec`."""
        return cls(
            num_layers=num_layers, block_shape=_block_shape(cache, "cache"),
            dtype=_dtype_name(cache), model=model, token_axis=token_axis,
        )


def _row_rule_hint(incoming: str, own: str) -> str:
    """What to add to a refusal whose two paged geometries name one block shape, one of
    them with rows of one cache token (``/t1``) and the other without: the block
    shapes agree, the row geometry does not."""
    def geometry(model: str) -> tuple[str, str] | None:
        if not model.startswith("paged:"):
            return None
        shape, _, rule = model[len("paged:"):].partition(":")[0].partition("/")
        return shape, rule

    def rows(rule: str) -> str:
        return f"rows of tokens, token_axis={rule[1:]}" if rule.startswith("t") else "opaque rows"

    a, b = geometry(incoming), geometry(own)
    if a is None or b is None or a[0] != b[0] or a[1] == b[1]:
        return ""
    return (f": the same block shape with other wire rows (incoming {rows(a[1])}, here {rows(b[1])}); "
            "both sides must give PagedSpec the same token_axis (upgrade both sides together)")


def _block_shape(x: Any, what: str) -> tuple[int, ...]:
    """The shape of one block of cache ``x`` (``x.shape[1:]``)."""
    try:
        return tuple(int(d) for d in x.shape[1:])
    except (AttributeError, TypeError, ValueError):
        raise UsageError(
            f"{what} must be an array [num_blocks, *block_shape] (numpy, torch, or DLPack), got {type(x).__name__}"
        ) from None


def _dtype_name(x: Any) -> str:
    name = str(getattr(x, "dtype", None)).removeprefix("torch.")
    if name not in DTYPES:
        raise UsageError(f"cache dtype {getattr(x, 'dtype', None)} is not one of {sorted(DTYPES)}")
    return name


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def _check_torch_dtype(x: Any, dtype: str, what: str) -> None:
    """A torch tensor's own dtype is the spec's, checked before its memory is read through
    another dtype (bfloat16 through its int16 bits): a cache is never reinterpreted."""
    name = str(x.dtype).removeprefix("torch.")
    if name != dtype:
        raise UsageError(f"{what} has dtype {name}, the spec says {dtype}")


def _is_device(x: Any) -> bool:
    mod = type(x).__module__
    if mod.startswith("cupy"):
        return True
    if mod.startswith("torch"):
        return str(getattr(x, "device", "cpu")) != "cpu"
    dev = getattr(x, "__dlpack_device__", None)
    if dev is not None and not isinstance(x, np.ndarray):
        try:
            return int(dev()[0]) != 1  # kDLCPU
        except Exception:
            return False
    return False


def host_view(x: Any, dtype: str) -> np.ndarray:
    """A numpy array sharing ``x``'s memory (numpy, torch CPU, or any CPU DLPack producer).

    bfloat16 torch tensors are read through their int16 bits (numpy has no bfloat16 in
    DLPack), once their dtype is checked to be the spec's.  :class:`~kvwire.UsageError`
    when ``x`` is not of ``dtype`` or cannot be read.
    """
    want = numpy_dtype(dtype)
    if isinstance(x, np.ndarray):
        arr = x
    elif _is_torch(x):
        import torch

        _check_torch_dtype(x, dtype, "cache")
        try:
            if x.dtype == torch.bfloat16:
                arr = x.detach().view(torch.int16).numpy().view(want)
            else:
                arr = x.detach().numpy()
        except (RuntimeError, TypeError) as exc:
            raise UsageError(f"cannot read the cache tensor in host memory: {exc}") from exc
    elif hasattr(x, "__dlpack__"):
        try:
            arr = np.from_dlpack(x)
        except (BufferError, TypeError, RuntimeError) as exc:
            hint = " (bfloat16 is read from numpy arrays and torch tensors)" if dtype == "bfloat16" else ""
            raise UsageError(f"cannot read the cache through DLPack: {exc}{hint}") from exc
    else:
        raise UsageError(f"a cache must be a numpy array, a torch tensor or expose __dlpack__, got {type(x).__name__}")
    if arr.dtype != want:
        raise UsageError(f"cache has dtype {arr.dtype}, the spec says {dtype}")
    return arr


def _device_view(x: Any, dtype: str) -> Any:
    """A CuPy array sharing ``x``'s GPU memory (bfloat16 as uint16 bits)."""
    try:
        import cupy
    except ImportError:
        from kvwire.codec.gpu import INSTALL_HINT

        where = getattr(x, "device", None)
        where = "a GPU" if where is None else f"device {where}"
        raise UsageError(f"a cache on {where} is not in host memory: reading it needs CuPy ({INSTALL_HINT})") from None

    if not isinstance(x, cupy.ndarray):
        if _is_torch(x):
            _check_torch_dtype(x, dtype, "cache")
            if dtype == "bfloat16":
                import torch

                x = x.view(torch.int16)
        try:
            x = cupy.from_dlpack(x)
        except Exception as exc:
            raise UsageError(f"cannot read the device cache through DLPack: {exc}") from exc
    # CuPy has no bfloat16: its bits come as uint16 (int16 through a torch tensor's view)
    want = {"float16": ("float16",), "float32": ("float32",), "bfloat16": ("uint16", "int16")}[dtype]
    if x.dtype.name not in want:
        raise UsageError(f"cache has dtype {x.dtype}, the spec says {dtype} (bfloat16 as uint16 on a GPU)")
    if dtype == "bfloat16":
        x = x.view(cupy.uint16)
    return x


def _as_blocks(spec: PagedSpec, cache: Any, what: str) -> tuple[Any, bool]:
    """``cache`` viewed as ``[num_blocks, block_elems]`` (numpy or CuPy) and whether on a GPU."""
    if _block_shape(cache, what) != spec.block_shape:
        raise UsageError(
            f"{what} has blocks shaped {tuple(cache.shape[1:])}, the spec says {spec.block_shape}"
        )
    device = _is_device(cache)
    arr = _device_view(cache, spec.dtype) if device else host_view(cache, spec.dtype)
    if not arr.flags.c_contiguous:
        raise UsageError(f"{what} must be C-contiguous (a block is N contiguous elements)")
    return arr.reshape(arr.shape[0], spec.block_elems), device


def _layer_caches(spec: PagedSpec, caches: Any) -> list[Any]:
    """``caches`` as a list of one cache per layer of ``spec``."""
    try:
        got = list(caches)
    except TypeError:
        raise UsageError(f"caches must be a sequence of per-layer cache arrays, got {type(caches).__name__}") from None
    if len(got) != spec.num_layers:
        raise UsageError(f"{len(got)} caches given, the spec has {spec.num_layers} layers")
    return got


def _check_ids(block_ids: Any, num_blocks: int, what: str, *, distinct: bool, drops: bool = False) -> np.ndarray:
    """``block_ids`` as int64, each a block of a cache of ``num_blocks`` (or ``DROP`` where
    ``drops``); with ``distinct`` no block named twice."""
    try:
        ids = np.asarray(block_ids)
    except (TypeError, ValueError, RuntimeError, BufferError):
        raise UsageError(
            f"{what}: block ids must be integers in host memory (a list, a numpy array, a CPU tensor), "
            f"got {type(block_ids).__name__}"
        ) from None
    if ids.ndim != 1 or ids.size == 0:
        raise UsageError(f"{what}: block ids must be a non-empty 1-D sequence")
    if ids.dtype.kind not in "iu":
        raise UsageError(f"{what}: block ids must be integers, got {ids.dtype}")
    if ids.dtype.kind == "u" and (big := ids[ids >= num_blocks]).size:  # before int64 wraps one to DROP
        raise UsageError(f"{what}: block id {int(big[0])} is out of range for a cache of {num_blocks} blocks")
    ids = ids.astype(np.int64)
    named = ids[ids != DROP] if drops else ids
    bad = named[(named < 0) | (named >= num_blocks)]
    if bad.size:
        raise UsageError(f"{what}: block id {int(bad[0])} is out of range for a cache of {num_blocks} blocks")
    if distinct and np.unique(named).size != named.size:
        values, counts = np.unique(named, return_counts=True)
        raise UsageError(f"{what}: block id {int(values[counts > 1][0])} is named twice")
    return ids


def gather_layer(spec: PagedSpec, cache: Any, block_ids: Any) -> tuple[Any, Any]:
    """One layer's ``(k, v)`` wire arrays gathered from ``cache`` at ``block_ids``.

    ``cache`` is ``[num_blocks, *block_shape]``; the result is two fresh contiguous arrays
    ``[len(block_ids) * rows_per_block, *row_shape]`` (numpy for host caches, CuPy for GPU
    ones), so the cache may be overwritten as soon as this returns.  A GPU cache is
    gathered on its own device, on CuPy's current stream there: work queued on that stream
    afterwards may overwrite it at once, work on another stream must wait for it.
    """
    blocks, device = _as_blocks(spec, cache, "cache")
    ids = _check_ids(block_ids, blocks.shape[0], "gather", distinct=False)
    half = spec.block_elems // 2
    shape = (ids.size * spec.rows_per_block, *spec.row_shape)
    if device:
        import cupy

        with blocks.device:
            dids = cupy.asarray(ids)
            return blocks[dids, :half].reshape(shape), blocks[dids, half:].reshape(shape)
    return blocks[ids, :half].reshape(shape), blocks[ids, half:].reshape(shape)


def layer_rows(spec: PagedSpec, cache: Any, block_ids: Any) -> tuple[Any, Any]:
    """One layer's ``(k, v)`` for ``send()`` as they lie in ``cache`` at ``block_ids``:
    :class:`BlockRows` of a host cache (not copied, so the blocks must not change until the
    send that carries them has returned), or gathered by :func:`gather_layer` from a GPU
    cache (on its GPU)."""
    blocks, device = _as_blocks(spec, cache, "cache")
    if device:
        return gather_layer(spec, cache, block_ids)
    ids = _check_ids(block_ids, blocks.shape[0], "source", distinct=False)
    return _block_rows(spec, blocks, (_halves(spec, ids, 0), _halves(spec, ids, 1)))


def _block_rows(spec: PagedSpec, blocks: np.ndarray, halves: tuple[np.ndarray, np.ndarray]) -> tuple[Any, Any]:
    """The K and V :class:`BlockRows` of a host cache's ``blocks`` (``[num_blocks,
    block_elems]``) whose halves lie at byte offsets ``halves`` (:func:`_halves`)."""
    flat = blocks.reshape(-1).view(np.uint8).data
    dtype = numpy_dtype(spec.dtype)
    k, v = (BlockRows(flat, h, spec.rows_per_block, spec.row_elems, dtype, heads=spec.row_shape[0]) for h in halves)
    return k, v


class PagedSource:
    """A request's layers out of per-layer paged caches, for ``peer.send(..., layers=source)``.

    Host caches are sent straight from their blocks: each layer's K and V are
    :class:`BlockRows` (:func:`layer_rows`); a raw chunk is written from the blocks and
    fp8/int8/int4 quantize the rows where they lie, with no copy (``raw`` behind an
    entropy stage gathers the rows of each chunk it encodes).  So, like any array given to
    ``send()``, the blocks must not change until ``send()`` returns; gather the layers with
    :func:`gather_layer` to free them sooner.  GPU caches are gathered one layer at a
    time, on their GPU.
    """

    def __init__(self, spec: PagedSpec, caches: Sequence[Any], block_ids: Any) -> None:
        self.spec = spec
        self.caches = _layer_caches(spec, caches)
        self.block_ids = block_ids
        for i, cache in enumerate(self.caches):  # the same ids, checked against each cache
            self._ids = _check_ids(block_ids, _as_blocks(spec, cache, f"cache {i}")[0].shape[0], "source", distinct=False)

    def __len__(self) -> int:
        return self.spec.num_layers

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        # as layer_rows for each layer, the ids (checked in __init__) placed once
        spec, ids = self.spec, self._ids
        halves = (_halves(spec, ids, 0), _halves(spec, ids, 1))
        for cache in self.caches:
            blocks, device = _as_blocks(spec, cache, "cache")
            yield gather_layer(spec, cache, ids) if device else _block_rows(spec, blocks, halves)


class PagedDestination:
    """Where a received paged cache goes: ``caches[layer]`` at ``block_ids``, in order.

    Give it to ``Server.expect(request_id, into=destination)``.  The incoming cache must
    carry exactly ``len(block_ids)`` blocks of the same geometry (anything else fails the
    transfer with ``INCOMPATIBLE_SPEC`` on both sides).  Destination block ids must be
    distinct: two received blocks can't both land in one.  A block id of :data:`DROP`
    (-1) drops that incoming block: it is received (the sender sends the whole cache) and
    written nowhere in the caches.  Its rows get places in a scratch buffer of the
    destination's own (one layer's dropped blocks), so a raw chunk over kept and dropped
    blocks is still read straight into its places, and a quantized chunk over both is
    decoded straight into the kept blocks (the dropped rows skipped).

    GPU caches (CuPy, or CUDA tensors through DLPack) are written by :meth:`write` on
    CuPy's current stream of each cache's device, and each write is waited for, so a layer
    the transfer yields is in its cache for work on any stream.  Work on the named blocks
    queued on another stream must be complete before the transfer writes them.

    A transfer that fails (the sender's producer, the connection, a chunk, or this
    destination's own error) leaves the named blocks with unspecified contents: some
    layers complete, some partly written, some untouched.  They must not be used; blocks
    not named are never written.
    """

    def __init__(self, spec: PagedSpec, caches: Sequence[Any], block_ids: Any) -> None:
        self.spec = spec
        self.caches = _layer_caches(spec, caches)
        views = [_as_blocks(spec, c, f"cache {i}") for i, c in enumerate(self.caches)]
        self._blocks = [v for v, _ in views]
        self._device = any(d for _, d in views)
        num_blocks = min(v.shape[0] for v in self._blocks)
        self.block_ids = _check_ids(block_ids, num_blocks, "destination", distinct=True, drops=True)
        self._kept = self.block_ids != DROP
        self._all_kept = bool(self._kept.all())
        # A dropped block's rows go to its own place in scratch (K half, V half): places
        # of one read must not overlap, or the CRC taken over them would not be the bytes'.
        self._drop_index = np.cumsum(~self._kept) - 1
        self._scratch: np.ndarray | None = None
        if not self._device:
            for i, v in enumerate(self._blocks):
                if not v.flags.writeable:
                    raise UsageError(f"cache {i} is read-only")
        self._rows = spec.rows_per_block
        self._width = spec.row_elems
        self._row_shape = spec.row_shape
        self._dtype = numpy_dtype(spec.dtype)
        # Each host cache as one flat byte view (a block's rows are slices of it), and the
        # offset in it of each destination block's K half and V half.
        self._flat = [] if self._device else [memoryview(v.reshape(-1).view(np.uint8)) for v in self._blocks]
        self._halves = (_halves(spec, self.block_ids, 0), _halves(spec, self.block_ids, 1))

    @property
    def wire_spec(self) -> KVSpec:
        return self.spec.wire_spec()

    @property
    def layer_tokens(self) -> int:
        return self.spec.tokens(int(self.block_ids.size))

    def check(self, spec: KVSpec, layer_tokens: int | None = None) -> None:
        """Raise :class:`~kvwire.IncompatiblePeerError` (``INCOMPATIBLE_SPEC``) unless a
        cache of ``spec`` with ``layer_tokens`` tokens per layer fits this destination
        exactly."""
        if spec.fingerprint != self.wire_spec.fingerprint:
            raise IncompatiblePeerError(
                f"incoming cache layout {spec} does not match the destination's {self.wire_spec}"
                + _row_rule_hint(spec.model, self.wire_spec.model)
            )
        if layer_tokens is not None and layer_tokens != self.layer_tokens:
            got = layer_tokens / self._rows
            raise IncompatiblePeerError(
                f"incoming cache has {got:g} blocks per layer, the destination names {self.block_ids.size}"
            )

    def layer(self, index: int) -> tuple[Any, Any]:
        """What a received :class:`~kvwire.Layer` carries: the layer's cache and the block
        ids (``DROP`` where a block was dropped)."""
        return self.caches[index], self.block_ids

    def _locate(self, kind: int, start: int, count: int) -> tuple[int, int, int] | None:
        """(block slot, first element, element count) when the range lies in one block."""
        slot, row = divmod(start, self._rows)
        if start < 0 or count < 1 or row + count > self._rows or slot >= self.block_ids.size or kind not in (0, 1):
            return None
        offset = kind * (self.spec.block_elems // 2) + row * self._width
        return slot, offset, count * self._width

    def view(self, layer: int, kind: int, start: int, count: int, layer_tokens: int) -> np.ndarray | None:
        """A writable array ``[count, *row_shape]`` in the destination for this token range
        (in scratch for a dropped block), or None when there is none (the range spans
        blocks, lies on a GPU, or does not fit)."""
        if self._device or layer_tokens != self.layer_tokens or not 0 <= layer < len(self._blocks):
            return None
        where = self._locate(kind, start, count)
        if where is None:
            return None
        slot, offset, n = where
        if not self._kept[slot]:  # its scratch place
            within = offset - kind * (self.spec.block_elems // 2)
            half: np.ndarray = self._scratch_half(kind, slot).view(self._dtype)
            return half[within : within + n].reshape(count, *self._row_shape)
        row: np.ndarray = self._blocks[layer][int(self.block_ids[slot]), offset : offset + n]
        return row.reshape(count, *self._row_shape)

    def regions(self, layer: int, kind: int, start: int, count: int, layer_tokens: int) -> list[memoryview] | None:
        """The destination's places for this token range of K (``kind`` 0) or V (1), in
        order, as writable byte views: one per block it touches (its rows of that block's
        half), or None when there are none (a GPU cache, a range that does not fit).
        A raw chunk is received straight into them, however many blocks it spans (a
        dropped block's rows into their place in scratch)."""
        where = self.ranges(layer, kind, start, count, layer_tokens)
        if where is None or self._all_kept:
            return None if where is None else where.views()
        first, row = divmod(start, self._rows)
        places = []
        for i, (at, size) in enumerate(np.frombuffer(where.spans, np.int64).reshape(-1, 2).tolist()):
            if at != DROP:
                places.append(where.base[at : at + size])
            else:  # only the first range can start inside its block
                within = row * self._row_bytes if i == 0 else 0
                places.append(self._scratch_half(kind, first + i)[within : within + size].data)
        return places

    def ranges(self, layer: int, kind: int, start: int, count: int, layer_tokens: int) -> ByteRanges | None:
        """The same places as :meth:`regions`, as byte ranges of the layer's cache (what a
        quantized chunk is decoded straight into).  A dropped block's range starts at
        ``DROP`` (-1): its rows go nowhere (the compiled codec loops skip them; a codec
        that cannot declines, and the chunk is decoded elsewhere and its kept rows
        copied)."""
        if not self._fits(layer, kind, start, count, layer_tokens):
            return None
        spans = _spans(self._halves[kind], self._rows, self._row_bytes, start, count)
        if not self._all_kept:
            first = start // self._rows
            spans[~self._kept[first : first + spans.shape[0]], 0] = DROP
        return ByteRanges(self._flat[layer], spans.data, count * self._row_bytes)

    def _fits(self, layer: int, kind: int, start: int, count: int, layer_tokens: int) -> bool:
        """A host destination, and the rows lie in it."""
        return not (self._device or layer_tokens != self.layer_tokens or not 0 <= layer < len(self._blocks)
                    or kind not in (0, 1) or count < 1 or start < 0 or start + count > layer_tokens)

    @property
    def _row_bytes(self) -> int:
        return self.spec.block_bytes // 2 // self._rows

    def _scratch_half(self, kind: int, slot: int) -> np.ndarray:
        """The scratch bytes of dropped block ``slot``'s K (``kind`` 0) or V half, for every
        layer (taken at first use from the receive pool: memory already faulted in, given
        back when the destination is garbage)."""
        if self._scratch is None:
            from kvwire.aio._pool import default_pool

            dropped = int(self.block_ids.size - np.count_nonzero(self._kept))
            self._scratch = default_pool().empty((2, dropped, self.spec.block_bytes // 2), np.uint8)
        half: np.ndarray = self._scratch[kind, int(self._drop_index[slot])]
        return half

    def write(self, layer: int, kind: int, start: int, data: Any, layer_tokens: int) -> None:
        """Scatter ``data`` (``[count, *row_shape]`` of the caches' dtype, decoded) into
        the destination blocks; :class:`~kvwire.UsageError` for data of another shape or
        dtype (its bytes are never reinterpreted, cast or cut), or a ``kind`` other than
        0 (K) or 1 (V).

        Into a GPU cache the rows are copied on the cache's device, on CuPy's current stream
        there (after the work queued on it), and waited for: they are in the cache when
        this returns, for work on any stream, and ``data`` is no longer read."""
        if kind not in (0, 1):
            raise UsageError(f"write() takes kind 0 (K) or 1 (V), got {kind!r}")
        self.check(self.wire_spec, layer_tokens)
        shape = tuple(int(d) for d in getattr(data, "shape", ()))
        count = shape[0] if shape else 0
        if shape != (count, *self._row_shape):
            heads, dim = self._row_shape
            raise UsageError(f"write() takes rows [count, {heads}, {dim}], got an array shaped {shape}")
        dtype = getattr(data, "dtype", None)
        bits = self._device and self.spec.dtype == "bfloat16" and dtype == np.uint16  # CuPy's bfloat16
        if not (isinstance(dtype, np.dtype) and (dtype == self._dtype or bits)):
            raise UsageError(f"write() takes {self.spec.dtype} rows (the caches' dtype), got {dtype}")
        if not 0 <= layer < len(self._blocks) or start < 0 or start + count > self.layer_tokens:
            raise IncompatiblePeerError(
                f"chunk layer {layer} tokens [{start}, {start + count}) is outside the destination"
            )
        if not self._device and not self._all_kept:
            rows = np.ascontiguousarray(data).reshape(count, self._width)
            for block, offset, done, n in self._kept_pieces(kind, start, count):
                place = self._blocks[layer][block, offset : offset + n * self._width]
                part = rows[done : done + n].reshape(-1)
                if not _same_memory(place, part):  # not decoded in place (view())
                    place[...] = part
            return
        if not self._device:
            places = self.regions(layer, kind, start, count, layer_tokens)
            assert places is not None  # the range was checked above
            src = np.ascontiguousarray(data)
            if len(places) == 1 and _same_memory(np.frombuffer(places[0], np.uint8), src):
                return  # decoded in place (view())
            flat = src.reshape(-1).view(np.uint8).data
            at = 0
            for place in places:
                place[:] = flat[at : at + place.nbytes]
                at += place.nbytes
            return
        import cupy

        pieces = list(self._kept_pieces(kind, start, count))
        if not pieces:
            return
        cache = self._blocks[layer]
        with cache.device:
            src = data
            if not isinstance(src, cupy.ndarray):
                src = np.ascontiguousarray(src)
                if self.spec.dtype == "bfloat16":
                    src = src.view(np.uint16)
            rows = cupy.asarray(src).reshape(count, self._width)
            for block, offset, done, n in pieces:
                cache[block, offset : offset + n * self._width] = rows[done : done + n].reshape(-1)
            cupy.cuda.get_current_stream().synchronize()

    def _kept_pieces(self, kind: int, start: int, count: int) -> Iterator[tuple[int, int, int, int]]:
        """Rows ``[start, start + count)`` of K (``kind`` 0) or V block by block, for the
        kept blocks: (block id, first element of the rows in it, first of them in the range,
        how many)."""
        done = 0
        while done < count:
            slot, row = divmod(start + done, self._rows)
            n = min(count - done, self._rows - row)
            if self._kept[slot]:
                yield int(self.block_ids[slot]), kind * (self.spec.block_elems // 2) + row * self._width, done, n
            done += n


def _halves(spec: PagedSpec, block_ids: np.ndarray, kind: int) -> np.ndarray:
    """Byte offset in a layer's cache of each block's K half (``kind`` 0) or V half (1)."""
    return block_ids * spec.block_bytes + kind * (spec.block_bytes // 2)


def _spans(halves: np.ndarray, rows: int, row_bytes: int, start: int, count: int) -> np.ndarray:
    """Where wire rows ``[start, start + count)`` lie in a layer's cache as bytes, given
    each block's half at ``halves`` holding ``rows`` rows: ``[blocks touched, 2]`` int64
    (byte offset, size), one per block (the first and the last may be partial)."""
    first, row = divmod(start, rows)
    last = (start + count - 1) // rows
    spans = np.empty((last - first + 1, 2), np.int64)
    spans[:, 0] = halves[first : last + 1]
    spans[:, 1] = rows * row_bytes
    spans[0, 0] += row * row_bytes
    spans[0, 1] -= row * row_bytes
    spans[-1, 1] -= (last * rows + rows - start - count) * row_bytes
    return spans


class BlockRows:
    """A layer's K or V for :class:`PagedSource`: the wire rows of a request's blocks where
    they lie in the cache, not gathered.

    It stands where a ``[tokens, heads, row_elems // heads]`` array would (``shape``, ``dtype``,
    ``nbytes``, slicing by rows).  A raw chunk sends its rows straight from the blocks
    (:meth:`byte_ranges`: a range per block, which the compiled send queue writes with one
    scatter-gather write per piece, no Python object per block); ``fp8``, ``int8`` and
    ``int4`` (behind an entropy stage too) read them where they lie (``Codec.encode_ranges``);
    ``raw`` behind an entropy stage gathers them (:meth:`gather`, or ``np.asarray``).
    """

    __slots__ = ("_flat", "_halves", "_row_bytes", "_rows", "_start", "dtype", "shape")

    def __init__(self, flat: memoryview, halves: np.ndarray, rows: int, row_elems: int, dtype: np.dtype,
                 start: int = 0, count: int | None = None, *, heads: int = 1) -> None:
        self._flat, self._halves, self._rows = flat, halves, rows
        self._row_bytes = row_elems * dtype.itemsize
        self._start = start
        count = halves.size * rows - start if count is None else count
        self.dtype = dtype
        self.shape = (count, heads, row_elems // heads)

    @property
    def ndim(self) -> int:
        return 3

    @property
    def itemsize(self) -> int:
        return int(self.dtype.itemsize)

    @property
    def size(self) -> int:
        return self.shape[0] * self.shape[1] * self.shape[2]

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self._row_bytes

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key: slice) -> BlockRows:
        if not isinstance(key, slice):
            raise TypeError("BlockRows takes a slice of rows")
        start, stop, step = key.indices(self.shape[0])
        if step != 1:
            raise ValueError("BlockRows takes a slice of rows with step 1")
        return BlockRows(self._flat, self._halves, self._rows, self.shape[1] * self.shape[2], self.dtype,
                         self._start + start, max(0, stop - start), heads=self.shape[1])

    def byte_views(self) -> list[memoryview]:
        """The rows' bytes where they lie, in order: one view per block touched."""
        return self.byte_ranges().views() if self.shape[0] else []

    def byte_ranges(self) -> ByteRanges:
        """The rows' bytes where they lie, as ranges of the cache (what a raw chunk sends)."""
        if not self.shape[0]:
            raise ValueError("no rows to send")
        spans = _spans(self._halves, self._rows, self._row_bytes, self._start, self.shape[0])
        return ByteRanges(self._flat, spans.data, self.nbytes)

    def gather(self) -> np.ndarray:
        """The rows copied into one new ``[tokens, heads, row_elems // heads]`` array."""
        out = np.empty(self.shape, self.dtype)
        flat = out.reshape(-1).view(np.uint8).data
        at = 0
        for view in self.byte_views():
            flat[at : at + view.nbytes] = view
            at += view.nbytes
        return out

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        if copy is False:
            # the rows lie in separate blocks: an array of them is always a copy
            raise ValueError("BlockRows cannot be an array without a copy (its rows are gathered from the blocks)")
        out = self.gather()
        return out if dtype is None else out.astype(dtype, copy=False)


def _same_memory(a: np.ndarray, b: Any) -> bool:
    if not isinstance(b, np.ndarray):
        return False
    ia, ib = a.__array_interface__, b.__array_interface__
    return bool(ia["data"][0] == ib["data"][0] and a.nbytes == b.nbytes)


__all__ = ["DROP", "BlockRows", "PagedDestination", "PagedSource", "PagedSpec", "gather_layer", "host_view", "layer_rows"]
