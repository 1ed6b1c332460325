"""A fake-time send pipeline for the codec chooser: encode, wire, decode, acknowledgement.

Each chunk carries ``chunk`` bytes of fp16 KV. The sender encodes one chunk at a time
(``encode[codec]`` KV bytes/s, ``None``: free), puts it on the wire once the bytes in
flight leave room for it (``window`` wire bytes, the real sender's in-flight limit), the
wire carries ``ratio[codec]`` of its KV bytes at ``link`` bytes/s, the receiver decodes
one chunk at a time (``decode[codec]``), and the acknowledgement comes back ``rtt / 2``
later. The next chunk's codec is chosen once the chunk before went on the wire, as in
``kvwire.aio``; every acknowledgement that arrived by then is fed to the chooser first.
``jitter(i)`` scales chunk ``i``'s encode, wire and decode times (a loaded host).
Everything is exact arithmetic over the event times: no clock, no sockets, no threads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvwire.control import CodecChooser

MIB = 1 << 20
RATIOS = {"raw": 1.0, "fp8": 0.516, "int8": 0.516, "int4": 0.375}


@dataclass(frozen=True)
class Path:
    link: float  # wire bytes/s
    encode: Mapping[str, float | None]  # KV bytes/s per codec; None: free
    decode: Mapping[str, float | None]
    rtt: float = 200e-6
    window: int = 16 * MIB
    chunk: int = 4 * MIB
    ratio: Mapping[str, float] = field(default_factory=lambda: dict(RATIOS))


@dataclass
class Run:
    seconds: float  # until the last acknowledgement
    kv_bytes: int
    codecs: list[str]

    @property
    def goodput(self) -> float:
        return self.kv_bytes / self.seconds


def simulate(
    path: Path, chunks: int, pick: Callable[[float], str], *, chooser: CodecChooser | None = None,
    jitter: Callable[[int], float] = lambda i: 1.0,
) -> Run:
    """Send ``chunks`` chunks, each with the codec ``pick(now)`` returns."""
    enc_free = wire_free = dec_free = 0.0
    now = 0.0
    flight: list[tuple[float, int]] = []  # (ack time, wire bytes) of chunks on the wire
    acks: list[tuple[float, str, int]] = []  # (time, codec, KV bytes), in time order
    fed = 0
    codecs = []
    for i in range(chunks):
        if chooser is not None:
            while fed < len(acks) and acks[fed][0] <= now:
                t, codec, kv = acks[fed]
                chooser.observe_delivered(codec, kv, t)
                fed += 1
        codec = pick(now)
        codecs.append(codec)
        scale = jitter(i)
        enc = path.encode[codec]
        enc_free = max(now, enc_free) + (path.chunk / enc * scale if enc else 0.0)
        size = int(path.chunk * path.ratio[codec])
        admit = enc_free
        while True:
            ahead = [t for t, _ in flight if t > admit]
            if not ahead or sum(b for t, b in flight if t > admit) + size <= path.window:
                break
            admit = min(ahead)  # the next acknowledgement
        flight = [(t, b) for t, b in flight if t > admit]
        wire_free = max(admit, wire_free) + size / path.link * scale
        dec = path.decode[codec]
        dec_free = max(wire_free + path.rtt / 2, dec_free) + (path.chunk / dec * scale if dec else 0.0)
        ack = dec_free + path.rtt / 2
        flight.append((ack, size))
        acks.append((ack, codec, path.chunk))
        now = admit
    return Run(seconds=acks[-1][0], kv_bytes=chunks * path.chunk, codecs=codecs)


def fixed(path: Path, chunks: int, codec: str, jitter: Callable[[int], float] = lambda i: 1.0) -> Run:
    return simulate(path, chunks, lambda now: codec, jitter=jitter)


def auto(path: Path, chunks: int, chooser: CodecChooser, bandwidth_bps: float,
         jitter: Callable[[int], float] = lambda i: 1.0) -> Run:
    """``chooser`` deciding every chunk, with ``bandwidth_bps`` as the estimate it is given."""
    return simulate(path, chunks, lambda now: chooser.choose(bandwidth_bps, now=now).codec,
                    chooser=chooser, jitter=jitter)
