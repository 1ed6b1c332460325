"""Literal-bytes round trips of every frame, and the decoder fed in every split."""

from __future__ import annotations

import contextlib
import itertools
import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.errors import FrameTooLargeError, IntegrityError, ProtocolError
from kvwire.wire import (
    Accept,
    Ack,
    Auth,
    Begin,
    BlockVersion,
    Challenge,
    Chunk,
    Credit,
    DecodeCost,
    Frame,
    FrameDecoder,
    GoAway,
    Hello,
    Ping,
    Pong,
    Report,
    Reset,
    UnknownFrame,
    Welcome,
    frame_bytes,
)
from kvwire.wire.crc import crc32c
from kvwire.wire.frames import (
    CHECK_AS_WRITTEN,
    CHUNK_FIXED,
    CRC,
    CRC_SIZE,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    WRITE_WHOLE,
    ByteRanges,
    CheckedPayload,
    FrameType,
    _frame,
    encode_body,
    encode_chunk_checked_as_written,
    plain_parts,
)

SAMPLES = [
    Hello(min_version=1, max_version=1, nonce=bytes(range(32)), session_id=bytes(16), stream_index=3,
          max_frame_size=1 << 22, codecs=("raw", "fp8"), fingerprint=b"F" * 16),
    Challenge(version=1, nonce=b"\x01" * 32),
    Auth(proof=b"\x02" * 32),
    Welcome(session_id=b"S" * 16, max_frame_size=1 << 22, window=1 << 25, max_transfers=64,
            codecs=("raw",), proof=b"\x03" * 32),
    Begin(transfer_id=7, num_layers=32, num_kv_heads=8, head_dim=128, dtype_id=1, model="llama",
          request_id="req-1", meta=b'{"a":1}', blocks=(BlockVersion(block=b"i12", version=3),)),
    Accept(transfer_id=7, layer_limit=8),
    Chunk(transfer_id=7, layer=2, kind=1, codec_id=0, token_start=512, token_count=256,
          layer_tokens=1024, params=b"pp", payload=b"\xaa" * 100),
    Ack(transfer_id=7, layer=2, kind=1, token_start=512),
    Chunk(transfer_id=7, layer=3, kind=2, codec_id=0, token_start=0, token_count=4,
          layer_tokens=4, params=b"", payload=b"\x0b" * 64),
    Ack(transfer_id=7, layer=3, kind=2, token_start=0),
    Credit(transfer_id=7, layer_limit=16),
    Reset(transfer_id=7, code=9, message="stale"),
    Report(transport_ns_per_mib=314_573, decode=(DecodeCost(codec_id=1, ns_per_melem=209_715),
                                                 DecodeCost(codec_id=3, ns_per_melem=0xFFFFFFFF))),
    Report(transport_ns_per_mib=0),
    Ping(opaque=42),
    Pong(opaque=42),
    GoAway(code=4, message="authentication failed"),
]


def _normalise(frame: object) -> object:
    if isinstance(frame, Chunk):
        return (frame.address, frame.codec_id, frame.token_count, frame.layer_tokens, frame.params, bytes(frame.payload))
    return frame


def test_literal_ack_bytes() -> None:
    # type 0x13, flags 0, reserved 0, length 16; then the body and CRC32C(header+body)
    raw = frame_bytes(Ack(transfer_id=1, layer=2, kind=1, token_start=3))
    assert raw[:8] == bytes.fromhex("1300000000000010")
    assert raw[8:24] == bytes.fromhex("0000000000000001" "0002" "01" "00" "00000003")
    import crc32c

    assert raw[24:] == crc32c.crc32c(raw[:24]).to_bytes(4, "big")


def test_literal_report_bytes() -> None:
    # docs/protocol.md 4.10: u32 transport_ns, u8 count, then (u8 codec_id, u32 decode_ns) each
    raw = frame_bytes(Report(transport_ns_per_mib=0x01020304, decode=(DecodeCost(codec_id=2, ns_per_melem=7),)))
    assert raw[:8] == bytes.fromhex("160000000000000a")  # type 0x16, flags 0, reserved 0, length 10
    assert raw[8:18] == bytes.fromhex("01020304" "01" "02" "00000007")
    import crc32c

    assert raw[18:] == crc32c.crc32c(raw[:18]).to_bytes(4, "big")


@pytest.mark.parametrize("body, why", [
    (bytes.fromhex("00000001" "02" "01 00000005" "01 00000006".replace(" ", "")), "twice"),
    (bytes.fromhex("00000001" "02" "0100000005"), "truncated"),
    (bytes.fromhex("00000001" "00" "ff"), "trailing"),
    (bytes.fromhex("000001"), "truncated"),
])
def test_malformed_report_is_a_protocol_error(body: bytes, why: str) -> None:
    raw = b"".join(bytes(p) for p in _frame(FrameType.REPORT, [body]))
    with pytest.raises(ProtocolError, match=why):
        FrameDecoder(1 << 20).feed(raw)


def test_report_fields_are_checked_when_encoded() -> None:
    with pytest.raises(ProtocolError, match="twice"):
        frame_bytes(Report(transport_ns_per_mib=1, decode=(DecodeCost(codec_id=1, ns_per_melem=1),) * 2))
    with pytest.raises(ProtocolError, match="range"):
        frame_bytes(Report(transport_ns_per_mib=1 << 32))
    with pytest.raises(ProtocolError, match="range"):
        frame_bytes(Report(transport_ns_per_mib=1, decode=(DecodeCost(codec_id=256, ns_per_melem=1),)))


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 0xFFFFFFFF),
       st.dictionaries(st.integers(0, 255), st.integers(0, 0xFFFFFFFF), max_size=40))
