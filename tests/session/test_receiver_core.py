"""The receiving session core on its own: a client connection speaks to it in memory, in
fake time, and every hook the asyncio server relies on is checked here (layout and codec
refusal, storage failures, in-place receive before the CRC, the byte budget, the registry
gate, the events the server logs)."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from typing import Any

import lz4.block
import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

import kvwire.session.receiver as receiver_module
from kvwire.codec import EntropyCodec, TensorKind, codec_by_id, get_codec
from kvwire.errors import ErrorCode, KvwireError
from kvwire.session.meta import parse_meta
from kvwire.session.receiver import (
    BLOCK_ENTRY_BYTES,
    AuthenticationFailed,
    ByteStore,
    ConnectionDropped,
    InternalError,
    LayerReady,
    ReceiverConfig,
    ReceiverCore,
    RegistryCheck,
    RegistryPublish,
    StreamResumed,
    TransferAborted,
    TransferArrived,
    TransferFailed,
    begin_footprint,
)
from kvwire.spec import KVSpec
from kvwire.wire import (
    KIND_KV,
    Chunk,
    ChunkAcked,
    Connection,
    ConnectionClosed,
    ConnectionConfig,
    CreditGranted,
    Event,
    Role,
    State,
    TransferAccepted,
    TransferReset,
)
from kvwire.wire.frames import PROTOCOL_VERSION, BlockVersion, Ping, Reset, frame_bytes
from kvwire.wire.transfer import RANGE_BYTES
from tests.session.receiver_harness import (
    BIG,
    BPT,
    HEAD_DIM,
    HEADS,
    SECRET,
    CountingStore,
    Harness,
    begin,
    chunk,
    join,
    split_after,
)

SPEC = KVSpec(num_layers=2, num_kv_heads=HEADS, head_dim=HEAD_DIM, dtype="float16")


def test_handshake_and_begin_accept_and_arrive() -> None:
    h = Harness()
    assert h.client.state is State.OPEN
    h.client.send_begin(begin())
    h.pump()
    [arrived] = h.of(TransferArrived)
    assert arrived.request_id == "r" and arrived.spec == SPEC and arrived.num_layers == 2
    assert h.client_of(TransferAccepted)[0].layer_limit == 1
    assert h.core.counters["transfers_accepted"] == 1


# -- layouts -------------------------------------------------------------------------------


def test_a_session_pinned_to_another_layout_is_refused_at_authentication() -> None:
    other = replace(SPEC, head_dim=8)
    cfg = ReceiverConfig(secret=SECRET, fingerprints=frozenset({SPEC.fingerprint}))
    h = Harness(cfg, fingerprint=other.fingerprint)
    [closed] = h.client_of(ConnectionClosed)
    assert closed.error is not None and closed.error.code == ErrorCode.INCOMPATIBLE_SPEC
    assert h.core.sessions == 0
    # the accepted layout opens
    assert Harness(cfg, fingerprint=SPEC.fingerprint).client.state is State.OPEN


def test_a_begin_of_another_layout_is_refused_with_incompatible_spec() -> None:
    h = Harness(ReceiverConfig(secret=SECRET, fingerprints=frozenset({SPEC.fingerprint})))
    h.client.send_begin(begin(head_dim=8, model="m" * 255))
    h.pump()
    [reset] = h.client_of(TransferReset)
    assert reset.code == ErrorCode.INCOMPATIBLE_SPEC
    # Both layouts named by fingerprint, within what the wire carries of a long model field.
    sent = replace(SPEC, head_dim=8, model="m" * 255).fingerprint.hex()[:12]
    assert f"KV layout {sent} (it accepts {SPEC.fingerprint.hex()[:12]})" in reset.message
    assert h.core.counters["transfers_refused"] == 1 and not h.of(TransferArrived)
    h.client.send_begin(begin(tid=2))
    h.pump()
    assert len(h.of(TransferArrived)) == 1


def test_a_begin_refused_at_admission_frees_its_id_and_a_registry_refusal_does_not() -> None:
    """docs/protocol.md 7.1: a BEGIN refused for a condition checked at BEGIN leaves nothing
    behind (the same id may be sent again and is decided afresh); a transfer the registry
    refused was admitted and failed, so its id gets the same RESET again."""
    from kvwire.errors import StaleVersionError

    h = Harness(ReceiverConfig(secret=SECRET, max_transfers=1, registry=True))
    h.client.send_begin(begin(tid=1, layers=1))
    h.client.send_begin(begin(tid=2, layers=1, request="r2"))
    h.pump()
    [full] = h.client_of(TransferReset)
    assert full.transfer_id == 2 and full.code == ErrorCode.LIMIT_EXCEEDED
    h.send(chunk(tid=1, layer=0, kind=0, tokens=8))
    h.send(chunk(tid=1, layer=0, kind=1, tokens=8))
    h.core.claim(h.key, h.now)
    h.core.take_layer(h.key, 0, h.now)  # its last layer: the transfer no longer counts
    h.client.send_begin(begin(tid=2, layers=1, request="r2", blocks=(BlockVersion(block=b"i:1", version=3),)))
    h.pump()
    [check] = h.of(RegistryCheck)  # admitted this time
    assert check.key[1] == 2 and len(h.client_of(TransferReset)) == 1
    h.core.registry_checked(check.key, [], StaleVersionError("block 1 is stale"), h.now)
    h.pump()
    h.client.send_begin(begin(tid=2, layers=1, request="r2", blocks=(BlockVersion(block=b"i:1", version=3),)))
    h.pump()
    resets = h.client_of(TransferReset)
    assert [(r.transfer_id, r.code) for r in resets[1:]] == [(2, ErrorCode.STALE_VERSION)] * 2
    assert len(h.of(RegistryCheck)) == 1  # not checked again


# -- meta ----------------------------------------------------------------------------------


@pytest.mark.parametrize("meta", [
    '{"a":1}'.encode("utf-16"),  # JSON, but not in UTF-8 (json.loads of bytes guesses UTF-16)
    '{"a":1}'.encode("utf-32"),
    b'{"a":"\xed\xa0\x80"}',  # a surrogate encoded as if UTF-8: invalid UTF-8
    b"\xef\xbb\xbf{}",  # a byte order mark
    b'{"a":NaN}', b'{"a":Infinity}', b'{"a":-Infinity}',  # Python's constants, not JSON
    b'{"a":1e999}',  # beyond a double: it would read as infinity
    b'{"a":1' + b"0" * 400 + b'}', b'{"a":-1' + b"0" * 5000 + b'}',  # integers beyond a double too
    b'{"a":"\\ud800"}', b'{"\\udc00":1}', b'{"a":[{"b":"x\\udbff"}]}',  # lone surrogates
], ids=["utf16", "utf32", "encoded-surrogate", "bom", "nan", "infinity", "-infinity", "overflow",
        "int-overflow", "long-int", "lone-surrogate", "lone-surrogate-key", "nested-lone-surrogate"])
def test_meta_that_is_not_a_json_object_in_utf8_is_refused_with_protocol_error(meta: bytes) -> None:
    h = Harness()
    h.client.send_begin(begin(meta=meta))
    h.pump()
    [reset] = h.client_of(TransferReset)
    assert reset.code == ErrorCode.PROTOCOL_ERROR and "meta" in reset.message
    assert not h.of(TransferArrived) and h.core.counters["transfers_refused"] == 1


def test_meta_in_utf8_with_paired_surrogate_escapes_arrives_as_sent() -> None:
    h = Harness()
    h.client.send_begin(begin(meta='{"é":"ü","s":"\\ud83d\\ude00","x":1.5}'.encode()))
    h.pump()
    [arrived] = h.of(TransferArrived)
    assert arrived.meta == {"é": "ü", "s": "\U0001f600", "x": 1.5}


# -- codecs --------------------------------------------------------------------------------


@pytest.mark.parametrize("codec_id", [1, 16, 35])
def test_a_chunk_in_a_codec_not_accepted_fails_its_transfer_with_unsupported_codec(codec_id: int) -> None:
    h = Harness(ReceiverConfig(secret=SECRET, codecs=("raw",)))
    h.client.send_begin(begin())
    h.pump()
    h.send(chunk(codec_id=codec_id))
    [failed] = h.of(TransferFailed)
    assert failed.error.code == ErrorCode.UNSUPPORTED_CODEC
    # the RESET goes out before the ACK on the same connection
    kinds = [type(e) for e in h.client_events if isinstance(e, TransferReset | ChunkAcked)]
    assert kinds == [TransferReset, ChunkAcked]
    assert h.core.buffered_bytes == 0


# -- what a compressed chunk decompresses to ------------------------------------------------


def codec_store() -> tuple[ByteStore, list[int]]:
    """A store decoding every codec into float16 layers of ``head_dim`` 8, and the sizes
    its entropy stages were asked to decompress to."""
    sizes: list[int] = []

    def decode(c: Chunk, dest: memoryview) -> None:
        codec = codec_by_id(c.codec_id)
        if isinstance(codec, EntropyCodec):
            codec = _SpyEntropy(codec, sizes)
        out = np.frombuffer(dest, np.float16).reshape(c.token_count, HEADS, 8)
        codec.decode(c.params, c.payload_buffer, shape=out.shape, dtype="float16", kind=TensorKind(c.kind), out=out)

    return ByteStore(decode=decode), sizes


class _SpyEntropy(EntropyCodec):
    def __init__(self, real: EntropyCodec, sizes: list[int]) -> None:
        super().__init__(real.inner)
        self.real, self.sizes, self.method, self.id_bit = real, sizes, real.method, real.id_bit

    def _decompress(self, data: Any, size: int) -> bytes:
        self.sizes.append(size)
        return self.real._decompress(data, size)


def codec_chunk(name: str, kind: int, params: bytes, payload: bytes, count: int = 64) -> Chunk:
    return Chunk(transfer_id=1, layer=0, kind=kind, codec_id=get_codec(name).codec_id, token_start=0,
                 token_count=count, layer_tokens=count, params=params, payload=payload)


@pytest.mark.parametrize("name", ["int4+zstd", "int4+lz4"])
@pytest.mark.parametrize("kind", [0, 1])
@pytest.mark.parametrize("over", [0, 1])
def test_a_chunk_whose_payload_would_decompress_beyond_max_chunk_bytes_is_refused_unopened(
    name: str, kind: int, over: int,
) -> None:
    """int4 with groups of 1 holds 8.5 bytes an element (scale and minimum of every element,
    half a byte of code) against the 2 it decodes to: the decompressed size, not only the
    decoded one, is held to max_chunk_bytes before anything is decompressed."""
    shape = (64, HEADS, 8)
    n = shape[0] * shape[1] * shape[2]
    inner = 8 * n + n // 2  # int4, group 1: 8704 bytes for 2048 decoded
    zeros = bytes(inner)  # a valid int4 payload: every scale, minimum and code 0
    packed = zstandard.ZstdCompressor(level=19).compress(zeros) if name.endswith("zstd") else \
        bytes(lz4.block.compress(zeros, store_size=False))
    store, sizes = codec_store()
    h = Harness(ReceiverConfig(secret=SECRET, codecs=("raw", name), max_chunk_bytes=inner - over), store=store)
    h.client.send_begin(begin(layers=1, head_dim=8))
    h.pump()
    h.send(codec_chunk(name, kind, b"\x01\x01", packed))
    if over:
        [failed] = h.of(TransferFailed)
        assert failed.error.code == ErrorCode.LIMIT_EXCEEDED
        assert f"decompresses to {inner} bytes" in str(failed.error)
        assert sizes == []  # never opened
        assert h.core.buffered_bytes == 0
    else:
        assert not h.of(TransferFailed)
        assert sizes == [inner]


@pytest.mark.parametrize("name", ["int4+zstd", "int4+lz4", "int8+zstd", "raw+lz4"])
@pytest.mark.parametrize("kind", [0, 1])
def test_a_chunk_of_the_encoder_at_max_chunk_bytes_is_accepted(name: str, kind: int) -> None:
    """What kvwire's own encoders send (int4 groups of 32) decompresses to no more than it
    decodes to here, so a chunk of exactly max_chunk_bytes decoded is taken."""
    # four tokens repeated: every stage compresses it
    x = np.tile(np.random.default_rng(3).standard_normal((4, HEADS, 8)), (16, 1, 1)).astype(np.float16)
    enc = get_codec(name).encode(x, TensorKind(kind))
    assert enc.params[0] == 1  # compressed
    store, sizes = codec_store()
    h = Harness(ReceiverConfig(secret=SECRET, codecs=("raw", name), max_chunk_bytes=x.nbytes), store=store)
    h.client.send_begin(begin(layers=1, head_dim=8))
    h.pump()
    h.send(codec_chunk(name, kind, enc.params, bytes(memoryview(enc.payload).cast("B"))))
    assert not h.of(TransferFailed)
    assert len(sizes) == 1 and sizes[0] <= x.nbytes


# -- storage -------------------------------------------------------------------------------


class FlakyStore(ByteStore):
    """Fails the ``fail_at``-th allocate or decode call with ``exc``; counts decodes."""

    def __init__(self, fail_at: int, exc: BaseException) -> None:
        super().__init__()
        self.calls = 0
        self.decodes = 0
        self.fail_at = fail_at
        self.exc = exc

    def _maybe_fail(self) -> None:
        self.calls += 1
        if self.calls == self.fail_at:
            raise self.exc

    def allocate(self, key: Any, chunk: Chunk, nbytes: int) -> Any:
        self._maybe_fail()
        return super().allocate(key, chunk, nbytes)

    def decode(self, key: Any, chunk: Chunk, buffer: Any, offset: int, nbytes: int) -> None:
        self._maybe_fail()
        self.decodes += 1
        super().decode(key, chunk, buffer, offset, nbytes)


@settings(max_examples=60, deadline=None)
@given(fail_at=st.integers(1, 12), exc=st.sampled_from([MemoryError(), ValueError("bad"), OverflowError(),
                                                        RecursionError()]))
def test_a_storage_failure_leaves_the_chunk_unreceived_and_becomes_a_typed_error(
    fail_at: int, exc: BaseException,
) -> None:
    store = FlakyStore(fail_at, exc)
    h = Harness(ReceiverConfig(secret=SECRET, transfer_buffer_bytes=1 << 20), store=store)
    h.client.send_begin(begin(layers=2))
    h.pump()
    key = h.key
    taken = 0
    for layer in range(2):
        for kind in range(2):
            for start in (0, 4):
                if h.of(TransferFailed):
                    break
                c = chunk(layer=layer, kind=kind, start=start, count=4)
                h.send(c)
                for ev in h.of(LayerReady)[taken:]:
                    h.core.take_layer(key, ev.layer, h.now)
                    taken += 1
    failed = h.of(TransferFailed)
    if fail_at > store.calls:  # the failure point was never reached: all delivered
        assert not failed and taken == 2
        return
    [f] = failed
    assert isinstance(f.error, KvwireError)
    assert f.error.code in (ErrorCode.LIMIT_EXCEEDED, ErrorCode.PROTOCOL_ERROR)
    # the failing chunk was never marked received: no layer became ready after it
    assert taken == len(h.of(LayerReady)) <= 1
    assert h.core.buffered_bytes == 0
    # the sender learns it before the chunk's ACK
    events = [e for e in h.client_events if isinstance(e, TransferReset | ChunkAcked)]
    first_reset = next(i for i, e in enumerate(events) if isinstance(e, TransferReset))
    assert all(isinstance(e, ChunkAcked) for e in events[:first_reset])


def test_a_chunk_past_the_buffer_budget_fails_and_counts_a_refusal() -> None:
    # One layer (8 tokens of K and V) fills the budget: a second transfer's layer is past it.
    cfg = ReceiverConfig(secret=SECRET, max_buffer_bytes=2 * 8 * BPT, transfer_buffer_bytes=1 << 20)
    h = Harness(cfg)
    for tid in (1, 2):
        h.client.send_begin(begin(tid=tid, layers=2, request=f"r{tid}"))
    h.pump()
    h.send(chunk(tid=1, layer=0))
    h.send(chunk(tid=2, layer=0))
    [failed] = h.of(TransferFailed)
    assert failed.key[1] == 2 and failed.error.code == ErrorCode.LIMIT_EXCEEDED
    assert h.core.counters["buffer_budget_refusals"] == 1
    assert h.core.buffered_bytes - h.core.kept_bytes == 2 * 8 * BPT  # the first transfer's layer


@pytest.mark.parametrize("budget_layers", [1, 3])
def test_a_lone_transfer_is_granted_no_more_layers_than_the_budget_holds(budget_layers: int) -> None:
    """transfer_buffer_bytes above max_buffer_bytes (the default 256 MiB over a smaller
    budget) granted layers the server could not hold: a lone transfer whose application
    took its layers as they came failed with LIMIT_EXCEEDED instead of waiting for them
    to be taken (protocol.md 8.2: it stops at its window)."""
    layer = 2 * 8 * BPT
    cfg = ReceiverConfig(secret=SECRET, max_buffer_bytes=budget_layers * layer, transfer_buffer_bytes=256 << 20)
    h = Harness(cfg)
    h.client.send_begin(begin(layers=8))
    h.pump()
    h.send(chunk(layer=0))
    # (ACCEPT grants layer 0; a CREDIT the rest of the window, as far as the budget less
    # the eighth kept for first layers goes)
    budget = budget_layers * layer
    granted = 1 + max(0, budget - layer - budget // 8) // layer
    assert granted <= budget_layers
    assert max([1] + [c.layer_limit for c in h.client_of(CreditGranted)]) == granted
    for li in range(granted):
        h.send(chunk(layer=li, kind=1))
        if li:
            h.send(chunk(layer=li))
    assert not h.of(TransferFailed)
    assert h.core.buffered_bytes - h.core.kept_bytes == granted * layer


def test_the_budget_counts_what_the_store_allocates_for_a_layer() -> None:
    """A store whose smallest buffer is 64 KiB: layers of a few bytes each must be counted
    at 64 KiB, or a transfer of many tiny layers holds thousands of times the budget."""

    class Coarse(ByteStore):
        def footprint(self, nbytes: int) -> int:
            return max(nbytes, 64 * 1024)

    # (each layer also remembers the token range of its K chunk: its V is not sent)
    cfg = ReceiverConfig(secret=SECRET, max_buffer_bytes=(1 << 20) + 16 * RANGE_BYTES, transfer_buffer_bytes=256 << 20)
    h = Harness(cfg, store=Coarse())
    for tid in range(1, 41):  # transfers of one layer each, so no window stops them first
        h.client.send_begin(begin(tid=tid, layers=1, request=f"r{tid}"))
    h.pump()
    for tid in range(1, 41):
        h.send(chunk(tid=tid, layer=0, kind=0, count=1, tokens=1))
        if h.of(TransferFailed):
            break
    [failed] = h.of(TransferFailed)
    assert failed.error.code == ErrorCode.LIMIT_EXCEEDED
    assert tid == 17  # 16 layers of 64 KiB (and a range each) fill the budget
    assert h.core.counters["buffer_budget_refusals"] == 1
    assert h.core.buffered_bytes - h.core.kept_bytes == 16 * 64 * 1024
    # and a transfer's window is counted the same way: in transfer_buffer_bytes, and in
    # the whole budget (less the eighth kept for first layers) when that is smaller
    for tbb, window in ((256 * 1024, 4), (256 << 20, 14)):
        h2 = Harness(replace(cfg, transfer_buffer_bytes=tbb), store=Coarse())
        h2.client.send_begin(begin(layers=40))
        h2.pump()
        h2.send(chunk(layer=0, kind=0, count=1, tokens=1))
        assert h2.client_of(CreditGranted)[-1].layer_limit == window


def test_attach_grants_every_layer_and_keeps_them_out_of_the_budget() -> None:
    h = Harness()
    h.client.send_begin(begin(layers=4))
    h.pump()
    h.core.attach(h.key, h.now)
    h.pump()
    assert h.client_of(CreditGranted)[-1].layer_limit == 4
    for layer in range(4):
        h.send(chunk(layer=layer, kind=0))
        h.send(chunk(layer=layer, kind=1))
    assert h.core.buffered_bytes == 0
    assert sorted(e.layer for e in h.of(LayerReady)) == [0, 1, 2, 3]


def test_the_token_ranges_a_server_remembers_count_in_the_buffer_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Until a layer is complete the server remembers the token range of each of its chunks
    (up to 16384 per kind): one token per chunk over every granted layer would hold memory
    no budget counted.  Each range counts RANGE_BYTES until its layer is complete."""
    layer = 2 * 64 * BPT
    monkeypatch.setattr(receiver_module, "KEPT_ROOM_MIN", 0)  # the room past the budget: an eighth of it
    budget = 2 * layer + 40 * RANGE_BYTES
    h = Harness(ReceiverConfig(secret=SECRET, max_buffer_bytes=budget, transfer_buffer_bytes=1 << 20))
    h.client.send_begin(begin(layers=2))
    h.pump()
    for start in range(20):
        h.send(chunk(layer=0, kind=0, start=start, count=1, tokens=64))
    assert h.core.buffered_bytes == layer + 20 * RANGE_BYTES
    h.send(chunk(layer=0, kind=0, start=20, count=44, tokens=64))
    assert h.core.buffered_bytes == layer + 21 * RANGE_BYTES
    h.send(chunk(layer=0, kind=1, start=0, count=64, tokens=64))  # complete: its ranges are forgotten
    assert h.core.buffered_bytes == layer and [e.layer for e in h.of(LayerReady)] == [0]
    for start in range(64):
        h.send(chunk(layer=1, kind=0, start=start, count=1, tokens=64))
        if h.of(TransferFailed):
            break
    assert start == 40 + budget // 8 // RANGE_BYTES  # what the two layers leave, and the room past it
    [failed] = h.of(TransferFailed)
    assert failed.error.code == ErrorCode.LIMIT_EXCEEDED
    assert h.core.counters["buffer_budget_refusals"] == 1 and h.core.buffered_bytes == 0


