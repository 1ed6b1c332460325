"""Bookkeeping of one transfer on each side (sans-IO): which chunks are out, which landed.

A transfer is one request's KV cache.  The sender splits every layer's K and V into
chunks along the token axis; a chunk is addressed by (transfer id, layer, kind,
token_start).  From protocol version 2 a chunk of kind KV carries a token range of K and
V together (a small layer's K and V in one frame).  The receiver de-duplicates by
address and knows a layer is complete when K and V both cover ``[0, layer_tokens)``.
The sender knows the transfer is complete when its producer is exhausted and every chunk
it sent is acknowledged.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass, field
from enum import Enum, auto

from kvwire.errors import ErrorCode, ProtocolError, error_from_code
from kvwire.wire.frames import KIND_K, KIND_KV, KIND_V, Chunk, ChunkAddress

#: Most chunks one (layer, kind) of a transfer may arrive in (LIMIT_EXCEEDED beyond): the
#: receiver remembers each range until the layer is complete, and a peer sending one token
#: per chunk, last token first, would otherwise cost it memory and time per range (a
#: 262144-token layer: 30 MB and a quadratic insert).  kvwire's sender never plans more
#: (:func:`plan_chunks`).
MAX_RANGES = 16384
#: What the receiver counts against its buffer budget for each range it remembers (a sorted
#: start, a dict entry and the ints they hold: about 90 to 120 bytes measured).  Ranges of
#: every (layer, kind) of every granted layer add up: 16384 one-token chunks per kind over a
#: few thousand granted layers of a small layout would otherwise hold GiBs uncounted.
RANGE_BYTES = 128

#: The kinds whose token ranges a chunk of each kind covers, and must not overlap.
_CROSSES = {KIND_K: (KIND_KV,), KIND_V: (KIND_KV,), KIND_KV: (KIND_K, KIND_V)}
_KIND_NAMES = {KIND_K: "K", KIND_V: "V", KIND_KV: "K and V"}


def kinds_overlap(a: int, b: int) -> bool:
    """Whether token ranges of chunk kinds ``a`` and ``b`` hold the same tensors' data:
    the same kind, or KV and K or V (a KV range is a K range and a V range)."""
    return a == b or b in _CROSSES.get(a, ())


def split_kv(chunk: Chunk) -> tuple[Chunk, Chunk]:
    """A raw KV chunk as the K chunk and the V chunk of its token range (views of its
    payload, which is K's bytes, then V's).  ProtocolError if its payload has an odd size."""
    payload = memoryview(chunk.payload_buffer).cast("B")
    half, odd = divmod(payload.nbytes, 2)
    if odd:
        raise ProtocolError(f"KV chunk payload of {payload.nbytes} bytes is not two equal halves")
    return (dataclasses.replace(chunk, kind=KIND_K, payload=payload[:half]),
            dataclasses.replace(chunk, kind=KIND_V, payload=payload[half:]))


class ChunkVerdict(Enum):
    NEW = auto()
    DUPLICATE = auto()


@dataclass(slots=True)
class _Coverage:
    """Token ranges received for one (layer, kind): sorted starts and their counts."""

    starts: list[int] = field(default_factory=list)
    counts: dict[int, int] = field(default_factory=dict)
    covered: int = 0

    def overlaps(self, start: int, count: int) -> bool:
        """Whether ``[start, start + count)`` overlaps a range recorded here."""
        i = bisect.bisect_right(self.starts, start)
        if i > 0:
            prev = self.starts[i - 1]
            if prev + self.counts[prev] > start:
                return True
        return i < len(self.starts) and self.starts[i] < start + count

    def classify(self, start: int, count: int) -> ChunkVerdict:
        """A range starting where one was recorded is a duplicate (ProtocolError with
        another count); a new one must not overlap any (ProtocolError)."""
        if start in self.counts:
            if self.counts[start] != count:
                raise ProtocolError("chunk re-sent with a different token range")
            return ChunkVerdict.DUPLICATE
        if self.overlaps(start, count):
            raise ProtocolError("chunk token ranges overlap")
        return ChunkVerdict.NEW

    def insert(self, start: int, count: int) -> None:
        """Record a range :meth:`classify` found NEW."""
        bisect.insort(self.starts, start)
        self.counts[start] = count
        self.covered += count


class IncomingTransfer:
    """Receiver side of one transfer: address checks, de-duplication, layer completion."""

    def __init__(self, transfer_id: int, num_layers: int, *, layer_limit: int, max_tokens: int) -> None:
        self.transfer_id = transfer_id
        self.num_layers = num_layers
        self.layer_limit = layer_limit
        self.max_tokens = max_tokens
        self.layer_tokens: int | None = None
        self._cov: dict[tuple[int, int], _Coverage] = {}
        self._complete: set[int] = set()
        self.ranges = 0
        """Token ranges remembered (those of layers not complete yet)."""
        self.chunks_received = 0
        self.duplicates = 0

    def check(self, chunk: Chunk) -> None:
        """Raise ProtocolError if ``chunk`` cannot belong to this transfer."""
        if chunk.layer >= self.num_layers:
            raise ProtocolError(f"chunk for layer {chunk.layer} of a {self.num_layers}-layer transfer")
        if chunk.layer >= self.layer_limit:
            raise error_from_code(
                ErrorCode.FLOW_CONTROL_ERROR, f"chunk for layer {chunk.layer} beyond the granted limit {self.layer_limit}",
            )
        if chunk.token_count == 0 or chunk.token_start + chunk.token_count > chunk.layer_tokens:
            raise ProtocolError("chunk token range outside its layer")
        if chunk.kind == KIND_KV and (chunk.codec_id != 0 or chunk.params):
            raise ProtocolError("a KV chunk carries raw data only (codec 0, no params)")
        if chunk.layer_tokens > self.max_tokens:
            raise error_from_code(
                ErrorCode.LIMIT_EXCEEDED, f"{chunk.layer_tokens} tokens exceeds this server's limit of {self.max_tokens}",
            )
        if self.layer_tokens is None:
            self.layer_tokens = chunk.layer_tokens
        elif chunk.layer_tokens != self.layer_tokens:
            raise ProtocolError("layers of one transfer disagree on the token count")

    def overlaps_received(self, layer: int, kind: int, start: int, count: int) -> bool:
        """Whether tokens ``[start, start + count)`` of (layer, kind) hold verified data
        (for a KV range: of K or of V)."""
        if layer in self._complete:
            return True
        for k in (kind, *_CROSSES[kind]):
            cov = self._cov.get((layer, k))
            if cov is not None and cov.overlaps(start, count):
                return True
        return False

    def classify(self, chunk: Chunk) -> ChunkVerdict:
        """Whether ``chunk`` is new or a duplicate, changing nothing (call :meth:`check`
        first; ProtocolError for an overlap, LIMIT_EXCEEDED past :data:`MAX_RANGES`; any
        chunk of a complete layer is a duplicate).  A receiver stores a NEW chunk's data first
        and :meth:`add` s it after, so a chunk counts as received only once its bytes are
        in place.  A duplicate has the address and token count of a chunk received; a KV
        range must not overlap a K or V range received, nor they a KV range."""
        if chunk.layer in self._complete:
            # Its ranges are forgotten: every token is here, so whatever it holds is late.
            return ChunkVerdict.DUPLICATE
        cov = self._cov.get((chunk.layer, chunk.kind))
        verdict = ChunkVerdict.NEW if cov is None else cov.classify(chunk.token_start, chunk.token_count)
        if verdict is ChunkVerdict.NEW:
            if cov is not None and len(cov.starts) >= MAX_RANGES:
                raise error_from_code(
                    ErrorCode.LIMIT_EXCEEDED, f"more than {MAX_RANGES} chunks for one layer's {_KIND_NAMES[chunk.kind]}",
                )
            for k in _CROSSES[chunk.kind]:
                other = self._cov.get((chunk.layer, k))
                if other is not None and other.overlaps(chunk.token_start, chunk.token_count):
                    raise ProtocolError("chunk token ranges overlap")
        return verdict

    def add(self, chunk: Chunk, verdict: ChunkVerdict | None = None) -> ChunkVerdict:
        """Record ``chunk`` (call :meth:`check` first).  ``verdict``: what :meth:`classify`
        said of it, nothing having been added since (else it is classified here)."""
        if verdict is None:
            verdict = self.classify(chunk)
        if verdict is ChunkVerdict.DUPLICATE:
            self.duplicates += 1
        else:
            self._cov.setdefault((chunk.layer, chunk.kind), _Coverage()).insert(chunk.token_start, chunk.token_count)
            self.ranges += 1
            self.chunks_received += 1
        return verdict

    def completes(self, chunk: Chunk) -> bool:
        """Whether a NEW ``chunk`` (see :meth:`classify`) completes its layer: once it is
        added, the layer's ranges are forgotten rather than one more remembered."""
        lt = self.layer_tokens
        if lt is None or chunk.layer in self._complete:
            return False
        k, v, kv = (self._covered(chunk.layer, kind) for kind in (KIND_K, KIND_V, KIND_KV))
        n = chunk.token_count
        k, v, kv = (k + n * (chunk.kind == KIND_K), v + n * (chunk.kind == KIND_V), kv + n * (chunk.kind == KIND_KV))
        return k + kv == lt and v + kv == lt

    def layer_complete(self, layer: int) -> bool:
        if layer in self._complete:
            return True
        lt = self.layer_tokens
        if lt is None:
            return False
        kv = self._covered(layer, KIND_KV)
        if self._covered(layer, KIND_K) + kv == lt and self._covered(layer, KIND_V) + kv == lt:
            self._complete.add(layer)
            for kind in (KIND_K, KIND_V, KIND_KV):  # a complete layer needs no ranges
                cov = self._cov.pop((layer, kind), None)
                if cov is not None:
                    self.ranges -= len(cov.starts)
            return True
        return False

    def _covered(self, layer: int, kind: int) -> int:
        cov = self._cov.get((layer, kind))
        return 0 if cov is None else cov.covered

    @property
    def complete(self) -> bool:
        return len(self._complete) == self.num_layers