def test_any_report_round_trips(transport: int, decode: dict[int, int]) -> None:
    report = Report(transport_ns_per_mib=transport,
                    decode=tuple(DecodeCost(codec_id=c, ns_per_melem=v) for c, v in decode.items()))
    raw = frame_bytes(report)
    assert len(raw) == 8 + 5 + 5 * len(decode) + 4
    [(got, size)] = FrameDecoder(1 << 20).feed(raw)
    assert got == report and size == len(raw)


def test_literal_hello_starts_with_magic() -> None:
    raw = frame_bytes(SAMPLES[0])
    assert raw[0] == 0x01 and raw[8:16] == MAGIC


@pytest.mark.parametrize("frame", SAMPLES, ids=lambda f: type(f).__name__)
def test_round_trip_whole_and_bytewise(frame: object) -> None:
    raw = frame_bytes(frame)  # type: ignore[arg-type]
    dec = FrameDecoder(1 << 20)
    [(got, size)] = dec.feed(raw)
    assert size == len(raw)
    assert _normalise(got) == _normalise(frame)
    dec2 = FrameDecoder(1 << 20)
    out = []
    for i in range(len(raw)):
        out += dec2.feed(raw[i : i + 1])
    assert [_normalise(f) for f, _ in out] == [_normalise(frame)]
    # trailing data stays buffered for the next frame
    dec3 = FrameDecoder(1 << 20)
    assert len(dec3.feed(raw + raw[:5])) == 1
    assert dec3.buffered == 5


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_split_yields_the_same_frames(data: st.DataObject) -> None:
    frames = data.draw(st.lists(st.sampled_from(SAMPLES), min_size=1, max_size=8))
    big = Chunk(transfer_id=1, layer=0, kind=0, codec_id=0, token_start=0, token_count=1,
                layer_tokens=1, params=b"", payload=bytes(range(256)) * 600)
    if data.draw(st.booleans()):
        frames.append(big)
    stream = b"".join(frame_bytes(f) for f in frames)  # type: ignore[arg-type]
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=20)))
    dec = FrameDecoder(1 << 20, big_body=1024)
    got = []
    prev = 0
    for c in [*cuts, len(stream)]:
        got += dec.feed(stream[prev:c])
        prev = c
    assert [_normalise(f) for f, _ in got] == [_normalise(f) for f in frames]
    assert dec.buffered == 0


def test_huge_length_refused_before_buffering() -> None:
    dec = FrameDecoder(1 << 20)
    with pytest.raises(FrameTooLargeError):
        dec.feed(HEADER.pack(0x12, 0, 0, 0xFFFFFFFF))
    assert dec.buffered <= 8


def test_every_single_bit_flip_is_caught() -> None:
    raw = bytearray(frame_bytes(SAMPLES[6]))
    for bit in range(len(raw) * 8):
        flipped = bytearray(raw)
        flipped[bit // 8] ^= 1 << (bit % 8)
        dec = FrameDecoder(1 << 20)
        try:
            frames = dec.feed(bytes(flipped))
        except ProtocolError:
            continue
        # A flip in the length field can make the decoder wait for more bytes: never a
        # silently different frame.
        assert frames == [], f"bit {bit} flipped and a frame was still delivered"


def test_crc_error_is_an_integrity_error() -> None:
    raw = bytearray(frame_bytes(SAMPLES[7]))
    raw[10] ^= 0x40
    with pytest.raises(IntegrityError):
        FrameDecoder(1 << 20).feed(bytes(raw))


def test_unknown_frame_type_is_an_event_not_a_crash() -> None:
    import crc32c

    body = b"hello"
    header = HEADER.pack(0x7E, 0, 0, len(body))
    raw = header + body + crc32c.crc32c(header + body).to_bytes(4, "big")
    [(frame, _)] = FrameDecoder(1024).feed(raw)
    assert frame == UnknownFrame(type=0x7E, flags=0, body=b"hello")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_random_bytes_raise_only_protocol_error(blob: bytes) -> None:
    dec = FrameDecoder(4096)
    with contextlib.suppress(ProtocolError):
        dec.feed(blob)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(SAMPLES), st.data())
def test_random_bodies_with_valid_crc_raise_only_protocol_error(frame: object, data: st.DataObject) -> None:
    import crc32c

    raw = frame_bytes(frame)  # type: ignore[arg-type]
    body = bytearray(raw[8:-4])
    for _ in range(data.draw(st.integers(1, 4))):
        if body:
            body[data.draw(st.integers(0, len(body) - 1))] = data.draw(st.integers(0, 255))
    body = body[: data.draw(st.integers(0, len(body)))]
    header = HEADER.pack(raw[0], 0, 0, len(body))
    crc = crc32c.crc32c(bytes(body), crc32c.crc32c(header))
    with contextlib.suppress(ProtocolError):
        FrameDecoder(1 << 20).feed(header + bytes(body) + crc.to_bytes(4, "big"))