def test_layers_that_fill_the_budget_exactly_still_leave_room_for_their_ranges() -> None:
    """A budget of exactly one layer granted one layer; its chunks' ranges, charged on top,
    then failed the transfer that fit before they were counted."""
    layer = 2 * 64 * BPT
    h = Harness(ReceiverConfig(secret=SECRET, max_buffer_bytes=layer, transfer_buffer_bytes=layer))
    h.client.send_begin(begin(layers=2, meta=b'{"a": 1}'))
    h.pump()
    for kind in (0, 1):
        for start in range(0, 64, 8):
            h.send(chunk(layer=0, kind=kind, start=start, count=8, tokens=64))
    assert not h.of(TransferFailed) and [e.layer for e in h.of(LayerReady)] == [0]
    assert h.core.buffered_bytes - h.core.kept_bytes == layer


def test_a_meta_padded_with_whitespace_is_charged_as_received() -> None:
    """b"{}" and 64 KiB of spaces parses to an empty dict, which was charged nothing while
    the server kept the 64 KiB."""
    padded = b"{}" + b" " * 65534
    assert begin_footprint(begin(meta=padded), parse_meta(padded)) >= len(padded)
    assert begin_footprint(begin(meta=b"{}"), {}) == 0


def blocks_of(n: int, first: int = 0) -> tuple[BlockVersion, ...]:
    """``n`` prefix blocks with keys of 255 bytes, the longest there are."""
    return tuple(BlockVersion(block=f"s:{i:0253d}".encode(), version=i) for i in range(first, first + n))


