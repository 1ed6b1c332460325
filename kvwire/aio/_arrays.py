"""Turning user tensors into host arrays of the spec's layout, and layer producers into one async iterator."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator, Sized
from typing import Any

import numpy as np

from kvwire.aio._gpu import INSTALL_HINT
from kvwire.codec import numpy_dtype
from kvwire.errors import UsageError
from kvwire.paged import BlockRows
from kvwire.spec import KVSpec


def is_device_array(x: Any) -> bool:
    """True for arrays that live on a GPU (CuPy, or a DLPack producer on a CUDA device)."""
    mod = type(x).__module__
    if mod.startswith("cupy"):
        return True
    dev = getattr(x, "__dlpack_device__", None)
    if dev is not None and not isinstance(x, np.ndarray):
        try:
            return int(dev()[0]) != 1  # kDLCPU == 1
        except Exception:
            return False
    return False


def as_host_array(x: Any, spec: KVSpec, what: str) -> Any:
    """``x`` as a C-contiguous numpy array ``[tokens, heads, head_dim]`` of ``spec.dtype``
    (a paged cache's :class:`~kvwire.paged.BlockRows` as they are)."""
    want = numpy_dtype(spec.dtype)
    arr: Any
    if isinstance(x, BlockRows):
        arr = x  # rows of a paged cache's blocks, sent from where they lie
    elif isinstance(x, np.ndarray):
        arr = x
    elif hasattr(x, "__dlpack__"):
        try:
            arr = np.from_dlpack(x)
        except (BufferError, TypeError, RuntimeError) as exc:
            # numpy has no bfloat16 for DLPack: take the bits and reinterpret them
            view = getattr(x, "view", None)
            if spec.dtype == "bfloat16" and view is not None:
                try:
                    import torch  # only reached with torch tensors

                    arr = np.from_dlpack(view(torch.int16)).view(want)
                except Exception:
                    raise UsageError(f"{what}: cannot read the tensor through DLPack: {exc}") from exc
            else:
                raise UsageError(f"{what}: cannot read the tensor through DLPack: {exc}") from exc
    else:
        raise UsageError(f"{what} must be a numpy array or expose __dlpack__, got {type(x).__name__}")
    if arr.dtype != want:
        raise UsageError(f"{what} has dtype {arr.dtype}, the spec says {spec.dtype}")
    if arr.ndim != 3 or arr.shape[1] != spec.num_kv_heads or arr.shape[2] != spec.head_dim:
        raise UsageError(
            f"{what} has shape {tuple(arr.shape)}, expected [tokens, {spec.num_kv_heads}, {spec.head_dim}]"
        )
    if arr.shape[0] < 1:
        raise UsageError(f"{what} has no tokens")
    return arr if isinstance(arr, BlockRows) else np.ascontiguousarray(arr)


def as_device_array(x: Any, spec: KVSpec, what: str) -> Any:
    """``x`` as a C-contiguous CuPy array ``[tokens, heads, head_dim]`` on its GPU.

    bfloat16 travels as its uint16 bit patterns (CuPy has no bfloat16); a torch CUDA
    bfloat16 tensor is reinterpreted that way through DLPack.
    """
    try:
        import cupy
    except ImportError:
        raise UsageError(f"{what} lives on a GPU: sending it needs CuPy ({INSTALL_HINT})") from None

    if not isinstance(x, cupy.ndarray):
        view = getattr(x, "view", None)
        if spec.dtype == "bfloat16" and view is not None and "torch" in type(x).__module__:
            import torch

            x = view(torch.int16)
        try:
            x = cupy.from_dlpack(x)
        except Exception as exc:
            raise UsageError(f"{what}: cannot read the device tensor through DLPack: {exc}") from exc
    want = {"float16": cupy.float16, "float32": cupy.float32, "bfloat16": cupy.uint16}[spec.dtype]
    if x.dtype == cupy.int16 and spec.dtype == "bfloat16":
        x = x.view(cupy.uint16)
    if x.dtype != want:
        raise UsageError(f"{what} has dtype {x.dtype}, the spec says {spec.dtype} (bfloat16 as uint16 on a GPU)")
    if x.ndim != 3 or x.shape[1] != spec.num_kv_heads or x.shape[2] != spec.head_dim or x.shape[0] < 1:
        raise UsageError(
            f"{what} has shape {tuple(x.shape)}, expected [tokens, {spec.num_kv_heads}, {spec.head_dim}]"
        )
    with x.device:  # a copy of a strided tensor stays on its GPU
        return cupy.ascontiguousarray(x)


def layer_count(layers: Any) -> int | None:
    """``len(layers)`` where it has one (a sequence): checked before BEGIN."""
    if not isinstance(layers, Sized):
        return None
    try:
        return len(layers)
    except TypeError:  # a __len__ that refuses (a 0-d array): counted as it is read
        return None


def sync_layers(layers: Any) -> Iterator[tuple[Any, Any]] | None:
    """``(k, v)`` pairs of a sequence or an iterable, taken with ``next()``; None for an
    async iterable (then :func:`iterate_layers`). What cannot be iterated (an int, a 0-d
    array) is a UsageError; an ``__iter__`` that fails otherwise raises its own error."""
    if hasattr(layers, "__aiter__"):
        return None
    what = "layers must be a sequence, an iterable or an async iterable of (k, v)"
    if not isinstance(layers, Iterable):
        raise UsageError(what)
    try:
        pairs = iter(layers)
    except TypeError as exc:  # an __iter__ that refuses (a 0-d array)
        raise UsageError(f"{what}: {exc}") from None
    return map(_pair, pairs)


async def iterate_layers(layers: Any) -> AsyncIterator[tuple[Any, Any]]:
    """Yield ``(k, v)`` from an async iterable (a sequence or an iterable: :func:`sync_layers`)."""
    async for item in layers:
        yield _pair(item)


def _pair(item: Any) -> tuple[Any, Any]:
    try:
        k, v = item
    except (TypeError, ValueError):
        raise UsageError("each layer must be a pair (k, v)") from None
    return k, v