@dataclass(slots=True)
class SentChunk:
    """A chunk the sender has put on a connection and not yet seen acknowledged."""

    address: ChunkAddress
    stream: int
    wire_size: int
    kv_bytes: int
    chunk: Chunk | None = None
    """The frame itself, kept until acknowledged so it can be re-sent after a break."""


class OutgoingTransfer:
    """Sender side of one transfer: what is in flight and when it is complete."""

    def __init__(self, transfer_id: int, num_layers: int) -> None:
        self.transfer_id = transfer_id
        self.num_layers = num_layers
        self.layer_limit = 0
        self.accepted = False
        self.producer_done = False
        self.unacked: dict[ChunkAddress, SentChunk] = {}
        self.chunks_sent = 0
        self.chunks_acked = 0
        self.wire_bytes = 0
        self.kv_bytes_acked = 0

    def on_sent(self, sent: SentChunk) -> None:
        self.unacked[sent.address] = sent
        self.chunks_sent += 1
        self.wire_bytes += sent.wire_size

    def on_ack(self, address: ChunkAddress) -> SentChunk | None:
        """The chunk acknowledged, or None for a duplicate ack (already counted)."""
        sent = self.unacked.pop(address, None)
        if sent is not None:
            self.chunks_acked += 1
            self.kv_bytes_acked += sent.kv_bytes
        return sent

    def raise_limit(self, layer_limit: int) -> None:
        self.layer_limit = max(self.layer_limit, min(layer_limit, self.num_layers))

    @property
    def complete(self) -> bool:
        return self.accepted and self.producer_done and not self.unacked