def test_a_begins_prefix_blocks_and_meta_count_in_the_buffer_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """A BEGIN may carry thousands of block keys and 64 KiB of meta, which the server keeps
    with the transfer until its last layer is taken: they count against max_buffer_bytes
    like its layers, and a BEGIN that would go beyond is refused with LIMIT_EXCEEDED."""
    blocks = blocks_of(500)
    meta = json.dumps({"x": [{}] * 500}).encode()  # parsed: an empty dict per 3 bytes of text
    cost = begin_footprint(begin(blocks=blocks, meta=meta), parse_meta(meta))
    assert cost >= 500 * (2 * 255 + BLOCK_ENTRY_BYTES) + len(meta) + 500 * sys.getsizeof({})
    layer = 2 * 8 * BPT
    monkeypatch.setattr(receiver_module, "KEPT_ROOM_MIN", 0)  # the room past the budget: an eighth of it
    h = Harness(ReceiverConfig(secret=SECRET, max_buffer_bytes=2 * cost + 2 * layer, transfer_buffer_bytes=1 << 20))
    for tid in (1, 2, 3):
        h.client.send_begin(begin(tid=tid, request=f"r{tid}", blocks=blocks, meta=meta))
    h.pump()
    assert [e.request_id for e in h.of(TransferArrived)] == ["r1", "r2"]
    arrived = h.of(TransferArrived)[0]
    assert arrived.blocks == tuple((b.block, b.version) for b in blocks) and arrived.meta == parse_meta(meta)
    [refused] = h.client_of(TransferReset)
    assert refused.transfer_id == 3 and refused.code == ErrorCode.LIMIT_EXCEEDED
    assert h.core.counters["buffer_budget_refusals"] == 1 and h.core.buffered_bytes == 2 * cost
    # The first completes and is taken: its blocks and meta leave the budget and the server.
    key = arrived.key
    h.core.claim(key, h.now)
    for layer_index in (0, 1):
        h.send(chunk(layer=layer_index, kind=0))
        h.send(chunk(layer=layer_index, kind=1))
        h.core.take_layer(key, layer_index, h.now)
        h.pump()
    assert h.core.buffered_bytes == cost
    [kept] = [t for t in h.core._sessions[key[0]].transfers.values() if t.key == key]
    assert kept.begin.blocks == () and kept.begin.meta == b"" and kept.meta == {}
    # The second fails: the same.
    h.core.abort(h.of(TransferArrived)[1].key, "test", h.now)
    h.pump()
    assert h.core.buffered_bytes == 0
    h.client.send_begin(begin(tid=4, request="r4", blocks=blocks, meta=meta))
    h.pump()
    assert h.of(TransferArrived)[-1].request_id == "r4" and h.core.buffered_bytes == cost


