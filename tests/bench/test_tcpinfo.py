"""read_tcp_info on a real loopback TCP connection.

Only what holds on any machine, however busy, is asserted: the connection's state and
that the counters exist and are consistent with each other; never how many segments
the kernel retransmitted or how long a round trip took.
"""

from __future__ import annotations

import socket
import struct
import sys
import threading

import pytest

from kvwire.aio.tcpinfo import parse_tcp_info, read_tcp_info

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="TCP_INFO is Linux-only"
)


def test_loopback_counters_after_a_transfer() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    server, _ = listener.accept()
    payload = bytes(4 << 20)
    received = 0

    def drain() -> None:
        nonlocal received
        while received < len(payload):
            chunk = server.recv(1 << 20)
            if not chunk:
                break
            received += len(chunk)
        server.sendall(b"ok")

    reader = threading.Thread(target=drain)
    reader.start()
    client.sendall(payload)
    assert client.recv(2) == b"ok"
    reader.join(5)
    try:
        info = read_tcp_info(client)
        assert info is not None
        assert info.length >= 104
        assert info.state == 1  # TCP_ESTABLISHED
        assert info.rtt_us is not None and info.rtt_us > 0
        assert info.rtt is not None and info.rtt > 0
        assert info.snd_cwnd is not None and info.snd_cwnd > 0
        # Retransmits happen on a loaded machine too: only that the counter is read.
        assert info.total_retrans is not None and info.total_retrans >= 0
        if info.bytes_acked is not None:
            # The SYN counts for one acked byte.
            assert info.bytes_acked >= len(payload)
        if info.notsent_bytes is not None:
            # The peer answered after reading every byte: nothing is left unsent.
            assert info.notsent_bytes == 0
        if info.min_rtt_us is not None:
            assert 0 < info.min_rtt_us <= info.rtt_us + (info.rttvar_us or 0)
        if info.delivery_rate is not None:
            assert info.delivery_rate > 0
        if info.busy_time_us is not None:
            assert info.busy_time_us >= 0
        if info.length >= 224:  # Linux 5.0+: the D-SACK and reordering counters
            assert info.dsack_dups is not None and info.dsack_dups >= 0
            assert info.reord_seen is not None and info.reord_seen >= 0
        server_info = read_tcp_info(server)
        assert server_info is not None and server_info.bytes_received is not None
        assert server_info.bytes_received >= len(payload)
    finally:
        for s in (client, server, listener):
            s.close()


def test_not_a_tcp_socket_gives_none() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        assert read_tcp_info(udp) is None


def test_short_buffers_leave_later_fields_none() -> None:
    raw = bytearray(104)
    struct.pack_into("=I", raw, 68, 1234)
    struct.pack_into("=I", raw, 80, 10)
    struct.pack_into("=I", raw, 100, 3)
    raw[7] = 1
    info = parse_tcp_info(bytes(raw))
    assert info.rtt_us == 1234 and info.snd_cwnd == 10 and info.total_retrans == 3
    assert info.delivery_rate_app_limited is True
    assert info.pacing_rate is None and info.min_rtt_us is None and info.delivery_rate is None


def test_full_layout_offsets() -> None:
    raw = bytearray(228)
    struct.pack_into("=Q", raw, 104, 111)
    struct.pack_into("=Q", raw, 120, 222)
    struct.pack_into("=I", raw, 144, 333)
    struct.pack_into("=I", raw, 148, 444)
    struct.pack_into("=Q", raw, 160, 555)
    struct.pack_into("=QQQ", raw, 168, 6, 7, 8)
    struct.pack_into("=II", raw, 216, 9, 10)
    info = parse_tcp_info(bytes(raw))
    assert (info.pacing_rate, info.bytes_acked, info.notsent_bytes) == (111, 222, 333)
    assert (info.min_rtt_us, info.delivery_rate) == (444, 555)
    assert (info.busy_time_us, info.rwnd_limited_us, info.sndbuf_limited_us) == (6, 7, 8)
    assert info.delivery_rate_bps == 8 * 555
    assert (info.dsack_dups, info.reord_seen) == (9, 10)
    assert info.snd_wnd is None
