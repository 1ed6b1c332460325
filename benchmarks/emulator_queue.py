"""What the emulated link's queue does to delay and sharing: against the queue it is set
to, in the same run.

For each pump and each number of connections, that many sender threads write
time-stamped 16 KiB blocks as fast as they can (16 KiB send buffers) through
LinkEmulator at ``--rate`` with no added delay, for ``--seconds``; receiver threads note
each block's one-way delay. After a warm-up it prints the link's throughput against its
rate, each connection's share against a fair one, and the delay (median, p90, max)
against the queue's own time (``queue_bytes`` at the rate: 50 ms by default). Then, on
the idle link, one 1 MiB write: when its first byte and its last arrive, against the
time the link needs for one piece (1 ms of its rate) and for the whole. Run::

    python benchmarks/emulator_queue.py --rate 100e6 --connections 1,4 --seconds 6
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import struct
import threading
import time

from kvwire.bench.emulator import PIECE_TIME, SPLICE_AVAILABLE, LinkEmulator
from kvwire.units import argument_type, number

_BLOCK = 16 * 1024
_STAMP = struct.Struct("<d")


def _send(port: int, stop: threading.Event) -> None:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _BLOCK)
        sock.connect(("127.0.0.1", port))
        pad = bytes(_BLOCK - _STAMP.size)
        with contextlib.suppress(OSError):
            while not stop.is_set():
                sock.sendall(_STAMP.pack(time.monotonic()) + pad)


def _receive(listener: socket.socket, index: int, out: list[tuple[float, float, int]]) -> None:
    conn, _ = listener.accept()
    buf = bytearray()
    with conn, contextlib.suppress(OSError):  # the emulator resets what it holds at its close
        while data := conn.recv(1 << 20):
            buf += data
            now = time.monotonic()
            while len(buf) >= _BLOCK:
                (sent,) = _STAMP.unpack_from(buf)
                del buf[:_BLOCK]
                out.append((now, now - sent, index))


async def _queue_run(rate: float, connections: int, seconds: float, warmup: float, splice: bool) -> None:
    listener = socket.create_server(("127.0.0.1", 0), backlog=connections)
    out: list[tuple[float, float, int]] = []
    stop = threading.Event()
    async with LinkEmulator("127.0.0.1", listener.getsockname()[1], rate_bps=rate, splice=splice) as link:
        queue_ms = link.queue_bytes * 8 / rate * 1e3
        receivers = [threading.Thread(target=_receive, args=(listener, i, out)) for i in range(connections)]
        senders = [threading.Thread(target=_send, args=(link.port, stop)) for _ in range(connections)]
        for thread in receivers + senders:
            thread.start()
        start = time.monotonic()
        await asyncio.sleep(seconds)
        stop.set()
        await asyncio.gather(*(asyncio.to_thread(t.join, 10) for t in senders))
    await asyncio.gather(*(asyncio.to_thread(t.join, 10) for t in receivers))
    listener.close()
    kept = [(t, d, i) for t, d, i in out if t - start >= warmup]
    if not kept:
        print(f"  {connections} connection(s): nothing arrived after the warm-up")
        return
    span = max(t for t, _, _ in kept) - (start + warmup)
    delays = sorted(d for _, d, _ in kept)
    shares = [sum(1 for _, _, i in kept if i == c) / len(kept) for c in range(connections)]
    gbps = len(kept) * _BLOCK * 8 / span / 1e9
    pick = lambda q: delays[min(len(delays) - 1, int(q * len(delays)))] * 1e3  # noqa: E731
    print(f"  {connections} connection(s): {gbps * 1e3:.1f} Mbit/s ({gbps * 1e9 / rate:.3f} of the rate); "
          f"shares {min(shares) * connections:.2f}-{max(shares) * connections:.2f} of fair; "
          f"delay median {pick(0.5):.0f} ms ({pick(0.5) / queue_ms:.2f} of the queue's {queue_ms:.0f} ms), "
          f"p90 {pick(0.9):.0f}, max {delays[-1] * 1e3:.0f}")


async def _first_byte(rate: float, splice: bool) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    loop = asyncio.get_running_loop()
    size = 1 << 20
    async with LinkEmulator("127.0.0.1", listener.getsockname()[1], rate_bps=rate, splice=splice) as link:
        _reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
        conn, _ = await loop.sock_accept(listener)
        start = time.monotonic()
        writer.write(bytes(size))
        got, first = 0, None
        while got < size:
            data = await loop.sock_recv(conn, 1 << 20)
            if not data:
                break
            if first is None:
                first = time.monotonic() - start
            got += len(data)
        last = time.monotonic() - start
        writer.close()
        conn.close()
    listener.close()
    piece_ms = max(4096 * 8 / rate, PIECE_TIME) * 1e3
    print(f"  1 MiB on the idle link: first byte after {(first or 0) * 1e3:.1f} ms (one piece: {piece_ms:.1f} ms), "
          f"all after {last * 1e3:.1f} ms (the rate: {size * 8 / rate * 1e3:.1f} ms)")


async def _main(args: argparse.Namespace) -> None:
    for pump in args.pumps.split(","):
        print(f"{pump} pump, {args.rate / 1e6:g} Mbit/s:")
        for n in args.connections:
            await _queue_run(args.rate, n, args.seconds, args.warmup, pump == "splice")
        await _first_byte(args.rate, pump == "splice")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=argument_type(number, "number"), default=100e6, help="link rate, bits/s")
    parser.add_argument("--connections", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    parser.add_argument("--seconds", type=argument_type(number, "number"), default=6.0)
    parser.add_argument("--warmup", type=argument_type(number, "number"), default=2.0)
    parser.add_argument("--pumps", default="splice,copy" if SPLICE_AVAILABLE else "copy")
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