def test_a_transfer_without_blocks_or_meta_is_charged_only_its_layers() -> None:
    h = Harness()
    for tid, meta in ((1, b""), (2, b"{}")):
        h.client.send_begin(begin(tid=tid, request=f"r{tid}", meta=meta))
    h.pump()
    assert len(h.of(TransferArrived)) == 2 and h.core.buffered_bytes == 0


def test_a_long_request_id_and_model_count_in_the_buffer_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request id may be 65535 bytes and a model 255: past their first FREE_ID_BYTES
    together they are kept with the transfer, counted like its prefix blocks and meta, and
    a BEGIN that would go beyond the budget is refused with LIMIT_EXCEEDED."""
    long_id, model = "\u00e9" * 30000, "m" * 255  # 60000 bytes of UTF-8
    cost = begin_footprint(begin(request=long_id, model=model), {})
    assert cost == 60000 + 255 - receiver_module.FREE_ID_BYTES
    assert begin_footprint(begin(request="r" * 200, model="m" * 56), {}) == 0  # a usual id costs nothing
    monkeypatch.setattr(receiver_module, "KEPT_ROOM_MIN", 0)
    h = Harness(ReceiverConfig(secret=SECRET, max_buffer_bytes=2 * cost, transfer_buffer_bytes=1 << 20))
    for tid in (1, 2, 3):
        h.client.send_begin(begin(tid=tid, request=long_id + str(tid), model=model))
    h.pump()
    # Each id is one byte longer than ``cost`` counted; with the eighth past the budget, two fit.
    assert len(h.of(TransferArrived)) == 2 and h.core.buffered_bytes == 2 * (cost + 1)
    assert [(r.transfer_id, r.code) for r in h.client_of(TransferReset)] == [(3, ErrorCode.LIMIT_EXCEEDED)]
    for arrived in h.of(TransferArrived):
        h.core.abort(arrived.key, "test", h.now)
    h.pump()
    assert h.core.buffered_bytes == 0


# -- in-place receive ----------------------------------------------------------------------


def big_harness() -> tuple[Harness, CountingStore]:
    store = CountingStore()
    h = Harness(ReceiverConfig(secret=SECRET, transfer_buffer_bytes=1 << 30), store=store)
    h.client.send_begin(begin(layers=2))
    h.pump()
    h.send(chunk(layer=0, kind=0, start=0, count=BIG, tokens=2 * BIG))  # tells the layer size
    assert store.decodes == 1
    return h, store


def test_a_raw_payload_is_received_in_place() -> None:
    h, store = big_harness()
    c = chunk(layer=0, kind=1, start=0, count=BIG, tokens=2 * BIG)
    h.send(c, split_after(40))
    assert store.decodes == 1  # not copied by a decoder: it landed in its place
    half = 2 * BIG * BPT
    assert bytes(store.buffers[0][half : half + len(c.payload)]) == c.payload
    assert len(h.client_of(ChunkAcked)) == 2


@settings(max_examples=80, deadline=None)
@given(bit=st.integers(0, (40 + 26 + BIG * BPT + 4) * 8 - 1), cut=st.integers(20, 60))
def test_an_in_place_payload_changes_nothing_before_its_crc(bit: int, cut: int) -> None:
    h, _ = big_harness()
    key = h.key
    t = h.core._live[key]
    def seen() -> tuple[object, ...]:
        # (the connection the flip broke is dropped: counted, and an event to log; no more)
        counters = {k: v for k, v in h.core.counters.items() if k != "connections_dropped"}
        events = [e for e in h.events if not isinstance(e, ConnectionDropped)]
        return repr(t.state.__dict__), counters, h.core.buffered_bytes, len(events)

    before = seen()
    c = chunk(layer=0, kind=1, start=0, count=BIG, tokens=2 * BIG)

    def flip(data: bytes) -> list[bytes]:
        b = bytearray(data)
        if len(b) > 1000:  # the CHUNK frame
            b[bit // 8 % len(b)] ^= 1 << (bit % 8)
        return split_after(cut)(bytes(b))

    acks = len(h.client_of(ChunkAcked))
    h.send(c, flip)
    if h.client.state is State.OPEN and len(h.client_of(ChunkAcked)) > acks:
        # the flip was caught as harmless only if the chunk still verified: impossible,
        # every bit is covered by the CRC; so the chunk never counted
        pytest.fail("a corrupted chunk was acknowledged")
    assert seen() == before
    assert not t.inplace  # the broken connection's reservation is gone


def test_a_copy_stored_from_another_connection_evicts_an_in_place_reservation() -> None:
    h, store = big_harness()
    key = h.key
    t = h.core._live[key]
    c = chunk(layer=0, kind=1, start=0, count=BIG, tokens=2 * BIG)
    view = h.core._sink(1, replace(c, payload=b""), len(c.payload))
    assert view is not None and t.inplace
    # the verified copy arrives (as if on another stream); the reservation is dropped
    h.send(c)
    assert not t.inplace and store.decodes == 2


def kv_chunk(layer: int, start: int, count: int, tokens: int) -> Chunk:
    k, v = chunk(layer=layer, kind=0, start=start, count=count, tokens=tokens), chunk(
        layer=layer, kind=1, start=start, count=count, tokens=tokens)
    return replace(k, kind=KIND_KV, payload=k.payload + v.payload)


def test_a_kv_chunk_of_a_whole_layer_is_received_in_place() -> None:
    h, store = big_harness()
    h.send(chunk(layer=0, kind=0, start=BIG, count=BIG, tokens=2 * BIG))
    h.send(chunk(layer=0, kind=1, start=0, count=2 * BIG, tokens=2 * BIG))
    decodes = store.decodes
    c = kv_chunk(1, 0, 2 * BIG, 2 * BIG)
    h.send(c, split_after(40))
    assert store.decodes == decodes  # K and V lie together in the layer's buffer: read in place
    assert bytes(store.buffers[1]) == c.payload
    assert [e.layer for e in h.of(LayerReady)] == [0, 1]
    assert h.client_of(ChunkAcked)[-1].address == c.address


def test_a_kv_chunk_of_part_of_a_layer_is_received_in_place_in_both_places() -> None:
    """Its K and its V lie apart in the layer's buffer: the payload is read straight into
    the two (the store names them as a tuple of places), not decoded from a copy."""
    h, store = big_harness()
    tokens = 2 * BIG
    h.send(chunk(layer=0, kind=0, start=BIG, count=BIG, tokens=tokens))
    h.send(chunk(layer=0, kind=1, start=0, count=tokens, tokens=tokens))
    decodes = store.decodes
    first, second = kv_chunk(1, 0, BIG, tokens), kv_chunk(1, BIG, BIG, tokens)
    for c in (second, first):
        h.send(c, split_after(40))
    assert store.decodes == decodes
    half = tokens * BPT
    buf = bytes(store.buffers[1])
    n = BIG * BPT
    k = first.payload[:n] + second.payload[:n]
    v = first.payload[n:] + second.payload[n:]
    assert buf == k + v
    assert [e.layer for e in h.of(LayerReady)] == [0, 1] and len(buf) == 2 * half


def test_a_kv_chunk_overlapping_a_k_chunk_fails_its_transfer() -> None:
    h = Harness()
    h.client.send_begin(begin(layers=1))
    h.pump()
    h.send(chunk(layer=0, kind=0, start=0, count=4, tokens=8))
    h.send(kv_chunk(0, 0, 8, 8))
    [reset] = h.client_of(TransferReset)
    assert reset.code == ErrorCode.PROTOCOL_ERROR and "overlap" in reset.message
    assert len(h.client_of(ChunkAcked)) == 2  # the refused chunk's credit still comes back


# -- budget --------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["send", "take", "abort", "timeout"]), st.integers(0, 2)),
                max_size=30),
       st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=3, max_size=3))
def test_the_buffer_budget_returns_to_zero(actions: list[tuple[str, int]], extras: list[tuple[int, int]]) -> None:
    cfg = ReceiverConfig(secret=SECRET, transfer_buffer_bytes=1 << 20, transfer_timeout=50.0,
                         claim_timeout=None)
    h = Harness(cfg)
    for tid, (nblocks, nmeta) in enumerate(extras):  # prefix blocks and meta count too
        meta = json.dumps({f"k{i}": [i] for i in range(nmeta)}).encode()
        h.client.send_begin(begin(tid=tid + 1, layers=2, request=f"r{tid}", blocks=blocks_of(nblocks, 100 * tid),
                                  meta=meta))
    h.pump()
    keys = {e.request_id: e.key for e in h.of(TransferArrived)}
    sent: dict[int, int] = {0: 0, 1: 0, 2: 0}
    taken: set[tuple[int, int]] = set()
    for action, tid in actions:
        if h.client.state is not State.OPEN:
            break
        key = keys[f"r{tid}"]
        if action == "send" and sent[tid] < 4 and key in h.core._live:
            layer, kind = divmod(sent[tid], 2)
            h.send(chunk(tid=tid + 1, layer=layer, kind=kind))
            sent[tid] += 1
        elif action == "take":
            for ev in h.of(LayerReady):
                if ev.key == key and (tid, ev.layer) not in taken and key in h.core._live:
                    h.core.take_layer(key, ev.layer, h.now)
                    taken.add((tid, ev.layer))
        elif action == "abort":
            h.core.abort(key, "test", h.now)
            h.pump()
        assert h.core.buffered_bytes == sum(t.held for t in h.core._live.values())
    assert h.client.state is State.OPEN and len(keys) == 3
    for key in keys.values():
        for ev in h.of(LayerReady):
            if ev.key == key and key in h.core._live and ev.layer in h.core._live[key].buffers:
                h.core.take_layer(key, ev.layer, h.now)
    h.now = 100.0
    h.core.handle_timer(h.now)  # every unfinished transfer times out
    # Those nobody claimed stay to be claimed (failed), with their BEGIN's prefix blocks
    # and meta charged: the application claiming them gives that back too.
    for key in h.core.unclaimed():
        h.core.claim(key, h.now)
    assert h.core.buffered_bytes == 0 and h.core.failed_unclaimed == 0


# -- the registry gate and claims ----------------------------------------------------------


def gated(layers: int = 1, **config: Any) -> Harness:
    """A harness whose transfer (one block at version 3) the registry has let in."""
    h = Harness(ReceiverConfig(secret=SECRET, registry=True, transfer_buffer_bytes=1 << 20, **config))
    h.client.send_begin(begin(layers=layers, blocks=(BlockVersion(block=b"i:1", version=3),)))
    h.pump()
    h.core.registry_checked(h.of(RegistryCheck)[0].key, [], None, h.now)
    h.pump()
    return h


def test_the_last_layer_of_a_gated_transfer_waits_for_its_publish() -> None:
    h = Harness(ReceiverConfig(secret=SECRET, registry=True, transfer_buffer_bytes=1 << 20))
    h.client.send_begin(begin(layers=2, blocks=(BlockVersion(block=b"i:1", version=3),)))
    h.pump()
    [check] = h.of(RegistryCheck)
    assert not h.of(TransferArrived)  # handed out only once the registry agreed
    h.core.registry_checked(check.key, [], None, h.now)
    h.pump()
    assert h.of(TransferArrived)
    for layer in range(2):
        h.send(chunk(layer=layer, kind=0))
        h.send(chunk(layer=layer, kind=1))
    assert [e.layer for e in h.of(LayerReady)] == [0]
    assert len(h.client_of(ChunkAcked)) == 3  # the last ack waits too
    [publish] = h.of(RegistryPublish)
    h.core.registry_published(publish.key, None, h.now)
    h.pump()
    assert [e.layer for e in h.of(LayerReady)] == [0, 1]
    assert len(h.client_of(ChunkAcked)) == 4


def test_a_failed_publish_resets_before_the_last_ack() -> None:
    h = gated()
    h.send(chunk(layer=0, kind=0))
    h.send(chunk(layer=0, kind=1))
    from kvwire.errors import StaleVersionError

    h.core.registry_published(h.key, StaleVersionError("stale"), h.now)
    h.pump()
    tail = [type(e) for e in h.client_events if isinstance(e, TransferReset | ChunkAcked)][-2:]
    assert tail == [TransferReset, ChunkAcked]
    [failed] = h.of(TransferFailed)
    assert failed.request_id == "r" and not h.of(LayerReady)


@pytest.mark.parametrize("how", ["abort", "deadline"])
def test_a_transfer_failing_while_its_publish_runs_still_acks_the_held_chunk(how: str) -> None:
    """The last ack, held for the registry, goes out (after the RESET) when the transfer
    fails first: without it the stream's credit for that chunk would never come back."""
    h = gated(transfer_timeout=2.0)
    h.send(chunk(layer=0, kind=0))
    h.send(chunk(layer=0, kind=1))
    assert len(h.client_of(ChunkAcked)) == 1 and h.of(RegistryPublish)
    if how == "abort":
        h.core.abort(h.key, "the test gives up", h.now)
    else:
        h.now = 10.0
        h.core.handle_timer(h.now)
    h.pump()
    assert len(h.client_of(ChunkAcked)) == 2
    tail = [type(e) for e in h.client_events if isinstance(e, TransferReset | ChunkAcked)][-2:]
    assert tail == [TransferReset, ChunkAcked]
    assert h.of(TransferFailed)
    h.core.registry_published(h.key, None, h.now)  # the answer comes late: nothing more
    h.pump()
    assert len(h.client_of(ChunkAcked)) == 2 and not h.of(LayerReady)


