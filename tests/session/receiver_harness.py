"""A client connection speaking to a :class:`ReceiverCore` in memory, in fake time, and
the frames the session tests send it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvwire.session.receiver import (
    ByteStore,
    LayerStore,
    ReceiverConfig,
    ReceiverCore,
    TransferArrived,
)
from kvwire.wire import Begin, Chunk, Connection, ConnectionConfig, Event, Role, chunk_frame_size
from kvwire.wire.frames import PROTOCOL_VERSION, FrameType

SECRET = b"receiver-core-secret"
HEADS, HEAD_DIM = 2, 4
BPT = HEADS * HEAD_DIM * 2  # float16


def begin(tid: int = 1, layers: int = 2, request: str = "r", **kw: Any) -> Begin:
    fields: dict[str, Any] = dict(
        transfer_id=tid, num_layers=layers, num_kv_heads=HEADS, head_dim=HEAD_DIM, dtype_id=1,
        model="", request_id=request, meta=b"{}",
    )
    fields.update(kw)
    return Begin(**fields)


def chunk(tid: int = 1, layer: int = 0, kind: int = 0, start: int = 0, count: int = 8, tokens: int = 8,
          codec_id: int = 0, fill: int | None = None) -> Chunk:
    seed = (tid * 31 + layer * 7 + kind * 3 + start) % 251 if fill is None else fill
    payload = bytes((seed + i) % 256 for i in range(count * BPT))
    return Chunk(transfer_id=tid, layer=layer, kind=kind, codec_id=codec_id, token_start=start,
                 token_count=count, layer_tokens=tokens, params=b"", payload=payload)


Tap = Callable[[bytes], list[bytes]]


class Harness:
    """One client connection (cid 1) talking to a :class:`ReceiverCore` in memory."""

    def __init__(self, config: ReceiverConfig | None = None, *, store: LayerStore | None = None,
                 fingerprint: bytes | None = None, secret: bytes = SECRET,
                 max_version: int = PROTOCOL_VERSION) -> None:
        self.now = 0.0
        self.core = ReceiverCore(config or ReceiverConfig(secret=SECRET, codecs=("raw", "fp8")), store=store)
        self.events: list[Any] = []
        self.client_events: list[Event] = []
        self.core.connection_made(1, self.now)
        ccfg = ConnectionConfig(secret=secret, max_version=max_version) if fingerprint is None else ConnectionConfig(
            secret=secret, fingerprint=fingerprint, max_version=max_version)
        self.client = Connection(Role.CLIENT, ccfg, now=self.now)
        self.client.initiate()
        self.pump()

    def pump(self, tap: Tap | None = None) -> None:
        moving = True
        while moving:
            moving = False
            for part in self.client.data_to_send():
                data = bytes(part)
                if data:
                    moving = True
                    for piece in tap(data) if tap is not None else [data]:
                        self.core.receive_data(1, piece, self.now)
            data = self.core.data_to_send(1)
            if data:
                moving = True
                self.client.receive_data(data, self.now)
            while (ev := self.client.next_event()) is not None:
                self.client_events.append(ev)
        while (rev := self.core.next_event()) is not None:
            self.events.append(rev)

    def send(self, c: Chunk, tap: Tap | None = None) -> None:
        self.client.send_chunk(c, chunk_frame_size(len(c.params), len(c.payload)))
        self.pump(tap)

    def of(self, kind: type) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]

    def client_of(self, kind: type) -> list[Any]:
        return [e for e in self.client_events if isinstance(e, kind)]

    @property
    def key(self) -> tuple[bytes, int]:
        return self.of(TransferArrived)[0].key  # type: ignore[no-any-return]


class CountingStore(ByteStore):
    def __init__(self) -> None:
        super().__init__()
        self.decodes = 0
        self.buffers: dict[int, memoryview] = {}

    def allocate(self, key: Any, chunk: Chunk, nbytes: int) -> Any:
        buf = super().allocate(key, chunk, nbytes)
        self.buffers[chunk.layer] = buf
        return buf

    def decode(self, key: Any, chunk: Chunk, buffer: Any, offset: int, nbytes: int) -> None:
        self.decodes += 1
        super().decode(key, chunk, buffer, offset, nbytes)


def split_after(n: int) -> Tap:
    """Deliver each write in two parts: the first ``n`` bytes, then the rest (a CHUNK frame
    larger than 64 KiB whose body is not all there is read into its sink)."""
    return lambda data: [data[:n], data[n:]] if len(data) > n else [data]


BIG = 8192  # tokens of BPT bytes: a 128 KiB payload, above the decoder's big-frame size


def join(core: ReceiverCore, cid: int, now: float, *, session_id: bytes = bytes(16), stream_index: int = 0,
         after_auth: bytes = b"", max_version: int = PROTOCOL_VERSION) -> tuple[Connection, list[Event]]:
    """Another client connection ``cid`` through its handshake with ``core`` (joining
    ``session_id`` if given); ``after_auth``: bytes written in the same read as its AUTH,
    before WELCOME.  The connection and the events it saw."""
    core.connection_made(cid, now)
    client = Connection(Role.CLIENT, ConnectionConfig(secret=SECRET, session_id=session_id,
                                                      stream_index=stream_index, max_version=max_version), now=now)
    client.initiate()
    events: list[Event] = []
    for _ in range(4):
        data = b"".join(bytes(part) for part in client.data_to_send())
        if after_auth and data[:1] == bytes([FrameType.AUTH]):
            data += after_auth
        if data:
            core.receive_data(cid, data, now)
        out = core.data_to_send(cid)
        if out:
            client.receive_data(out, now)
        events.extend(iter(client.next_event, None))
    return client, events
