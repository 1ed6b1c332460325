"""How closely LinkEmulator holds its rate, against a raw socket pair in the same run.

A sender process runs a plain ``sendall`` loop and a receiver process a ``recv_into``
loop; the receiver samples its byte count every 10 ms. Three runs:

1. raw: sender straight to receiver (what the machine can do);
2. for each pump (``--pumps``: splice(2) through kernel pipes, and reading into Python),
   through the emulator with no shaping (the proxy's ceiling) ...
3. ... and at the target rate (default 10 Gbit/s), optionally with a step down.

For the shaped runs it prints the achieved rate over every whole second after a warm-up
and its error against the rate in effect, and for every run through the emulator its CPU
seconds per GB forwarded (CPU the sender and receiver on the same host do not get). Run::

    python benchmarks/emulator.py --rate 10e9 --seconds 4
    python benchmarks/emulator.py --rate 10e9 --step 2.5e9 --seconds 6
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import resource
import socket
import time
from multiprocessing.connection import Connection

from kvwire.bench.emulator import SPLICE_AVAILABLE, LinkEmulator
from kvwire.units import argument_type, number

_BLOCK = 4 << 20


def _receiver(listener: socket.socket, seconds: float, out: Connection) -> None:
    conn, _ = listener.accept()
    buf = bytearray(_BLOCK)
    view = memoryview(buf)
    total = 0
    samples: list[tuple[float, int]] = []
    next_sample = 0.0
    start: float | None = None
    while True:
        n = conn.recv_into(view)
        if not n:
            break
        now = time.monotonic()
        if start is None:
            start = now
        total += n
        if now >= next_sample:
            samples.append((now, total))
            next_sample = now + 0.01
        if now - start > seconds:
            break
    samples.append((time.monotonic(), total))
    conn.close()
    out.send(samples)


def _sender(port: int, seconds: float) -> None:
    sock = socket.create_connection(("127.0.0.1", port))
    block = bytes(_BLOCK)
    deadline = time.monotonic() + seconds + 1.0
    try:
        while time.monotonic() < deadline:
            sock.sendall(block)
    except OSError:
        pass
    sock.close()


def _run(
    port_for_sender: int | None, listener: socket.socket, seconds: float
) -> list[tuple[float, int]]:
    parent, child = mp.Pipe(duplex=False)
    recv = mp.Process(target=_receiver, args=(listener, seconds, child))
    recv.start()
    port = port_for_sender or listener.getsockname()[1]
    send = mp.Process(target=_sender, args=(port, seconds))
    send.start()
    samples: list[tuple[float, int]] = parent.recv()
    recv.join()
    send.join(10)
    return samples


async def _run_through(
    listener: socket.socket, seconds: float, **link_kwargs: object
) -> tuple[list[tuple[float, int]], LinkEmulator]:
    target_port = listener.getsockname()[1]
    async with LinkEmulator("127.0.0.1", target_port, **link_kwargs) as link:  # type: ignore[arg-type]
        loop = asyncio.get_running_loop()
        samples = await loop.run_in_executor(None, _run, link.port, listener, seconds)
    return samples, link


def _rate(samples: list[tuple[float, int]], t0: float, t1: float) -> float:
    """Bits/s between two offsets (seconds) from the first sample."""
    base = samples[0][0]
    a = min(samples, key=lambda s: abs(s[0] - base - t0))
    b = min(samples, key=lambda s: abs(s[0] - base - t1))
    return 8.0 * (b[1] - a[1]) / (b[0] - a[0])


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _through(listener: socket.socket, seconds: float, **link_kwargs: object) -> tuple[list[tuple[float, int]], LinkEmulator, float]:
    """A run through the emulator, and the emulator's CPU seconds per GB it forwarded (the
    emulator is this process; sender and receiver are children)."""
    cpu0 = _cpu()
    samples, link = asyncio.run(_run_through(listener, seconds, **link_kwargs))
    cpu = _cpu() - cpu0
    return samples, link, cpu / max(samples[-1][1], 1) * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rate", type=argument_type(number, "number"), default=10e9, help="shaped rate, bits/s")
    parser.add_argument("--step", type=argument_type(number, "number"), default=None, help="rate after --step-at seconds")
    parser.add_argument("--step-at", type=argument_type(lambda t: number(t, strictly_positive=False), "number"), default=3.0)
    parser.add_argument("--seconds", type=argument_type(number, "number"), default=4.0)
    parser.add_argument("--warmup", type=argument_type(lambda t: number(t, strictly_positive=False), "number"), default=0.5)
    parser.add_argument("--pumps", default="splice,copy" if SPLICE_AVAILABLE else "copy",
                        help="emulator pumps to run, in order: splice (splice(2), Linux) and/or copy")
    parser.add_argument("--no-uvloop", action="store_true")
    args = parser.parse_args()
    pumps = [p for p in args.pumps.split(",") if p]
    if not pumps or any(p not in ("splice", "copy") for p in pumps):
        parser.error("--pumps takes splice and/or copy, comma-separated")
    if "splice" in pumps and not SPLICE_AVAILABLE:
        parser.error("the splice pump needs splice(2) (Linux)")
    if not args.no_uvloop:
        try:
            import uvloop

            uvloop.install()
        except ImportError:
            pass

    listener = socket.create_server(("127.0.0.1", 0))

    raw = _run(None, listener, args.seconds)
    raw_rate = _rate(raw, args.warmup, args.seconds)
    print(f"raw socket pair:        {raw_rate / 1e9:7.2f} Gbit/s")

    schedule = [(0.0, args.rate)]
    if args.step is not None:
        schedule.append((args.step_at, args.step))
    for pump in pumps:
        splice = pump == "splice"
        open_samples, _, open_cpu = _through(listener, args.seconds, rate_bps=None, splice=splice)
        open_rate = _rate(open_samples, args.warmup, args.seconds)
        print(f"{pump} pump, unlimited:  {open_rate / 1e9:7.2f} Gbit/s  ({open_rate / raw_rate:.2f} x raw), "
              f"emulator CPU {open_cpu:.2f} s/GB")
        shaped, link, shaped_cpu = _through(listener, args.seconds, schedule=schedule, splice=splice)
        # The receiver's clock starts at its first byte, the schedule's at the proxy start:
        # the gap is the connection setup, well under a millisecond here.
        whole = _rate(shaped, args.warmup, args.seconds)
        print(f"{pump} pump, shaped:     {whole / 1e9:7.2f} Gbit/s over {args.warmup}-{args.seconds} s, "
              f"emulator CPU {shaped_cpu:.2f} s/GB")
        t = args.warmup
        worst = 0.0
        while t + 1.0 <= args.seconds + 1e-9:
            expected = link.rate_at(t + 0.5)
            got = _rate(shaped, t, t + 1.0)
            # A window straddling a step has no single expected rate.
            straddles = args.step is not None and t < args.step_at < t + 1.0
            if expected is not None and not straddles:
                err = got / expected - 1.0
                worst = max(worst, abs(err))
                print(
                    f"  {t:4.1f}-{t + 1:4.1f} s: {got / 1e9:6.3f} Gbit/s vs {expected / 1e9:.3f}  ({err:+.2%})"
                )
            t += 0.5
        print(f"worst 1 s error: {worst:.2%}; shaped rate is {args.rate / raw_rate:.2f} x raw capacity")
    listener.close()


if __name__ == "__main__":
    main()
