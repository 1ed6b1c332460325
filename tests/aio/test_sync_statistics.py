"""kvwire.sync's SyncPeer.protocol_version, SyncPeer.statistics() and
SyncServer.statistics(): the async objects' own, read on the bridge's loop from any
thread, within a timeout.  Real loopback sockets."""

from __future__ import annotations

import threading
from typing import Any

import pytest

import kvwire
from kvwire.errors import ConnectionLostError, TransferTimeoutError, UsageError
from kvwire.sync import Bridge, SyncPeer, SyncServer
from kvwire.wire.frames import PROTOCOL_VERSION
from tests.conftest import SECRET, make_layers

pytestmark = pytest.mark.timeout(60)

SPEC = kvwire.KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32")


def test_sync_peer_and_server_report_version_session_streams_and_arrivals() -> None:
    with (
        SyncServer(secret=SECRET) as server,
        SyncPeer("127.0.0.1", server.port, secret=SECRET, streams=2) as peer,
    ):
        assert peer.protocol_version == PROTOCOL_VERSION
        stats = peer.statistics()
        assert stats["protocol_version"] == PROTOCOL_VERSION
        assert stats["session_id"] == peer.peer.session_id.hex()
        assert len(stats["streams"]) == 2
        sent_before = stats["bytes_sent"]
        server_stats = server.statistics()
        assert server_stats["sessions_by_version"] == {PROTOCOL_VERSION: 1}
        assert server_stats["pending_arrivals"] == 0
        peer.send("x", SPEC, make_layers(2, 3, 2, 16, "float32"), timeout=30)
        assert peer.statistics(timeout=30)["bytes_sent"] > sent_before
        assert server.statistics(timeout=30)["pending_arrivals"] == 1
        server.expect("x", timeout=30).wait(30)
        assert server.statistics()["pending_arrivals"] == 0


def test_from_another_thread() -> None:
    with (
        SyncServer(secret=SECRET) as server,
        SyncPeer("127.0.0.1", server.port, secret=SECRET) as peer,
    ):
        got: list[Any] = []

        def read() -> None:
            got.append((peer.protocol_version, peer.statistics(), server.statistics()))

        reader = threading.Thread(target=read)
        reader.start()
        reader.join(30)
        assert len(got) == 1
        version, peer_stats, server_stats = got[0]
        assert version == PROTOCOL_VERSION
        assert peer_stats["protocol_version"] == PROTOCOL_VERSION
        assert server_stats["sessions"] == 1


def test_a_loop_held_up_raises_timeout_and_a_closed_bridge_connection_lost() -> None:
    bridge = Bridge("test-sync-statistics")
    try:
        server = SyncServer(secret=SECRET, bridge=bridge)
        peer = SyncPeer("127.0.0.1", server.port, secret=SECRET, bridge=bridge)
        release = threading.Event()
        bridge.call_soon(release.wait, 30)  # the loop runs nothing else until it is set
        try:
            with pytest.raises(TransferTimeoutError):
                peer.statistics(timeout=0.05)
            with pytest.raises(TransferTimeoutError):
                server.statistics(timeout=0.05)
        finally:
            release.set()
        with pytest.raises(UsageError):
            server.statistics(timeout=-1)
        with pytest.raises(UsageError):
            peer.statistics(timeout=float("nan"))
        assert peer.statistics(timeout=30)["protocol_version"] == PROTOCOL_VERSION
    finally:
        bridge.close()
    with pytest.raises(ConnectionLostError):
        peer.statistics()
    with pytest.raises(ConnectionLostError):
        _ = peer.protocol_version
    with pytest.raises(ConnectionLostError):
        server.statistics()


def test_refused_on_the_loop_thread() -> None:
    with (
        SyncServer(secret=SECRET) as server,
        SyncPeer("127.0.0.1", server.port, secret=SECRET, bridge=server.bridge) as peer,
    ):
        errors: list[BaseException] = []
        done = threading.Event()

        def on_loop() -> None:
            for call in (peer.statistics, server.statistics, lambda: peer.protocol_version):
                try:
                    call()
                except UsageError as exc:
                    errors.append(exc)
            done.set()

        server.bridge.call_soon(on_loop)
        assert done.wait(30)
        assert len(errors) == 3
