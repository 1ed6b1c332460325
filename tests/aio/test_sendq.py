"""The compiled send queue (``kvwire.aio._sendq``) on real sockets: the bytes it writes
are the frames' bytes in order, a checked payload's trailer is the CRC32C of the frame
whatever the kernel takes per write, buffers are held exactly until written, and errors
are clear.  Where the extension is not built (``KVWIRE_NO_EXTENSIONS=1``) streams write
through their transports, which ``tests/aio/test_stream.py`` and the system tests cover."""

from __future__ import annotations

import contextlib
import select
import socket
import struct
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire._extensions import load_extension
from kvwire.wire import Chunk
from kvwire.wire.crc import crc32c
from kvwire.wire.frames import CheckedPayload, encode_chunk_checked_as_written, plain_parts
from tests.conftest import needs_extension, require_extension

EXT = "kvwire.aio._sendq"
sendq = load_extension(EXT)
# Without the queue streams write through their transports (tests/aio/test_stream.py).
pytestmark = needs_extension(sendq is not None, EXT)


def test_the_extension_is_built() -> None:
    require_extension(sendq is not None, EXT)


@contextlib.contextmanager
def loopback_pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A connected TCP pair on loopback, the writer non-blocking with a small send buffer
    (so that the kernel takes a large part over many writes)."""
    lst = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(lst.getsockname())
    b, _ = lst.accept()
    lst.close()
    try:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
        a.setblocking(False)
        b.settimeout(10)
        yield a, b
    finally:
        a.close()
        b.close()


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    with loopback_pair() as ab:
        yield ab


def trailer(payload: bytes | memoryview, crc: int) -> bytes:
    return struct.pack(">I", crc32c(payload, crc))


def drain(q: object, reader: socket.socket, nbytes: int) -> tuple[bytes, int]:
    """Flush ``q`` whenever its socket is writable and read what arrives, as an event loop
    would, until ``nbytes`` arrived; the bytes and the flushes it took."""
    got, flushes, left = bytearray(), 0, 1
    fd = q.fd  # type: ignore[attr-defined]
    while len(got) < nbytes or left:
        readable, writable, _ = select.select([reader], [fd] if left else [], [], 10)
        assert readable or writable, "neither side can go on"
        if writable:
            left = q.flush()  # type: ignore[attr-defined]
            flushes += 1
        if readable:
            data = reader.recv(1 << 20)
            assert data, "the writer's side closed early"
            got += data
    return bytes(got), flushes


part = st.one_of(
    st.binary(max_size=2000).map(lambda b: ("plain", b)),
    st.tuples(st.integers(0, 300_000), st.integers(0, 2**32 - 1)).map(lambda t: ("checked", t)),
    # one payload in several buffers (a KV chunk's K and V; a paged cache's blocks, many
    # small ones gathered into one write up to a piece): one CRC, one trailer
    st.tuples(st.lists(st.integers(1, 200_000), min_size=2, max_size=3), st.integers(0, 2**32 - 1))
    .map(lambda t: ("chained", t)),
    st.tuples(st.lists(st.integers(1, 9000), min_size=2, max_size=80), st.integers(0, 2**32 - 1))
    .map(lambda t: ("chained", t)),
    # byte ranges of one buffer (a paged cache's blocks, no Python object per range), alone
    # or chained with a plain buffer after them
    st.tuples(st.lists(st.tuples(st.integers(0, 300_000), st.integers(1, 40_000)), min_size=1, max_size=60),
              st.integers(0, 2**32 - 1), st.booleans())
    .map(lambda t: ("ranges", t)),
)


@settings(max_examples=40, deadline=None)
@given(parts=st.lists(part, max_size=8), seed=st.integers(0, 2**32 - 1),
       piece=st.sampled_from([1, 4096, 20_000, 512 * 1024]))
def test_writes_the_parts_in_order_and_each_checked_payload_with_its_trailer(
    parts: list[tuple[str, object]], seed: int, piece: int,
) -> None:
    assert sendq is not None
    rng = np.random.default_rng(seed)
    with loopback_pair() as (a, b):
        pushed: list[object] = []
        expect = bytearray()
        for kind, value in parts:
            if kind == "plain":
                assert isinstance(value, bytes)
                pushed.append(value)
                expect += value
            elif kind == "checked":
                size, crc = value  # type: ignore[misc]
                payload = memoryview(rng.integers(0, 256, size, dtype=np.uint8))
                pushed.append((payload, crc))
                expect += bytes(payload) + trailer(payload, crc)
            elif kind == "ranges":
                ranges, crc, then_plain = value  # type: ignore[misc]
                base = rng.integers(0, 256, 340_000, dtype=np.uint8)
                spans = np.array(ranges, np.int64)
                ranged = b"".join(base[a : a + n].tobytes() for a, n in ranges)
                if then_plain:  # the payload goes on in a buffer of its own
                    tail = memoryview(rng.integers(0, 256, 5000, dtype=np.uint8))
                    pushed += [(base, crc, True, spans), (tail, 7)]
                    whole = ranged + bytes(tail)
                else:
                    pushed.append((base, crc, False, spans))
                    whole = ranged
                expect += whole + trailer(whole, crc)
            else:
                sizes, crc = value  # type: ignore[misc]
                views = [memoryview(rng.integers(0, 256, n, dtype=np.uint8)) for n in sizes]
                # every part of the chain after the first carries a wrong crc: it is ignored
                pushed += [(views[0], crc, True), *((v, 12345, True) for v in views[1:-1]), (views[-1], 999)]
                whole = b"".join(bytes(v) for v in views)
                expect += whole + trailer(whole, crc)
        q = sendq.SendQueue(a.fileno(), piece=piece)
        q.push(pushed)
        assert q.pending == len(expect)
        got, _ = drain(q, b, len(expect))
        assert got == bytes(expect)
        assert q.pending == 0


def test_a_chunk_frame_goes_out_as_the_transport_path_writes_it(pair: tuple[socket.socket, socket.socket]) -> None:
    """The same CHUNK frame: its parts with the CheckedPayload as (payload, crc), against
    the frame's plain bytes."""
    assert sendq is not None
    a, b = pair
    payload = np.random.default_rng(3).integers(0, 256, 3 << 20, dtype=np.uint8)
    chunk = Chunk(transfer_id=7, layer=2, kind=1, codec_id=0, token_start=0, token_count=1536,
                  layer_tokens=1536, params=b"", payload=payload)
    parts = encode_chunk_checked_as_written(chunk)
    assert any(isinstance(p, CheckedPayload) for p in parts)
    expect = b"".join(bytes(p) for p in plain_parts(parts))
    q = sendq.SendQueue(a.fileno())
    q.push([(p.payload, p.crc) if isinstance(p, CheckedPayload) else p for p in parts])
    got, flushes = drain(q, b, len(expect))
    assert got == expect
    assert flushes > 1  # the kernel took it over several writes


