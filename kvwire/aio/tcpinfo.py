"""Read the kernel's ``TCP_INFO`` for a socket (Linux).

The kernel copies as much of ``struct tcp_info`` as both it and the caller know, so the
returned length says which fields exist: fields past it are ``None`` (older kernels).
Offsets are those of the x86-64 layout, which is also the layout on every other 64-bit
Linux architecture: all fields are naturally aligned fixed-width integers.
"""

from __future__ import annotations

import socket
import struct
import sys
from dataclasses import dataclass

__all__ = ["TcpInfo", "read_tcp_info"]

_TCP_INFO = getattr(socket, "TCP_INFO", 11)
_BUFFER = 512

# name -> (offset, struct format); units are the kernel's (microseconds, bytes, segments).
_FIELDS: dict[str, tuple[int, str]] = {
    "state": (0, "B"),
    "ca_state": (1, "B"),
    "retransmits": (2, "B"),
    "rto_us": (8, "I"),
    "snd_mss": (16, "I"),
    "rcv_mss": (20, "I"),
    "unacked": (24, "I"),
    "lost": (32, "I"),
    "retrans": (36, "I"),
    "rtt_us": (68, "I"),
    "rttvar_us": (72, "I"),
    "snd_ssthresh": (76, "I"),
    "snd_cwnd": (80, "I"),
    "total_retrans": (100, "I"),
    "pacing_rate": (104, "Q"),
    "max_pacing_rate": (112, "Q"),
    "bytes_acked": (120, "Q"),
    "bytes_received": (128, "Q"),
    "notsent_bytes": (144, "I"),
    "min_rtt_us": (148, "I"),
    "delivery_rate": (160, "Q"),
    "busy_time_us": (168, "Q"),
    "rwnd_limited_us": (176, "Q"),
    "sndbuf_limited_us": (184, "Q"),
    "delivered": (192, "I"),
    "bytes_sent": (200, "Q"),
    "bytes_retrans": (208, "Q"),
    "dsack_dups": (216, "I"),
    "reord_seen": (220, "I"),
    "snd_wnd": (228, "I"),
}
_APP_LIMITED_BYTE = 7  # bit 0: tcpi_delivery_rate_app_limited


@dataclass(frozen=True, slots=True, kw_only=True)
class TcpInfo:
    """One ``TCP_INFO`` reading. ``None``: the running kernel does not report the field.

    Rates are bytes/s, times microseconds, windows segments unless named bytes.
    """

    length: int
    """Bytes the kernel returned."""
    state: int | None = None
    ca_state: int | None = None
    retransmits: int | None = None
    rto_us: int | None = None
    snd_mss: int | None = None
    rcv_mss: int | None = None
    unacked: int | None = None
    lost: int | None = None
    retrans: int | None = None
    rtt_us: int | None = None
    rttvar_us: int | None = None
    snd_ssthresh: int | None = None
    snd_cwnd: int | None = None
    total_retrans: int | None = None
    pacing_rate: int | None = None
    max_pacing_rate: int | None = None
    bytes_acked: int | None = None
    bytes_received: int | None = None
    notsent_bytes: int | None = None
    min_rtt_us: int | None = None
    delivery_rate: int | None = None
    busy_time_us: int | None = None
    rwnd_limited_us: int | None = None
    sndbuf_limited_us: int | None = None
    delivered: int | None = None
    bytes_sent: int | None = None
    bytes_retrans: int | None = None
    dsack_dups: int | None = None
    """Segments the peer reported received twice (D-SACK): retransmits that were not
    needed (Linux 5.0+)."""
    reord_seen: int | None = None
    """Times the sender saw reordering (Linux 5.0+)."""
    snd_wnd: int | None = None
    delivery_rate_app_limited: bool | None = None

    @property
    def rtt(self) -> float | None:
        """Smoothed RTT in seconds."""
        return None if self.rtt_us is None else self.rtt_us / 1e6

    @property
    def min_rtt(self) -> float | None:
        """Minimum RTT in seconds (the kernel's window is minutes long)."""
        return None if self.min_rtt_us is None else self.min_rtt_us / 1e6

    @property
    def delivery_rate_bps(self) -> float | None:
        """The kernel's latest delivery-rate sample in bits/s."""
        return None if self.delivery_rate is None else 8.0 * self.delivery_rate

    @property
    def cwnd_bytes(self) -> int | None:
        if self.snd_cwnd is None or self.snd_mss is None:
            return None
        return self.snd_cwnd * self.snd_mss


def parse_tcp_info(raw: bytes) -> TcpInfo:
    """Parse a ``struct tcp_info`` of any length the kernel may return."""
    n = len(raw)
    values: dict[str, int | bool] = {}
    for name, (offset, fmt) in _FIELDS.items():
        end = offset + struct.calcsize(fmt)
        if end <= n:
            values[name] = struct.unpack_from("=" + fmt, raw, offset)[0]
    if n > _APP_LIMITED_BYTE:
        values["delivery_rate_app_limited"] = bool(raw[_APP_LIMITED_BYTE] & 1)
    return TcpInfo(length=n, **values)  # type: ignore[arg-type]


def read_tcp_info(sock: socket.socket) -> TcpInfo | None:
    """``TCP_INFO`` of a connected TCP socket; ``None`` off Linux or if unavailable."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _BUFFER)
    except OSError:
        return None
    if not raw:
        return None
    return parse_tcp_info(raw)
