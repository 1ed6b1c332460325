"""Kernel link shaping: two network namespaces joined by a veth pair, rate-limited by tbf.

Root only, Linux only, opt-in. :class:`NetnsLink` creates two fresh namespaces with
unique names, a veth pair between them with addresses in 10.0.0.0/8 that exist only
inside those namespaces, and a ``tc tbf`` qdisc on the sender's end. The kernel paces
the packets, so endpoint TCP sees the real bottleneck (cwnd, TCP_INFO and all), unlike
the userspace emulator, which terminates TCP.

Delay: ``tbf`` shapes rate only and ``netem`` (the qdisc that adds delay and loss) is
not available on every kernel, so this mode adds no delay: the RTT is the veth's, tens
of microseconds. For rate *and* delay, run the userspace
:class:`~kvwire.bench.emulator.LinkEmulator` (delay) on top of this link (rate), or use
the emulator alone.

Everything created is removed on exit of the ``with`` block, on failure while creating,
at interpreter exit, and on SIGINT/SIGTERM/SIGHUP (those the process does not ignore;
while :func:`kvwire.bench._signals.run`'s event loop runs, once that loop has stopped).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ctypes.util
import multiprocessing as mp
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator, Sequence
from types import FrameType, TracebackType
from typing import Any, TypeVar

from kvwire.bench._signals import defers, ends_the_program
from kvwire.bench.emulator import TCP_IP_HEADERS
from kvwire.errors import UsageError

__all__ = [
    "TBF_MAX_LIMIT",
    "VETH_HEADERS",
    "NetnsLink",
    "NetnsUnavailable",
    "check_tbf",
    "netns_available",
    "payload_of",
    "sweep_stale",
    "tbf_rate",
]

_CLONE_NEWNET = 0x40000000
T = TypeVar("T")


class NetnsUnavailable(RuntimeError):
    """This process cannot create namespaces (not root, not Linux, or no ``ip``/``tc``)."""


#: The most bytes tc's tbf can queue: its ``limit`` is a 32-bit count, and ``tc`` wraps a
#: larger one around without a word (asked for 50 ms at 1 Tbit/s, it queued 15.6 ms).
TBF_MAX_LIMIT = 2**32 - 1
#: How long a packet may wait in the link's tbf queue (seconds), unless told otherwise.
DEFAULT_QUEUE_LATENCY = 0.05


#: Bytes of each Ethernet frame that tbf counts: its header (the veth's packets hold it).
#: The FCS, preamble and inter-frame gap (24 of the 38 bytes a frame takes beyond its IP
#: packet) are not in the packet.
_COUNTED_ETHERNET = 14
#: Headers in every packet the veth counts (Ethernet 14, IPv4 20, TCP with timestamps 32):
#: an offload packet of many segments counts once, with one set of headers.
VETH_HEADERS = _COUNTED_ETHERNET + TCP_IP_HEADERS


def tbf_rate(rate_bps: float, mtu: int | None, link_layer: str = "ethernet") -> float:
    """The rate to give tbf for an Ethernet link of line rate ``rate_bps`` at MTU ``mtu``
    (``None``: ``rate_bps`` itself, the rate of what tbf counts).

    tbf counts each segment of an offload packet with its own headers (the kernel's
    ``qdisc_pkt_len_init``): a full segment is ``mtu`` bytes of IP packet and the 14 of
    its Ethernet header, of the ``mtu + 38`` a frame takes on the wire. The other 24 bytes
    a frame takes are folded into the rate, ``rate x (mtu + 14) / (mtu + 38)``, not added
    as ``tc``'s ``stab overhead``: that is added once per packet the qdisc sees, so once
    per offload super-packet of up to 64 KiB, not once per frame.

    ``link_layer="payload"``: ``rate_bps`` counts TCP payload bytes, of which a full
    segment holds ``mtu - 52``: ``rate x (mtu + 14) / (mtu - 52)``."""
    if mtu is None:
        return rate_bps
    from kvwire.bench.emulator import ETHERNET_FRAMING, check_mtu

    check_mtu(mtu)
    if link_layer == "payload":
        return rate_bps * (mtu + _COUNTED_ETHERNET) / (mtu - TCP_IP_HEADERS)
    if link_layer != "ethernet":
        raise ValueError(f"link_layer must be 'ethernet' or 'payload', not {link_layer!r}")
    return rate_bps * (mtu + _COUNTED_ETHERNET) / (mtu + ETHERNET_FRAMING)


def payload_of(nbytes: int, packets: int) -> int:
    """The TCP payload in ``packets`` packets of ``nbytes`` that a veth counted."""
    return max(0, nbytes - VETH_HEADERS * packets)


def check_tbf(rate_bps: float, burst_bytes: int, latency: float, *, per_link: float = 1.0) -> None:
    """Raise UsageError unless tbf can hold ``latency`` of queue at ``rate_bps`` on top
    of its ``burst_bytes`` bucket (``rate x latency + burst`` within :data:`TBF_MAX_LIMIT`).
    ``per_link``: tbf's rate for each bit/s of the link's (:func:`tbf_rate`); the message
    gives the link's rates."""
    if rate_bps / 8 * latency + burst_bytes <= TBF_MAX_LIMIT:
        return
    from kvwire.units import format_rate, format_size

    fastest = max(0.0, (TBF_MAX_LIMIT - burst_bytes) * 8 / latency)
    raise UsageError(
        f"tc's tbf cannot queue {latency * 1e3:g} ms at {format_rate(rate_bps / per_link)} with a "
        f"{format_size(burst_bytes)} bucket: it holds at most {format_size(TBF_MAX_LIMIT)} "
        f"(at most {format_rate(fastest / per_link)} with that bucket)"
    )


