"""kvwire against its peers on the same bytes: a raw socket pair, Mooncake, NIXL and ZeroMQ.

Run (root for the shaped link; the peers come from ``pip install kvwire[peers]``, and
Mooncake's wheel needs the ``libibverbs1`` system package)::

    python benchmarks/peers.py                       # everything, a few minutes
    python benchmarks/peers.py --rounds 5 --links loopback --loads quiet
    python benchmarks/peers.py --json results.json --kvwire-codecs raw,auto

What is moved: a Llama-3-8B KV cache, 32 layers x (K, V) x ``[tokens, 8, 128]`` fp16,
as 64 separate arrays, in two shapes: one whole 1 GiB cache (8192 tokens) and 20
back-to-back 128 MiB caches (1024 tokens each). Over two links: loopback, and a veth pair
between two network namespaces shaped by ``tc tbf`` to 10 Gbit/s (``--rate``), the link
of :class:`kvwire.bench.netns.NetnsLink`. Under two loads: quiet, and busy, where this
script starts one process spinning on a core and one churning memory (allocating,
touching and freeing 256 MiB over and over), and stops them afterwards on every exit path.

The systems, each in its own sender and receiver processes, forked fresh for every
measurement from a parent that has imported none of the peers (the parent imports kvwire
itself, for its arguments and the host's CPU times; a ``kvwire-<codec>@<tree>`` system's
processes drop it and import kvwire from that tree). Every process this script starts
(the two of a measurement, the busy load's) ends when the script does, however it ends (a
closed terminal's SIGHUP, SIGKILL: Linux's parent-death signal), so none is left running
to load the host of a later run:

* ``raw``: ``sendall`` of each array / ``recv_into`` one reused, pre-faulted buffer;
  ``raw-paged``: the same bytes between paged caches (as ``/paged`` below), each layer's
  blocks whole with ``sendmsg`` / ``recvmsg_into`` over up to 1024 blocks, no protocol:
  what the layout itself costs;
  ``raw/<habits>``: the same with some of kvwire's sending habits, ``+``-separated, to
  tell what each costs: ``p<size>`` writes pieces of that size (``p512KiB``),
  ``lowat<size>`` sets TCP_NOTSENT_LOWAT, ``nb`` writes non-blocking and waits in
  ``select()``, ``crc`` takes each piece's CRC32C after its write, ``crcthread`` each
  array's CRC32C on a second thread while the array is written (``raw/p512KiB+lowat1MiB+nb``);
* ``kvwire-<codec>``: ``kvwire.connect(...).send`` / ``server.accept()`` and iterating the
  layers (each dropped once seen), each send awaited before the next starts, both ends on
  asyncio's own event loop; ``kvwire-<codec>*N``: up to N sends in flight at once (each
  still awaited for its receipt; the receiver takes each transfer on a task of its own);
  ``kvwire-auto-measured``: ``auto`` with
  ``auto_codec="measured"``; after a ``/``, ``+``-separated: ``uvloop`` runs both ends
  on uvloop, as ``kvwire.aio.run`` does (``kvwire-raw/uvloop``), ``paged`` sends the same
  bytes out of a paged cache and receives them into one, as a serving engine does
  (``kvwire.paged``: blocks of 16 tokens, 64 KiB per layer, at random block ids on both
  sides; ``kvwire-raw/paged``);
* ``mooncake``: Mooncake Transfer Engine over TCP (``P2PHANDSHAKE``), one batch write of
  the 64 arrays into memory the receiver registered once;
* ``nixl``: NIXL over UCX with ``UCX_TLS=tcp``, one WRITE of the 64 arrays into
  registered memory;
* ``zmq``: pyzmq PUSH/PULL, one multipart message per cache, sent zero-copy.

Every system gets one untimed warm-up transfer of the measured size (connections,
windows, registrations and receive pools are warm, as in a serving process). Timing is
``perf_counter`` (one clock for all processes): from just before the sender starts until
the receiver has every byte; for the one-sided writes (Mooncake, NIXL), until the
sender's write completes, which is when those engines report the data placed. CPU
seconds per GB are each process's own CPU time (all its threads) over the measured
interval, per GB of KV, and (quiet rows) the whole host's busy time over it from
``/proc/stat``, which also counts the kernel's work done outside either process (a
shaped link's packets released by a timer while no process runs), but not a virtual
machine's steal time (its vCPUs waiting while the hypervisor runs others). On the shaped link the
JSON samples also hold the TCP segments the sender's namespace sent per MB of KV and the
share of them retransmitted (``segments_per_mb``, ``retransmitted``, from
``/proc/<pid>/net/snmp``). Rounds are interleaved (round 1 of every system, then round 2,
...), and each figure is the median with min and max. A system that is not installed or
fails says why and the others still run. Under the busy load, the load's processes are
checked before and after every measurement: if one of them ended (``--churn-mib`` more
than the host can allocate), the scenario fails, every system's row saying why, instead of
reporting a quiet host's figures as busy ones.

Absolute numbers depend on the host and what else runs on it; compare systems within one
run (the ``vs raw`` column is the ratio to the raw pair's median in the same scenario,
over the rounds both completed: a raw pair that failed in a later round anchors the
ratios only with its earlier rounds, and the table says so).
CPU is also given for both processes together, and its ratio to the raw pair's (``CPU vs
raw``): on one host the kernel's work for a segment (its copy into the receiving socket on
loopback, the veth and qdisc work on the shaped link) runs in whichever process's context
it happens to, so one side's figure can fall while the other's rises.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import json
import math
import mmap
import multiprocessing as mp
import os
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

LAYERS, HEADS, HEAD_DIM = 32, 8, 128
TOKEN_BYTES = LAYERS * 2 * HEADS * HEAD_DIM * 2  # fp16 K and V of one token, all layers
MiB = 1 << 20
GiB = 1 << 30
SECRET = b"peers-benchmark-secret"

# -- the cache ------------------------------------------------------------------------------


def make_cache(nbytes: int) -> mmap.mmap:
    """An anonymous shared mapping holding fp16 KV values; forked senders read it in place."""
    buf = mmap.mmap(-1, nbytes)
    block = np.random.default_rng(0).standard_normal(2 * MiB, dtype=np.float32).astype(np.float16)
    arr = np.frombuffer(buf, np.float16)
    for start in range(0, arr.size, block.size):
        part = arr[start : start + block.size]
        part[...] = block[: part.size]
    return buf


def layer_arrays(buf: Any, tokens: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The 32 (K, V) pairs of ``[tokens, 8, 128]`` laid out one after another in ``buf``."""
    arr = np.frombuffer(buf, np.float16, count=LAYERS * 2 * tokens * HEADS * HEAD_DIM)
    arr = arr.reshape(LAYERS, 2, tokens, HEADS, HEAD_DIM)
    return [(arr[i, 0], arr[i, 1]) for i in range(LAYERS)]


