"""The send pipeline of one transfer: the producer's layers checked, chunked, encoded (codec
fixed or chosen per chunk) and handed to the session core once the receiver granted their
layer; then the :class:`Receipt`.  Every protocol decision is the core's
(:class:`kvwire.session.SenderCore`); this module only waits for its verdicts."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvwire.aio._arrays import (
    as_device_array,
    as_host_array,
    is_device_array,
    iterate_layers,
    layer_count,
    sync_layers,
)
from kvwire.aio._codec_speed import codec_speeds
from kvwire.aio._encode import Part, device_parts, encode_host, host_chunks, raw_based
from kvwire.codec import TensorKind, get_codec
from kvwire.control import CodecCandidate, CodecChooser, DeliveryRateEstimator
from kvwire.errors import (
    ErrorCode,
    IncompatiblePeerError,
    KvwireError,
    TransferAbortedError,
    UsageError,
)
from kvwire.session.options import Receipt
from kvwire.session.sender import SenderCore, TransferDone
from kvwire.spec import KVSpec
from kvwire.wire import KIND_KV, BlockVersion, Chunk, plan_chunks
from kvwire.wire.frames import payload_parts

if TYPE_CHECKING:
    from kvwire.aio.client import Peer

_log = logging.getLogger("kvwire")

#: Measurement clock (uvloop's loop clock ticks in whole milliseconds).
clock = time.perf_counter
AUTO = "auto"
#: Codecs ``auto`` chooses among, most precise first.
AUTO_CANDIDATES = ("raw", "fp8", "int8", "int4")
#: Size of a transfer's first chunk: until it arrives the receiver grants one layer only.
LEAD_CHUNK_BYTES = 64 * 1024
#: Chunks of raw host arrays queued ahead of the streams (see ``_send_layer``).
AHEAD_CHUNKS = 2
#: Longest the send task hands chunks to the core without letting the event loop run
#: (seconds); docs/benchmarks.md compares every chunk, 2 ms, 5 ms and never.
YIELD_AFTER = 0.002


class SendProgress:
    """How far one send got, for a watcher on another thread (:class:`kvwire.sync.SendHandle`):
    set on the loop, read from anywhere without it, and referring to nothing (the send's
    task holds it, not the watcher).  ``accepted`` is set once the server answered the
    send's BEGIN (it holds that ACCEPT while its buffer budget has no room for a first
    layer, docs/protocol.md 7.1); ``layers_granted`` is the layer limit it granted so far;
    ``waiting_for_credit`` is True while the send waits for the server to grant the layer
    it has next (the server grants within its buffer budget's room, 8.2)."""

    __slots__ = ("accepted", "layers_granted", "waiting_for_credit")

    def __init__(self) -> None:
        self.accepted = threading.Event()
        self.layers_granted = 0
        self.waiting_for_credit = False


@dataclass(eq=False)
class SendState:
    """What the I/O layer learned about one transfer from the core's events."""

    changed: asyncio.Event  # the peer's: set whenever the core reported anything
    failed: asyncio.Event = field(default_factory=asyncio.Event)
    error: KvwireError | None = None
    done: TransferDone | None = None
    first_layer_at: float | None = None  # when every chunk of layer 0 was acknowledged
    ran_since: float = 0.0  # when the send task last let the event loop run (see YIELD_AFTER)
    # When the send task last came back from waiting on the session (a grant, its queue
    # draining onto the streams): the path set the pace until then, not the producer.
    resumed_at: float = -math.inf
    progress: SendProgress | None = None  # a watcher's on another thread, if any

    def credit(self, layer_limit: int) -> None:
        """The server accepted the transfer and granted layers below ``layer_limit``: a
        watcher's progress says so (until then the server may be holding its ACCEPT for
        want of room in its buffer budget, docs/protocol.md 7.1)."""
        if (p := self.progress) is not None:
            p.layers_granted = max(p.layers_granted, layer_limit)
            p.accepted.set()

    def fail(self, error: KvwireError) -> None:
        if self.error is None:
            self.error = error
        self.failed.set()
        self.changed.set()


async def until(st: SendState, ready: Callable[[], bool]) -> None:
    """Wait until ``ready()`` or the transfer failed (raised).  The event is cleared before
    the conditions are read, so a change at any time before (a RESET while a layer was
    produced, a grant) is never lost."""
    while True:
        st.changed.clear()
        if st.error is not None:
            raise st.error
        if ready():
            return
        await st.changed.wait()
        st.ran_since = st.resumed_at = clock()


async def next_or_fail(producer: AsyncIterator[tuple[Any, Any]], st: SendState) -> tuple[Any, Any] | None:
    """The producer's next layer, or the transfer's error if it fails first (a producer
    waiting on something must not keep a dead transfer's ``send()`` alive).

    The producer's ``__anext__`` runs in a task of its own; when the transfer fails or
    ``send()`` is cancelled while it waits, that task is cancelled and awaited (its
    cleanup runs before ``send()`` ends, for at most :data:`PRODUCER_STOP_TIMEOUT`) and
    what it ended with (its end, its error) is read and dropped: the transfer's error or
    the cancellation is what ``send()`` raises."""
    if st.error is not None:
        raise st.error
    nxt = asyncio.ensure_future(producer.__anext__())
    failed = asyncio.ensure_future(st.failed.wait())
    try:
        await asyncio.wait({nxt, failed}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # send() cancelled: the producer's wait ends with it
        await _stop_producer(nxt)
        raise  # (the cancellation send() was given, still counted by cancelling())
    finally:
        failed.cancel()
    if nxt.done():
        try:
            item = nxt.result()
        except StopAsyncIteration:
            return None
        if st.error is not None:
            raise st.error  # failed while the layer was produced
        return item
    await _stop_producer(nxt)
    assert st.error is not None
    raise st.error


#: Longest ``send()`` waits, once it failed or was cancelled, for a producer that was
#: waiting for its next layer to end (its ``finally`` blocks, an ``except
#: CancelledError`` releasing what it holds), in seconds.  One that takes longer is left
#: running, with a warning on the ``kvwire`` logger: a producer that ignores its
#: cancellation must not keep a failed or cancelled ``send()`` alive for ever.
PRODUCER_STOP_TIMEOUT = 2.0


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Read what a stopped producer ended with, so that asyncio never reports it as an
    exception nobody retrieved (its end, StopAsyncIteration, or its cleanup's error)."""
    if not task.cancelled():
        exc = task.exception()
        if exc is not None and not isinstance(exc, StopAsyncIteration):
            _log.debug("layer producer failed while it was stopped: %r", exc)


async def _stop_producer(nxt: asyncio.Future[Any]) -> None:
    """Cancel the producer's pending ``__anext__`` and wait (bounded) for it to end.  A
    cancellation of ``send()`` that comes meanwhile stops the wait and is raised; the
    caller re-raises its own error or cancellation otherwise."""
    nxt.add_done_callback(_retrieve)  # (run once it ends, whether or not it is waited for)
    if nxt.done():
        return
    nxt.cancel()
    await asyncio.wait({nxt}, timeout=PRODUCER_STOP_TIMEOUT)
    if not nxt.done():
        _log.warning("layer producer still running %.1f s after it was cancelled; left running",
                     PRODUCER_STOP_TIMEOUT)


def available_cpus() -> int:
    """CPUs this process may run on (its affinity where the platform says)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def make_chooser(server_codecs: tuple[str, ...], mode: str = "model") -> CodecChooser:
    """The ``auto`` chooser for a server accepting ``server_codecs``; ``mode`` is
    :attr:`~kvwire.ClientOptions.auto_codec`."""
    candidates = []
    for name in AUTO_CANDIDATES:
        if name in server_codecs:
            ratio = get_codec(name).encoded_size_ratio((256, 8, 128), "float16")
            enc, dec = codec_speeds(name)  # the receiver's decode measured here
            candidates.append(CodecCandidate(name=name, size_ratio=ratio, encode_bytes_per_s=enc,
                                             decode_bytes_per_s=dec))
    if not candidates:
        raise IncompatiblePeerError(
            "codec 'auto' needs at least one of " + ", ".join(AUTO_CANDIDATES) + " on the server",
            code=ErrorCode.UNSUPPORTED_CODEC,
        )
    cores = available_cpus()
    if mode == "measured":
        # Measured goodput's samples vary by 10-20% on two loaded cores: a wider band
        # than the model's (docs/architecture.md).
        return CodecChooser(candidates, measure_goodput=True, tolerance=0.05, hysteresis=0.10, cores=cores)
    return CodecChooser(candidates, cores=cores)


async def send(
    peer: Peer, request_id: str, spec: KVSpec, layers: Any, meta: bytes, codec_name: str,
    blocks: tuple[BlockVersion, ...], deadline: float | None, timeout: float | None,
    progress: SendProgress | None = None,
) -> Receipt:
    """:meth:`kvwire.Peer.send`'s transfer; ``progress`` (if given) is kept up to date, on
    the loop, for a watcher on another thread."""
    core = peer.core
    peer.check_usable()
    count = layer_count(layers)
    if count is not None and count != spec.num_layers:  # refused before anything is sent
        raise UsageError(f"layers has {count} layers, spec.num_layers={spec.num_layers}")
    # A sequence or a plain iterable is read with next(): it cannot wait on anything, so it
    # needs no race against the transfer's failure (next_or_fail's two futures and a wait
    # for every layer).  Neither reads a layer yet; what is none of them (an int) is
    # refused here, before BEGIN, so the receiver never sees a transfer for it.
    sync = _sync_source(layers)
    producer = iterate_layers(layers) if sync is None else None
    started = clock()
    idle = not peer.sends
    tid = core.begin(request_id, num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads,
                     head_dim=spec.head_dim, dtype_id=spec.dtype_id, model=spec.model, meta=meta,
                     blocks=blocks, now=asyncio.get_running_loop().time(), timeout=timeout)
    if idle:  # (after BEGIN: a send it refuses leaves the peer idle, its meter paused)
        peer.transport_meter.resume()
        if peer.chooser is not None:
            peer.chooser.observe_idle()  # the peer was idle (or its last transfer failed)
    st = peer.sends[tid] = SendState(peer.changed, progress=progress)
    peer.pump()
    used: dict[str, int] = {}
    kv_bytes = 0
    try:
        index, tokens = -1, None
        exhausted = False

        async def next_item() -> Any:
            """The producer's next layer (None once it has ended)."""
            if sync is not None:
                if st.error is not None:
                    raise st.error
                return next(sync, None)
            assert producer is not None
            return await next_or_fail(producer, st)

        async def past_last() -> None:
            """Read the producer once more before the last layer's final chunk goes to the
            core: a producer that yields too many layers, or fails after its last one,
            aborts a transfer the receiver cannot have completed yet."""
            nonlocal exhausted
            if exhausted:
                return
            if await next_item() is not None:
                raise UsageError(f"layers yielded more than spec.num_layers={spec.num_layers}")
            exhausted = True

        while not exhausted:
            item = await next_item()
            if item is None:
                break
            index += 1  # (the last layer reads past itself: a layer too many never gets here)
            as_array = as_device_array if is_device_array(item[0]) else as_host_array
            k = as_array(item[0], spec, f"layer {index} k")
            v = as_array(item[1], spec, f"layer {index} v")
            if k.shape[0] != v.shape[0] or (tokens is not None and k.shape[0] != tokens):
                earlier = "" if tokens is None else f", earlier layers {tokens}"
                raise UsageError(f"layer {index}: every k and v of a cache must have the same token count "
                                 f"(k has {k.shape[0]}, v {v.shape[0]}{earlier})")
            tokens = k.shape[0]
            kv_bytes += k.nbytes + v.nbytes
            await _credit_for(st, core, tid, index)
            last = index == spec.num_layers - 1
            await _send_layer(peer, st, tid, spec, index, k, v, codec_name, used, started, deadline,
                              past_last if last else None)
            if last:
                await past_last()  # (done already, unless the layer had no chunk)
        if index + 1 != spec.num_layers:
            raise UsageError(f"layers yielded {index + 1} layers, spec.num_layers={spec.num_layers}")
        core.producer_done(tid)
        peer.pump()
        await until(st, lambda: st.done is not None)
        st.credit(spec.num_layers)  # (a send done was accepted and granted, whenever that was read)
    except BaseException as exc:
        if st.error is None:  # tell the receiver this transfer will not complete
            core.abort(tid, _abort_error(exc))
            peer.pump()
        if isinstance(exc, asyncio.CancelledError):
            task = asyncio.current_task()
            if task is None or task.cancelling():
                raise  # send() itself was cancelled
            # The producer's own cancellation (a future of its cancelled): nobody cancelled
            # send(), so it must not end as if its caller had been.
            raise TransferAbortedError("the layer producer was cancelled") from exc
        if isinstance(exc, KvwireError):
            raise
        if isinstance(exc, Exception):  # the producer's own exception stays the cause
            raise TransferAbortedError(f"layer producer failed: {exc!r}") from exc
        raise
    finally:
        peer.sends.pop(tid, None)
        if not peer.sends:
            peer.transport_meter.pause()
    done = st.done
    assert done is not None
    snap = peer.estimator.snapshot()
    if codec_name == AUTO and len(used) == 1:
        codec_name = next(iter(used))
    return Receipt(
        request_id=request_id, transfer_id=tid, codec=codec_name, kv_bytes=kv_bytes,
        wire_bytes=done.wire_bytes, chunks=done.chunks, seconds=clock() - started,
        time_to_first_layer=(st.first_layer_at - started) if st.first_layer_at else None,
        estimated_gbps=snap.bandwidth_bps / 1e9 if snap.bandwidth_bps else None,
        rtt_ms=snap.min_rtt * 1e3 if snap.min_rtt is not None else None,
        extra={"chunks_by_codec": used},
    )


def _sync_source(layers: Any) -> Iterator[tuple[Any, Any]] | None:
    """:func:`sync_layers` of ``layers``, before BEGIN: what cannot be iterated (an int, a
    0-d array) is its UsageError, an ``__iter__`` that fails a failed producer."""
    try:
        return sync_layers(layers)
    except KvwireError:
        raise
    except Exception as exc:
        raise TransferAbortedError(f"layer producer failed: {exc!r}") from exc


def _abort_error(exc: BaseException) -> KvwireError:
    """What the receiver is told of a send that failed on this side: an error with a code of
    its own (a timeout, a code a peer gave) as it is; CANCELLED for a failing producer, a
    cancellation and a local error without a code (a UsageError for a layer that does not
    fit the spec: its INTERNAL_ERROR is no error of the receiver's), docs/protocol.md 10.
    (A RESET never carries NO_ERROR: the connection sends CANCELLED for it.)"""
    if isinstance(exc, KvwireError):
        if exc.code != ErrorCode.INTERNAL_ERROR:
            return exc
        return TransferAbortedError(f"sender aborted: {exc}")
    if isinstance(exc, asyncio.CancelledError):  # send() cancelled, SendHandle.abort(): no repr
        why = f" ({exc.args[0]})" if exc.args and exc.args[0] else ""
        return TransferAbortedError(f"sender aborted: the send was cancelled{why}")
    return TransferAbortedError(f"sender aborted: {exc!r}")


async def _credit_for(st: SendState, core: SenderCore, tid: int, layer: int) -> None:
    """Wait until ``layer`` is granted (or the transfer failed); a watcher sees it as a wait
    for credit, except layer 0's: that is a wait for ACCEPT, which ``accepted`` shows."""
    ready = _granted(core, tid, layer)
    if ready():
        return
    if (p := st.progress if layer else None) is not None:
        p.waiting_for_credit = True
    try:
        await until(st, ready)
    finally:
        if p is not None:
            p.waiting_for_credit = False


def _granted(core: SenderCore, tid: int, layer: int) -> Callable[[], bool]:
    return lambda: core.layer_limit(tid) > layer


def chooser_app_limited(est: DeliveryRateEstimator) -> bool:
    """Whether ``auto``'s chooser is told the sender sets the pace (``app_limited``):
    the estimator's samples are app-limited, and not only because the in-flight window
    held data back to drain the path's queue (ProbeRTT: the drain, the round trip after
    it, and what the sender sent then with the pipe running dry). A drain's estimate is
    the path's as measured before it, and told otherwise the chooser sent a run of raw
    probes for each drain (10 Gbit/s, 100 ms: 9 raw chunks in each, whose samples the
    estimator holds, and a raw run in the round trip after it when only the drain was
    left out)."""
    return est.app_limited and not est.hold_limited


async def _send_layer(
    peer: Peer, st: SendState, tid: int, spec: KVSpec, index: int, k: Any, v: Any, codec_name: str,
    used: dict[str, int], started: float, deadline: float | None,
    before_final: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Chunk, encode and hand one layer to the core (K first, then V); an encoded chunk
    waits until the core put the one before on a stream.  ``before_final`` is awaited
    before the layer's final chunk (V's last) goes to the core."""
    core = peer.core
    tokens = int(k.shape[0])
    bpt = spec.num_kv_heads * spec.head_dim * spec.itemsize
    target = core.chunk_target(peer.options.chunk_bytes)
    host = not is_device_array(k)
    chooser = peer.chooser
    fixed = None if codec_name == AUTO else get_codec(codec_name)  # (send() checked the name)

    def pick() -> Any:
        if fixed is not None:
            return fixed
        assert chooser is not None
        left = None if deadline is None else deadline - (clock() - started)
        remaining = (spec.num_layers - index) * 2 * tokens * bpt
        est = peer.estimator
        rtt = est.min_rtt
        if rtt is not None:  # the data's round trip: below a busy host's handshake
            chooser.observe_path_rtt(rtt)
        return get_codec(chooser.choose(
            est.bandwidth_bps, remaining_bytes=remaining if deadline is not None else None,
            time_left=left, app_limited=chooser_app_limited(est), now=clock(), peak_bps=est.max_filter_bps,
        ).codec)

    chosen: Any = None
    if codec_name in ("raw", AUTO) and host and index > 0 and core.kv_chunks and 2 * tokens * bpt <= target:
        # K and V in one chunk (protocol version 2), where the layer goes raw: half the
        # frames, acks and per-chunk work on both sides, and the receiver reads them
        # straight into the layer's array. Not the first layer: its small first chunk is
        # how the receiver learns the layer size and grants more than one layer.
        chosen = pick()
        if chosen.name == "raw":
            payload = tuple(
                b for x, kind in ((k, TensorKind.K), (v, TensorKind.V))
                for b in payload_parts(encode_host(chosen, x, kind).payload)
            )
            if before_final is not None:
                await before_final()
            used["raw"] = used.get("raw", 0) + 1
            core.add_chunk(tid, Chunk(transfer_id=tid, layer=index, kind=KIND_KV, codec_id=chosen.codec_id,
                                      token_start=0, token_count=tokens, layer_tokens=tokens, params=b"",
                                      payload=payload),
                           kv_bytes=2 * tokens * bpt)
            peer.pump()
            await _after_chunk(core, st, tid, AHEAD_CHUNKS * target)
            return
    plan = plan_chunks(tokens, bpt, target)
    first = [chosen] if chosen is not None else []  # ``auto`` chose a compact codec: the first chunk's

    # The codec chosen for each chunk (host) or part (device), in the order they come out:
    # a chunk sent raw in place of it is told to the chooser by its address (its wire
    # time is taken out of the run of measured goodput at its acknowledgement).
    picks: deque[Any] = deque()
    # ``auto`` sends raw a chunk whose values its choice refuses (NaN, infinity, or an int4
    # group's range past float32); a codec the caller named refuses them as the codec does
    fallback = codec_name == AUTO

    def next_codec() -> Any:
        codec = first.pop() if first else pick()
        if fallback:  # (only a chunk that may fall back to raw needs its pick kept)
            picks.append(codec)
        return codec

    def pick_part() -> Any:
        codec = pick()
        if fallback:
            picks.append(codec)
        return codec

    # Raw chunks of host arrays (``auto``'s included) are views of the caller's memory,
    # free to hold: up to AHEAD_CHUNKS of them wait in the core's queue, so the task wakes
    # once per that many instead of once per chunk. An encoded chunk is memory: the next
    # goes to the core once the one before is on a stream (host_chunks has encoded it
    # meanwhile, up to ENCODE_AHEAD chunks ahead, for ``auto`` as for a fixed codec).
    # Encoded only when asked for, or with each raw chunk waiting for the queue to drain,
    # ``auto`` left the pipe empty at every chunk and on two busy cores delivered less
    # than any fixed codec (docs/benchmarks.md).
    queue_ahead = AHEAD_CHUNKS * target if host else 0
    parts: list[Part] = []
    for kind, arr in ((TensorKind.K, k), (TensorKind.V, v)):
        chunks = plan
        # The transfer's first chunk is small (the receiver grants its window once it knows
        # the layer size); the GPU kernels quantize equal chunks only.
        if index == 0 and kind is TensorKind.K and (host or raw_based(codec_name)):
            chunks = plan_chunks(tokens, bpt, target, lead_bytes=LEAD_CHUNK_BYTES)
        parts.append((kind, arr, chunks))
    source = (host_chunks(parts, next_codec, chooser, raw_fallback=fallback) if host
              else device_parts(parts, pick_part, spec.dtype, chooser, raw_fallback=fallback))
    chosen_for = None
    async with contextlib.aclosing(source):
        async for kind, start, count, codec, enc in source:
            if st.error is not None:
                raise st.error
            if fallback and (host or start == 0):  # (a device part's chunks share its pick)
                chosen_for = picks.popleft()
            if before_final is not None and kind == TensorKind.V and start + count == tokens:
                await before_final()
                if st.error is not None:
                    raise st.error
            used[codec.name] = used.get(codec.name, 0) + 1
            chunk = Chunk(
                transfer_id=tid, layer=index, kind=int(kind), codec_id=enc.codec_id, token_start=start,
                token_count=count, layer_tokens=tokens, params=enc.params, payload=enc.payload,
            )
            if chooser is not None and fallback and chosen_for is not None and codec.name != chosen_for.name:
                # marked by its address: its acknowledgement (a resend's too) names it
                chooser.observe_fallback(codec.name, chunk.address, transfer=tid)
            core.add_chunk(tid, chunk, kv_bytes=count * bpt)
            peer.pump()
            await _after_chunk(core, st, tid, queue_ahead if codec.name == "raw" else 0)


async def _after_chunk(core: SenderCore, st: SendState, tid: int, queue_ahead: int) -> None:
    """After a chunk went to the core: wait while more than ``queue_ahead`` bytes of the
    transfer are queued, else let the loop run if the task has held it long enough."""
    if core.queued_bytes(tid) > queue_ahead:
        await until(st, lambda: core.queued_bytes(tid) == 0)
    elif clock() - st.ran_since >= YIELD_AFTER:
        # Nothing to wait for, but the loop runs at least this often: acks are read as
        # they come (the estimate's samples, the window's room), other tasks and timers
        # run, instead of all of it once the window is full.
        await asyncio.sleep(0)
        st.ran_since = clock()


__all__ = ["AUTO", "Receipt", "SendState", "make_chooser", "next_or_fail", "send", "until"]