def test_a_kv_chunk_in_two_buffers_goes_out_as_one_frame(pair: tuple[socket.socket, socket.socket]) -> None:
    """A KV chunk's payload is the caller's K and V, two buffers: the stream pushes them as
    a chain, and the bytes are the frame's, one CRC over both."""
    from kvwire.aio._stream import _checked_parts

    assert sendq is not None
    a, b = pair
    rng = np.random.default_rng(4)
    k, v = (rng.integers(0, 256, 1 << 20, dtype=np.uint8) for _ in range(2))
    chunk = Chunk(transfer_id=7, layer=2, kind=2, codec_id=0, token_start=0, token_count=512,
                  layer_tokens=512, params=b"", payload=(k.data, v.data))
    parts = encode_chunk_checked_as_written(chunk)
    [checked] = [p for p in parts if isinstance(p, CheckedPayload)]
    assert len(checked.views) == 2 and len(checked) == (2 << 20) + 4
    expect = b"".join(bytes(p) for p in plain_parts(parts))
    assert expect[-4:] == trailer(k.tobytes() + v.tobytes(), checked.crc)
    q = sendq.SendQueue(a.fileno())
    q.push([x for p in parts for x in (_checked_parts(p) if isinstance(p, CheckedPayload) else (p,))])
    got, _ = drain(q, b, len(expect))
    assert got == expect
    # the Python writer's pieces are the same bytes
    assert b"".join(bytes(x) for x in checked.pieces()) == expect[-len(checked):]


