"""Receive buffers reused across transfers, so received bytes land in memory already faulted in.

A fresh ``np.empty`` for every received layer makes the kernel fault in every page as the
payload is copied into it; that costs little on an idle host and a great deal under memory
pressure. The pool keeps released buffers (slabs) and hands them out again.

Lifetime is tied to references, never to a call the application may forget or make too
early. Each lease is an array whose data belongs to a small owner object; every view numpy
derives from the array (slices, reshapes, ``np.asarray``, memoryviews, DLPack/torch views)
keeps that owner alive, because numpy records the owner, not the leased array, as the base.
The slab goes back to the pool only when the owner is garbage: when the application has
dropped every array and view of the layer, or when the transfer holding undelivered layers is
dropped. Memory that is still visible anywhere can therefore never be handed out again.

The pool holds at most ``max_bytes`` of idle slabs; leased memory is bounded by the server's
own limits (transfer buffer, concurrent transfers), not here.

A slab is given back by a finalizer, which runs whenever its owner is collected: on any
thread, at any allocation (a garbage collection), including one the pool makes while it
holds its own lock. So giving back only queues the slab, without waiting for the lock;
whoever holds the lock next files the queued slabs. A lease still alive at interpreter exit
is not given back (its memory may still be read or written by whatever runs then).
"""

from __future__ import annotations

import math
import os
import threading
import weakref
from collections import OrderedDict, deque
from typing import Any

import numpy as np

from kvwire.errors import UsageError

__all__ = ["ReceivePool", "default_max_bytes", "default_pool", "size_class"]

_PAGE = 4096
_MIN_CLASS = 64 * 1024


def size_class(nbytes: int) -> int:
    """The slab size serving ``nbytes``: rounded up to an eighth of its power of two.

    Layers of one model differ only in token count, so a coarse class lets a slab serve the
    next transfer of a slightly different length while wasting at most 12.5 %.
    """
    if nbytes <= _MIN_CLASS:
        return _MIN_CLASS
    step = 1 << max(nbytes.bit_length() - 4, 12)
    return -(-nbytes // step) * step


class _Owner:
    """Owns a leased slab's memory; numpy arrays built on it keep it alive (``base``)."""

    __slots__ = ("__array_interface__", "__weakref__", "slab")

    def __init__(self, slab: np.ndarray, nbytes: int) -> None:
        self.slab = slab
        # Bytes only: dtypes outside numpy's own (bfloat16) do not survive a typestr.
        self.__array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (slab.ctypes.data, False),
            "version": 3,
        }