def test_random_streams_of_valid_frames() -> None:
    rng = random.Random(5)
    frames = [rng.choice(SAMPLES) for _ in range(200)]
    stream = b"".join(frame_bytes(f) for f in frames)  # type: ignore[arg-type]
    dec = FrameDecoder(1 << 20)
    got = []
    pos = 0
    while pos < len(stream):
        n = rng.randint(1, 300)
        got += dec.feed(stream[pos : pos + n])
        pos += n
    assert len(got) == 200


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_recv_into_path_yields_the_same_frames(data: st.DataObject) -> None:
    """get_buffer()/buffer_updated() (reads straight into frame buffers) == feed()."""
    frames = data.draw(st.lists(st.sampled_from(SAMPLES), min_size=1, max_size=6))
    big = Chunk(transfer_id=1, layer=0, kind=0, codec_id=0, token_start=0, token_count=1,
                layer_tokens=1, params=b"", payload=bytes(range(256)) * 700)
    if data.draw(st.booleans()):
        frames.insert(data.draw(st.integers(0, len(frames))), big)
    stream = memoryview(b"".join(frame_bytes(f) for f in frames))  # type: ignore[arg-type]
    dec = FrameDecoder(1 << 20, big_body=1024, scratch_size=4096)
    got = []
    pos = 0
    quiet_until = 0  # the decoder promised that no frame completes before this offset
    while pos < len(stream):
        remaining = dec.payload_remaining
        assert pos + remaining <= len(stream)  # never more than the sender committed to
        quiet_until = max(quiet_until, pos + remaining)
        buf = dec.get_buffer()
        n = min(len(buf), len(stream) - pos, data.draw(st.integers(1, 70_000)))
        buf[:n] = stream[pos : pos + n]
        pos += n
        done = dec.buffer_updated(n)
        assert not done or pos > quiet_until
        got += done
    assert [_normalise(f) for f, _ in got] == [_normalise(f) for f in frames]
    assert dec.buffered == 0 and dec.bytes_received == len(stream) and dec.payload_remaining == 0


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 100_000 + 40), st.integers(1, 70_000))
def test_a_flipped_bit_read_in_place_is_an_integrity_error(at: int, step: int) -> None:
    """The CRC of a payload read straight into its buffer is kept up read by read: a bit
    flipped anywhere in the frame, read in steps of any size, is still caught."""
    chunk = Chunk(transfer_id=3, layer=0, kind=0, codec_id=0, token_start=0, token_count=1,
                  layer_tokens=1, params=b"pp", payload=bytes(range(250)) * 400)
    raw = bytearray(frame_bytes(chunk))
    raw[at % len(raw)] ^= 0x04
    dec = FrameDecoder(1 << 20, big_body=1024, payload_sink=lambda head, size: memoryview(bytearray(size)))
    got = []
    with contextlib.suppress(ProtocolError):  # IntegrityError, or a header field that no longer fits
        pos = 0
        while pos < len(raw):
            buf = dec.get_buffer()
            n = min(len(buf), len(raw) - pos, step)
            buf[:n] = raw[pos : pos + n]
            pos += n
            got += dec.buffer_updated(n)
    assert got == []  # refused, or (a longer length) still waiting: never delivered


def _read_in_steps(dec: FrameDecoder, stream: memoryview, rng: random.Random, most: int,
                   got: list[tuple[Frame, int]], *, start_deferred: bool = False) -> None:
    """Feed ``stream`` through get_buffer/buffer_updated in random reads of at most
    ``most`` bytes, appending the frames to ``got`` as each read returns them; with
    ``start_deferred``, a chunk behind them is started after each read, as a receiver does."""
    pos = 0
    while pos < len(stream):
        buf = dec.get_buffer()
        n = min(len(buf), len(stream) - pos, rng.randint(1, most))
        buf[:n] = stream[pos : pos + n]
        pos += n
        got += dec.buffer_updated(n)
        if start_deferred:
            got += dec.start_deferred()


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_payload_sink_receives_big_chunk_payloads_in_place(data: st.DataObject) -> None:
    plen = data.draw(st.integers(0, 8))
    payload = bytes([data.draw(st.integers(0, 255))]) * 70_000
    chunk = Chunk(transfer_id=3, layer=1, kind=1, codec_id=0, token_start=64, token_count=8,
                  layer_tokens=128, params=b"p" * plen, payload=payload)
    frames = [SAMPLES[7], chunk, SAMPLES[10]]
    stream = memoryview(b"".join(frame_bytes(f) for f in frames))  # type: ignore[arg-type]
    sinks: list[memoryview] = []

    def sink(head: Chunk, size: int) -> memoryview:
        assert head.address == chunk.address and head.params == chunk.params and len(head.payload) == 0
        sinks.append(memoryview(bytearray(size)))
        return sinks[-1]

    dec = FrameDecoder(1 << 20, big_body=1024, scratch_size=data.draw(st.integers(16, 5000)), payload_sink=sink)
    got: list[tuple[Frame, int]] = []
    _read_in_steps(dec, stream, random.Random(data.draw(st.integers(0, 2**32))), 90_000, got,
                   start_deferred=data.draw(st.booleans()))
    assert [_normalise(f) for f, _ in got] == [_normalise(f) for f in frames]
    [sunk] = sinks
    assert got[1][0].payload is sunk and bytes(sunk) == payload  # type: ignore[union-attr]


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_payload_sink_is_asked_only_after_the_frames_before_are_handed_over(data: st.DataObject) -> None:
    """The sink decides from what the receiver has processed (the first chunk of a transfer
    tells it the layer's size), so it is never asked about a chunk while a frame before it
    sits completed but not yet returned; nothing waits for bytes that already arrived."""
    frames: list[Frame] = []
    for i in range(data.draw(st.integers(2, 6))):
        if data.draw(st.booleans()):
            frames.append(SAMPLES[data.draw(st.sampled_from([7, 10]))])  # type: ignore[arg-type]
        else:
            n = data.draw(st.sampled_from([1, 200, 2000, 6000]))
            frames.append(Chunk(transfer_id=3, layer=i, kind=0, codec_id=0, token_start=0, token_count=n,
                                layer_tokens=n, params=b"", payload=bytes([i]) * (16 * n)))
    stream = memoryview(b"".join(frame_bytes(f) for f in frames))
    got: list[tuple[Frame, int]] = []
    asked: list[int] = []

    def sink(head: Chunk, size: int) -> memoryview:
        index = next(i for i, f in enumerate(frames) if isinstance(f, Chunk) and f.layer == head.layer)
        assert len(got) == index  # every frame before it was returned, none after
        asked.append(index)
        return memoryview(bytearray(size))

    dec = FrameDecoder(1 << 20, big_body=1024, scratch_size=data.draw(st.integers(16, 5000)), payload_sink=sink)
    _read_in_steps(dec, stream, random.Random(data.draw(st.integers(0, 2**32))), 40_000, got,
                   start_deferred=data.draw(st.booleans()))
    assert [_normalise(f) for f, _ in got] == [_normalise(f) for f in frames]
    assert dec.buffered == 0 and dec.payload_remaining == 0
    assert asked == sorted(set(asked))


