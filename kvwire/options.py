"""Types of the public API's inputs, for type checkers.

``serve(**options)`` and ``connect(**options)`` take the fields of
:class:`kvwire.aio.ServerOptions` and :class:`kvwire.aio.ClientOptions` as keywords; the
:class:`~typing.TypedDict` classes here spell those keywords out, so that ``mypy`` rejects a
misspelt option or a value of the wrong type (``serve(windw=1)``, ``connect(...,
streams="4")``) instead of the call failing at run time. A test keeps their keys equal to
the dataclasses' fields.

:data:`Layers` is what ``Peer.send`` sends: an iterable or async iterable of ``(k, v)``
pairs of arrays (numpy, CuPy, PyTorch: anything with ``__dlpack__``).

This module imports nothing but :mod:`kvwire.spec`, so any layer may use it.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Iterable, Sequence
from typing import Any, Literal, Protocol, TypeAlias, TypedDict

from kvwire.spec import KVSpec

__all__ = [
    "ConnectOptions",
    "KVArray",
    "LayerPair",
    "Layers",
    "ServeOptions",
    "Streams",
    "SupportsDLPack",
]


class SupportsDLPack(Protocol):
    """An array that can be exchanged through DLPack: ``numpy.ndarray``, CuPy arrays,
    PyTorch tensors."""

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any: ...


KVArray: TypeAlias = SupportsDLPack
"""One K or V array of a layer, shaped ``[tokens, num_kv_heads, head_dim]``."""

LayerPair: TypeAlias = tuple[SupportsDLPack, SupportsDLPack]
"""One layer: ``(k, v)``."""

Layers: TypeAlias = Iterable[LayerPair] | AsyncIterable[LayerPair]
"""A KV cache as ``Peer.send`` takes it: a sequence, iterable or async iterable of layers,
each sent as soon as it is produced."""

Streams: TypeAlias = int | Literal["auto"]
"""TCP streams of a client session: a count, or ``"auto"``."""


class ServeOptions(TypedDict, total=False):
    """Keywords of :func:`kvwire.serve` beyond its named parameters: the fields of
    :class:`kvwire.aio.ServerOptions` (``specs`` is the ``spec=`` parameter)."""

    max_frame_size: int
    window: int
    max_transfers: int
    transfer_buffer_bytes: int
    max_tokens: int
    max_sessions: int
    max_streams: int
    handshake_timeout: float
    idle_timeout: float | None
    transfer_timeout: float | None
    codecs: Sequence[str]
    notsent_lowat: int | None
    device: str  # "cpu", "gpu" or "gpu:N"
    resume_timeout: float
    max_layer_bytes: int
    max_chunk_bytes: int
    max_buffer_bytes: int
    claim_timeout: float | None
    max_meta_bytes: int


class ConnectOptions(TypedDict, total=False):
    """Keywords of :func:`kvwire.connect` beyond its named parameters: the fields of
    :class:`kvwire.aio.ClientOptions`."""

    chunk_bytes: int
    max_frame_size: int
    connect_timeout: float
    idle_timeout: float | None
    notsent_lowat: int | None
    spec: KVSpec | None
    reconnect_attempts: int
    reconnect_backoff: float
    max_streams: int
    max_reconnects: int
    max_transfer_reconnects: int
    auto_codec: str