@pytest.mark.parametrize("parts", [
    [(b"k", 0, True)],  # the chain never goes on
    [(b"k", 0, True), b"plain"],  # nor with a plain part
    [(b"", 0, True), (b"v", 0)],  # empty parts of a chain
    [(b"k", 0, True), (b"", 0)],
    [(b"k", 0, True, 1)],  # not a checked tuple
])
def test_a_bad_chain_is_refused_and_nothing_is_queued(pair: tuple[socket.socket, socket.socket], parts: list[object]) -> None:
    assert sendq is not None
    a, _ = pair
    q = sendq.SendQueue(a.fileno())
    with pytest.raises((ValueError, TypeError)):
        q.push(parts)
    assert q.pending == 0 and q.flush() == 0


@pytest.mark.parametrize(("spans", "says"), [
    (np.zeros((0, 2), np.int64), "non-empty"),
    (np.array([[0, 10], [5, 0]], np.int64), "range 1 .* is empty or outside"),
    (np.array([[95, 10]], np.int64), "range 0 .* is empty or outside"),
    (np.array([[-1, 2]], np.int64), "is empty or outside"),
    (np.array([0, 10, 3], np.int64), "pairs"),
])
def test_bad_ranges_are_refused_and_nothing_is_queued(
    pair: tuple[socket.socket, socket.socket], spans: np.ndarray, says: str,
) -> None:
    assert sendq is not None
    a, _ = pair
    q = sendq.SendQueue(a.fileno())
    base = bytearray(100)
    with pytest.raises(ValueError, match=says):
        q.push([b"head", (base, 0, False, spans)])
    assert q.pending == 0
    base.extend(b"x")  # no buffer export is left behind: the bytearray may resize
    q.push([(base, 0, False, np.array([[1, 100]], np.int64))])
    assert q.pending == 104
    q.clear()
    base.extend(b"y")


def test_ranges_given_in_any_buffer_of_int64_pairs(pair: tuple[socket.socket, socket.socket]) -> None:
    """The spans may be any buffer of int64 pairs, aligned or not (a slice of bytes)."""
    assert sendq is not None
    a, b = pair
    base = bytes(range(256))
    spans = memoryview(b"\x00" + np.array([[200, 50], [3, 7]], np.int64).tobytes())[1:]
    q = sendq.SendQueue(a.fileno())
    q.push([(base, 11, False, spans)])
    want = base[200:250] + base[3:10]
    got, _ = drain(q, b, len(want) + 4)
    assert got == want + trailer(want, 11)


def test_buffers_are_held_until_written_and_let_go_after(pair: tuple[socket.socket, socket.socket]) -> None:
    assert sendq is not None
    a, b = pair
    plain, checked = bytearray(b"p" * 100_000), bytearray(b"c" * 100_000)
    q = sendq.SendQueue(a.fileno())
    q.push([plain, (checked, 0)])
    with pytest.raises(BufferError):
        plain.extend(b"x")  # exported to the queue: it cannot change size
    with pytest.raises(BufferError):
        checked.extend(b"x")
    drain(q, b, 200_004)
    plain.extend(b"x")  # written: released
    checked.extend(b"x")


def test_clear_drops_what_is_queued_and_releases_it(pair: tuple[socket.socket, socket.socket]) -> None:
    assert sendq is not None
    a, _ = pair
    held = bytearray(1 << 20)
    q = sendq.SendQueue(a.fileno())
    q.push([held])
    assert q.flush() > 0  # the reader does not read: most of it is left
    q.clear()
    assert q.pending == 0 and q.flush() == 0
    held.extend(b"x")


def test_a_socket_error_is_raised_and_the_queue_kept(pair: tuple[socket.socket, socket.socket]) -> None:
    assert sendq is not None
    a, b = pair
    b.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    b.close()  # reset: the writer's next writes fail
    q = sendq.SendQueue(a.fileno())
    q.push([b"x" * 100_000])
    with pytest.raises(OSError) as err:
        for _ in range(100):
            q.flush()
    assert err.value.errno in (104, 32)  # ECONNRESET, EPIPE
    assert q.pending > 0
    q.clear()
    assert q.pending == 0


def test_bad_parts_raise_and_queue_nothing(pair: tuple[socket.socket, socket.socket]) -> None:
    assert sendq is not None
    a, _ = pair
    q = sendq.SendQueue(a.fileno())
    with pytest.raises(TypeError):
        q.push([b"ok", (b"payload",)])  # a checked part is (payload, crc)
    with pytest.raises(TypeError):
        q.push([b"ok", ("not a buffer", 0)])
    with pytest.raises((BufferError, ValueError)):  # numpy refuses a simple buffer of it
        q.push([b"ok", np.zeros((4, 4), np.uint8)[:, ::2]])  # not contiguous
    with pytest.raises(TypeError):
        q.push(5)
    assert q.pending == 0 and q.flush() == 0
    with pytest.raises(ValueError):
        sendq.SendQueue(-1)
    assert q.fd == a.fileno()