def plan_chunks(
    tokens: int, bytes_per_token: int, chunk_bytes: int, *, align: int = 32, lead_bytes: int = 0,
) -> list[tuple[int, int]]:
    """Split ``tokens`` into ``(start, count)`` ranges of about ``chunk_bytes`` each.

    Counts are multiples of ``align`` (so block-grouped codecs see whole blocks) except
    the last one, and there are at most :data:`MAX_RANGES` ranges.  With ``lead_bytes``, a first range of about that size (at least
    ``align`` tokens) is split off the first chunk: the first CHUNK of a transfer is how
    the receiver learns the layer size and grants more than one layer, so a small one
    lets that grant come back while the rest of the layer is still being written.
    """
    if tokens <= 0:
        return []
    per = max(1, chunk_bytes // max(1, bytes_per_token))
    if per >= align:
        per -= per % align
    need = -(-tokens // (MAX_RANGES - 1))
    if need > per:
        # Never more ranges than a receiver takes (a lead range included): a small
        # ``chunk_bytes`` on a very large layer gets larger chunks.
        per = -(-need // align) * align
    out = []
    start = 0
    while start < tokens:
        count = min(per, tokens - start)
        out.append((start, count))
        start += count
    if lead_bytes > 0:
        lead = max(align, lead_bytes // max(1, bytes_per_token) // align * align)
        first = out[0][1]
        if first > lead:
            out[0:1] = [(0, lead), (lead, first - lead)]
    return out