def test_an_unclaimed_transfer_is_aborted_at_its_claim_deadline() -> None:
    h = Harness(ReceiverConfig(secret=SECRET, claim_timeout=5.0))
    h.client.send_begin(begin(layers=1))
    h.pump()
    h.send(chunk(layer=0, kind=0))
    h.send(chunk(layer=0, kind=1))
    assert h.core.get_timer() == pytest.approx(5.0)
    h.now = 5.0
    h.core.handle_timer(h.now)
    h.pump()
    assert h.core.counters["transfers_unclaimed"] == 1 and h.core.counters["transfers_aborted"] == 1
    [aborted] = h.of(TransferAborted)
    assert "not claimed" in aborted.reason and not aborted.by_peer
    assert h.core.buffered_bytes == 0


def test_unclaimed_lists_arrived_transfers_in_order_until_claimed_or_failed() -> None:
    h = Harness(ReceiverConfig(secret=SECRET, claim_timeout=5.0))
    for tid, request in ((1, "a"), (2, "b"), (3, "a")):
        h.client.send_begin(begin(tid=tid, layers=1, request=request))
    h.pump()
    sid = h.key[0]
    assert h.core.unclaimed() == [(sid, 1), (sid, 2), (sid, 3)]
    assert h.core.unclaimed("a") == [(sid, 1), (sid, 3)] and h.core.unclaimed("c") == []
    h.core.claim((sid, 1), h.now)
    assert h.core.unclaimed("a") == [(sid, 3)]
    h.core.abort((sid, 3), "gone", h.now)  # a failed transfer is no longer there to claim
    h.pump()
    assert h.core.unclaimed() == [(sid, 2)]
    h.now = 5.0  # dropped at its claim deadline
    h.core.handle_timer(h.now)
    h.pump()
    assert h.core.unclaimed() == []


