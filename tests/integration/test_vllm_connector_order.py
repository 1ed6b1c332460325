"""The vLLM connector's synchronous saves refused for want of room go back to the queue
oldest first, and the whole-number settings (kvwire_chunk_bytes, kvwire_max_transfers,
kvwire_registry_max_connections, kvwire_streams) take what their docs say and nothing that
int() would cut or read otherwise; a value with no repr (an int past 4300 digits) is named
in the error, not a ValueError.  The worker-side connectors are driven step by step, over
real sockets on 127.0.0.1 (the helpers of tests/integration/vllm_workers.py).
"""

from __future__ import annotations

import threading
import warnings
from decimal import Decimal
from fractions import Fraction
from typing import Any

import pytest

from kvwire.errors import UsageError
from tests.integration.vllm_workers import (
    config,
    consume,
    consumer,
    produce,
    producer,
)

with warnings.catch_warnings():  # vLLM's import chain trips torch's own deprecation warnings
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvwire.integrations.vllm import KvwireConnector, KvwireConnectorMetadata, _Move, _SendState

pytestmark = pytest.mark.timeout(180)


def made(role: str, extra: dict[str, Any]) -> KvwireConnector:
    """A scheduler-side connector (it reads every setting, and connects nowhere)."""
    return KvwireConnector(config(role, {"kvwire_peer": "127.0.0.1:9", **extra}), KVConnectorRole.SCHEDULER)


def test_sync_saves_refused_for_room_are_sent_again_oldest_first(workers: list[KvwireConnector]) -> None:
    """A synchronous step's sends a then b, both refused at BEGIN (the consumer's server
    holds max_transfers unclaimed transfers), go back to the queue as they were, a first,
    and a is begun (and sent) first once there is room.  They went back to its head one
    at a time, each ahead of the one refused before it: b was sent first."""
    cons, _ = consumer({"kvwire_max_transfers": 2, "kvwire_load_timeout": 60})
    prod, pkv = producer(cons.listen_port or 0, {"kvwire_load_timeout": 60, "kvwire_async_save": False})
    workers[:] = [prod, cons]

    def move(req_id: str, block: int) -> _Move:
        return _Move(req_id, f"{req_id}#prompt:{block:032x}", [block])

    # u1 and u2 arrive whole (the sync step waits for their acknowledgement) and wait unclaimed
    produce(prod, KvwireConnectorMetadata(saves=[move("u1", 1), move("u2", 2)]), pkv)
    refused, claimed = threading.Event(), threading.Event()
    queue_at_wait: list[list[str]] = []
    sent: list[str] = []
    wait_for_room, ended_well = prod._wait_for_room, prod._ended_well

    def waits_for_the_claim(deadline: float) -> bool:
        # (after the first pass over a and b, both refused: the claim frees the server's
        # room before they are begun again, so the second pass sends both)
        queue_at_wait.append(list(prod._sends_in(_SendState.QUEUED, _SendState.REFUSED)))
        refused.set()
        assert claimed.wait(60)
        return wait_for_room(deadline)

    def records(req_id: str, send: Any, outcome: Any) -> bool:
        well = ended_well(req_id, send, outcome)
        if well:
            sent.append(req_id)
        return well

    prod._wait_for_room = waits_for_the_claim  # type: ignore[method-assign]
    prod._ended_well = records  # type: ignore[method-assign]

    def claim() -> None:
        if refused.wait(60):
            got, _ = consume(cons, KvwireConnectorMetadata(loads=[move("u1", 1), move("u2", 2)]))
            for _ in range(1200):
                if got >= {"u1", "u2"}:
                    break
                threading.Event().wait(0.05)
                got |= consume(cons)[0]
        claimed.set()

    claimer = threading.Thread(target=claim)
    claimer.start()
    try:
        produce(prod, KvwireConnectorMetadata(saves=[move("a", 3), move("b", 4)]), pkv)
    finally:
        refused.set()
        claimed.set()
        claimer.join()
    assert sent == ["a", "b"]
    assert queue_at_wait[0] == ["a", "b"]
    got, _ = consume(cons, KvwireConnectorMetadata(loads=[move("a", 3), move("b", 4)]))
    for _ in range(1200):
        if got >= {"a", "b"}:
            break
        threading.Event().wait(0.05)
        got |= consume(cons)[0]
    assert got >= {"a", "b"}


# -- whole-number settings -----------------------------------------------------------------

HUGE = 10**5000  # (its repr raises ValueError: past sys.get_int_max_str_digits)

