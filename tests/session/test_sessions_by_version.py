"""The receiver core counts its open sessions by the protocol version they agreed, so an
operator can tell, during a rolling upgrade, how many clients still speak an earlier one."""

from __future__ import annotations

from kvwire.session.receiver import ReceiverConfig
from kvwire.wire.frames import PROTOCOL_VERSION
from tests.session.receiver_harness import SECRET, Harness, join


def test_open_sessions_are_counted_by_the_version_they_agreed() -> None:
    h = Harness(ReceiverConfig(secret=SECRET), max_version=1)
    assert h.core.sessions_by_version == {1: 1}
    second, _ = join(h.core, 2, h.now)  # a session of its own, of this release's version
    assert second.version == PROTOCOL_VERSION
    assert h.core.sessions_by_version == {1: 1, PROTOCOL_VERSION: 1}
    h.client.close(h.now)  # the version-1 client goes
    h.pump()
    h.core.forget(1)
    assert h.core.sessions_by_version == {PROTOCOL_VERSION: 1}