def _read_all(dec: FrameDecoder, stream: memoryview, got: list[Frame], *, start_deferred: bool) -> list[int]:
    """Read ``stream`` as a receiver does (each read as large as the buffer handed out),
    appending the frames to ``got``; the size of each read."""
    reads: list[int] = []
    pos = 0
    while pos < len(stream):
        buf = dec.get_buffer()
        n = min(len(buf), len(stream) - pos)
        buf[:n] = stream[pos : pos + n]
        pos += n
        reads.append(n)
        got += [f for f, _ in dec.buffer_updated(n)]
        if start_deferred:
            got += [f for f, _ in dec.start_deferred()]
    return reads


def test_a_chunk_behind_a_completed_frame_still_lands_in_the_sink() -> None:
    """Read in 16 KiB pieces, the first chunk's end and the next one's head arrive together:
    the next chunk waits in the buffer until the first is returned, then its payload goes
    to the sink's buffer (not to a private copy)."""
    first = Chunk(transfer_id=3, layer=0, kind=0, codec_id=0, token_start=0, token_count=4096,
                  layer_tokens=4096, params=b"", payload=b"\x01" * 65536)
    second = Chunk(transfer_id=3, layer=1, kind=0, codec_id=0, token_start=0, token_count=65536,
                   layer_tokens=65536, params=b"", payload=b"\x02" * 1048576)
    stream = memoryview(frame_bytes(first) + frame_bytes(second))
    returned: list[Frame] = []
    sunk: list[memoryview] = []

    def sink(head: Chunk, size: int) -> memoryview | None:
        if head.layer == 0 or not returned:
            return None  # what a receiver says before it knows the layer size
        sunk.append(memoryview(bytearray(size)))
        return sunk[-1]

    dec = FrameDecoder(8 << 20, scratch_size=16 * 1024, payload_sink=sink)
    _read_all(dec, stream, returned, start_deferred=False)
    assert [f.layer for f in returned] == [0, 1]  # type: ignore[union-attr]
    assert len(sunk) == 1 and returned[1].payload is sunk[0]  # type: ignore[union-attr]


def test_after_a_payload_the_next_chunk_head_is_read_alone_and_its_payload_lands_in_place() -> None:
    """As a receiver reads (whatever is there, up to the buffer's size): once a payload is
    in, the next read is its CRC and the next CHUNK's head only; start_deferred() then asks
    the sink, and that chunk's payload is read straight into its place, whole.  No byte of
    it passes through scratch (to be copied later), and a chunk costs two reads."""
    chunks = [Chunk(transfer_id=3, layer=i, kind=0, codec_id=0, token_start=0, token_count=4096,
                    layer_tokens=4096, params=b"", payload=bytes([i + 1]) * 65536) for i in range(3)]
    stream = memoryview(b"".join(frame_bytes(c) for c in chunks))
    sunk: list[memoryview] = []

    def sink(head: Chunk, size: int) -> memoryview:
        sunk.append(memoryview(bytearray(size)))
        return sunk[-1]

    dec = FrameDecoder(8 << 20, scratch_size=16 * 1024, payload_sink=sink)
    got: list[Frame] = []
    reads = _read_all(dec, stream, got, start_deferred=True)
    head = HEADER_SIZE + CHUNK_FIXED.size
    # The first chunk's head comes with 16 KiB of scratch; after that: CRC + head, payload.
    assert reads == [16 * 1024, 65536 + head - 16 * 1024, CRC_SIZE + head, 65536, CRC_SIZE + head, 65536, CRC_SIZE]
    assert got == chunks
    assert len(sunk) == 3 and all(f.payload is view for f, view in zip(got, sunk, strict=True))  # type: ignore[union-attr]
    assert dec.start_deferred() == [] and dec.buffered == 0


@pytest.mark.parametrize("crc_ok", [True, False])
def test_a_large_chunk_with_an_impossible_params_length_is_judged_by_its_crc(crc_ok: bool) -> None:
    """A CHUNK read in stages whose params are longer than its body: the rest of the body
    goes to scratch (never to the payload sink), and the CRC decides what it was: valid, a
    peer breaking the protocol (PROTOCOL_ERROR, final, as for a small frame); not, line
    noise (INTEGRITY_ERROR).  Arrived behind a PING, its head waits to be started."""
    body = CHUNK_FIXED.pack(3, 0, 0, 0, 0, 1, 1, 65535)  # params of 65535 bytes...
    body += bytes(2000 - len(body))  # ...in a body of 2000
    header = HEADER.pack(FrameType.CHUNK, 0, 0, len(body))
    crc = crc32c(body, crc32c(header)) ^ (0 if crc_ok else 1)
    frame = header + body + CRC.pack(crc)
    sunk: list[int] = []

    def sink(head: Chunk, size: int) -> memoryview:
        sunk.append(size)
        return memoryview(bytearray(size))

    dec = FrameDecoder(1 << 20, big_body=1024, payload_sink=sink)
    got = dec.feed(frame_bytes(Ping(opaque=1)) + frame[:HEADER_SIZE + CHUNK_FIXED.size])
    assert [f for f, _ in got] == [Ping(opaque=1)]  # the chunk waits behind it
    assert dec.start_deferred() == []
    with pytest.raises(ProtocolError if crc_ok else IntegrityError, match="params longer than its body" if crc_ok else "CRC"):
        dec.feed(frame[HEADER_SIZE + CHUNK_FIXED.size:])
    assert sunk == []


