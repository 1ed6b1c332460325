"""The application's view of one incoming KV cache: metadata, layers as they complete."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from kvwire.aio import _gpu
from kvwire.aio._receive import INTO, check_destination, destination_call
from kvwire.consistency.blocks import block_from_key
from kvwire.errors import KvwireError, TransferTimeoutError, UsageError, detached
from kvwire.session.options import check_seconds
from kvwire.session.receiver import Key, TransferArrived, quoted_id
from kvwire.spec import KVCache, KVSpec, Layer

if TYPE_CHECKING:
    from kvwire.aio.server import Server


class Transfer:
    """One incoming KV cache: its metadata, its layers as they complete, or all of it.

    Iterate (``async for layer in transfer``) to receive :class:`~kvwire.Layer` objects
    in completion order, or ``await transfer.collect()`` for the whole cache (not for one
    received into a destination); not both.  One let go of (garbage collected) before its
    layers were taken is aborted, as by :meth:`abort`.
    """

    def __init__(self, server: Server, arrived: TransferArrived) -> None:
        assert arrived.spec is not None
        self._server = server
        self._key: Key = arrived.key
        self.transfer_id = arrived.key[1]
        self.request_id = arrived.request_id
        self.spec: KVSpec = arrived.spec
        self.meta: dict[str, Any] = arrived.meta
        self.blocks = [(block_from_key(b.decode("utf-8")), v) for b, v in arrived.blocks]
        self._into: Any = None
        self._ready: deque[int] = deque()
        self._arrived_layers = 0
        self._changed = asyncio.Event()
        self._error: KvwireError | None = None
        self._yielded = 0
        self._consumer: str | None = None
        self.wire_bytes = 0
        """Bytes on the wire of the chunks stored so far (headers and CRCs included)."""
        self.started = asyncio.get_event_loop().time()
        self.finished: float | None = None
        """Loop time of arrival, and of the last layer's (None until then)."""

    # -- application side ---------------------------------------------------------------

    def __aiter__(self) -> AsyncIterator[Layer]:
        self._claim("iterate")
        return self._layers()

    async def collect(self, *, timeout: float | None = None, device: str | None = None) -> KVCache:
        """Wait for every layer; return them as a :class:`~kvwire.KVCache` in layer order.

        ``device`` ("cpu", "gpu" or "gpu:N") states where the arrays must be; it must match
        the server's ``device`` option (layers are decoded where they will be used):
        :class:`~kvwire.UsageError` otherwise, and for a string that names no device.

        Refused (:class:`~kvwire.UsageError`) for a transfer received into a destination
        (``expect(into=...)``, :meth:`attach`): its layers are already in the caller's
        memory, so iterate to learn when each is complete.
        """
        check_seconds("timeout", timeout)
        if self._into is not None:
            raise UsageError(
                "collect() of a transfer received into a destination: its layers are in the "
                "destination's memory; iterate (async for layer in transfer) to wait for them"
            )
        if device is not None:
            self._check_device(device)
        self._claim("collect")
        got: dict[int, tuple[Any, Any]] = {}

        async def run() -> None:
            async for layer in self._layers():
                got[layer.index] = (layer.k, layer.v)

        try:
            # Not asyncio.wait_for(): on Python 3.11 it returns the result when the caller
            # is cancelled in the loop iteration that completes it, and the cancel is lost.
            async with asyncio.timeout(timeout):
                await run()
        except KvwireError:
            raise
        except TimeoutError:
            raise TransferTimeoutError(f"transfer {self.request_id!r} not complete in {timeout} s") from None
        return KVCache(self.spec, [got[i] for i in range(self.spec.num_layers)])

    def _check_device(self, device: str) -> None:
        on_gpu = self._server.on_gpu
        _gpu.check_device_name(device)  # "bogus" is no device (nor a hint to serve it)
        if (device == "cpu") == on_gpu:
            raise UsageError(f"this server decodes on {'gpu' if on_gpu else 'cpu'}; serve(device={device!r}) to change it")

    @property
    def complete(self) -> bool:
        """Every layer is here (and, with a registry, its blocks are published)."""
        return self._arrived_layers == self.spec.num_layers and self._error is None

    def attach(self, into: Any) -> None:
        """Receive the layers not yet begun straight into ``into`` (for instance a
        :class:`kvwire.paged.PagedDestination`); ones already begun (buffered, not yet
        taken) are copied there as the transfer is iterated.  Attach before taking any
        layer: once the application has taken one (iterating), ``into`` would lack it, so
        this raises :class:`~kvwire.UsageError`.

        ``into`` provides ``check(spec, layer_tokens)``, ``view(...)``, ``write(...)`` and
        ``layer(index)`` (one without them is refused with :class:`~kvwire.UsageError`).
        Its memory is the caller's, so every layer is granted at once.

        A transfer has at most one destination: attaching a second one, attaching to a
        transfer any of whose layers was taken (every one, once it ended) or one being
        collected raises :class:`~kvwire.UsageError`, and attaching to one that failed
        raises its error; the transfer is left as it was.  A destination that refuses the
        cache (its ``check()`` raises), or fails taking or giving a layer (``write()``
        copying one begun before, ``layer()``), fails the transfer, the sender's ``send()``
        included (if it has not yet returned), as when it fails while the cache arrives: with its own
        :class:`~kvwire.KvwireError`, otherwise a :class:`~kvwire.KvwireError`
        (``INTERNAL_ERROR``) naming the transfer, the call and what it raised, the
        original as its cause; this raises it (or iterating the transfer does).
        """
        if self._server.on_gpu:
            raise UsageError("into= needs a server with device='cpu'")
        if into is None:
            raise UsageError("attach() takes a destination, not None")
        check_destination(into)
        if self._into is not None:
            raise UsageError("the transfer already has a destination: its layers go there, a second one is refused")
        if self._error is not None:
            raise detached(self._error)
        if self._yielded >= self.spec.num_layers:
            raise UsageError("the transfer has ended: every layer of it was taken")
        if self._yielded:
            raise UsageError(
                f"the application already took {self._yielded} of the transfer's {self.spec.num_layers} layers: "
                "a destination attached now would lack them; attach() before taking any layer"
            )
        if self._consumer == "collect":
            raise UsageError("the transfer is being collected: collect() does not take a destination's layers")
        self._server._attach(self, into)
        self._into = into

    def abort(self, reason: str = "") -> None:
        """Give up on this transfer: its layers are dropped and the sender's ``send()``
        fails promptly with :class:`~kvwire.TransferAbortedError` (nothing happens if
        the transfer already failed).  Leaving ``async for`` early or a ``collect()``
        that times out aborts too."""
        if self._error is None:
            self._server._abort(self, reason)

    def _claim(self, how: str) -> None:
        if self._consumer is not None:
            raise UsageError(f"transfer already consumed by {self._consumer}(); use one of iteration or collect()")
        self._consumer = how
        self._server._taking(self)

    async def _layers(self) -> AsyncIterator[Layer]:
        try:
            while self._yielded < self.spec.num_layers:
                if self._ready:
                    index = self._ready.popleft()
                    buf = self._server._take(self, index)
                    k, v = buf if self._into is None else self._from_destination(index, buf)
                    self._yielded += 1
                    yield Layer(index, k, v)
                    continue
                if self._error is not None:
                    raise detached(self._error)
                self._changed.clear()
                await self._changed.wait()
        finally:
            if self._yielded < self.spec.num_layers and self._error is None:
                self.abort("the application stopped taking layers")

    def _from_destination(self, index: int, buf: Any) -> tuple[Any, Any]:
        """Layer ``index`` in the destination: copied there first if it began arriving
        before :meth:`attach`.  The destination failing fails the transfer, on both sides,
        as when it fails taking a chunk as it arrives."""
        name = quoted_id(self.request_id)
        try:
            if buf is not INTO:  # begun before attach(): copy it there
                with destination_call(name, "write", f"failed to take layer {index}"):
                    for kind, part in enumerate(buf):
                        self._into.write(index, kind, 0, part, int(part.shape[0]))
            with destination_call(name, "layer", f"failed to give layer {index}"):
                k, v = self._into.layer(index)
        except KvwireError as exc:
            self._server._destination_failed(self, exc)
            raise
        return k, v

    # -- server side ----------------------------------------------------------------------

    def _layer_ready(self, layer: int, wire_bytes: int) -> None:
        self.wire_bytes = wire_bytes
        self._arrived_layers += 1
        if self._arrived_layers == self.spec.num_layers:
            self.finished = asyncio.get_event_loop().time()
        self._ready.append(layer)
        self._changed.set()

    def _fail(self, error: KvwireError) -> None:
        if self._error is None:
            self._error = error
            self._ready.clear()  # never hand out a half-filled cache
            self._changed.set()


__all__ = ["Transfer"]
