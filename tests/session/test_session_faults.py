"""The session cores under faults, without sockets: a sender and a receiver over in-memory
connections with a fake clock; Hypothesis picks drops at frame boundaries, bit flips
anywhere, black holes, allocation failures and receiver restarts.

Invariants, whatever the faults:
- a Receipt (TransferDone) implies the receiving application took exactly the bytes sent;
- every transfer ends, done or with a typed error, within its deadline in fake time;
- the receiver's layers, held or granted, never exceed its budget (what it keeps besides, an
  eighth past it).
"""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvwire.errors import KvwireError
from kvwire.session.receiver import KEPT_ROOM_MIN, ReceiverConfig, byte_buffer
from kvwire.session.sender import SenderConfig, TransferDone
from kvwire.testing.session_pair import SessionPair
from kvwire.wire import Chunk

#: Cases of the fault property test (KVWIRE_FAULT_CASES=10000 for a long run).
CASES = int(os.environ.get("KVWIRE_FAULT_CASES", "400"))
# Hypothesis reports a failing example through code that warns on this Python.
pytestmark = [
    pytest.mark.timeout(max(600, CASES // 4)), pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

SECRET = b"session-secret-01"
HEADS, HEAD_DIM, ITEM = 2, 8, 2
BPT = HEADS * HEAD_DIM * ITEM
DEADLINE = 60.0


def make_transfer(seed: int, layers: int, tokens: int) -> list[tuple[bytes, bytes]]:
    rng = random.Random(seed)
    return [(rng.randbytes(tokens * BPT), rng.randbytes(tokens * BPT)) for _ in range(layers)]


def start(pair: SessionPair, name: str, data: list[tuple[bytes, bytes]], chunk_tokens: int) -> int:
    tokens = len(data[0][0]) // BPT
    tid = pair.sender.begin(name, num_layers=len(data), num_kv_heads=HEADS, head_dim=HEAD_DIM,
                            now=pair.clock.now)
    pair.began_at[tid] = pair.clock.now
    for layer, (k, v) in enumerate(data):
        for kind, blob in ((0, k), (1, v)):
            for start_tok in range(0, tokens, chunk_tokens):
                count = min(chunk_tokens, tokens - start_tok)
                pair.sender.add_chunk(tid, Chunk(
                    transfer_id=tid, layer=layer, kind=kind, codec_id=0, token_start=start_tok,
                    token_count=count, layer_tokens=tokens, params=b"",
                    payload=blob[start_tok * BPT : (start_tok + count) * BPT],
                ))
    pair.sender.producer_done(tid)
    return tid


def configs(streams: int, budget: int) -> tuple[SenderConfig, ReceiverConfig]:
    sender = SenderConfig(secret=SECRET, streams=streams, max_frame_size=64 * 1024, idle_timeout=4.0,
                          connect_timeout=2.0, reconnect_backoff=0.1, reconnect_attempts=4,
                          max_reconnects=12, max_transfer_reconnects=6, transfer_timeout=DEADLINE)
    receiver = ReceiverConfig(secret=SECRET, max_frame_size=64 * 1024, window=128 * 1024,
                              idle_timeout=4.0, handshake_timeout=2.0, resume_timeout=5.0,
                              transfer_timeout=DEADLINE + 10, claim_timeout=30.0,
                              transfer_buffer_bytes=4 * 1024, max_buffer_bytes=budget)
    return sender, receiver


def check_invariants(pair: SessionPair, sent: dict[int, tuple[str, list[tuple[bytes, bytes]]]],
                     budget: int) -> None:
    for tid, (name, data) in sent.items():
        assert tid in pair.outcomes, f"transfer {name} never ended (t={pair.clock.now})"
        began = pair.began_at[tid]
        assert pair.ended_at[tid] <= began + DEADLINE + 1e-9, (name, began, pair.ended_at[tid])
        outcome = pair.outcomes[tid]
        if isinstance(outcome, TransferDone):
            got = pair.delivered.get(name, {})
            assert [got.get(i) for i in range(len(data))] == data, f"receipt for {name} without its bytes"
        else:
            assert isinstance(outcome.error, KvwireError)
    assert pair.max_layers_buffered <= budget  # layers alone within it; the rest an eighth past it at most
    assert pair.max_layers_committed <= budget  # and with the layers granted, not yet begun
    assert pair.max_buffered <= budget + max(budget // 8, KEPT_ROOM_MIN)


def test_clean_run_delivers_every_transfer_exactly() -> None:
    scfg, rcfg = configs(3, 1 << 20)
    pair = SessionPair(scfg, rcfg)
    pair.run(until=1.0)  # handshakes
    sent = {}
    for i in range(4):
        data = make_transfer(i, layers=5, tokens=40)
        sent[start(pair, f"r{i}", data, chunk_tokens=16)] = (f"r{i}", data)
    pair.run(until=DEADLINE + 5)
    check_invariants(pair, sent, 1 << 20)
    assert all(isinstance(o, TransferDone) for o in pair.outcomes.values())
    assert max(pair.ended_at.values()) < 5.0  # nothing waited for a timer


FAULT = st.one_of(
    st.tuples(st.just("drop"), st.just(0)),
    st.tuples(st.just("flip"), st.integers(min_value=0, max_value=8 * 600)),
    st.tuples(st.just("blackhole"), st.just(0)),
)


@settings(max_examples=CASES, deadline=None,
          derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    faults=st.dictionaries(st.integers(min_value=0, max_value=400), FAULT, max_size=6),
    restart=st.sets(st.integers(min_value=0, max_value=400), max_size=1),
    fail_alloc=st.sets(st.integers(min_value=0, max_value=40), max_size=2),
    streams=st.integers(min_value=1, max_value=3),
    transfers=st.integers(min_value=1, max_value=3),
    budget_layers=st.integers(min_value=2, max_value=40),
    aborts=st.dictionaries(st.integers(min_value=0, max_value=300), st.sampled_from(["t0", "t1"]), max_size=1),
)
def test_faults_never_break_the_invariants(
    faults: dict[int, tuple[str, int]], restart: set[int], fail_alloc: set[int], streams: int,
    transfers: int, budget_layers: int, aborts: dict[int, str],
) -> None:
    layer_bytes = 2 * 24 * BPT
    budget = budget_layers * layer_bytes
    calls = [0]

    def allocate(nbytes: int) -> memoryview:
        calls[0] += 1
        if calls[0] - 1 in fail_alloc:
            raise MemoryError
        return byte_buffer(nbytes)

    scfg, rcfg = configs(streams, budget)
    pair = SessionPair(scfg, rcfg, faults=faults, restart_at=frozenset(restart), allocate=allocate,
                       abort_at=aborts)
    pair.run(until=0.5)
    sent = {}
    for i in range(transfers):
        data = make_transfer(i, layers=4, tokens=24)
        try:
            sent[start(pair, f"t{i}", data, chunk_tokens=10)] = (f"t{i}", data)
        except KvwireError:
            assert pair.sender.broken is not None  # the session already failed, typed
    pair.run(until=DEADLINE + 30)
    check_invariants(pair, sent, budget)


def test_black_holed_session_ends_typed_within_the_deadline() -> None:
    scfg, rcfg = configs(2, 1 << 20)
    faults = {n: ("blackhole", 0) for n in range(12, 40)}
    pair = SessionPair(scfg, rcfg, faults=faults)
    pair.run(until=0.5)
    data = make_transfer(1, layers=4, tokens=40)
    sent = {start(pair, "bh", data, chunk_tokens=8): ("bh", data)}
    pair.run(until=DEADLINE + 30)
    check_invariants(pair, sent, 1 << 20)


def test_receiver_restart_fails_the_transfer_with_connection_lost() -> None:
    scfg, rcfg = configs(1, 1 << 20)
    pair = SessionPair(scfg, rcfg, restart_at=frozenset({10}))
    pair.run(until=0.5)
    data = make_transfer(2, layers=4, tokens=40)
    tid = start(pair, "rs", data, chunk_tokens=8)
    pair.run(until=DEADLINE + 30)
    outcome = pair.outcomes[tid]
    assert not isinstance(outcome, TransferDone)
    assert type(outcome.error).__name__ == "ConnectionLostError"


def test_receiver_abort_reaches_the_sender_as_transfer_aborted() -> None:
    scfg, rcfg = configs(2, 1 << 20)
    pair = SessionPair(scfg, rcfg)
    pair.hold.add("ab")  # the application does not take layers: the sender runs out of credit
    pair.run(until=0.5)
    data = make_transfer(3, layers=8, tokens=40)
    tid = start(pair, "ab", data, chunk_tokens=8)
    pair.run(until=1.0)
    assert tid not in pair.outcomes
    pair.receiver.abort(pair.keys["ab"], "no room", pair.clock.now)
    aborted_at = pair.clock.now
    pair.run(until=DEADLINE + 30)
    outcome = pair.outcomes[tid]
    assert not isinstance(outcome, TransferDone)
    assert type(outcome.error).__name__ == "TransferAbortedError"
    assert pair.ended_at[tid] == aborted_at  # promptly: no timer had to fire
    assert pair.receiver.buffered_bytes == 0


def test_registry_gate_refusal_fails_both_sides_before_data_moves() -> None:
    from dataclasses import replace

    from kvwire.errors import StaleVersionError
    from kvwire.wire import BlockVersion

    scfg, rcfg = configs(1, 1 << 20)
    pair = SessionPair(scfg, replace(rcfg, registry=True),
                       registry=lambda blocks: StaleVersionError(f"stale: {blocks[0][0]!r}"))
    pair.run(until=0.5)
    tid = pair.sender.begin("gate", num_layers=1, num_kv_heads=HEADS, head_dim=HEAD_DIM,
                            blocks=(BlockVersion(block=b"i:1", version=3),), now=pair.clock.now)
    pair.run(until=DEADLINE + 30)
    outcome = pair.outcomes[tid]
    assert not isinstance(outcome, TransferDone)
    assert type(outcome.error).__name__ == "StaleVersionError"
    assert type(pair.failed_incoming["gate"]).__name__ == "StaleVersionError"
    assert pair.max_buffered == 0


def test_unclaimed_transfers_count_toward_max_transfers_and_are_dropped_at_claim_timeout() -> None:
    from dataclasses import replace

    scfg, rcfg = configs(1, 1 << 20)
    pair = SessionPair(scfg, replace(rcfg, max_transfers=2))
    pair.claim = False  # nobody calls accept()/expect()
    pair.run(until=0.5)
    sent = {}
    for i in range(3):
        data = make_transfer(10 + i, layers=2, tokens=16)
        sent[start(pair, f"u{i}", data, chunk_tokens=16)] = (f"u{i}", data)
    pair.run(until=5.0)
    kinds = [type(pair.outcomes[t]).__name__ for t in sorted(sent)]
    assert kinds == ["TransferDone", "TransferDone", "TransferFailed"]
    assert type(pair.outcomes[max(sent)].error).__name__ == "LimitExceededError"  # type: ignore[union-attr]
    assert pair.receiver.buffered_bytes == 2 * 2 * (2 * 16 * BPT)
    pair.run(until=rcfg.claim_timeout + 1)  # type: ignore[operator]
    assert pair.receiver.counters["transfers_unclaimed"] == 2
    assert pair.receiver.buffered_bytes == 0


def test_reports_reach_the_sessions_that_sent_data_since_the_last() -> None:
    scfg, rcfg = configs(2, 1 << 20)
    pair = SessionPair(scfg, rcfg)
    pair.run(until=1.0)  # handshakes
    assert pair.receiver.report(1e-9, {1: 2e-10}) == 0  # no CHUNK bytes yet: nobody to tell
    data = make_transfer(0, layers=3, tokens=40)
    start(pair, "r0", data, chunk_tokens=16)
    pair.run(until=DEADLINE)
    assert pair.receiver.chunk_bytes_received > 3 * 2 * 40 * BPT  # payloads and frame overhead
    assert pair.receiver.report(None, {}) == 0  # nothing measured: nothing sent
    assert pair.receiver.report(1.5e-9, {1: 2e-10, 3: 0.0}) == 1
    pair.run(until=DEADLINE + 1)
    [costs] = pair.receiver_costs
    # whole nanoseconds per MiB / per 2^20 elements on the wire
    assert costs.transport_s_per_byte == round(1.5e-9 * 1e9 * (1 << 20)) / 1e9 / (1 << 20)
    assert costs.decode_s_per_element == {1: round(2e-10 * 1e9 * (1 << 20)) / 1e9 / (1 << 20)}
    assert pair.receiver.report(1.5e-9, {}) == 0  # nothing received since
    start(pair, "r1", make_transfer(1, layers=1, tokens=8), chunk_tokens=8)
    pair.run(until=2 * DEADLINE)
    assert pair.receiver.report(100.0, {}) == 1  # beyond a u32: the largest value
    pair.run(until=2 * DEADLINE + 1)
    assert pair.receiver_costs[-1].transport_s_per_byte == 0xFFFFFFFF / 1e9 / (1 << 20)
    assert pair.receiver_costs[-1].decode_s_per_element == {}
    assert all(isinstance(o, TransferDone) for o in pair.outcomes.values())
