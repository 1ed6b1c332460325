"""atheris harness: the server side of the sans-IO connection, past authentication.

Each input is fed to a fresh server ``Connection`` that a real handshake with a known
secret (fixed nonces) has already opened (a clone of one opened once), so the fuzzer spends its time on the frames
an authenticated client can send.  The first input byte chooses whether to skip the
handshake (top bit: pre-auth fuzzing), whether to fix every frame's CRC (bit 6: so mutated
bodies reach the parsers and handlers) and how to split the rest into reads (low 6 bits).

Nothing may escape ``receive_data``; the state afterwards must be a server state; a
closed connection reports exactly one ConnectionClosed carrying a KvwireError or None.

    python fuzz/fuzz_server.py fuzz/corpus/server -runs=20000
"""

from __future__ import annotations

import os
import sys

import atheris

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

with atheris.instrument_imports():
    import kvwire
    from kvwire.wire import Connection, ConnectionClosed, State

from _common import (
    Cloner,
    check_cloner,
    fix_crcs,
    handshake_bytes,
    new_server,
    pump,
)
from make_corpus import whole_transfer

HELLO, AUTH = handshake_bytes()


def opened() -> Connection:
    conn = new_server()
    for part in (HELLO, AUTH):
        conn.receive_data(part)
        pump(conn)
    assert conn.state is State.OPEN
    return conn


# Inputs that start authenticated start from a clone of this connection: the same state
# as replaying HELLO and AUTH, at a fraction of the cost.  Checked here: a clone equals a
# replayed handshake, and using a clone leaves the original as it was.
OPENED = opened()
clone_opened = Cloner(OPENED)
check_cloner(clone_opened, opened, lambda conn: (conn.receive_data(whole_transfer()), pump(conn)))

SERVER_STATES = {
    State.SERVER_AWAIT_HELLO, State.SERVER_CHALLENGE_SENT, State.SERVER_AUTHENTICATED,
    State.OPEN, State.CLOSED,
}


def TestOneInput(data: bytes) -> None:
    if not data:
        return
    mode, rest = data[0], data[1:]
    if mode & 0x40:  # fix every CRC so mutated bodies reach the state machine
        rest = fix_crcs(rest)
    events: list[object] = []
    # Most inputs start authenticated (HELLO and AUTH already in); 0x80: the handshake itself.
    conn = clone_opened() if mode & 0x80 == 0 else new_server()
    step = (mode & 0x3F) + 1
    for i in range(0, len(rest), step):
        conn.receive_data(rest[i : i + step])
        events += pump(conn)
    assert conn.state in SERVER_STATES, conn.state
    closed = [e for e in events if isinstance(e, ConnectionClosed)]
    assert len(closed) <= 1, closed
    if conn.state is State.CLOSED:
        assert len(closed) == 1
        assert closed[0].error is None or isinstance(closed[0].error, kvwire.KvwireError)
    conn.handle_timer(1e9)
    pump(conn)


def main() -> None:
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