def netns_available() -> str | None:
    """``None`` if kernel shaping can run here, else the reason it cannot."""
    if not os.path.exists("/proc/self/ns/net"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the '{tool}' command (iproute2) is missing"
    return None


_libc: ctypes.CDLL | None = None


def _setns(fd: int) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


@contextlib.contextmanager
def _inside(ns: str) -> Iterator[None]:
    """Switch the calling thread into namespace ``ns`` and back."""
    original = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        _setns(target)
        try:
            yield
        finally:
            _setns(original)
    finally:
        os.close(target)
        os.close(original)


def _child(ns: str, fn: Callable[..., Any], args: tuple[Any, ...], out: Any) -> None:
    try:
        fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
        _setns(fd)
        os.close(fd)
        out.send((True, fn(*args)))
    except BaseException as exc:
        out.send((False, repr(exc)))


# -- cleanup on every exit path -----------------------------------------------------------

_live: set[NetnsLink] = set()
_lock = threading.Lock()
_previous_handlers: dict[int, Any] = {}
#: Signals whose default action ends the process without running atexit hooks: the
#: namespaces are removed first (a terminal that closes sends SIGHUP).
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _cleanup_all() -> None:
    for link in list(_live):
        link.close()


@ends_the_program
def _on_signal(signum: int, frame: FrameType | None) -> None:
    # While an event loop runs (kvwire.bench._signals.run), this one is set aside: the
    # loop's main task is cancelled, the ``with`` blocks around it close their links, and
    # this runs once the loop has stopped. Raised inside one of the loop's callbacks, its
    # exception would end that callback only, the links already gone.
    previous = _previous_handlers.get(signum, signal.SIG_DFL)  # before the cleanup forgets it
    if defers(previous):  # opened while such a loop runs: its exit closes the link
        previous(signum, frame)
        return
    _cleanup_all()
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _register(link: NetnsLink) -> None:
    with _lock:
        first = not _live
        _live.add(link)
    if first and threading.current_thread() is threading.main_thread():
        for signum in _SIGNALS:
            current = signal.getsignal(signum)
            if current == signal.SIG_IGN:  # a signal the process ignores does not end it
                continue
            _previous_handlers[signum] = current
            signal.signal(signum, _on_signal)


def _unregister(link: NetnsLink) -> None:
    with _lock:
        _live.discard(link)
        last = not _live
    if last and threading.current_thread() is threading.main_thread():
        for signum, handler in list(_previous_handlers.items()):
            if signal.getsignal(signum) is _on_signal:
                signal.signal(signum, handler)
            del _previous_handlers[signum]


atexit.register(_cleanup_all)

#: The names :class:`NetnsLink` gives its namespaces: ``kvwire-<pid>-<tag>-<s|r>``.
_NAME = re.compile(r"kvwire-(\d+)-[0-9a-f]{6}-[sr]")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Remove the namespaces that links of ended processes left behind (a process killed
    with SIGKILL runs no cleanup): those named ``kvwire-<pid>-...`` whose process no longer
    exists and in which no process runs. Returns the names removed."""
    try:
        names = sorted(os.listdir("/run/netns"))
    except OSError:
        return []
    removed: list[str] = []
    for name in names:
        match = _NAME.fullmatch(name)
        if match is None or int(match[1]) == os.getpid() or _pid_alive(int(match[1])):
            continue
        try:
            users = subprocess.run(["ip", "netns", "pids", name], capture_output=True, timeout=10)
            if users.returncode != 0 or users.stdout.strip():
                continue
            if subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10).returncode == 0:
                removed.append(name)
        except (OSError, subprocess.SubprocessError):
            continue
    return removed


class NetnsLink:
    """Two namespaces joined by a veth pair, the sender's egress shaped by ``tc tbf``.

    ::

        with NetnsLink(rate_bps=1e9) as link:
            server = link.socket(link.receiver_ns)
            server.bind((link.receiver_addr, 0))
            client = link.socket(link.sender_ns)
            client.connect((link.receiver_addr, port))

    Sockets made with :meth:`socket` stay in their namespace for life and can be used
    from any thread or event loop of this process.

    :param rate_bps: sender-to-receiver rate (``None``: unshaped).
    :param reverse_rate_bps: receiver-to-sender rate (``None``: unshaped).
    :param burst_bytes: tbf bucket; default about 1 ms at the rate, at least 64 KiB
        (segmentation offload hands tbf packets of up to 64 KiB).
    :param mtu: the rates are Ethernet line rates at this MTU, which the veth is given:
        tbf's rate is :func:`tbf_rate` of them, so a saturated link carries the TCP payload
        an Ethernet link of that rate does. ``None`` (the default): tbf is given the rates
        as they are (they count packets with their headers, once per offload packet's
        segment) and the veth keeps its MTU.
    :param link_layer: with ``mtu``, ``ethernet`` (the rates are line rates) or
        ``payload`` (the rates count TCP payload bytes in full segments of that MTU).
    :param queue_latency: how long a packet may wait in tbf's queue (seconds, default
        50 ms). tbf holds at most 4 GiB (``rate x latency + burst``): a rate that needs
        more (above about 670 Gbit/s at the defaults) raises UsageError
        (:func:`check_tbf`), where ``tc`` would shorten the queue without a word.

    On a closed link, :meth:`socket`, :meth:`run`, :meth:`call` and :meth:`tx_bytes`
    raise UsageError.
    """

    def __init__(
        self,
        rate_bps: float | None = None,
        *,
        reverse_rate_bps: float | None = None,
        burst_bytes: int | None = None,
        queue_latency: float = DEFAULT_QUEUE_LATENCY,
        mtu: int | None = None,
        link_layer: str = "ethernet",
    ) -> None:
        if mtu is not None:
            tbf_rate(1.0, mtu, link_layer)  # checks them
        self.mtu = mtu
        self.link_layer = link_layer
        tag = secrets.token_hex(3)
        self.sender_ns = f"kvwire-{os.getpid()}-{tag}-s"
        self.receiver_ns = f"kvwire-{os.getpid()}-{tag}-r"
        self.sender_dev = f"kvw{tag}s"
        self.receiver_dev = f"kvw{tag}r"
        octets = secrets.randbelow(250) + 1, secrets.randbelow(64) * 4
        self.sender_addr = f"10.{octets[0]}.{octets[1] // 256}.{octets[1] % 256 + 1}"
        self.receiver_addr = f"10.{octets[0]}.{octets[1] // 256}.{octets[1] % 256 + 2}"
        self.rate_bps = rate_bps
        self.reverse_rate_bps = reverse_rate_bps
        self._burst = burst_bytes
        self._latency = queue_latency
        self._created: list[str] = []
        self._owner = os.getpid()  # only this process removes what it made (see close)
        self.swept: list[str] = []  # what open() removed of ended processes (sweep_stale)

    # -- setup and teardown ------------------------------------------------------------

    @staticmethod
    def _ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)

    def _exec(self, ns: str, *argv: str) -> None:
        subprocess.run(
            ["ip", "netns", "exec", ns, *argv], check=True, capture_output=True, timeout=10
        )

    def _burst_for(self, rate_bps: float) -> int:
        if self._burst is not None:
            return self._burst
        return max(64 * 1024, int(rate_bps / 8 * 0.001))

    def _tc_shape(self, dev: str, rate_bps: float, verb: str) -> list[str]:
        """The ``tc`` command that shapes ``dev`` to the link rate ``rate_bps``."""
        rate = tbf_rate(rate_bps, self.mtu, self.link_layer)
        return [
            "tc", "qdisc", verb, "dev", dev, "root", "tbf",
            "rate", f"{int(rate)}bit",
            "burst", str(self._burst_for(rate)),
            "latency", f"{int(self._latency * 1000)}ms",
        ]  # fmt: skip

    def _shape(self, ns: str, dev: str, rate_bps: float | None, verb: str) -> None:
        if rate_bps is None:
            if verb == "change":
                subprocess.run(
                    ["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                    capture_output=True,
                    timeout=10,
                )
            return
        rate = tbf_rate(rate_bps, self.mtu, self.link_layer)
        check_tbf(rate, self._burst_for(rate), self._latency, per_link=rate / rate_bps)
        self._exec(ns, *self._tc_shape(dev, rate_bps, verb))

    def open(self) -> NetnsLink:
        reason = netns_available()
        if reason is not None:
            raise NetnsUnavailable(reason)
        for rate in (self.rate_bps, self.reverse_rate_bps):
            if rate is not None:  # before anything is made
                shaped = tbf_rate(rate, self.mtu, self.link_layer)
                check_tbf(shaped, self._burst_for(shaped), self._latency, per_link=shaped / rate)
        self.swept = sweep_stale()
        _register(self)
        try:
            for ns in (self.sender_ns, self.receiver_ns):
                self._ip("netns", "add", ns)
                self._created.append(ns)
            self._ip(
                "link", "add", self.sender_dev, "netns", self.sender_ns,
                "type", "veth", "peer", "name", self.receiver_dev, "netns", self.receiver_ns,
            )  # fmt: skip
            for ns, dev, addr in (
                (self.sender_ns, self.sender_dev, self.sender_addr),
                (self.receiver_ns, self.receiver_dev, self.receiver_addr),
            ):
                self._exec(ns, "ip", "addr", "add", f"{addr}/30", "dev", dev)
                if self.mtu is not None:
                    self._exec(ns, "ip", "link", "set", dev, "mtu", str(self.mtu))
                self._exec(ns, "ip", "link", "set", dev, "up")
                self._exec(ns, "ip", "link", "set", "lo", "up")
            self._shape(self.sender_ns, self.sender_dev, self.rate_bps, "replace")
            self._shape(self.receiver_ns, self.receiver_dev, self.reverse_rate_bps, "replace")
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Remove everything created (idempotent). Deleting a namespace removes its veth.

        A no-op in a forked child: it inherits the link, the signal handlers and the atexit
        hook, and a child stopped with SIGTERM (a load process, a worker) must not remove
        the namespaces its parent is still using.
        """
        if os.getpid() != self._owner:
            return
        while self._created:
            ns = self._created.pop()
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        _unregister(self)

    def __enter__(self) -> NetnsLink:
        return self.open()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- use ---------------------------------------------------------------------------

    @property
    def namespaces(self) -> tuple[str, str]:
        return (self.sender_ns, self.receiver_ns)

    def set_rate(self, rate_bps: float | None) -> None:
        """Change the sender-to-receiver rate in place."""
        verb = "replace" if rate_bps is not None else "change"
        self._shape(self.sender_ns, self.sender_dev, rate_bps, verb)
        self.rate_bps = rate_bps

    def tx_bytes(self) -> int:
        """Bytes the sender's end of the veth has transmitted (through tbf): TCP payload,
        and one set of Ethernet, IP and TCP headers per packet (an offload packet of many
        segments is one packet, so this is not what a wire of frames would carry)."""
        return self.tx_counts()[0]

    def tx_counts(self) -> tuple[int, int]:
        """Bytes and packets the sender's end of the veth has transmitted (an offload
        packet of many segments is one packet)."""
        self._check(self.sender_ns)
        with _inside(self.sender_ns), open("/proc/thread-self/net/dev") as f:
            for line in f:
                name, sep, fields = line.partition(":")
                if sep and name.strip() == self.sender_dev:
                    transmit = fields.split()[8:10]  # receive: 8 fields, then transmit bytes, packets
                    return int(transmit[0]), int(transmit[1])
        raise OSError(f"no device {self.sender_dev} in {self.sender_ns}")

    def tx_payload_bytes(self) -> int:
        """TCP payload the sender's end of the veth has transmitted: its bytes less
        :data:`VETH_HEADERS` for each packet it counted (the sender's pure ACKs carry none)."""
        nbytes, packets = self.tx_counts()
        return payload_of(nbytes, packets)

    def socket(
        self, ns: str, family: int = socket.AF_INET, type: int = socket.SOCK_STREAM
    ) -> socket.socket:
        """A socket that lives in namespace ``ns``."""
        self._check(ns)
        with _inside(ns):
            return socket.socket(family, type)

    def run(
        self, ns: str, argv: Sequence[str], *, timeout: float | None = 60, check: bool = True
    ) -> subprocess.CompletedProcess[bytes]:
        """Run a command inside namespace ``ns``; returns its completed process."""
        self._check(ns)
        return subprocess.run(
            ["ip", "netns", "exec", ns, *argv], capture_output=True, timeout=timeout, check=check
        )

    def call(self, ns: str, fn: Callable[..., T], *args: Any, timeout: float | None = 60) -> T:
        """Run ``fn(*args)`` in a forked child inside ``ns``; returns its (picklable) result."""
        self._check(ns)
        ctx = mp.get_context("fork")
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(ns, fn, args, child))
        proc.start()
        child.close()
        try:
            if not parent.poll(timeout):
                raise TimeoutError(f"call in {ns} did not finish within {timeout} s")
            ok, value = parent.recv()
        finally:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join()
            parent.close()
        if not ok:
            raise RuntimeError(f"call in {ns} failed: {value}")
        result: T = value
        return result

    def _check(self, ns: str) -> None:
        if ns not in self.namespaces:
            raise UsageError(f"{ns!r} is not a namespace of this link")
        if ns not in self._created:
            raise UsageError(f"namespace {ns!r} does not exist: the link is closed (or was never opened)")
