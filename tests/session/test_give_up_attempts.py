"""How many connections a slot given up tried, as its error says: a broken stream's
reconnects (the connection that broke is no attempt: with reconnect_attempts=5 it said 6),
a join's first connection and its retries."""

from __future__ import annotations

import pytest

from kvwire.errors import ConnectionLostError, ErrorCode
from kvwire.session.sender import SenderConfig, SenderCore, StreamGivenUp
from tests.session.sender_harness import SECRET, Harness


@pytest.mark.parametrize("attempts", [1, 2, 5])
@pytest.mark.parametrize("how", ["connect-refused", "goaway-timeout-in-handshake"])
def test_a_broken_stream_given_up_names_the_reconnects_it_tried(attempts: int, how: str) -> None:
    h = Harness(SenderCore(SenderConfig(secret=SECRET, streams=2, codecs=("raw",), reconnect_attempts=attempts,
                                        reconnect_backoff=0.1)))
    h.step()
    assert h.core.open_streams == [0, 1]
    if how == "connect-refused":
        h.unreachable.add(1)
    else:
        h.refuse[1] = ErrorCode.TIMEOUT  # a break, resumable: retried
    h.kill(1)
    h.advance(60.0)
    assert h.connects[1] == 1 + attempts  # its first join, then the reconnects after the break
    [given_up] = h.of(StreamGivenUp)
    assert given_up.index == 1 and isinstance(given_up.error, ConnectionLostError)
    plural = "" if attempts == 1 else "s"
    assert f"stream 1 could not reconnect in {attempts} attempt{plural}:" in str(given_up.error)


@pytest.mark.parametrize("attempts", [0, 1, 3])
def test_a_join_given_up_counts_its_first_connection(attempts: int) -> None:
    h = Harness(SenderCore(SenderConfig(secret=SECRET, streams=2, codecs=("raw",), reconnect_attempts=attempts,
                                        reconnect_backoff=0.1)))
    h.unreachable.add(1)
    h.advance(60.0)
    assert h.connects[1] == 1 + attempts
    [given_up] = h.of(StreamGivenUp)
    plural = "" if attempts == 0 else "s"
    assert f"stream 1 could not join the session in {1 + attempts} attempt{plural}:" in str(given_up.error)