def prefaulted(nbytes: int) -> np.ndarray:
    out = np.empty(nbytes, np.uint8)
    out[::4096] = 0
    return out


# -- systems ----------------------------------------------------------------------------------
#
# A system has a receiver and a sender. ``receiver_setup`` returns what the sender needs
# (address, port, registration keys); ``receive(n)`` returns once ``n`` caches have arrived
# (immediately for one-sided writes); ``send(n)`` sends ``n`` caches back to back.


class Receiver:
    one_sided = False

    def setup(self, addr: str, nbytes: int) -> Any:
        raise NotImplementedError

    def receive(self, n: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class Sender:
    def setup(self, addr: str, info: Any, cache: Any, tokens: int) -> None:
        raise NotImplementedError

    def send(self, n: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class RawReceiver(Receiver):
    def setup(self, addr: str, nbytes: int) -> Any:
        import socket

        self.listener = socket.create_server((addr, 0))
        self.nbytes = nbytes
        self.buf = prefaulted(nbytes)
        self.sock: Any = None
        return self.listener.getsockname()[1]

    def receive(self, n: int) -> None:
        if self.sock is None:
            self.sock, _ = self.listener.accept()
        view = memoryview(self.buf.data)
        for _ in range(n):
            got = 0
            while got < self.nbytes:
                k = self.sock.recv_into(view[got:], self.nbytes - got)
                if k == 0:
                    raise ConnectionError("sender closed early")
                got += k

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.listener.close()


class RawSender(Sender):
    def setup(self, addr: str, info: Any, cache: Any, tokens: int) -> None:
        import socket

        self.sock = socket.create_connection((addr, info))
        self.arrays = [a.data.cast("B") for kv in layer_arrays(cache, tokens) for a in kv]

    def send(self, n: int) -> None:
        for _ in range(n):
            for a in self.arrays:
                self.sock.sendall(a)

    def close(self) -> None:
        self.sock.close()


def raw_habits(name: str) -> dict[str, Any]:
    """``raw/<habits>`` as :class:`RawHabitsSender`'s keywords; ValueError names what is wrong."""
    from kvwire.errors import UsageError
    from kvwire.units import parse_size

    habits: dict[str, Any] = {"piece": None, "lowat": 0, "nonblocking": False, "crc": False, "crc_thread": False}

    def size(text: str) -> int:
        try:
            value = parse_size(text)
        except UsageError:
            value = 0
        if value < 1:
            raise ValueError(f"{name}: {text!r} is not a size such as 512KiB or 1MiB")
        return value

    for habit in name.partition("/")[2].split("+"):
        if habit == "nb":
            habits["nonblocking"] = True
        elif habit == "crc":
            habits["crc"] = True
        elif habit == "crcthread":
            habits["crc_thread"] = True
        elif habit.startswith("lowat"):
            habits["lowat"] = size(habit[5:])
        elif habit.startswith("p"):
            habits["piece"] = size(habit[1:])
        else:
            raise ValueError(f"{name}: unknown habit {habit!r} (p<size>, lowat<size>, nb, crc, crcthread)")
    return habits


class RawHabitsSender(RawSender):
    """``raw/<habits>``: the raw pair's sender with some of kvwire's habits (see the
    module docstring): which of them costs the sender's CPU."""

    def __init__(self, *, piece: int | None, lowat: int, nonblocking: bool, crc: bool, crc_thread: bool) -> None:
        self.piece, self.lowat, self.nonblocking, self.crc = piece, lowat, nonblocking, crc
        self.crc_thread = crc_thread

    def setup(self, addr: str, info: Any, cache: Any, tokens: int) -> None:
        import socket

        super().setup(addr, info, cache, tokens)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.lowat:
            self.sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, "TCP_NOTSENT_LOWAT", 25), self.lowat)
        self.sock.setblocking(not self.nonblocking)

    def send(self, n: int) -> None:
        import select
        from concurrent.futures import ThreadPoolExecutor

        from kvwire.wire.crc import crc32c

        pool = ThreadPoolExecutor(1) if self.crc_thread else None
        for _ in range(n):
            for a in self.arrays:
                checked = pool.submit(crc32c, a) if pool is not None else None
                off, piece = 0, self.piece or len(a)
                while off < len(a):
                    view = a[off : off + piece]
                    if self.nonblocking:
                        try:
                            sent = self.sock.send(view)
                        except BlockingIOError:
                            select.select([], [self.sock], [])
                            continue
                    else:
                        self.sock.sendall(view)
                        sent = len(view)
                    if self.crc:
                        crc32c(view[:sent])
                    off += sent
                if checked is not None:
                    checked.result()
        if pool is not None:
            pool.shutdown()


class ZmqReceiver(Receiver):
    def setup(self, addr: str, nbytes: int) -> Any:
        import zmq

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.RCVHWM, 4)
        port = self.sock.bind_to_random_port(f"tcp://{addr}")
        self.nbytes = nbytes
        return port

    def receive(self, n: int) -> None:
        for _ in range(n):
            frames = self.sock.recv_multipart(copy=False)
            got = sum(len(f.buffer) for f in frames)
            if got != self.nbytes:
                raise ValueError(f"received {got} bytes, expected {self.nbytes}")

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