def test_payload_sink_corruption_is_still_an_integrity_error() -> None:
    chunk = Chunk(transfer_id=3, layer=0, kind=0, codec_id=0, token_start=0, token_count=1,
                  layer_tokens=1, params=b"", payload=b"\x07" * 100_000)
    raw = bytearray(frame_bytes(chunk))
    raw[50_000] ^= 0x10
    dec = FrameDecoder(1 << 20, payload_sink=lambda head, size: memoryview(bytearray(size)))
    with pytest.raises(IntegrityError):
        dec.feed(bytes(raw))


# -- a payload given as byte ranges of one buffer -----------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 600_000), st.integers(1, 70_000)), min_size=1, max_size=30),
       st.booleans(), st.integers(0, 2**32))
def test_byte_ranges_frame_as_the_bytes_they_name(ranges: list[tuple[int, int]], with_tail: bool, seed: int) -> None:
    """A payload of ByteRanges (a paged cache's rows where they lie) makes the frame of the
    bytes they name, in order, whichever way the frame is written: checked as written in
    pieces, as plain parts, or (small) as a plain frame."""
    import numpy as np

    base = np.random.default_rng(seed).integers(0, 256, 670_000, dtype=np.uint8)
    spans = np.array(ranges, np.int64)
    ranged = ByteRanges(memoryview(base), spans, int(spans[:, 1].sum()))
    tail = b"\x09" * 3000
    payload = (ranged, tail) if with_tail else ranged
    data = b"".join(base[a : a + n].tobytes() for a, n in ranges) + (tail if with_tail else b"")
    chunk = Chunk(transfer_id=9, layer=2, kind=1, codec_id=0, token_start=0, token_count=1,
                  layer_tokens=1, params=b"qq", payload=payload)
    expected = frame_bytes(replace(chunk, payload=data))
    assert frame_bytes(chunk) == expected and chunk.payload_buffer == data
    parts = encode_chunk_checked_as_written(chunk)
    assert sum(len(p) for p in parts) == len(expected)
    assert b"".join(bytes(p) for p in plain_parts(parts)) == expected
    pieces = b"".join(bytes(q) for p in parts for q in (p.pieces() if isinstance(p, CheckedPayload) else (p,)))
    assert pieces == expected
    checked = [p for p in parts if isinstance(p, CheckedPayload)]
    assert len(checked) == (1 if len(data) >= CHECK_AS_WRITTEN else 0)
    if checked:
        assert checked[0].views[0] is ranged  # kept as ranges for the send queue


# -- a payload scattered over several buffers ---------------------------------------------


def _segments(size: int, cuts: list[int]) -> tuple[memoryview, ...]:
    """``size`` bytes as separate writable buffers cut at ``cuts`` (none empty)."""
    bounds = sorted({0, size, *(c % size for c in cuts)})
    return tuple(memoryview(bytearray(b - a)) for a, b in itertools.pairwise(bounds))


def _read_scattered(dec: FrameDecoder, stream: memoryview, rng: random.Random, most: int,
                    got: list[tuple[Frame, int]]) -> int:
    """Feed ``stream`` as the stream does: each read through get_buffer(), or, where the
    decoder hands out scatter buffers, a scatter read of any size over them (as
    ``recvmsg_into`` fills them: in order).  Returns the number of scatter reads."""
    pos = scatters = 0
    while pos < len(stream):
        bufs = dec.scatter_buffers() if rng.random() < 0.7 else []
        if bufs:
            n = min(sum(b.nbytes for b in bufs), len(stream) - pos, rng.randint(1, most))
            left = n
            for b in bufs:
                take = min(b.nbytes, left)
                b[:take] = stream[pos + n - left : pos + n - left + take]
                left -= take
            scatters += 1
        else:
            buf = dec.get_buffer()
            n = min(len(buf), len(stream) - pos, rng.randint(1, most))
            buf[:n] = stream[pos : pos + n]
        pos += n
        got += dec.buffer_updated(n)
        got += dec.start_deferred()
    return scatters


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_a_payload_scattered_over_the_sinks_buffers_lands_in_them_in_order(data: st.DataObject) -> None:
    """A sink may give a chunk's place as several buffers (a paged cache's blocks): the
    payload fills them in order, read through get_buffer() one buffer at a time, through
    scatter reads over many, or fed; the chunk's payload is that tuple, and the frames
    around it are unchanged."""
    size = data.draw(st.integers(20_000, 60_000))  # more than a feed step: read in stages
    payload = random.Random(data.draw(st.integers(0, 2**32))).randbytes(size)
    chunk = Chunk(transfer_id=3, layer=1, kind=1, codec_id=0, token_start=64, token_count=8,
                  layer_tokens=128, params=b"p" * data.draw(st.integers(0, 8)), payload=payload)
    frames = [SAMPLES[7], chunk, SAMPLES[10], chunk]
    stream = memoryview(b"".join(frame_bytes(f) for f in frames))  # type: ignore[arg-type]
    cuts = data.draw(st.lists(st.integers(1, size - 1), max_size=40))
    sinks: list[tuple[memoryview, ...]] = []

    def sink(head: Chunk, n: int) -> tuple[memoryview, ...]:
        assert n == size
        sinks.append(_segments(n, cuts))
        return sinks[-1]

    dec = FrameDecoder(1 << 20, big_body=1024, scratch_size=data.draw(st.integers(16, 5000)), payload_sink=sink)
    got: list[tuple[Frame, int]] = []
    rng = random.Random(data.draw(st.integers(0, 2**32)))
    if data.draw(st.booleans()):
        _read_scattered(dec, stream, rng, data.draw(st.sampled_from([7, 5000, 70_000])), got)
    else:
        pos = 0
        while pos < len(stream):
            step = rng.randint(1, 9000)
            got += dec.feed(stream[pos : pos + step])
            pos += step
    assert [f.address if isinstance(f, Chunk) else f for f, _ in got] == [  # type: ignore[union-attr]
        f.address if isinstance(f, Chunk) else f for f in frames
    ]
    assert len(sinks) == 2
    for (frame, _), sunk in zip((got[1], got[3]), sinks, strict=True):
        assert frame.payload is sunk  # type: ignore[union-attr]
        assert b"".join(bytes(v) for v in sunk) == payload
    assert dec.buffered == 0 and dec.payload_remaining == 0 and dec.scatter_buffers() == []