# -- events the server logs ----------------------------------------------------------------


def test_a_wrong_secret_is_an_authentication_failure_event() -> None:
    h = Harness(secret=b"not-the-right-secret")
    [ev] = h.of(AuthenticationFailed)
    assert ev.cid == 1
    assert h.core.counters["authentication_failures"] == 1


def test_a_peer_reset_is_counted_and_reported() -> None:
    h = Harness()
    h.client.send_begin(begin())
    h.pump()
    h.client.send_reset(1, ErrorCode.CANCELLED, "x" * 1000)
    h.pump()
    [ev] = h.of(TransferAborted)
    assert ev.by_peer and len(ev.reason) <= 160
    assert h.core.counters["transfers_aborted_by_peer"] == 1


@pytest.mark.parametrize("code", [ErrorCode.NO_ERROR, 0x7777])
def test_a_peer_reset_with_no_error_or_an_unknown_code_fails_the_transfer_as_a_protocol_error(code: int) -> None:
    """NO_ERROR is no reason for a transfer to fail: it was failed with a plain
    KvwireError(NO_ERROR), and its later chunks answered with RESET(NO_ERROR)."""
    h = Harness()
    h.client.send_begin(begin())
    h.pump()
    # (as a peer of its own would: a kvwire Connection never puts NO_ERROR in a RESET)
    h.client._queue(Reset(transfer_id=1, code=code, message="why not"))
    h.pump()
    [failed] = h.of(TransferFailed)
    assert type(failed.error).__name__ == "ProtocolError" and failed.error.code == ErrorCode.PROTOCOL_ERROR
    h.send(chunk(layer=0, kind=0))
    [reset] = h.client_of(TransferReset)
    assert reset.code == ErrorCode.PROTOCOL_ERROR