class ReceivePool:
    """Pre-faulted receive buffers, reused once nothing refers to them any more."""

    def __init__(self, max_bytes: int) -> None:
        """
        :param max_bytes: most bytes of idle slabs kept for reuse; ``0`` keeps none (every
            lease is a fresh allocation, as without a pool).
        """
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        # Idle slabs by size class, least recently returned first (evicted first).
        self._idle: OrderedDict[int, list[np.ndarray]] = OrderedDict()
        self._idle_bytes = 0
        self._leased_bytes = 0
        # Slabs given back and not yet filed as idle (see the module docstring).
        self._returned: deque[np.ndarray] = deque()
        self.hits = 0
        self.misses = 0

    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    @property
    def idle_bytes(self) -> int:
        """Bytes of slabs waiting to be reused."""
        with self._lock:
            self._file_returned()
            return self._idle_bytes

    @property
    def leased_bytes(self) -> int:
        """Bytes of slabs some array or view still refers to."""
        with self._lock:
            self._file_returned()
            return self._leased_bytes

    def empty(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """A C-contiguous array of ``shape`` and ``dtype`` with undefined contents.

        Its memory returns to the pool when the array and every view of it are gone.
        """
        dt = np.dtype(dtype)
        nbytes = math.prod(shape) * dt.itemsize  # np.prod costs 5 us a call, a third of this
        if nbytes == 0:
            return np.empty(shape, dt)
        cls = size_class(nbytes)
        slab = self._take(cls)
        owner = _Owner(slab, nbytes)
        arr: np.ndarray = np.asarray(owner).view(dt).reshape(shape)
        # Not at exit: a lease alive then may still be in use by what runs at exit.
        weakref.finalize(owner, self._give_back, slab).atexit = False
        return arr

    def reserve(self, nbytes: int, count: int = 1) -> None:
        """Fault in ``count`` idle slabs for ``nbytes`` each now, ahead of the first transfer."""
        cls = size_class(nbytes)
        with self._lock:
            self._file_returned()
            room = (self._max_bytes - self._idle_bytes) // cls
        for _ in range(min(count, max(room, 0))):
            slab = _new_slab(cls)
            with self._lock:
                self._file_returned()
                self._put_idle(cls, slab)

    def clear(self) -> None:
        """Drop every idle slab (leased ones return, or not, as their owners die)."""
        with self._lock:
            self._file_returned()
            self._idle.clear()
            self._idle_bytes = 0

    def _take(self, cls: int) -> np.ndarray:
        with self._lock:
            self._file_returned()
            free = self._idle.get(cls)
            if free:
                slab = free.pop()
                if not free:
                    del self._idle[cls]
                self._idle_bytes -= cls
                self._leased_bytes += cls
                self.hits += 1
                return slab
            self.misses += 1
        slab = _new_slab(cls)  # outside the lock: faulting pages in takes a while
        with self._lock:
            self._leased_bytes += cls
        return slab

    def _give_back(self, slab: np.ndarray) -> None:
        """The finalizer of a lease: queue its slab, and file it now if the lock is free
        (never wait for it: this thread may be the one holding it)."""
        self._returned.append(slab)
        if self._lock.acquire(blocking=False):
            try:
                self._file_returned()
            finally:
                self._lock.release()

    def _file_returned(self) -> None:
        """File the slabs given back since (the lock held).  A collection here may queue
        more; they are filed by this same loop."""
        while self._returned:
            slab = self._returned.popleft()
            self._leased_bytes -= slab.nbytes
            self._put_idle(slab.nbytes, slab)

    def _put_idle(self, cls: int, slab: np.ndarray) -> None:
        """Keep ``slab`` as idle, evicting the least recently returned over ``max_bytes``
        (the lock held)."""
        if cls > self._max_bytes:
            return
        while self._idle_bytes + cls > self._max_bytes and self._idle:
            old_cls, slabs = next(iter(self._idle.items()))
            slabs.pop(0)
            self._idle_bytes -= old_cls
            if not slabs:
                del self._idle[old_cls]
        self._idle.setdefault(cls, []).append(slab)
        self._idle.move_to_end(cls)
        self._idle_bytes += cls


def _new_slab(nbytes: int) -> np.ndarray:
    slab = np.empty(nbytes, np.uint8)
    slab[::_PAGE] = 0  # fault every page in now, not while a payload is copied into it
    return slab


_DEFAULT_MAX = 1 << 30


def default_max_bytes() -> int:
    """The idle bytes the process-wide pool keeps: ``KVWIRE_RECV_POOL_MB`` MiB, 1 GiB when it
    is unset or empty.  :class:`~kvwire.UsageError` naming the variable and its value unless
    that is a whole number of MiB, 0 or more (``serve()`` checks it before it listens)."""
    value = os.environ.get("KVWIRE_RECV_POOL_MB", "")
    if not value.strip():
        return _DEFAULT_MAX
    try:
        mib = int(value)
    except ValueError:
        mib = -1
    if mib < 0:
        raise UsageError(
            f"KVWIRE_RECV_POOL_MB must be a whole number of MiB, 0 or more (0: no reuse), not {value!r:.80}"
        )
    return mib << 20


_default: ReceivePool | None = None
_default_lock = threading.Lock()


def default_pool() -> ReceivePool:
    """The process-wide pool received layers are allocated from.

    Holds at most 1 GiB of idle buffers, or ``KVWIRE_RECV_POOL_MB`` MiB (``0``: no reuse);
    an invalid setting is a :class:`~kvwire.UsageError` (:func:`default_max_bytes`).
    """
    global _default
    with _default_lock:
        if _default is None:
            _default = ReceivePool(default_max_bytes())
        return _default
