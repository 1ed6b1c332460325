"""The checks of kvwire.session.options refuse every value that is not what they ask for
with UsageError, an int too large for a float and one whose repr cannot be written
included, where a raw OverflowError or ValueError came out."""

from __future__ import annotations

from typing import Any

import pytest

from kvwire.errors import UsageError
from kvwire.session.options import (
    ClientOptions,
    ServerOptions,
    check_index,
    check_port,
    check_seconds,
    check_value,
    make_server_options,
)

HUGE = 10**400  # past the largest float: math.isfinite() raised OverflowError
ENORMOUS = 10**5000  # past 4300 digits: its repr() raises ValueError


@pytest.mark.parametrize("value", [HUGE, -HUGE, ENORMOUS], ids=["huge", "-huge", "enormous"])
@pytest.mark.parametrize("none_ok,zero_ok", [(False, False), (True, False), (False, True), (True, True)])
def test_an_int_too_large_for_a_float_is_no_finite_number(value: int, none_ok: bool, zero_ok: bool) -> None:
    with pytest.raises(UsageError, match="timeout must be a finite number"):
        check_value("timeout", value, none_ok=none_ok, zero_ok=zero_ok)
    with pytest.raises(UsageError, match="timeout must be a finite number"):
        check_seconds("timeout", value)


@pytest.mark.parametrize("name", ["connect_timeout", "idle_timeout", "reconnect_backoff"])
def test_a_client_timeout_too_large_for_a_float_is_refused(name: str) -> None:
    with pytest.raises(UsageError, match=name):
        ClientOptions(**{name: HUGE})


@pytest.mark.parametrize("name", ["handshake_timeout", "idle_timeout", "transfer_timeout", "claim_timeout",
                                  "resume_timeout"])
def test_a_server_timeout_too_large_for_a_float_is_refused(name: str) -> None:
    with pytest.raises(UsageError, match=name):
        ServerOptions(**{name: HUGE})
    with pytest.raises(UsageError, match=name):
        make_server_options(**{name: ENORMOUS})


def test_a_sync_servers_expect_refuses_a_timeout_too_large_for_a_float() -> None:
    from kvwire.sync import SyncServer
    from tests.conftest import SECRET

    with SyncServer(secret=SECRET) as server:
        with pytest.raises(UsageError, match="timeout"):
            server.expect("x", timeout=HUGE)


def test_large_values_that_are_numbers_still_pass() -> None:
    check_value("timeout", 1e300)
    check_value("timeout", 10**300)  # an int a float holds
    check_seconds("timeout", 2**1000)
    ClientOptions(connect_timeout=10**20)


@pytest.mark.parametrize("call", [
    lambda: check_index("layer", ENORMOUS, 0, 10),
    lambda: check_index("layer", -ENORMOUS, 0),
    lambda: check_port(ENORMOUS, 0),
    lambda: ClientOptions(chunk_bytes=-ENORMOUS),
    lambda: ClientOptions(max_streams=ENORMOUS),
    lambda: ClientOptions(auto_codec=ENORMOUS),
    lambda: ServerOptions(max_transfers=ENORMOUS),
    lambda: ServerOptions(notsent_lowat=ENORMOUS),
], ids=["index", "index-low", "port", "chunk_bytes", "max_streams", "auto_codec", "max_transfers",
        "notsent_lowat"])
def test_a_refused_int_too_long_to_print_is_still_a_usage_error(call: Any) -> None:
    with pytest.raises(UsageError, match="an int of 16610 bits"):
        call()


def test_a_refused_value_is_quoted_short() -> None:
    class Unprintable:
        def __repr__(self) -> str:
            raise RuntimeError("no repr")

    from kvwire.session.options import shown

    assert shown(1.5) == "1.5"
    assert shown("x" * 1000) == repr("x" * 1000)[:80] + "..."
    assert shown(Unprintable()) == "a Unprintable"
    with pytest.raises(UsageError, match="got a Unprintable"):
        check_value("timeout", Unprintable())