def test_scatter_reads_take_many_buffers_at_once() -> None:
    """Scatter reads fill a 64-buffer place in a few reads, not one read per buffer."""
    chunk = Chunk(transfer_id=3, layer=0, kind=0, codec_id=0, token_start=0, token_count=4096,
                  layer_tokens=4096, params=b"", payload=bytes(range(256)) * 1024)
    sunk: list[tuple[memoryview, ...]] = []

    def sink(head: Chunk, size: int) -> tuple[memoryview, ...]:
        sunk.append(tuple(memoryview(bytearray(size // 64)) for _ in range(64)))
        return sunk[-1]

    dec = FrameDecoder(1 << 20, big_body=1024, payload_sink=sink)
    got: list[tuple[Frame, int]] = []
    scatters = _read_scattered(dec, memoryview(frame_bytes(chunk)), random.Random(1), 1 << 20, got)
    [(frame, _)] = got
    assert frame.address == chunk.address and frame.payload is sunk[0]  # type: ignore[union-attr]
    assert b"".join(bytes(v) for v in sunk[0]) == chunk.payload
    assert 1 <= scatters <= 3


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 100_000 + 40), st.integers(1, 70_000), st.lists(st.integers(1, 99_999), max_size=20))
def test_a_flipped_bit_in_a_scattered_payload_is_an_integrity_error(at: int, step: int, cuts: list[int]) -> None:
    """The CRC is kept up over the buffers as bytes land in them: a bit flipped anywhere is
    caught, however the payload was cut and read."""
    chunk = Chunk(transfer_id=3, layer=0, kind=0, codec_id=0, token_start=0, token_count=1,
                  layer_tokens=1, params=b"pp", payload=bytes(range(250)) * 400)
    raw = bytearray(frame_bytes(chunk))
    raw[at % len(raw)] ^= 0x04
    dec = FrameDecoder(1 << 20, big_body=1024, payload_sink=lambda head, size: _segments(size, cuts))
    got: list[tuple[Frame, int]] = []
    with contextlib.suppress(ProtocolError):  # IntegrityError, or a header field that no longer fits
        _read_scattered(dec, memoryview(raw), random.Random(step), step, got)
    assert got == []


def test_abandoning_a_scattered_payload_moves_the_rest_to_a_private_copy() -> None:
    chunk = Chunk(transfer_id=3, layer=0, kind=0, codec_id=0, token_start=0, token_count=1,
                  layer_tokens=1, params=b"", payload=bytes(range(256)) * 300)
    places: list[tuple[memoryview, ...]] = []

    def sink(head: Chunk, size: int) -> tuple[memoryview, ...]:
        places.append(_segments(size, [1000, 30_000, 60_000]))
        return places[-1]

    dec = FrameDecoder(1 << 20, big_body=1024, payload_sink=sink)
    stream = frame_bytes(chunk)
    got = dec.feed(stream[:40_000])
    assert got == [] and dec.abandon_payload(places[0]) and not dec.abandon_payload(places[0])
    before = [bytes(v) for v in places[0]]
    got = dec.feed(stream[40_000:])
    [(frame, _)] = got
    assert frame == chunk  # the private copy, whole
    assert [bytes(v) for v in places[0]] == before  # never written again


@pytest.mark.parametrize("bad", ["empty", "short", "readonly", "not bytes"])
def test_a_sink_giving_bad_buffers_is_a_usage_bug(bad: str) -> None:
    chunk = Chunk(transfer_id=3, layer=0, kind=0, codec_id=0, token_start=0, token_count=1,
                  layer_tokens=1, params=b"", payload=b"\x05" * 10_000)

    def sink(head: Chunk, size: int) -> tuple[memoryview, ...]:
        a, b = memoryview(bytearray(size - 100)), memoryview(bytearray(100))
        return {
            "empty": (a, memoryview(bytearray(0)), b),
            "short": (a, b[:50]),
            "readonly": (a, memoryview(bytes(100))),
            "not bytes": (a, memoryview(bytearray(100)).cast("H")),
        }[bad]

    dec = FrameDecoder(1 << 20, big_body=1024, payload_sink=sink)
    with pytest.raises(ValueError, match="payload sink returned"):
        dec.feed(frame_bytes(chunk)[:2000])  # the frame is incomplete: its place is asked for


# -- hostile input: sizes, reserved bits, bit flips ---------------------------------------


def _frame_with(ftype: int, body: bytes, *, reserved: int = 0) -> bytes:
    from crc32c import crc32c

    header = HEADER.pack(ftype, 0, reserved, len(body))
    return header + body + crc32c(body, crc32c(header)).to_bytes(4, "big")


@pytest.mark.parametrize("step", [1, 7, 4096, 65536, 1 << 20])
def test_control_frame_larger_than_64k_is_decoded_in_any_split(step: int) -> None:
    meta = b'{"x":"' + b"m" * 200_000 + b'"}'
    begin = Begin(transfer_id=3, num_layers=1, num_kv_heads=1, head_dim=8, dtype_id=1, model="",
                  request_id="big", meta=meta)
    data = frame_bytes(begin) + frame_bytes(Ping(opaque=5))
    dec = FrameDecoder(1 << 20)
    got = []
    for i in range(0, len(data), step):
        got += [f for f, _ in dec.feed(data[i : i + step])]
    assert got == [begin, Ping(opaque=5)]


def test_control_frame_larger_than_64k_through_get_buffer() -> None:
    body = b"\x00" * 100_000
    data = _frame_with(0x7F, body)
    dec = FrameDecoder(1 << 20)
    got = []
    pos = 0
    while pos < len(data):
        buf = dec.get_buffer()
        n = min(len(buf), len(data) - pos, 5000)
        buf[:n] = data[pos : pos + n]
        pos += n
        got += [f for f, _ in dec.buffer_updated(n)]
    assert got == [UnknownFrame(type=0x7F, flags=0, body=body)]


@pytest.mark.parametrize("bit", range(32))
def test_flipped_length_bit_of_an_ack_is_a_protocol_error_never_an_assert(bit: int) -> None:
    data = bytearray(frame_bytes(Ack(transfer_id=1, layer=0, kind=0, token_start=0)) + bytes(300_000))
    data[4 + bit // 8] ^= 1 << (bit % 8)
    dec = FrameDecoder(1 << 20)
    with contextlib.suppress(ProtocolError):
        for i in range(0, len(data), 1000):
            dec.feed(bytes(data[i : i + 1000]))


@pytest.mark.parametrize("bit", range(16))
def test_flipped_reserved_bit_is_an_integrity_error(bit: int) -> None:
    data = bytearray(frame_bytes(Ack(transfer_id=1, layer=0, kind=0, token_start=0)))
    data[2 + bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(IntegrityError):
        FrameDecoder(1 << 20).feed(bytes(data))


def test_reserved_bits_under_a_valid_crc_are_a_protocol_error() -> None:
    with pytest.raises(ProtocolError) as info:
        FrameDecoder(1 << 20).feed(_frame_with(0x20, bytes(8), reserved=0x8000))
    assert not isinstance(info.value, IntegrityError)
    big = _frame_with(0x7F, bytes(100_000), reserved=1)
    with pytest.raises(ProtocolError) as info:
        FrameDecoder(1 << 20).feed(big)
    assert not isinstance(info.value, IntegrityError)


@settings(max_examples=300, deadline=None)
@given(
    frames=st.lists(st.sampled_from(range(len(SAMPLES))), min_size=1, max_size=6),
    flips=st.lists(st.integers(min_value=0), min_size=1, max_size=4),
    step=st.integers(min_value=1, max_value=70_000),
)
def test_bit_flips_anywhere_raise_only_protocol_errors(frames: list[int], flips: list[int], step: int) -> None:
    big = Begin(transfer_id=3, num_layers=1, num_kv_heads=1, head_dim=8, dtype_id=1, model="",
                request_id="big", meta=b"[" + b"0," * 40_000 + b"0]")
    data = bytearray(b"".join(frame_bytes(SAMPLES[i]) for i in frames) + frame_bytes(big))
    for f in flips:
        data[f % len(data)] ^= 1 << (f % 8)
    dec = FrameDecoder(1 << 20)
    with contextlib.suppress(ProtocolError):
        for i in range(0, len(data), step):
            dec.feed(bytes(data[i : i + step]))
            assert dec.buffered <= (1 << 20) + 12


@pytest.mark.parametrize("fmt", ["H", "I", "d"])
def test_payload_with_wide_items_is_framed_by_its_bytes(fmt: str) -> None:
    # A payload handed over as a view of 2-, 4- or 8-byte items (e.g. a uint16 array's
    # memoryview) is framed by its size in bytes, not its item count.
    raw = bytes(range(256)) * 4
    view = memoryview(raw).cast(fmt)
    assert len(view) < len(raw)
    frame = Chunk(transfer_id=1, layer=0, kind=0, codec_id=0, token_start=0, token_count=1,
                  layer_tokens=1, params=b"", payload=view)
    ftype, parts = encode_body(frame)
    wire = b"".join(bytes(memoryview(p).cast("B")) for p in _frame(ftype, parts))
    [(got, size)] = FrameDecoder(1 << 20).feed(wire)
    assert size == len(wire)
    assert isinstance(got, Chunk) and bytes(got.payload) == raw



@settings(max_examples=60, deadline=None)
@given(st.integers(0, 3 * WRITE_WHOLE), st.sampled_from(["B", "H", "f"]), st.integers(0, 3))
def test_a_payload_checked_as_written_makes_the_same_bytes(size: int, fmt: str, plen: int) -> None:
    """A CHUNK encoded for writing piece by piece (CRC computed as each piece goes) is
    byte for byte the frame encode_frame makes, whether written in pieces or as parts."""
    import numpy as np

    arr = np.arange(size // np.dtype(fmt).itemsize, dtype=fmt)
    chunk = Chunk(transfer_id=9, layer=2, kind=1, codec_id=0, token_start=0, token_count=1,
                  layer_tokens=1, params=b"q" * plen, payload=memoryview(arr))
    expected = frame_bytes(chunk)
    parts = encode_chunk_checked_as_written(chunk)
    checked = [p for p in parts if isinstance(p, CheckedPayload)]
    assert len(checked) == (1 if arr.nbytes >= CHECK_AS_WRITTEN else 0)
    assert sum(len(p) for p in parts) == len(expected)  # len() is bytes, whatever the item size
    assert b"".join(bytes(p) for p in plain_parts(parts)) == expected
    pieces = [bytes(q) for p in encode_chunk_checked_as_written(chunk)
              for q in (p.pieces() if isinstance(p, CheckedPayload) else (p,))]
    assert b"".join(pieces) == expected
    if checked:  # up to WRITE_WHOLE in one piece, else in pieces of CHECK_AS_WRITTEN
        sizes = [len(q) for q in checked[0].pieces()][:-1]
        assert sizes == ([arr.nbytes] if arr.nbytes <= WRITE_WHOLE
                         else [min(CHECK_AS_WRITTEN, arr.nbytes - a) for a in range(0, arr.nbytes, CHECK_AS_WRITTEN)])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 2 * WRITE_WHOLE), min_size=2, max_size=3), st.sampled_from(["B", "H"]))
def test_a_payload_in_several_buffers_is_one_payload_on_the_wire(sizes: list[int], fmt: str) -> None:
    """A chunk to send may give its payload in parts (a KV chunk: K's bytes, then V's): the
    frame is the one a single joined payload makes, written whole, in pieces or as parts,
    and it decodes to that payload."""
    import numpy as np

    arrays = [np.arange(n // np.dtype(fmt).itemsize, dtype=fmt) for n in sizes]
    split = Chunk(transfer_id=9, layer=2, kind=2, codec_id=0, token_start=0, token_count=1,
                  layer_tokens=1, params=b"", payload=tuple(memoryview(a) for a in arrays))
    joined = b"".join(a.tobytes() for a in arrays)
    expected = frame_bytes(Chunk(transfer_id=9, layer=2, kind=2, codec_id=0, token_start=0, token_count=1,
                                 layer_tokens=1, params=b"", payload=joined))
    assert frame_bytes(split) == expected
    parts = encode_chunk_checked_as_written(split)
    assert sum(len(p) for p in parts) == len(expected)
    assert b"".join(bytes(p) for p in plain_parts(parts)) == expected
    pieces = [bytes(q) for p in parts for q in (p.pieces() if isinstance(p, CheckedPayload) else (p,))]
    assert b"".join(pieces) == expected
    checked = [p for p in parts if isinstance(p, CheckedPayload)]
    assert len(checked) == (1 if len(joined) >= CHECK_AS_WRITTEN else 0)
    if checked:
        assert all(v.nbytes for v in checked[0].views)  # empty buffers are left out
    [(got, _)] = FrameDecoder(1 << 23).feed(expected)
    assert isinstance(got, Chunk) and got.kind == 2 and bytes(got.payload) == joined


@pytest.mark.parametrize("big", [False, True])
def test_a_decoder_below_version_2_refuses_kv_chunks(big: bool) -> None:
    size = 256 * 1024 if big else 64
    wire = frame_bytes(Chunk(transfer_id=1, layer=0, kind=2, codec_id=0, token_start=0, token_count=1,
                             layer_tokens=1, params=b"", payload=bytes(size)))
    dec = FrameDecoder(1 << 20, big_body=64 * 1024)
    dec.max_kind = 1
    with pytest.raises(ProtocolError, match="kind 2 is not K \\(0\\) or V \\(1\\)"):
        dec.feed(wire)
    dec = FrameDecoder(1 << 20, big_body=64 * 1024)
    with pytest.raises(ProtocolError, match="kind 3 is not K \\(0\\), V \\(1\\) or KV \\(2\\)"):
        dec.feed(frame_bytes(Chunk(transfer_id=1, layer=0, kind=3, codec_id=0, token_start=0, token_count=1,
                                   layer_tokens=1, params=b"", payload=bytes(size))))


@pytest.mark.parametrize("failure", ["crc", "too large"])
def test_frames_before_a_failing_frame_in_the_same_feed_are_returned_then_its_error(failure: str) -> None:
    """The frames a read completed before one that fails are handed over (a receiver
    processes frames in order and stops at the first failure, docs/protocol.md 3.4); the
    failure then comes from ``raise_pending``, and nothing after it is decoded."""
    decoder = FrameDecoder(1 << 16)
    if failure == "crc":
        bad = bytearray(frame_bytes(Ping(opaque=2)))
        bad[-1] ^= 0x01
        error: type[Exception] = IntegrityError
    else:
        bad = bytearray(frame_bytes(Ping(opaque=2)))
        bad[4:8] = (1 << 20).to_bytes(4, "big")  # the length field: over max_body
        error = FrameTooLargeError
    got = decoder.feed(frame_bytes(Ping(opaque=1)) + frame_bytes(Pong(opaque=1)) + bytes(bad)
                       + frame_bytes(Ping(opaque=3)))
    assert [f for f, _ in got] == [Ping(opaque=1), Pong(opaque=1)]
    with pytest.raises(error):
        decoder.raise_pending()
    with pytest.raises(error):
        decoder.feed(frame_bytes(Ping(opaque=4)))
    decoder.close()  # (the connection closed: later bytes go nowhere, and raise nothing)
    decoder.raise_pending()
