"""A stream's socket, transport, session core and owner, faked in memory."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from kvwire.aio._stream import Stream


class FakeSocket:
    def __init__(self) -> None:
        self.lowat: list[int] = []

    def setsockopt(self, level: int, name: int, value: int) -> None:
        if (level, name) == (socket.SOL_SOCKET, socket.SO_RCVLOWAT):
            self.lowat.append(value)


class FakeTransport(asyncio.Transport):
    def __init__(self, sock: FakeSocket | None = None, *, tls: bool = False) -> None:
        super().__init__()
        self.written: list[bytes] = []
        self.gathered: list[list[bytes]] = []
        self.closing = self.aborted = False
        self.reading = True
        self.extra = {"peername": ("127.0.0.1", 1), "socket": sock, "sslcontext": object() if tls else None}

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.extra.get(name, default)

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def is_closing(self) -> bool:
        return self.closing or self.aborted

    def write(self, data: Any) -> None:
        self.written.append(bytes(data))

    def writelines(self, parts: Any) -> None:
        self.gathered.append([bytes(p) for p in parts])  # one scatter-gather write
        self.written.append(b"".join(self.gathered[-1]))

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.aborted = True

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True


class FakeCore:
    def __init__(self) -> None:
        self.buf = bytearray(16)
        self.fed: list[tuple[int, bytes]] = []
        self.out: list[bytes] = []
        self.closed = False
        self.progress = True  # what buffer_updated says: a frame completed
        self.remaining = 0  # what payload_remaining says

    def get_buffer(self, key: int) -> memoryview:
        return memoryview(self.buf)

    def buffer_updated(self, key: int, nbytes: int, now: float) -> bool:
        self.fed.append((key, bytes(self.buf[:nbytes])))
        return self.progress

    def receive_data(self, key: int, data: bytes, now: float) -> None:
        self.fed.append((key, data))

    def payload_remaining(self, key: int) -> int:
        return self.remaining

    def buffers_to_send(self, key: int) -> list[Any]:
        out, self.out = self.out, []
        return out

    def is_closed(self, key: int) -> bool:
        return self.closed

    def connection(self, key: int) -> Any:
        return None


class Owner:
    replaces_streams = True  # (every read asks is_current: a test may set current False)
    fixed_connections = False

    def __init__(self, *, want: bool = True) -> None:
        self.core = FakeCore()
        self.notsent_lowat: int | None = None
        self.want, self.current = want, True
        self.pumps = 0
        self.lost: list[Stream] = []
        self.writable: list[bool] = []

    def now(self) -> float:
        return 0.0

    def pump(self) -> None:
        self.pumps += 1

    def stream_made(self, stream: Stream) -> bool:
        return self.want

    def is_current(self, stream: Stream) -> bool:
        return self.current

    def stream_lost(self, stream: Stream) -> None:
        self.lost.append(stream)

    def set_writable(self, stream: Stream, writable: bool) -> None:
        self.writable.append(writable)
