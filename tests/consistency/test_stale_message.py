"""The stale-version message of a block committed under an earlier tenure of the Redis
server: the tenure also changes without a restart or failover (a replica attaching to a
primary holding no replication backlog, the backlog dropped after ``repl-backlog-ttl``),
so the message names the tenure rather than claiming a restart or failover."""

from __future__ import annotations

from kvwire.consistency.core import explain_stale


def test_a_block_from_an_earlier_tenure_says_so() -> None:
    message = str(explain_stale(b"x", 5, 5, False, earlier_server=True))
    assert message == (
        "block b'x' version 5 is committed under an earlier tenure of the Redis server"
        " (it restarted or failed over, or began a new replication history); recompute it"
    )


def test_the_other_reasons_are_unchanged() -> None:
    assert "invalidated or not yet committed" in str(explain_stale(b"x", 5, 5, False))
    assert str(explain_stale(b"x", 5, 5, True)).endswith("is fresh")