NOT_WHOLE: list[object] = [Decimal("2.5"), Fraction(5, 2), Decimal("2"), Fraction(4, 2), b"12", bytearray(b"12"),
                           "2.0", "2.5", "1e3", float("inf"), float("nan"), None, [2]]


@pytest.mark.parametrize(("key", "value"), [
    (key, value)
    for key in ("kvwire_max_transfers", "kvwire_registry_max_connections")
    for value in NOT_WHOLE
    if not (value is None and key == "kvwire_registry_max_connections")  # (None: the registry's default)
])
def test_a_count_setting_refuses_what_int_would_cut_or_read(key: str, value: object) -> None:
    """Decimal('2.5') and Fraction(5, 2) were taken as 2 and b'12' as 12, as int() reads
    them: none is a whole number as the settings' docs mean it."""
    with pytest.raises(UsageError, match=f"{key} must be a whole number"):
        made("kv_consumer", {key: value})


@pytest.mark.parametrize("value", [v for v in NOT_WHOLE if v is not None])
def test_kvwire_chunk_bytes_refuses_what_int_would_cut_or_read(value: object) -> None:
    with pytest.raises(UsageError, match="kvwire_chunk_bytes must be a number of bytes"):
        made("kv_producer", {"kvwire_chunk_bytes": value})


@pytest.mark.parametrize("value", [*NOT_WHOLE, 4.0, True])
def test_kvwire_streams_refuses_what_is_no_int(value: object) -> None:
    with pytest.raises(UsageError, match="kvwire_streams must be an int"):
        made("kv_producer", {"kvwire_streams": value})


@pytest.mark.parametrize(("key", "role", "says"), [
    ("kvwire_max_transfers", "kv_consumer", r"kvwire_max_transfers must be in \[1, 4294967295\], got an int of"),
    ("kvwire_registry_max_connections", "kv_consumer", r"kvwire_registry_max_connections must be in \[1, 65535\], got an int of"),
    ("kvwire_streams", "kv_producer", r"kvwire_streams must be an int in \[1, 64\] or 'auto', got an int of"),
    ("kvwire_load_timeout", "kv_producer", "kvwire_load_timeout must be a number of seconds, got an int of"),
    ("kvwire_async_save", "kv_producer", "kvwire_async_save must be true or false, got an int of"),
])
@pytest.mark.parametrize("sign", [1, -1])
def test_a_huge_int_setting_is_named_by_its_size(key: str, role: str, says: str, sign: int) -> None:
    """An int past 4300 digits: the error's repr of it raised ValueError (float() of it
    OverflowError, str() of it ValueError) instead of the setting's UsageError."""
    with pytest.raises(UsageError, match=says):
        made(role, {key: sign * HUGE})


def test_a_huge_negative_chunk_size_is_named_by_its_size() -> None:
    with pytest.raises(UsageError, match="kvwire_chunk_bytes must be > 0, got an int of"):
        made("kv_producer", {"kvwire_chunk_bytes": -HUGE})


def test_a_long_text_setting_is_cut_in_the_error() -> None:
    with pytest.raises(UsageError, match=r"kvwire_max_transfers must be a whole number, got '(12)+1?\.\.\.$") as caught:
        made("kv_consumer", {"kvwire_max_transfers": "12" * 1000 + "x"})
    assert len(str(caught.value)) < 200


@pytest.mark.parametrize("value", [256, "256", " 256 ", "+256", 256.0])
def test_the_documented_whole_numbers_are_still_taken(value: object) -> None:
    """An int, text of one, a float without a fraction: taken as before."""
    assert made("kv_consumer", {"kvwire_max_transfers": value})._max_transfers == 256
    assert made("kv_consumer", {"kvwire_registry_max_connections": value})._registry_connections == 256
    assert made("kv_producer", {"kvwire_chunk_bytes": value})._chunk_bytes == 256


@pytest.mark.parametrize("value", [4, "4", " 4 ", "+4"])
def test_kvwire_streams_still_takes_an_int_and_its_text(value: object) -> None:
    assert made("kv_producer", {"kvwire_streams": value})._streams == 4


def test_numpy_ints_are_whole_numbers() -> None:
    import numpy as np
    connector = made("kv_producer", {"kvwire_streams": np.int64(4), "kvwire_chunk_bytes": np.int32(65536)})
    assert connector._streams == 4 and connector._chunk_bytes == 65536
    assert type(connector._chunk_bytes) is int
    with pytest.raises(UsageError, match="kvwire_streams must be an int"):
        made("kv_producer", {"kvwire_streams": np.float64(4.0)})
