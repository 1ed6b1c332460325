"""Calls that ``mypy --strict`` must accept, with the types it must infer (checked by
tests/test_typing.py; never run)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import assert_type

import numpy as np

import kvwire
from kvwire.aio import Peer, Receipt, Server

Pair = tuple[np.ndarray, np.ndarray]


def produce(n: int) -> Iterator[Pair]:
    for _ in range(n):
        yield np.zeros((4, 2, 8), np.float16), np.zeros((4, 2, 8), np.float16)


async def produce_async(n: int) -> AsyncIterator[Pair]:
    for pair in produce(n):
        yield pair


async def use(spec: kvwire.KVSpec, layers: list[Pair]) -> None:
    server = kvwire.serve("127.0.0.1", 0, secret=b"0123456789", window=1 << 20,
                          idle_timeout=None, codecs=["raw", "fp8"], device="cpu")
    assert_type(server, Server)
    peer = kvwire.connect("h", 1, secret=b"0123456789", streams="auto", codec="fp8",
                          chunk_bytes=1 << 20, spec=spec, idle_timeout=5.0)
    assert_type(peer, Peer)
    assert_type(kvwire.connect("h", 1, secret=b"0123456789", streams=4), Peer)
    async with peer:
        assert_type(await peer.send("a", spec, layers), Receipt)
        assert_type(await peer.send("b", spec, produce(2), meta={"k": 1}), Receipt)
        assert_type(await peer.send("c", spec, produce_async(2), codec="auto"), Receipt)
        assert_type(await peer.send("d", spec, tuple(layers)), Receipt)
