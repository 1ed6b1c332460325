"""Client and server options are checked when they are made: a value that cannot work
(a float count, an infinite timeout, a socket option out of range, a spec that is not one)
is a UsageError there, not an internal error, a hang or a TypeError on the first
connection."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest

import kvwire
from kvwire.errors import UsageError
from kvwire.session.options import ClientOptions, ServerOptions, make_server_options
from tests.conftest import SECRET, make_layers

BAD_CLIENT: list[dict[str, Any]] = [
    {"notsent_lowat": "1MiB"},
    {"notsent_lowat": 1.5},
    {"notsent_lowat": 1 << 32},
    {"notsent_lowat": -1},
    {"chunk_bytes": math.inf},
    {"chunk_bytes": 4e6},
    {"spec": "llama"},
    {"max_frame_size": None},
    {"max_frame_size": "x"},
    {"max_streams": 100},
    {"max_streams": 4.0},
    {"reconnect_attempts": 2.5},
    {"connect_timeout": math.inf},
    {"idle_timeout": math.nan},
]

BAD_SERVER: list[dict[str, Any]] = [
    {"window": math.inf},
    {"window": math.nan},
    {"window": 1e9},
    {"window": "big"},
    {"window": 1 << 64},
    {"max_transfers": 2.5},
    {"max_transfers": math.inf},
    {"max_transfers": 1 << 32},
    {"transfer_buffer_bytes": 1e9},
    {"notsent_lowat": "x"},
    {"handshake_timeout": math.inf},
    {"transfer_timeout": math.inf},
    {"max_meta_bytes": True},
]


@pytest.mark.parametrize("options", BAD_CLIENT, ids=lambda o: repr(o))
def test_a_client_option_that_cannot_work_is_refused_up_front(options: dict[str, Any]) -> None:
    with pytest.raises(UsageError, match=next(iter(options))):
        ClientOptions(**options)


@pytest.mark.parametrize("options", BAD_SERVER, ids=lambda o: repr(o))
def test_a_server_option_that_cannot_work_is_refused_up_front(options: dict[str, Any]) -> None:
    with pytest.raises(UsageError, match=next(iter(options))):
        ServerOptions(**options)


def test_codecs_given_as_one_string_are_refused() -> None:
    with pytest.raises(UsageError, match="list of codec names"):
        make_server_options(codecs="raw")
    assert make_server_options(codecs=["raw"]).codecs == ("raw",)


def test_specs_is_refused_pointing_at_spec() -> None:
    # it failed with "unknown server option: ... got multiple values for keyword argument 'specs'"
    spec = kvwire.KVSpec(num_layers=2, num_kv_heads=1, head_dim=2)
    with pytest.raises(UsageError, match="spec="):
        kvwire.serve("127.0.0.1", 0, secret=b"s" * 32, specs=[spec])  # type: ignore[call-arg]
    assert kvwire.serve("127.0.0.1", 0, secret=b"s" * 32, spec=[spec]).options.specs == (spec,)


def test_server_hostname_without_ssl_is_refused() -> None:
    # it was ignored: the connection went out as plain TCP, checking no certificate
    with pytest.raises(UsageError, match=r"server_hostname= .* needs ssl="):
        kvwire.connect("127.0.0.1", 1, secret=SECRET, server_hostname="localhost")


def test_the_defaults_and_ordinary_values_still_work() -> None:
    ClientOptions()
    ServerOptions()
    ClientOptions(notsent_lowat=None, idle_timeout=None, reconnect_attempts=0, max_streams=64)
    ServerOptions(window=1 << 40, max_transfers=(1 << 32) - 1, transfer_timeout=None, claim_timeout=None)


async def test_a_large_window_written_as_an_int_reaches_the_client() -> None:
    """The largest values the options take are the ones the wire carries."""
    spec = kvwire.KVSpec(num_layers=2, num_kv_heads=2, head_dim=16)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, window=10**9, max_transfers=(1 << 32) - 1) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, notsent_lowat=(1 << 31) - 1) as peer:
            receive = asyncio.ensure_future(server.expect("r", timeout=10))
            await peer.send("r", spec, make_layers(2, 8, 2, 16), timeout=10)
            await (await receive).collect(timeout=10)


async def test_with_auto_streams_the_in_flight_floor_is_for_the_streams_in_use() -> None:
    """streams="auto" opens max_streams connections but starts on one: two chunks queued
    per stream in use, not per connection opened (four times the queue with 4)."""
    from kvwire.control import InflightController

    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, streams="auto", max_streams=4) as peer:
            in_use = peer.active_streams
            assert in_use < 4
            chunk = ClientOptions().chunk_bytes
            assert peer.inflight.floor_bytes == InflightController(streams=in_use, chunk_bytes=chunk).floor_bytes
            assert peer.inflight.floor_bytes < InflightController(streams=4, chunk_bytes=chunk).floor_bytes


# 10**400: an int past the largest float (math.isfinite() raised OverflowError for it).
BAD_SECONDS: list[Any] = [-5, 0, math.nan, math.inf, -math.inf, True, "1", 10**400, -(10**400)]


@pytest.mark.parametrize("value", BAD_SECONDS, ids=lambda v: "-10**400" if v == -(10**400) else "10**400" if v == 10**400 else repr(v))
async def test_a_timeout_of_a_call_that_cannot_work_is_refused_up_front(value: Any) -> None:
    """send(timeout=, deadline=), expect/accept/collect(timeout=) follow serve()'s rule for
    its timeouts: a finite number > 0, or None for no limit; not a send that times out at
    once (-5) or never (nan, inf), and nothing is sent."""
    spec = kvwire.KVSpec(num_layers=2, num_kv_heads=2, head_dim=16)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, codec="auto") as peer:
            with pytest.raises(UsageError, match="timeout"):
                await peer.send("t", spec, make_layers(2, 4, 2, 16), timeout=value)
            with pytest.raises(UsageError, match="deadline"):
                await peer.send("d", spec, make_layers(2, 4, 2, 16), deadline=value)
            with pytest.raises(UsageError, match="timeout"):
                await server.expect("t", timeout=value)
            with pytest.raises(UsageError, match="timeout"):
                await server.accept(timeout=value)
            await peer.send("c", spec, make_layers(2, 4, 2, 16), timeout=30)
            transfer = await server.expect("c", timeout=30)
            with pytest.raises(UsageError, match="timeout"):
                await transfer.collect(timeout=value)
            assert len((await transfer.collect(timeout=30)).layers) == 2  # refused, not consumed
            assert server.statistics()["pending_arrivals"] == 0  # "t" and "d" never went out


async def test_an_empty_codec_name_is_refused_not_the_peers_codec() -> None:
    spec = kvwire.KVSpec(num_layers=2, num_kv_heads=2, head_dim=16)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, codec="int8") as peer:
            with pytest.raises(UsageError, match="unknown codec ''"):
                await peer.send("e", spec, make_layers(2, 4, 2, 16), codec="")
            receipt = await peer.send("n", spec, make_layers(2, 4, 2, 16), codec=None)
            assert receipt.codec == "int8"