def complete_transfer(claim: bool) -> Harness:
    h = Harness()
    h.client.send_begin(begin(layers=1))
    h.pump()
    if claim:
        h.core.claim(h.key, h.now)
    h.send(chunk(layer=0, kind=0))
    h.send(chunk(layer=0, kind=1))
    assert h.of(LayerReady) and not h.of(TransferFailed)
    return h


def test_a_peer_reset_of_a_complete_transfer_nobody_claimed_fails_it() -> None:
    """Every chunk arrived, then the sender's send() ended without success (cancelled) and
    it reset the transfer: the cache is not handed out later (a retry would make a second
    one, holding memory), only its failure, and the RESET is counted and reported as what
    failed it."""
    h = complete_transfer(claim=False)
    assert h.core.unclaimed() == [h.key] and h.core.buffered_bytes > 0
    h.client.send_reset(1, ErrorCode.CANCELLED, "sender aborted: CancelledError()")
    h.pump()
    [failed] = h.of(TransferFailed)
    assert failed.key == h.key and failed.error.code == ErrorCode.CANCELLED
    [ev] = h.of(TransferAborted)
    assert ev.by_peer and ev.key == h.key
    assert h.core.counters["transfers_aborted_by_peer"] == 1
    assert failed.claimable and h.core.unclaimed() == [h.key] and h.core.buffered_bytes == 0
    with pytest.raises(KvwireError):
        h.core.pop_layer(h.key, 0, h.now)
    h.core.claim(h.key, h.now)
    assert h.core.unclaimed() == [] and h.core.failed_unclaimed == 0


def test_a_peer_reset_of_a_complete_transfer_the_application_claimed_is_not_counted() -> None:
    """Too late to matter: the application holds the whole cache.  Nothing fails, so
    nothing is counted or reported as a transfer reset by the client."""
    h = complete_transfer(claim=True)
    h.client.send_reset(1, ErrorCode.CANCELLED, "sender aborted: CancelledError()")
    h.pump()
    assert not h.of(TransferFailed) and not h.of(TransferAborted)
    assert h.core.counters.get("transfers_aborted_by_peer", 0) == 0
    assert len(h.core.take_layer(h.key, 0, h.now)[0]) == 8 * BPT


def test_a_reconnected_stream_resumes_its_session() -> None:
    h = Harness(ReceiverConfig(secret=SECRET, resume_timeout=10.0))
    h.client.send_begin(begin())
    h.pump()
    sid = h.client.session_id
    h.core.receive_data(1, b"", h.now)  # the connection broke
    h.core.forget(1)
    assert h.core.get_timer() == pytest.approx(10.0)
    client, _ = join(h.core, 2, h.now, session_id=sid)
    assert client.state is State.OPEN
    while (ev := h.core.next_event()) is not None:
        h.events.append(ev)
    assert h.of(StreamResumed) and h.core.counters["resumes"] == 1
    assert h.core.sessions == 1


def test_a_connection_failing_right_after_auth_opens_no_session() -> None:
    """A frame read with AUTH fails the connection; it must not leave behind a session
    with no stream (never lost, never removed), or a few such connections fill
    max_sessions for good."""
    h = Harness(ReceiverConfig(secret=SECRET, max_sessions=2, resume_timeout=1.0))
    for cid in (2, 3, 4):
        client, events = join(h.core, cid, h.now, after_auth=frame_bytes(Ping(opaque=1)))
        assert client.state is not State.OPEN
        [closed] = [e for e in events if isinstance(e, ConnectionClosed)]
        assert closed.code == ErrorCode.PROTOCOL_ERROR
        h.core.forget(cid)
    assert h.core.sessions == 1  # the harness's own
    ok, _ = join(h.core, 5, h.now)
    assert ok.state is State.OPEN and h.core.sessions == 2


def test_a_join_failing_right_after_auth_leaves_the_live_stream_alone() -> None:
    h = Harness(ReceiverConfig(secret=SECRET, resume_timeout=1.0))
    h.client.send_begin(begin())
    h.pump()
    join(h.core, 2, h.now, session_id=h.client.session_id, after_auth=frame_bytes(Ping(opaque=1)))
    h.core.forget(2)
    h.pump()
    assert not h.client_of(ConnectionClosed) and h.client.state is State.OPEN
    h.send(chunk(layer=0, kind=0))  # the transfer goes on over the stream it had
    assert h.client_of(ChunkAcked)


@pytest.mark.parametrize("session_version", [1, PROTOCOL_VERSION])
@pytest.mark.parametrize("join_version", [1, PROTOCOL_VERSION])
@pytest.mark.parametrize("stream_index", [0, 1])
def test_a_join_speaking_another_version_than_its_session_is_refused_and_the_session_goes_on(
    session_version: int, join_version: int, stream_index: int,
) -> None:
    """Every stream of a session speaks one version (protocol.md 6.1): a join that does
    not is refused with UNSUPPORTED_VERSION, replaces no stream (stream_index 0 is the live
    one's) and leaves the session's transfers alone."""
    h = Harness(ReceiverConfig(secret=SECRET, resume_timeout=1.0), max_version=session_version)
    assert h.client.version == session_version
    h.client.send_begin(begin(layers=2))
    h.pump()
    h.send(chunk(layer=0, kind=0))
    second, events = join(h.core, 2, h.now, session_id=h.client.session_id, stream_index=stream_index,
                          max_version=join_version)
    h.pump()
    if join_version == session_version:
        assert second.state is State.OPEN
        return
    [closed] = [e for e in events if isinstance(e, ConnectionClosed)]
    assert closed.code == ErrorCode.UNSUPPORTED_VERSION and second.state is not State.OPEN
    h.core.forget(2)
    h.pump()
    assert not h.client_of(ConnectionClosed) and h.client.state is State.OPEN
    assert not h.of(TransferFailed) and h.core.sessions == 1
    h.send(chunk(layer=0, kind=1))  # the transfer completes its layer on the stream it had
    assert len(h.client_of(ChunkAcked)) == 2 and h.of(LayerReady)


def test_accept_goes_on_the_stream_that_carried_begin() -> None:
    """The spec: the server answers BEGIN on the stream that carried it (a client may wait
    on that stream alone, and the first stream may be half-open)."""
    h = Harness()
    h.core.connection_made(2, h.now)
    second = Connection(Role.CLIENT, ConnectionConfig(secret=SECRET, session_id=h.client.session_id,
                                                      stream_index=1), now=h.now)
    second.initiate()
    events: list[Event] = []

    def pump_second() -> None:
        for _ in range(4):
            for part in second.data_to_send():
                h.core.receive_data(2, bytes(part), h.now)
            data = h.core.data_to_send(2)
            if data:
                second.receive_data(data, h.now)
            events.extend(iter(second.next_event, None))
        h.pump()

    pump_second()
    assert second.state is State.OPEN
    second.send_begin(begin(tid=5))
    pump_second()
    assert [e.transfer_id for e in events if isinstance(e, TransferAccepted)] == [5]
    assert not h.client_of(TransferAccepted)