def test_an_empty_checked_payload_is_its_trailer(pair: tuple[socket.socket, socket.socket]) -> None:
    assert sendq is not None
    a, b = pair
    q = sendq.SendQueue(a.fileno())
    q.push([(b"", 0x12345678), b"!"])
    got, _ = drain(q, b, 5)
    assert got == trailer(b"", 0x12345678) + b"!"


def test_code_a_push_or_a_release_runs_cannot_reenter_the_queue(pair: tuple[socket.socket, socket.socket]) -> None:
    """Converting a part (a crc's ``__index__``) or letting go of a written one (a
    finalizer) runs Python code; a push or clear from there would move the parts under
    the running call. It is refused, and what was queued goes out intact."""
    import weakref

    a, b = pair
    assert sendq is not None
    q = sendq.SendQueue(a.fileno(), piece=4096)
    inner: list[BaseException] = []

    class Crc:
        def __index__(self) -> int:
            try:
                q.push([b"inner"] * 100)
            except RuntimeError as exc:
                inner.append(exc)
            return 0

    q.push([(b"outer", Crc())])
    assert len(inner) == 1 and "re-entered" in str(inner[0])
    grown = bytearray(np.array([0, 1], np.int64).tobytes())

    class Grow:
        def __index__(self) -> int:
            grown.extend(np.array([0, 1] * 500, np.int64).tobytes())
            return 0

    with pytest.raises(ValueError, match="spans changed"):
        q.push([(bytearray(64), Grow(), False, grown)])

    class Hooked(bytearray):
        pass

    first = Hooked(b"A" * 10)
    refused: list[BaseException] = []

    def push_when_let_go() -> None:
        try:
            q.push([b"late"])
        except RuntimeError as exc:
            refused.append(exc)

    weakref.finalize(first, push_when_let_go)
    q.push([first, b"B" * 10])
    del first
    got, _ = drain(q, b, 5 + 4 + 20)
    assert q.pending == 0 and len(refused) == 1  # let go of during the flush: the late push refused
    assert got == b"outer" + trailer(b"outer", 0) + b"A" * 10 + b"B" * 10


def test_a_queue_never_initialised_refuses_work() -> None:
    assert sendq is not None
    q = sendq.SendQueue.__new__(sendq.SendQueue)
    for call in (lambda: q.push([b"x"]), q.flush, q.clear):
        with pytest.raises(ValueError, match="not initialised"):
            call()


def test_reinitialising_is_refused_while_the_queue_is_in_use_or_holds_parts() -> None:
    """``__init__`` again while a push converts its parts (a crc's ``__index__``), or
    while parts are queued, would send the rest of a frame to another socket: refused
    with the error push and flush give, and what was queued goes to its own socket."""
    assert sendq is not None
    a, b = socket.socketpair()
    c, d = socket.socketpair()
    try:
        a.setblocking(False)
        b.settimeout(10)
        d.setblocking(False)
        q = sendq.SendQueue(a.fileno(), 4)
        inner: list[BaseException] = []

        class Crc:
            def __index__(self) -> int:
                try:
                    q.__init__(c.fileno(), 1)
                except RuntimeError as exc:
                    inner.append(exc)
                return 0

        q.push([(b"payload", Crc())])
        assert len(inner) == 1 and "re-entered" in str(inner[0])
        assert q.fd == a.fileno()
        with pytest.raises(RuntimeError, match="parts queued"):
            q.__init__(c.fileno(), 1)
        got, _ = drain(q, b, 11)
        assert got == b"payload" + trailer(b"payload", 0)
        with pytest.raises(BlockingIOError):
            d.recv(100)
        # queued parts dropped, or all written: it may be pointed at another socket
        q.push([b"dropped"])
        with pytest.raises(RuntimeError, match="parts queued"):
            q.__init__(c.fileno(), 1)
        q.clear()
        q.__init__(c.fileno(), 2)
        assert q.fd == c.fileno()
        q.push([b"other"])
        assert q.flush() == 0
        d.settimeout(10)
        assert d.recv(100) == b"other"
    finally:
        for s in (a, b, c, d):
            s.close()
