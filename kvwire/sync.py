"""A synchronous, thread-safe bridge to kvwire for callers that are not asyncio code.

Serving engines call their KV hooks from model-runner threads, once per layer.  A
:class:`Bridge` runs an event loop on a background thread; :class:`SyncServer` and
:class:`SyncPeer` run ``kvwire.serve()`` / ``kvwire.connect()`` on it and hand out handles
whose methods any thread may call:

- :meth:`SyncPeer.begin` -> :class:`SendHandle`: ``send_layer(k, v)`` queues a layer
  (it goes on the wire while the caller computes the next), ``wait()`` returns the
  :class:`~kvwire.Receipt`, ``abort()`` gives up.
- :class:`PendingPeer` starts ``kvwire.connect()`` on a bridge's loop without waiting
  for it (``done()``, then ``result()``: a :class:`SyncPeer`), for a thread that must not
  wait for a handshake.
- :meth:`SyncServer.expect` -> :class:`ReceiveHandle`: ``wait_layer(i)``, ``wait()``,
  ``abort()``; with ``into=`` (e.g. a :class:`kvwire.paged.PagedDestination`) the layers
  land in the caller's memory.

GPU arrays keep the calling thread's CUDA stream order although the transfer runs on the
loop thread (CuPy's current stream is per thread): ``send()`` (of a list or tuple of
layers, or of a :class:`kvwire.paged.PagedSource`'s caches), ``send_layer()`` and
``expect(into=)`` mark the caller's current stream on the arrays' devices, and the loop
thread's own non-blocking stream on that device (its current stream there, never the
legacy default stream, so no other work waits behind the caller's) waits for that mark
before it reads or writes them; a GPU layer from ``wait_layer()`` is ordered before the
caller's current stream (docs/integrations.md).

No method blocks the loop thread, and calling a blocking one *from* the loop thread is
refused (it could never return), as is any call in a child made by ``fork()`` on a bridge
made before it (its loop thread runs in the parent only).  ``close()`` fails every waiter with
:class:`~kvwire.ConnectionLostError` and joins the thread; a shared :class:`Bridge` closed
first closes the servers and peers that run on it (their sockets do not outlive it).  A
:class:`SyncServer` or :class:`SyncPeer` with its own bridge garbage-collected unclosed is
closed then, with a ResourceWarning (as an unclosed socket), and so is a shared
:class:`Bridge` once nothing made on it is alive (the servers and peers made on it
with it).  The implementation lives in
``kvwire.aio`` (the only package that runs an event loop).
"""

from kvwire.aio._pending import PendingPeer
from kvwire.aio._sync import Bridge, ReceiveHandle, SendHandle, SyncPeer, SyncServer

__all__ = ["Bridge", "PendingPeer", "ReceiveHandle", "SendHandle", "SyncPeer", "SyncServer"]
