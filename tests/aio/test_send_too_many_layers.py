"""A producer yielding more (or fewer) layers than ``spec.num_layers``: send() raises the
UsageError the docs name, whatever the codec (raw, a fixed quantizer, ``auto`` choosing
raw or a quantizer), the source (a list, an iterator, an async iterator) and however the
read past the last layer interleaves with the last layer's chunks being encoded and
handed on (an async producer that lets the loop run 0, 1, 3 or 8 times there, with the
last layer cut into several chunks encoded ahead on the workers); never an internal
error of the send pipeline's bookkeeping.  Real loopback sockets."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import kvwire
from tests.aio.arrival_helpers import received
from tests.conftest import SECRET, make_layers

pytestmark = pytest.mark.timeout(120)

SPEC = kvwire.KVSpec(num_layers=2, num_kv_heads=2, head_dim=32)
TOKENS = 256
#: K or V of one layer is 32 KiB: with 8 KiB chunks each layer is several chunks, encoded ahead.
CHUNK_BYTES = 8 * 1024


def layers() -> list[tuple[np.ndarray, np.ndarray]]:
    return make_layers(SPEC.num_layers, TOKENS, SPEC.num_kv_heads, SPEC.head_dim, seed=5)


def iterator(data: list[Any], count: int) -> Iterator[Any]:
    for i in range(count):
        yield data[i % len(data)]


async def async_iterator(data: list[Any], count: int, pauses: int) -> AsyncIterator[Any]:
    """``count`` layers; the read past the last layer (the one after layer
    ``num_layers - 1``) lets the loop run ``pauses`` times first, while the last layer's
    chunks are being encoded and handed on."""
    for i in range(count + 1):
        if i == SPEC.num_layers:
            for _ in range(pauses):
                await asyncio.sleep(0)
        if i == count:
            return
        yield data[i % len(data)]


def forced_auto(peer: kvwire.Peer, codec: str) -> None:
    """``auto``'s chooser picks ``codec`` for every chunk (its measurements still taken)."""
    chooser = peer.chooser
    assert chooser is not None
    chooser.choose = lambda *args, **kwargs: SimpleNamespace(codec=codec)  # type: ignore[method-assign,assignment]


CODECS = [("raw", None), ("fp8", None), ("auto", None), ("auto", "raw"), ("auto", "int8")]
SOURCES = ["iterator", "async0", "async1", "async3", "async8"]


def source(kind: str, data: list[Any], count: int) -> Any:
    if kind == "list":
        return [data[i % len(data)] for i in range(count)]
    if kind == "iterator":
        return iterator(data, count)
    return async_iterator(data, count, int(kind.removeprefix("async")))


async def outcome(codec: str, forced: str | None, kind: str, count: int) -> tuple[BaseException | None, Any]:
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server, \
            kvwire.connect("127.0.0.1", server.port, secret=SECRET, codec=codec, chunk_bytes=CHUNK_BYTES) as peer:
        if forced is not None:
            forced_auto(peer, forced)
        rx = asyncio.create_task(received(server, "r")) if kind != "list" else None
        error: BaseException | None = None
        try:
            await peer.send("r", SPEC, source(kind, layers(), count), timeout=20)
        except kvwire.KvwireError as exc:
            error = exc
        got = await rx if rx is not None else None
        # The session goes on.
        nxt = asyncio.create_task(received(server, "next"))
        await peer.send("next", SPEC, layers(), timeout=20)
        assert not isinstance(await nxt, kvwire.KvwireError)
        return error, got


@pytest.mark.parametrize(("codec", "forced"), CODECS)
@pytest.mark.parametrize("kind", SOURCES)
async def test_a_layer_too_many_is_a_usage_error(codec: str, forced: str | None, kind: str) -> None:
    error, got = await outcome(codec, forced, kind, SPEC.num_layers + 1)
    assert type(error) is kvwire.UsageError, repr(error)
    assert str(error) == f"layers yielded more than spec.num_layers={SPEC.num_layers}"
    assert isinstance(got, kvwire.TransferAbortedError), repr(got)


@pytest.mark.parametrize(("codec", "forced"), CODECS)
@pytest.mark.parametrize("kind", SOURCES)
async def test_a_layer_too_few_is_a_usage_error(codec: str, forced: str | None, kind: str) -> None:
    error, got = await outcome(codec, forced, kind, SPEC.num_layers - 1)
    assert type(error) is kvwire.UsageError, repr(error)
    assert str(error) == f"layers yielded {SPEC.num_layers - 1} layers, spec.num_layers={SPEC.num_layers}"
    assert isinstance(got, kvwire.TransferAbortedError), repr(got)


@pytest.mark.parametrize("count", [SPEC.num_layers - 1, SPEC.num_layers + 1])
@pytest.mark.parametrize("codec", ["raw", "fp8", "auto"])
async def test_a_list_of_the_wrong_length_is_refused_before_begin(codec: str, count: int) -> None:
    error, _ = await outcome(codec, None, "list", count)
    assert type(error) is kvwire.UsageError, repr(error)
    assert str(error) == f"layers has {count} layers, spec.num_layers={SPEC.num_layers}"