def test_a_transfer_failed_while_no_stream_was_open_is_reset_on_the_stream_that_joins() -> None:
    """The application gave the transfer up while the client was reconnecting: its RESET
    had no stream to go on.  A sender with every chunk acknowledged, waiting for a grant,
    sends nothing that would draw the RESET out: the stream that joins must carry it."""
    h = Harness(ReceiverConfig(secret=SECRET, resume_timeout=10.0))
    h.client.send_begin(begin(layers=2))
    h.pump()
    h.send(chunk(layer=0, kind=0))
    sid = h.client.session_id
    h.core.receive_data(1, b"", h.now)  # the connection broke
    h.core.forget(1)
    h.core.abort(h.key, "the application gave up", h.now)  # no stream to tell
    client, events = join(h.core, 2, h.now, session_id=sid)
    assert client.state is State.OPEN
    [reset] = [e for e in events if isinstance(e, TransferReset)]
    assert reset.transfer_id == 1 and reset.code == ErrorCode.CANCELLED


def test_a_bug_in_a_hook_closes_the_connection_with_internal_error_and_is_reported() -> None:
    class Broken(ByteStore):
        def opened(self, key: Any, spec: KVSpec) -> None:
            raise RuntimeError("bug")

    h = Harness(store=Broken())
    h.client.send_begin(begin())
    h.pump()
    [ev] = h.of(InternalError)
    assert isinstance(ev.error, RuntimeError) and ev.cid == 1
    [closed] = h.client_of(ConnectionClosed)
    assert closed.code == ErrorCode.INTERNAL_ERROR


# -- the deadline heap ---------------------------------------------------------------------


def every_deadline(core: ReceiverCore) -> float | None:
    """get_timer() by brute force: every connection, session and transfer scanned."""
    times = [c.get_timer() for c in core._conns.values()]
    times += [s.lose_at for s in core._sessions.values()]
    for t in core._live.values():
        times += [t.deadline, None if t.claimed else t.claim_deadline]
    times += [f.claim_deadline for f in core._failed.values()]  # failed, kept to be claimed
    real = [x for x in times if x is not None]
    return min(real) if real else None


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["begin", "send", "claim", "wait", "break"]), st.floats(0, 20)),
                max_size=25))
def test_get_timer_is_the_earliest_deadline_of_all(actions: list[tuple[str, float]]) -> None:
    cfg = ReceiverConfig(secret=SECRET, idle_timeout=8.0, transfer_timeout=30.0, claim_timeout=12.0,
                         resume_timeout=5.0, transfer_buffer_bytes=1 << 20)
    h = Harness(cfg)
    tid = 0
    sent: dict[int, int] = {}
    for action, amount in actions:
        if action == "begin" and h.client.state is State.OPEN:
            tid += 1
            h.client.send_begin(begin(tid=tid, layers=1, request=f"r{tid}"))
            sent[tid] = 0
        elif action == "send" and sent and h.client.state is State.OPEN:
            t = max(sent)
            if sent[t] < 2 and any(e.key[1] == t for e in h.of(TransferArrived)):
                h.send(chunk(tid=t, layer=0, kind=sent[t]))
                sent[t] += 1
        elif action == "claim":
            for ev in h.of(TransferArrived):
                h.core.claim(ev.key, h.now)
        elif action == "wait":
            h.now += amount
            h.core.handle_timer(h.now)
        elif action == "break" and 1 in h.core.connections:
            h.core.receive_data(1, b"", h.now)
            h.core.forget(1)
        if 1 in h.core.connections:
            h.pump()
        assert h.core.get_timer() == every_deadline(h.core)
        when = h.core.get_timer()
        assert action != "wait" or when is None or when > h.now  # nothing due is left behind


# -- deadlines -----------------------------------------------------------------------------


@pytest.mark.parametrize("end", ["reset by the client", "completed and taken"])
def test_transfers_that_ended_leave_no_deadline_behind(end: str) -> None:
    """A transfer's deadlines (transfer_timeout, claim_timeout: minutes) stay in the
    server's timer heap only while it lives: a client opening and ending transfers as fast
    as it can does not grow the server's memory outside its buffer budget."""
    h = Harness()
    n = 6 * receiver_module.TIMERS_COMPACT_MIN
    for tid in range(1, n + 1):
        h.client.send_begin(begin(tid, layers=1, request=f"r{tid}"))
        h.pump()
        key = h.of(TransferArrived)[-1].key
        if end == "reset by the client":
            h.client.send_reset(tid, ErrorCode.CANCELLED, "sender aborted")
            h.pump()
            h.core.claim(key, h.now)  # (the application takes it, failed: it ended)
        else:
            h.core.claim(key, h.now)
            h.send(chunk(tid, layer=0, kind=0))
            h.send(chunk(tid, layer=0, kind=1))
            h.core.pop_layer(key, 0, h.now)
        h.events.clear()
    # Entries of ended transfers are dropped as the heap grows: it stays within twice the
    # deadlines alive at its last compaction (here one connection's) or its first size.
    assert not h.core._live
    assert len(h.core._timer_at) <= len(h.core._timers) <= receiver_module.TIMERS_COMPACT_MIN
    # Deadlines still work: one more transfer, claimed and never completed, times out.
    h.client.send_begin(begin(n + 1, layers=1, request="late"))
    h.pump()
    h.core.claim(h.of(TransferArrived)[-1].key, h.now)
    h.now = h.core.get_timer() or 0.0
    while h.now < 1e6 and not h.of(TransferFailed):
        h.core.handle_timer(h.now)
        h.pump()
        h.now = h.core.get_timer() or 1e6
    [failed] = h.of(TransferFailed)
    assert failed.error.code == ErrorCode.TIMEOUT, failed.error


def test_a_begin_repeating_a_completed_transfer_is_answered_alike_before_and_after_its_data_is_gone() -> None:
    """A re-sent BEGIN (same id, same request id) of a transfer that completed and was
    taken gets ACCEPT, also once a later BEGIN made the server forget all but its id and
    a digest of its request id; the id with another request id is a duplicate."""
    h = complete_transfer(claim=True)
    key = h.key
    h.core.pop_layer(key, 0, h.now)
    answers = []
    for _ in range(2):
        h.client_events.clear()
        h.client.send_begin(begin(1, layers=1, request="r"))
        h.pump()
        answers.append([type(e).__name__ for e in h.client_events])
        h.client.send_begin(begin(len(answers) + 1, layers=1, request=f"later{len(answers)}"))  # forgets transfer 1's data
        h.pump()
    assert answers == [["TransferAccepted"], ["TransferAccepted"]]
    h.client_events.clear()
    h.client.send_begin(begin(1, layers=1, request="another"))
    h.pump()
    [reset] = h.client_of(TransferReset)
    assert reset.code == ErrorCode.DUPLICATE_TRANSFER
