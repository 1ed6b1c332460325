"""serve() takes an IPv6 address in brackets as connect() does (and names it with one
pair of brackets), names its unknown options as connect() does, and a stream count
refused is named."""

from __future__ import annotations

from typing import Any

import pytest

import kvwire
import kvwire.aio.server as server_mod
from kvwire.errors import ConnectionLostError, UsageError
from tests.conftest import SECRET

pytestmark = pytest.mark.timeout(60)


# -- serve()'s host -------------------------------------------------------------------------


def test_serve_takes_an_ipv6_address_in_brackets_as_connect_does() -> None:
    # it was given to the resolver as it was: "cannot listen on [[::1]]:0: Name or service not known"
    assert kvwire.serve("[::1]", 0, secret=SECRET).host == "::1"
    assert kvwire.serve("[fe80::1%lo]", 0, secret=SECRET).host == "fe80::1%lo"
    for host in ("[localhost]", "[::1", "[127.0.0.1]"):
        with pytest.raises(UsageError, match="brackets enclose an IPv6 address only"):
            kvwire.serve(host, 0, secret=SECRET)


async def test_a_bracketed_host_that_cannot_listen_is_named_with_one_pair_of_brackets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def fails(loop: Any, host: str) -> list[Any]:
        raise OSError(99, "Cannot assign requested address")

    monkeypatch.setattr(server_mod, "_passive_addresses", fails)
    with pytest.raises(ConnectionLostError) as info:
        async with kvwire.serve("[::1]", 0, secret=SECRET):
            pass
    assert str(info.value).startswith("cannot listen on [::1]:0: ")


# -- options --------------------------------------------------------------------------------


def test_serve_names_unknown_options_as_connect_does() -> None:
    # it said "unknown server option: ServerOptions.__init__() got an unexpected keyword argument 'windw'"
    with pytest.raises(UsageError, match=r"^unknown serve option\(s\): tmeout, windw$"):
        kvwire.serve("127.0.0.1", 0, secret=SECRET, windw=1, tmeout=2)  # type: ignore[call-arg]


@pytest.mark.parametrize(("streams", "shown"), [("4", "'4'"), (0, "0"), (65, "65")])
def test_a_bad_stream_count_is_named(streams: Any, shown: str) -> None:
    with pytest.raises(UsageError, match=rf"^streams must be an int in \[1, 64\] or 'auto', not {shown}$"):
        kvwire.connect("127.0.0.1", 7070, secret=SECRET, streams=streams)