class ZmqSender(Sender):
    def setup(self, addr: str, info: Any, cache: Any, tokens: int) -> None:
        import zmq

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.SNDHWM, 4)
        self.sock.connect(f"tcp://{addr}:{info}")
        self.arrays = [a.data for kv in layer_arrays(cache, tokens) for a in kv]

    def send(self, n: int) -> None:
        for _ in range(n):
            self.sock.send_multipart(self.arrays, copy=False)

    def close(self) -> None:
        self.sock.close(linger=1000)
        self.ctx.term()


class MooncakeReceiver(Receiver):
    one_sided = True

    def setup(self, addr: str, nbytes: int) -> Any:
        from mooncake.engine import TransferEngine

        self.engine = TransferEngine()
        if self.engine.initialize(addr, "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("TransferEngine.initialize failed")
        self.buf = prefaulted(nbytes)
        if self.engine.register_memory(self.buf.ctypes.data, nbytes) != 0:
            raise RuntimeError("register_memory failed")
        return f"{addr}:{self.engine.get_rpc_port()}", self.buf.ctypes.data

    def receive(self, n: int) -> None:
        pass


class MooncakeSender(Sender):
    def setup(self, addr: str, info: Any, cache: Any, tokens: int) -> None:
        from mooncake.engine import TransferEngine

        self.target, remote = info
        self.engine = TransferEngine()
        if self.engine.initialize(addr, "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("TransferEngine.initialize failed")
        arrays = [a for kv in layer_arrays(cache, tokens) for a in kv]
        base = arrays[0].ctypes.data
        total = sum(a.nbytes for a in arrays)
        if self.engine.register_memory(base, total) != 0:
            raise RuntimeError("register_memory failed")
        self.src = [a.ctypes.data for a in arrays]
        self.dst = [remote + (a.ctypes.data - base) for a in arrays]
        self.lengths = [a.nbytes for a in arrays]

    def send(self, n: int) -> None:
        for _ in range(n):
            rc = self.engine.batch_transfer_sync_write(self.target, self.src, self.dst, self.lengths)
            if rc != 0:
                raise RuntimeError(f"batch_transfer_sync_write returned {rc}")


def _nixl_agent(name: str) -> Any:
    """A NIXL agent whose UCX backend uses only this namespace's interface."""
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(name, nixl_agent_config(backends=[]))
    params = agent.get_plugin_params("UCX")
    params["ucx_devices"] = os.environ.get("UCX_NET_DEVICES", "")
    agent.create_backend("UCX", params)
    return agent


class NixlReceiver(Receiver):
    one_sided = True

    def setup(self, addr: str, nbytes: int) -> Any:
        self.agent = _nixl_agent("receiver")
        self.buf = prefaulted(nbytes)
        self.reg = self.agent.register_memory([(self.buf.ctypes.data, nbytes, 0, "")], "DRAM")
        return self.agent.get_agent_metadata(), self.buf.ctypes.data

    def receive(self, n: int) -> None:
        pass


class NixlSender(Sender):
    def setup(self, addr: str, info: Any, cache: Any, tokens: int) -> None:

        meta, remote_base = info
        self.agent = _nixl_agent("sender")
        arrays = [a for kv in layer_arrays(cache, tokens) for a in kv]
        base = arrays[0].ctypes.data
        self.reg = self.agent.register_memory([(base, tokens * TOKEN_BYTES, 0, "")], "DRAM")
        remote = self.agent.add_remote_agent(meta)
        local = self.agent.get_xfer_descs([(a.ctypes.data, a.nbytes, 0) for a in arrays], "DRAM")
        dst = self.agent.get_xfer_descs(
            [(remote_base + a.ctypes.data - base, a.nbytes, 0) for a in arrays], "DRAM"
        )
        self.handle = self.agent.initialize_xfer("WRITE", local, dst, remote, b"kv")

    def send(self, n: int) -> None:
        for _ in range(n):
            state = self.agent.transfer(self.handle)
            while state not in ("DONE", "ERR"):
                state = self.agent.check_xfer_state(self.handle)
            if state == "ERR":
                raise RuntimeError("NIXL transfer failed")


#: ``/paged``: tokens per block, and the block shape of one layer's cache (vLLM's layout
#: of K then V per block; kvwire treats a block as opaque bytes)
PAGE_TOKENS = 16
PAGE_SHAPE = (2, PAGE_TOKENS, HEADS, HEAD_DIM)


def paged_spec() -> Any:
    from kvwire.paged import PagedSpec

    return PagedSpec(num_layers=LAYERS, block_shape=PAGE_SHAPE, dtype="float16", model="peers")


def paged_caches(tokens: int, seed: int) -> tuple[list[np.ndarray], np.ndarray]:
    """Per layer a pre-faulted cache of ``[blocks, *PAGE_SHAPE]`` with room for a quarter
    more blocks than ``tokens`` need, and the block ids of a request of ``tokens``: the
    cache's blocks in a random order, as an engine's free list hands them out."""
    blocks = -(-tokens // PAGE_TOKENS)
    room = blocks + blocks // 4 + 1
    caches = [prefaulted(room * math.prod(PAGE_SHAPE) * 2).view(np.float16).reshape(room, *PAGE_SHAPE)
              for _ in range(LAYERS)]
    ids = np.random.default_rng(seed).permutation(room)[:blocks]
    return caches, ids


def destination_ids(caches: list[np.ndarray], blocks: int, count: int) -> np.ndarray:
    """The block ids transfer ``count`` is received into: new random ones each time."""
    return np.random.default_rng(count).permutation(len(caches[0]))[:blocks]


def paged_source(layers: list[tuple[np.ndarray, np.ndarray]], tokens: int) -> tuple[list[np.ndarray], np.ndarray]:
    """:func:`paged_caches` holding ``layers`` block by block (K, then V, per block)."""
    caches, ids = paged_caches(tokens, seed=2)
    for (k, v), layer in zip(layers, caches, strict=True):
        for b, block in enumerate(ids):
            rows = slice(b * PAGE_TOKENS, min((b + 1) * PAGE_TOKENS, tokens))
            n = rows.stop - rows.start
            layer[block, 0, :n], layer[block, 1, :n] = k[rows], v[rows]
    return caches, ids


def block_views(cache: np.ndarray, ids: np.ndarray) -> list[memoryview]:
    """Each block ``ids[i]`` of ``cache`` as one byte view, in order."""
    flat = cache.reshape(len(cache), -1).view(np.uint8)
    return [flat[i].data for i in ids.tolist()]


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    """``views`` without their first ``n`` bytes."""
    i = 0
    while i < len(views) and n >= views[i].nbytes:
        n -= views[i].nbytes
        i += 1
    return ([views[i][n:]] if n else []) + views[i + (1 if n else 0) :]


class RawPagedReceiver(RawReceiver):
    """``raw-paged``: the raw pair between paged caches, no protocol at all: each layer's
    blocks, whole (K then V), read with ``recvmsg_into`` (MSG_WAITALL) straight into the
    destination's blocks, new random block ids per cache.  What a paged transfer costs by
    its layout."""

    def setup(self, addr: str, nbytes: int) -> Any:
        port = super().setup(addr, 0)
        tokens = nbytes // TOKEN_BYTES
        self.nbytes = nbytes
        self.caches, _ = paged_caches(tokens, seed=1)
        self.blocks = -(-tokens // PAGE_TOKENS)
        self.count = 0
        return port

    def receive(self, n: int) -> None:
        import socket

        if self.sock is None:
            self.sock, _ = self.listener.accept()
        for _ in range(n):
            self.count += 1
            ids = destination_ids(self.caches, self.blocks, self.count)
            for cache in self.caches:
                views = block_views(cache, ids)
                while views:  # MSG_WAITALL: all of them in one call, as a reader in C would
                    k = self.sock.recvmsg_into(views[:1024], 0, socket.MSG_WAITALL)[0]
                    if k == 0:
                        raise ConnectionError("sender closed early")
                    views = _advance(views, k)


class RawPagedSender(RawSender):
    """``raw-paged``: each layer's blocks, whole, with ``sendmsg`` over up to 1024 of them."""

    def setup(self, addr: str, info: Any, cache: Any, tokens: int) -> None:
        import socket

        if tokens % PAGE_TOKENS:
            raise ValueError(f"raw-paged sends whole blocks: tokens must be a multiple of {PAGE_TOKENS}")
        self.sock = socket.create_connection((addr, info))
        caches, ids = paged_source(layer_arrays(cache, tokens), tokens)
        self.views = [block_views(c, ids) for c in caches]

    def send(self, n: int) -> None:
        for _ in range(n):
            for layer in self.views:
                views = layer
                while views:
                    views = _advance(views, self.sock.sendmsg(views[:1024]))


class KvwireReceiver(Receiver):
    """The server's event loop runs on its own thread, as in a serving process: it accepts
    connections and handshakes whenever they come, not only while a receive is awaited.
    ``paged``: each transfer is received into a paged cache (``server.expect(...,
    into=PagedDestination(...))``) at new random block ids."""

    def __init__(self, loop: str = "asyncio", paged: bool = False) -> None:
        self.loop_kind = loop
        self.paged = paged
        self.count = 0

    def setup(self, addr: str, nbytes: int) -> Any:
        import threading

        import kvwire

        self.loop = new_loop(self.loop_kind)
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server_cm = kvwire.serve(addr, 0, secret=SECRET)
        self.server = self._call(self.server_cm.__aenter__())
        if self.paged:
            self.blocks = -(-(nbytes // TOKEN_BYTES) // PAGE_TOKENS)
            self.caches, _ = paged_caches(nbytes // TOKEN_BYTES, seed=1)
        return self.server.port

    def _call(self, coro: Any) -> Any:
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def receive(self, n: int) -> None:
        import asyncio

        async def take(transfer: Any) -> None:
            async for layer in transfer:
                del layer  # the application takes each layer and lets it go

        async def next_transfer() -> Any:
            if not self.paged:
                return await self.server.accept()
            from kvwire.paged import PagedDestination

            self.count += 1  # the sender's request ids, in order; new block ids for each
            ids = destination_ids(self.caches, self.blocks, self.count)
            return await self.server.expect(f"r{self.count}", into=PagedDestination(paged_spec(), self.caches, ids))

        async def run() -> None:
            # Each transfer on a task of its own, as a server taking several requests
            # does: with ``kvwire-<codec>*N`` the next transfer's layers are taken while
            # the one before still arrives, not held until it is done.
            tasks = []
            for _ in range(n):
                tasks.append(asyncio.ensure_future(take(await next_transfer())))
            await asyncio.gather(*tasks)

        self._call(run())

    def close(self) -> None:
        self._call(self.server_cm.__aexit__(None, None, None))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class KvwireSender(Sender):
    """``kvwire-<codec>``: each ``peer.send`` awaited before the next; ``kvwire-<codec>*N``:
    up to N sends in flight at once, each still awaited for its receipt."""

    def __init__(self, codec: str, loop: str = "asyncio", paged: bool = False) -> None:
        codec, _, depth = codec.partition("*")
        self.codec = codec
        self.depth = int(depth or 1)
        self.loop_kind = loop
        self.paged = paged

    def setup(self, addr: str, info: Any, cache: Any, tokens: int) -> None:
        import kvwire

        self.loop = new_loop(self.loop_kind)
        self.spec = kvwire.KVSpec(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM, dtype="float16")
        self.layers: Any = layer_arrays(cache, tokens)
        if self.paged:  # the same bytes, block by block at random ids of a paged cache
            from kvwire.paged import PagedSource

            caches, ids = paged_source(self.layers, tokens)
            pspec = paged_spec()
            self.spec = pspec.wire_spec()
            self.layers = PagedSource(pspec, caches, ids)
        codec, _, mode = self.codec.partition("-")
        extra = {"auto_codec": mode} if mode else {}
        self.peer_cm = kvwire.connect(addr, info, secret=SECRET, codec=codec, **extra)
        self.peer = self.loop.run_until_complete(self.peer_cm.__aenter__())
        self.count = 0
        self.codecs: dict[str, int] = {}

    def send(self, n: int) -> None:
        import asyncio

        async def one() -> None:
            self.count += 1
            receipt = await self.peer.send(f"r{self.count}", self.spec, self.layers)
            for name, chunks in receipt.extra.get("chunks_by_codec", {}).items():
                self.codecs[name] = self.codecs.get(name, 0) + chunks

        async def run() -> None:
            pending: set[asyncio.Task[None]] = set()
            for _ in range(n):
                if len(pending) >= self.depth:
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    for task in done:
                        task.result()
                pending.add(asyncio.ensure_future(one()))
            for task in pending:
                await task

        self.loop.run_until_complete(run())

    def close(self) -> None:
        self.loop.run_until_complete(self.peer_cm.__aexit__(None, None, None))
        self.loop.close()


def make_system(name: str) -> tuple[Receiver, Sender]:
    if name == "raw":
        return RawReceiver(), RawSender()
    if name == "raw-paged":
        return RawPagedReceiver(), RawPagedSender()
    if name.startswith("raw/"):
        return RawReceiver(), RawHabitsSender(**raw_habits(name))
    if name == "zmq":
        return ZmqReceiver(), ZmqSender()
    if name == "mooncake":
        return MooncakeReceiver(), MooncakeSender()
    if name == "nixl":
        return NixlReceiver(), NixlSender()
    if name.startswith("kvwire-"):
        spec, loop, paged = kvwire_system(name)
        return KvwireReceiver(loop, paged), KvwireSender(spec, loop, paged)
    raise ValueError(f"unknown system {name!r}")


def kvwire_system(name: str) -> tuple[str, str, bool]:
    """``kvwire-<codec>[*N][/<option>[+<option>]][@<tree>]`` as (``<codec>[*N]``, the event
    loop: ``asyncio`` unless ``uvloop`` is named, whether ``paged``); ValueError for an
    unknown option."""
    spec, _, options = name.removeprefix("kvwire-").split("@")[0].partition("/")
    chosen = set(options.split("+")) - {""}
    unknown = chosen - {"uvloop", "paged"}
    if unknown:
        raise ValueError(f"{name}: unknown option {sorted(unknown)[0]!r} (uvloop, paged)")
    return spec, "uvloop" if "uvloop" in chosen else "asyncio", "paged" in chosen


def new_loop(kind: str) -> Any:
    """An event loop of ``kind``: ``"asyncio"`` or ``"uvloop"``."""
    import asyncio

    if kind == "uvloop":
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def missing(name: str) -> str | None:
    """Why ``name`` cannot run here, or ``None``."""
    import importlib.util

    module = {"zmq": "zmq", "mooncake": "mooncake", "nixl": "nixl"}.get(name)
    if module is not None and importlib.util.find_spec(module) is None:
        return f"{module} is not installed (pip install kvwire[peers])"
    return None


# -- one measurement: a forked receiver and sender ------------------------------------------------

_CLONE_NEWNET = 0x40000000
_CLONE_NEWNS = 0x00020000
_MS_REC, _MS_SLAVE, _MNT_DETACH = 0x4000, 1 << 19, 2


_TREES: dict[str, str] = {}


def _use_tree(name: str) -> None:
    """``kvwire-<codec>@<tree>``: import kvwire from that source tree (``--kvwire-tree``)."""
    if "@" not in name:
        return
    sys.path.insert(0, _TREES[name.split("@", 1)[1]])
    for module in [m for m in sys.modules if m == "kvwire" or m.startswith("kvwire.")]:
        del sys.modules[module]


def _quiet_env(dev: str) -> None:
    os.environ["UCX_TLS"] = "tcp"  # NIXL's UCX backend over TCP only
    os.environ["UCX_NET_DEVICES"] = dev  # the namespace's own interface
    os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake's per-connection INFO lines
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


def _enter_netns(ns: str | None) -> None:
    if ns is None:
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
    finally:
        os.close(fd)
    # What lists the network devices (UCX) reads /sys/class/net, which shows the namespace
    # sysfs was mounted in: mount it anew for this one, in a mount namespace of this
    # process's own (as `ip netns exec` does), else NIXL finds no device but the host's.
    for call, args in (("unshare", (_CLONE_NEWNS,)),
                       ("mount", (b"none", b"/", None, _MS_REC | _MS_SLAVE, None)),
                       ("umount2", (b"/sys", _MNT_DETACH)),
                       ("mount", (ns.encode(), b"/sys", b"sysfs", 0, None))):
        if getattr(libc, call)(*args) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{call}: {os.strerror(err)}")


def _end_with_parent() -> None:
    """This child process ends when its parent, the script, does, however that ends (a
    SIGHUP of a closed terminal, SIGKILL): SIGTERM then, at its default action, which
    ends the process even inside a C call (the handler inherited from the parent would
    only raise KeyboardInterrupt, and in Python code)."""
    from kvwire.bench.runner import _die_with_parent

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _die_with_parent()


def _receiver_main(name: str, ns: str | None, dev: str, addr: str, nbytes: int, conn: Connection) -> None:
    _end_with_parent()
    try:
        _quiet_env(dev)
        _enter_netns(ns)
        _use_tree(name)
        receiver, _ = make_system(name)
        conn.send(("ready", receiver.setup(addr, nbytes)))
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            n = msg[1]
            cpu0 = time.process_time()
            receiver.receive(n)
            end = time.perf_counter()
            conn.recv()  # the sender finished: CPU counted up to here
            conn.send(("done", end, time.process_time() - cpu0, receiver.one_sided))
        receiver.close()
        conn.send(("closed",))
    except BaseException:
        conn.send(("error", traceback.format_exc(limit=3).strip().splitlines()[-1]))


def _sender_main(name: str, ns: str | None, dev: str, addr: str, tokens: int, cache: Any, conn: Connection) -> None:
    _end_with_parent()
    try:
        _quiet_env(dev)
        _enter_netns(ns)
        _use_tree(name)
        _, sender = make_system(name)
        info = conn.recv()
        sender.setup(addr, info, cache, tokens)
        conn.send(("ready",))
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            n = msg[1]
            cpu0 = time.process_time()
            start = time.perf_counter()
            sender.send(n)
            end = time.perf_counter()
            conn.send(("sent", start, end))
            conn.recv()  # the receiver has everything: CPU counted up to here (I/O threads too)
            conn.send(("cpu", time.process_time() - cpu0))
        extra = getattr(sender, "codecs", None)
        sender.close()
        conn.send(("closed", extra))
    except BaseException:
        conn.send(("error", traceback.format_exc(limit=3).strip().splitlines()[-1]))


@dataclass
class Sample:
    gbps: float
    send_cpu: float  # s/GB
    recv_cpu: float  # s/GB
    # s/GB, the whole host's busy time (/proc/stat), None if unread: it also counts what
    # the two processes' own CPU times miss, softirq work done while no process ran (a
    # shaped link's packets released by a timer) and the kernel threads; and a load. Not
    # steal time: a hypervisor running other guests is no work of this host's.
    host_cpu: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _expect(conn: Connection, timeout: float, what: str) -> tuple[Any, ...]:
    if not conn.poll(timeout):
        raise TimeoutError(f"no {what} within {timeout:.0f} s")
    msg: tuple[Any, ...] = conn.recv()
    if msg[0] == "error":
        raise RuntimeError(msg[1])
    return msg


def tcp_counters(pid: int) -> dict[str, int] | None:
    """TCP's segment counters in the network namespace of process ``pid`` (``OutSegs``,
    ``RetransSegs``), or ``None`` if unread: on the shaped link a system that sends more
    segments per byte, or loses more, pays for it in kernel copies and softirq time."""
    try:
        with open(f"/proc/{pid}/net/snmp") as fh:
            lines = [line.split() for line in fh if line.startswith("Tcp:")]
        return {k: int(v) for k, v in zip(lines[0][1:], lines[1][1:], strict=True) if k in ("OutSegs", "RetransSegs")}
    except (OSError, IndexError, ValueError):
        return None


def measure(name: str, link: Link, cache: Any, tokens: int, count: int, timeout: float) -> Sample:
    """Warm up once, then time ``count`` caches of ``tokens`` tokens from ``name``'s sender;
    ``timeout``: seconds each of its phases may take (the sending, the receiving)."""
    import kvwire.bench.runner  # noqa: F401  (the children's _end_with_parent, imported once here)
    from kvwire.bench.report import machine_cpu_times

    ctx = mp.get_context("fork")
    nbytes = tokens * TOKEN_BYTES
    r_parent, r_child = ctx.Pipe()
    s_parent, s_child = ctx.Pipe()
    receiver = ctx.Process(target=_receiver_main, args=(name, link.receiver_ns, link.receiver_dev, link.receiver_addr, nbytes, r_child), daemon=True)
    sender = ctx.Process(target=_sender_main, args=(name, link.sender_ns, link.sender_dev, link.receiver_addr, tokens, cache, s_child), daemon=True)
    receiver.start()
    try:
        info = _expect(r_parent, 60, "receiver setup")[1]
        sender.start()
        s_parent.send(info)
        _expect(s_parent, 60, "sender setup")
        result = None
        count_tcp = bool(link.sender_ns and sender.pid)  # the sender's own namespace
        for n in (1, count):  # warm-up, then the measurement
            host0 = machine_cpu_times()
            tcp0 = tcp_counters(sender.pid) if count_tcp else None
            r_parent.send(("go", n))
            s_parent.send(("go", n))
            sent = _expect(s_parent, timeout, "end of sending")
            r_parent.send(("end",))
            got = _expect(r_parent, timeout, "end of receiving")
            host1 = machine_cpu_times()
            tcp1 = tcp_counters(sender.pid) if count_tcp else None
            s_parent.send(("end",))
            send_cpu = _expect(s_parent, timeout, "sender CPU time")[1]
            _, start, send_end = sent
            _, recv_end, recv_cpu, one_sided = got
            seconds = (send_end if one_sided else recv_end) - start
            gb = n * nbytes / 1e9
            host = (host1[0] - host0[0]) / gb if host0 is not None and host1 is not None else None
            result = Sample(gbps=8 * gb / seconds, send_cpu=send_cpu / gb, recv_cpu=recv_cpu / gb, host_cpu=host)
            if tcp0 is not None and tcp1 is not None:
                segs = tcp1["OutSegs"] - tcp0["OutSegs"]
                result.extra["segments_per_mb"] = segs / (n * nbytes / 1e6)
                result.extra["retransmitted"] = (tcp1["RetransSegs"] - tcp0["RetransSegs"]) / max(segs, 1)
        r_parent.send(("stop",))
        s_parent.send(("stop",))
        closed = _expect(s_parent, 30, "sender close")
        _expect(r_parent, 30, "receiver close")
        assert result is not None
        if closed[1]:
            result.extra["chunks_by_codec"] = closed[1]
        return result
    finally:
        for proc in (sender, receiver):
            if proc.pid is not None:
                proc.join(2)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
        for c in (r_parent, s_parent, r_child, s_child):
            c.close()


# -- links and loads ---------------------------------------------------------------------------------


@dataclass
class Link:
    name: str
    sender_ns: str | None = None
    receiver_ns: str | None = None
    receiver_addr: str = "127.0.0.1"
    sender_dev: str = "lo"
    receiver_dev: str = "lo"


@contextlib.contextmanager
def open_link(name: str, rate_bps: float) -> Iterator[Link]:
    if name == "loopback":
        yield Link("loopback")
        return
    from kvwire.bench.netns import NetnsLink

    with NetnsLink(rate_bps=rate_bps) as shaped:
        yield Link(name, shaped.sender_ns, shaped.receiver_ns, shaped.receiver_addr,
                   shaped.sender_dev, shaped.receiver_dev)


LINKS = ("loopback", "veth")
LOADS = ("quiet", "busy")


def _default_signals() -> None:
    """A load process ends quietly on terminate(): not through the handlers it inherited
    from the parent (which turn SIGTERM into a KeyboardInterrupt and its traceback); and
    it ends with the parent, however that ends."""
    _end_with_parent()  # SIGTERM at its default action
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the parent, which stops it


def _spin() -> None:
    _default_signals()
    while True:
        pass


def _churn(mib: int) -> None:
    _default_signals()
    while True:
        block = np.ones(mib * MiB, np.uint8)  # fault in, touch, free: memory pressure
        del block


#: what each process of the busy load does, as a failed scenario names it
_LOAD_ROLES = ("the spinning process", "the memory-churning process")


@contextlib.contextmanager
def load(kind: str, churn_mib: int) -> Iterator[Callable[[], str | None]]:
    """``busy``: a spinning process and a memory-churning one, stopped on every exit.

    Yields a check: why the load is not what it should be (one of its processes ended),
    or ``None``; under ``quiet`` always ``None``."""
    if kind == "quiet":
        yield lambda: None
        return
    import kvwire.bench.runner  # noqa: F401  (the children's _end_with_parent, imported once here)

    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_spin, daemon=True),
             ctx.Process(target=_churn, args=(churn_mib,), daemon=True)]
    for p in procs:
        p.start()

    def check() -> str | None:
        for p, role in zip(procs, _LOAD_ROLES, strict=True):
            if not p.is_alive():
                return f"busy load: {role} ended (exit code {p.exitcode}), the host is not busy"
        return None

    try:
        time.sleep(0.5)
        yield check
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()


# -- the run -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    link: str
    load: str
    tokens: int
    count: int

    @property
    def label(self) -> str:
        size = f"{self.tokens * TOKEN_BYTES // MiB} MiB" if self.count == 1 else f"{self.count} x {self.tokens * TOKEN_BYTES // MiB} MiB"
        if self.tokens * TOKEN_BYTES == GiB and self.count == 1:
            size = "1 GiB"
        return f"{self.link}, {self.load}, {size}"


def _host_cpu(got: list[Sample]) -> list[float]:
    return [x.host_cpu for x in got if x.host_cpu is not None]


def _ratio(values: list[float], raw: list[float]) -> str:
    """The median of ``values`` over the raw pair's median of the same rounds, or ``-``."""
    if not values or not raw:
        return "-"
    base = statistics.median(raw)
    return f"{statistics.median(values) / base:.2f}" if base else "-"


def _fmt(values: list[float], digits: int = 3) -> str:
    if not values:
        return "-"
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.{digits}g}"
    return f"{med:.{digits}g} ({min(values):.{digits}g}-{max(values):.{digits}g})"


def main(argv: list[str] | None = None) -> int:
    from kvwire.units import argument_type, whole_number

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", default="raw,kvwire-raw,mooncake,nixl,zmq",
                    help="comma-separated: raw, raw/<habits>, raw-paged, kvwire-<codec>[*N][/uvloop+paged], mooncake, nixl, zmq")
    ap.add_argument("--kvwire-codecs", default="", help="extra kvwire codecs to add, e.g. auto,fp8")
    ap.add_argument("--links", default="loopback,veth", help="comma-separated: loopback and/or veth (root)")
    ap.add_argument("--rate", type=float, default=10e9, help="veth rate in bit/s (default 10e9)")
    ap.add_argument("--loads", default="quiet,busy", help="comma-separated: quiet and/or busy")
    ap.add_argument("--whole-tokens", type=argument_type(lambda t: whole_number(t, minimum=0), "int"), default=8192, help="tokens of the whole cache (8192 = 1 GiB); 0 to skip")
    ap.add_argument("--burst", default="20x1024", help="COUNTxTOKENS back-to-back caches (20x1024 = 20 x 128 MiB); '' to skip")
    ap.add_argument("--burst-links", default="loopback", help="links the burst shape runs on")
    ap.add_argument("--burst-loads", default="quiet", help="loads the burst shape runs under")
    ap.add_argument("--rounds", type=argument_type(whole_number, "int"), default=3)
    ap.add_argument("--churn-mib", type=argument_type(whole_number, "int"), default=256,
                    help="MiB the busy load's churning process allocates, touches and frees over and over")
    ap.add_argument("--timeout", type=float, default=120.0,
                    help="seconds each phase of a measurement may take, of its warm-up and its timed "
                         "transfers alike: the sending, then the rest of the receiving (setting each end "
                         "up has 60 s, closing it 30 s)")
    ap.add_argument("--json", help="write every sample to this file")
    ap.add_argument("--kvwire-tree", action="append", default=[], metavar="NAME=DIR",
                    help="also import kvwire from source tree DIR as system kvwire-<codec>@NAME "
                         "(name it in --systems), e.g. to compare two versions in one run")
    args = ap.parse_args(argv)
    burst: tuple[int, int] | None = None
    if args.burst:
        try:
            count, tokens = (int(x) for x in args.burst.split("x"))
        except ValueError:
            ap.error(f"--burst takes COUNTxTOKENS (e.g. 20x1024), not {args.burst!r}")
        if count < 1 or tokens < 1:
            ap.error(f"--burst needs a count and tokens of at least 1, not {args.burst!r}")
        burst = count, tokens

    for spec in args.kvwire_tree:
        tree_name, _, tree_dir = spec.partition("=")
        _TREES[tree_name] = os.path.abspath(tree_dir)
    systems = [s for s in args.systems.split(",") if s]
    systems += [f"kvwire-{c}" for c in args.kvwire_codecs.split(",") if c and f"kvwire-{c}" not in systems]
    for s in systems:
        if s.startswith("raw/"):
            try:
                raw_habits(s)
            except ValueError as exc:
                ap.error(str(exc))
        if not s.startswith("kvwire-"):
            continue
        try:
            spec, _, _ = kvwire_system(s)
        except ValueError as exc:
            ap.error(str(exc))
        depth = spec.partition("*")[2]
        if "*" in spec and not (depth.isdigit() and int(depth) >= 1):
            ap.error(f"{s}: kvwire-<codec>*N takes N >= 1 sends in flight")
    def names(option: str, text: str, known: tuple[str, ...]) -> list[str]:
        got = [x for x in text.split(",") if x]
        for x in got:
            if x not in known:
                ap.error(f"{option}: unknown name {x!r} (one of {', '.join(known)})")
        return list(dict.fromkeys(got))

    links = names("--links", args.links, LINKS)
    loads = names("--loads", args.loads, LOADS)
    burst_links = names("--burst-links", args.burst_links, LINKS)
    burst_loads = names("--burst-loads", args.burst_loads, LOADS)
    scenarios: list[Scenario] = []
    for link_name in links:
        for load_kind in loads:
            if args.whole_tokens:
                scenarios.append(Scenario(link_name, load_kind, args.whole_tokens, 1))
            if burst and link_name in burst_links and load_kind in burst_loads:
                scenarios.append(Scenario(link_name, load_kind, burst[1], burst[0]))

    skipped = {s: why for s in systems if (why := missing(s)) is not None}
    if "veth" in links:
        from kvwire.bench.netns import netns_available

        reason = netns_available()
        if reason is not None:
            print(f"veth link skipped: {reason}", file=sys.stderr)
            scenarios = [s for s in scenarios if s.link != "veth"]
    for s, why in skipped.items():
        print(f"{s}: skipped: {why}", file=sys.stderr)
    runnable = [s for s in systems if s not in skipped]
    if not scenarios:
        ap.error("nothing to run: no scenario is left for these links, loads and shapes")

    largest = max(s.tokens for s in scenarios) * TOKEN_BYTES
    cache = make_cache(largest)
    samples: dict[tuple[Scenario, str], list[Sample]] = {}
    rounds_of: dict[tuple[Scenario, str], list[int]] = {}  # the round of each sample
    failures: dict[tuple[Scenario, str], str] = {}

    def on_signal(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    t_start = time.perf_counter()
    # Scenarios grouped by link and load so each namespace pair and load starts once.
    for link_name in links:
        group = [s for s in scenarios if s.link == link_name]
        if not group:
            continue
        with open_link(link_name, args.rate) as link:
            for load_kind in dict.fromkeys(s.load for s in group):
                with load(load_kind, args.churn_mib) as load_gone:
                    for sc in (s for s in group if s.load == load_kind):
                        for rnd in range(args.rounds):
                            for system in runnable:
                                key = (sc, system)
                                if key in failures:
                                    continue
                                # the load is checked on both sides of every measurement:
                                # a sample taken while it was running is one of a busy host
                                if (gone := load_gone()) is None:
                                    try:
                                        sample = measure(system, link, cache, sc.tokens, sc.count, args.timeout)
                                    except Exception as exc:
                                        failures[key] = f"{type(exc).__name__}: {exc}"
                                        print(f"[{sc.label}] {system}: failed: {failures[key]}", file=sys.stderr)
                                        continue
                                    gone = load_gone()
                                if gone is not None:  # the scenario fails, every system in it
                                    for s in runnable:
                                        failures.setdefault((sc, s), gone)
                                    print(f"[{sc.label}] failed: {gone}", file=sys.stderr)
                                    continue
                                samples.setdefault(key, []).append(sample)
                                rounds_of.setdefault(key, []).append(rnd)
                                print(f"[{sc.label}] round {rnd + 1} {system}: {sample.gbps:.2f} Gbit/s", file=sys.stderr)

    print(f"\n{len(runnable)} systems, {args.rounds} interleaved rounds, {time.perf_counter() - t_start:.0f} s; "
          f"Gbit/s of KV delivered and CPU s/GB per side: median (min-max)\n")
    for sc in scenarios:
        print(f"### {sc.label}\n")
        print("| system | Gbit/s | vs raw | sender CPU s/GB | receiver CPU s/GB | both CPU s/GB | CPU vs raw "
              "| host CPU s/GB | host CPU vs raw |")
        print("|---|---|---|---|---|---|---|---|---|")
        # The raw pair's samples by round: each ratio is taken over the rounds both
        # completed, never against a raw pair of other rounds (one that failed later).
        raw_by_round = dict(zip(rounds_of.get((sc, "raw"), []), samples.get((sc, "raw"), []), strict=True))
        compared = False  # a ratio to the raw pair shown
        for system in systems:
            key = (sc, system)
            if system in skipped or key in failures:
                why = (skipped.get(system) or failures[key]).replace("|", "\\|")
                what = "skipped" if system in skipped else "failed"
                print(f"| {system} | {what}: {why} | - | - | - | - | - | - | - |")
                continue
            got = samples.get(key, [])
            rates = [x.gbps for x in got]
            both = [x.send_cpu + x.recv_cpu for x in got]
            host = _host_cpu(got) if sc.load == "quiet" else []  # busy: the load's too
            pairs = [(x, raw_by_round[r]) for x, r in zip(got, rounds_of.get(key, []), strict=True) if r in raw_by_round]
            ratio = _ratio([x.gbps for x, _ in pairs], [r.gbps for _, r in pairs])
            cpu_ratio = _ratio([x.send_cpu + x.recv_cpu for x, _ in pairs], [r.send_cpu + r.recv_cpu for _, r in pairs])
            host_pairs = [(x.host_cpu, r.host_cpu) for x, r in pairs if x.host_cpu is not None and r.host_cpu is not None]
            host_ratio = _ratio([x for x, _ in host_pairs], [r for _, r in host_pairs]) if sc.load == "quiet" else "-"
            compared = compared or (system != "raw" and bool(pairs))
            print(f"| {system} | {_fmt(rates)} | {ratio} | {_fmt([x.send_cpu for x in got], 2)} "
                  f"| {_fmt([x.recv_cpu for x in got], 2)} | {_fmt(both, 2)} | {cpu_ratio} "
                  f"| {_fmt(host, 2) if host else '-'} | {host_ratio} |")
        if (sc, "raw") in failures and compared:
            done = ", ".join(str(r + 1) for r in sorted(raw_by_round))
            print(f"\nThe raw pair failed after {len(raw_by_round)} round(s): the ratios to it are over "
                  f"round(s) {done} alone.")
        print()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({
                "args": vars(args),
                "skipped": skipped,
                "failures": {f"{k[0].label} / {k[1]}": v for k, v in failures.items()},
                "samples": {f"{k[0].label} / {k[1]}": [x.__dict__ for x in v] for k, v in samples.items()},
                "sample_rounds": {f"{k[0].label} / {k[1]}": [r + 1 for r in v] for k, v in rounds_of.items()},
            }, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
