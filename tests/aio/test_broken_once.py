"""Peer.broken for a session the server no longer has (UNKNOWN_SESSION) is an explained
error made once: a SyncPeer reads ``broken`` from its caller's thread while the loop thread
reads it too, and made lazily at the first look two threads could each make one (6 of
3000 trials). It is now made when the loop handles the session's failure, before any look,
and a look that comes first makes it under a lock."""

from __future__ import annotations

import threading

from kvwire.aio.client import ClientOptions, Peer
from kvwire.errors import ConnectionLostError, ErrorCode
from kvwire.session.sender import SESSION_GONE, SessionFailed
from tests.conftest import SECRET

made: list[object] = []


class _Counted(ConnectionLostError):
    def __init__(self, message: str = "", *, code: ErrorCode | None = None) -> None:
        super().__init__(message, code=code)
        made.append(self)


def _peer() -> Peer:
    return Peer("127.0.0.1", 1, secret=SECRET, streams=1, codec="raw", ssl=None, options=ClientOptions())


def _fail(peer: Peer) -> _Counted:
    err = _Counted("no such session", code=ErrorCode.UNKNOWN_SESSION)
    peer.core.broken = err
    return err


async def test_the_explained_error_exists_before_any_look() -> None:
    made.clear()
    peer = _peer()
    err = _fail(peer)
    peer._on_event(SessionFailed(error=err))
    assert len(made) == 2  # the server's, and the one ``broken`` says: before anyone read it
    said = peer.broken
    assert said is not None
    assert said is made[1] and said is peer.broken and len(made) == 2
    assert str(said).startswith(SESSION_GONE) and said.__cause__ is err and said.code == ErrorCode.UNKNOWN_SESSION


async def test_two_threads_looking_first_get_one_object() -> None:
    made.clear()
    peer = _peer()
    _fail(peer)  # (the loop has not handled the failure yet)
    barrier = threading.Barrier(2)
    seen: list[object] = []

    def look() -> None:
        barrier.wait()
        seen.append(peer.broken)

    threads = [threading.Thread(target=look) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 2 and seen[0] is seen[1] and len(made) == 2
