"""``Transfer.attach()`` once the application took a layer of the transfer is refused
(the destination would silently lack that layer while the transfer reports complete);
layers begun but not yet taken are copied into the destination."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

import kvwire
from kvwire.errors import UsageError
from kvwire.paged import PagedDestination, PagedSpec, layer_rows
from tests.conftest import SECRET

pytestmark = pytest.mark.timeout(60)

PAGED = PagedSpec(num_layers=4, block_shape=(2, 64, 128), dtype="float16")


async def _attach_after(take: bool) -> tuple[list[np.ndarray], list[np.ndarray], list[kvwire.Layer], Any]:
    """Send four layers (the last two once released), take the first one from the
    transfer if ``take``, then attach a destination: (the source, the destination's
    caches, the layers taken, what attach() raised)."""
    src = [np.random.default_rng(i).standard_normal((8, 2, 64, 128)).astype(np.float16) for i in range(4)]
    dst = [np.zeros((8, 2, 64, 128), np.float16) for _ in range(4)]
    refused: Any = None
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, chunk_bytes=100_000) as peer:
            go = asyncio.Event()

            async def produce() -> Any:
                for i in range(4):
                    if i == 2:
                        await go.wait()
                    yield layer_rows(PAGED, src[i], [0, 1, 2])

            sending = asyncio.create_task(peer.send("r", PAGED.wire_spec(), produce(), timeout=10))
            transfer = await server.accept(timeout=10)
            it = transfer.__aiter__()
            taken = []
            if take:
                taken.append(await asyncio.wait_for(it.__anext__(), 10))
            else:
                async with asyncio.timeout(10):
                    while transfer._arrived_layers < 1:  # begun, buffered, not taken
                        await asyncio.sleep(0.005)
            try:
                transfer.attach(PagedDestination(PAGED, dst, [5, 6, 7]))
            except UsageError as exc:
                refused = exc
            go.set()
            async with asyncio.timeout(10):
                taken += [layer async for layer in it]
            await asyncio.wait_for(sending, 10)
    return src, dst, taken, refused


async def test_attach_after_a_layer_was_taken_is_refused_and_the_transfer_goes_on() -> None:
    src, dst, taken, refused = await _attach_after(take=True)
    assert isinstance(refused, UsageError)
    assert "already took 1 of the transfer's 4 layers" in str(refused)
    assert sorted(layer.index for layer in taken) == [0, 1, 2, 3]  # from the receive pool, as before
    for layer in taken:
        assert layer.k.tobytes() == np.asarray(layer_rows(PAGED, src[layer.index], [0, 1, 2])[0]).tobytes()
    assert not any(d.any() for d in dst)  # the refused destination got nothing


async def test_attach_with_layers_begun_but_not_taken_puts_every_layer_there() -> None:
    src, dst, taken, refused = await _attach_after(take=False)
    assert refused is None
    assert sorted(layer.index for layer in taken) == [0, 1, 2, 3]
    for i in range(4):
        assert dst[i][[5, 6, 7]].tobytes() == src[i][[0, 1, 2]].tobytes()
