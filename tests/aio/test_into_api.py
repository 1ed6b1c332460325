"""Receiving into caller memory, the API's edges: one destination per transfer, none for a
transfer that ended, ``into=`` refused at once on a GPU server, a destination that
refuses the cache fails the transfer, and ``collect()`` is not for such a transfer."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

import kvwire
from kvwire.errors import (
    ErrorCode,
    KvwireError,
    LimitExceededError,
    TransferAbortedError,
    UsageError,
)
from kvwire.paged import PagedDestination, PagedSource, PagedSpec
from tests.conftest import SECRET

pytestmark = pytest.mark.timeout(60)

SPEC = PagedSpec(num_layers=3, block_shape=(2, 16, 8, 64), dtype="float16")


def filled(num_blocks: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((num_blocks, *SPEC.block_shape), dtype=np.float32).astype(np.float16)
            for _ in range(SPEC.num_layers)]


def zeros(num_blocks: int) -> list[np.ndarray]:
    return [np.zeros((num_blocks, *SPEC.block_shape), np.float16) for _ in range(SPEC.num_layers)]


class RefusingDestination(PagedDestination):
    """A destination whose ``check()`` fails with an error of its own (not a KvwireError)."""

    def check(self, spec: kvwire.KVSpec, layer_tokens: int | None = None) -> None:
        raise RuntimeError("this destination takes nothing")


async def test_a_second_destination_is_refused_and_the_first_keeps_the_layers() -> None:
    src = filled(4, seed=1)
    first, second = zeros(4), zeros(4)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, chunk_bytes=1 << 20) as peer:
            waiting = asyncio.create_task(server.expect("req", into=PagedDestination(SPEC, first, [0, 1]), timeout=10))
            await asyncio.sleep(0)
            sending = asyncio.create_task(peer.send("req", SPEC.wire_spec(), PagedSource(SPEC, src, [2, 3]), timeout=10))
            transfer = await waiting
            with pytest.raises(UsageError, match="already has a destination"):
                transfer.attach(PagedDestination(SPEC, second, [0, 1]))
            layers = [layer async for layer in transfer]
            await sending  # the refused attach left the transfer going
    assert sorted(layer.index for layer in layers) == list(range(SPEC.num_layers))
    for layer in layers:
        assert layer.k is first[layer.index]
        assert first[layer.index][[0, 1]].tobytes() == src[layer.index][[2, 3]].tobytes()
        assert not second[layer.index].any()


async def test_attach_refuses_what_is_not_a_destination_and_leaves_the_transfer_as_it_was() -> None:
    src = filled(4, seed=3)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            sending = asyncio.create_task(peer.send("req", SPEC.wire_spec(), PagedSource(SPEC, src, [2, 3]), timeout=10))
            transfer = await server.accept(timeout=10)
            with pytest.raises(UsageError, match=r"into= must be a destination.*without check\(\), view\(\)"):
                transfer.attach(object())
            with pytest.raises(UsageError, match="not None"):
                transfer.attach(None)
            layers = [layer async for layer in transfer]  # the transfer went on as before
            await asyncio.wait_for(sending, 10)
    assert [layer.k.tobytes() for layer in layers] == [s[[2, 3]][:, 0].tobytes() for s in src]


@pytest.mark.parametrize("end", ["aborted", "all-taken"])
async def test_attach_to_a_transfer_that_ended_raises_a_kvwire_error(end: str) -> None:
    src = filled(4, seed=2)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            sending = asyncio.create_task(peer.send("req", SPEC.wire_spec(), PagedSource(SPEC, src, [2, 3]), timeout=10))
            transfer = await server.accept(timeout=10)
            if end == "aborted":
                transfer.abort("not wanted")
            else:
                assert len([layer async for layer in transfer]) == SPEC.num_layers
            await asyncio.gather(sending, return_exceptions=True)
            dst = zeros(4)
            expected = TransferAbortedError if end == "aborted" else UsageError
            with pytest.raises(expected):
                transfer.attach(PagedDestination(SPEC, dst, [0, 1]))
    assert not any(d.any() for d in dst)


async def test_into_on_a_gpu_server_is_refused_before_any_transfer() -> None:
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        server.on_gpu = True  # what a device="gpu" server sets (no GPU is needed to refuse)
        with pytest.raises(UsageError, match="device='cpu'"):
            await server.expect("req", into=PagedDestination(SPEC, zeros(4), [0, 1]), timeout=2)


async def test_a_destination_that_refuses_the_cache_fails_the_transfer_it_was_waiting_for() -> None:
    src = filled(4, seed=3)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            waiting = asyncio.create_task(
                server.expect("req", into=RefusingDestination(SPEC, zeros(4), [0, 1]), timeout=5))
            await asyncio.sleep(0)
            sending = asyncio.create_task(peer.send("req", SPEC.wire_spec(), PagedSource(SPEC, src, [2, 3]), timeout=10))
            with pytest.raises(KvwireError, match="takes nothing") as refused:
                await waiting
            with pytest.raises(KvwireError) as failed:
                await sending
            stats = server.statistics()
    # The same error on both sides, as for a destination refusing the cache as it arrives.
    for err in (refused.value, failed.value):
        assert err.code == ErrorCode.INTERNAL_ERROR
        assert str(err) == ("the destination of transfer 'req' refused the cache: "
                            "its check() raised RuntimeError('this destination takes nothing')")
    assert isinstance(refused.value.__cause__, RuntimeError)
    assert stats["pending_arrivals"] == 0 and stats["buffered_bytes"] == 0


async def test_a_destination_that_refuses_an_arrived_cache_fails_the_transfer() -> None:
    src = filled(4, seed=4)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            await peer.send("req", SPEC.wire_spec(), PagedSource(SPEC, src, [2, 3]), timeout=10)  # held, unclaimed
            assert server.statistics()["buffered_bytes"] > 0
            with pytest.raises(KvwireError, match=r"its check\(\) raised RuntimeError\('this destination takes nothing'\)") as refused:
                await server.expect("req", into=RefusingDestination(SPEC, zeros(4), [0, 1]), timeout=5)
            assert refused.value.code == ErrorCode.INTERNAL_ERROR
            assert isinstance(refused.value.__cause__, RuntimeError)
            stats = server.statistics()
    assert stats["pending_arrivals"] == 0 and stats["buffered_bytes"] == 0  # nothing held for nobody


async def test_collect_is_refused_for_a_transfer_with_a_destination() -> None:
    src = filled(4, seed=5)
    dst = zeros(4)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            waiting = asyncio.create_task(server.expect("req", into=PagedDestination(SPEC, dst, [0, 1]), timeout=10))
            await asyncio.sleep(0)
            sending = asyncio.create_task(peer.send("req", SPEC.wire_spec(), PagedSource(SPEC, src, [2, 3]), timeout=10))
            transfer = await waiting
            with pytest.raises(UsageError, match="async for"):
                await transfer.collect(timeout=10)
            layers = [layer async for layer in transfer]  # the refused collect() took nothing
            await sending
    assert len(layers) == SPEC.num_layers
    assert all(dst[i][[0, 1]].tobytes() == src[i][[2, 3]].tobytes() for i in range(SPEC.num_layers))


async def test_a_transfer_being_collected_takes_no_destination() -> None:
    src = filled(4, seed=6)
    dst = zeros(4)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            sending = asyncio.create_task(peer.send("req", SPEC.wire_spec(), PagedSource(SPEC, src, [2, 3]), timeout=10))
            transfer = await server.accept(timeout=10)
            collecting: asyncio.Task[Any] = asyncio.create_task(transfer.collect(timeout=10))
            await asyncio.sleep(0)  # collect() has claimed the transfer
            with pytest.raises(UsageError, match="collected"):
                transfer.attach(PagedDestination(SPEC, dst, [0, 1]))
            cache = await collecting
            await sending
    assert cache.num_tokens == SPEC.tokens(2)
    assert not any(d.any() for d in dst)


class _Failing(PagedDestination):
    """A paged destination whose ``method()`` raises ``error``: ``check()`` only once it
    is told the layer size (once the cache's size is known)."""

    def __init__(self, method: str, error: Exception, *args: Any) -> None:
        super().__init__(*args)
        self.method, self.error = method, error

    def check(self, spec: kvwire.KVSpec, layer_tokens: int | None = None) -> None:
        super().check(spec, layer_tokens)
        if self.method == "check" and layer_tokens is not None:
            raise self.error

    def write(self, *args: Any) -> None:
        if self.method == "write":
            raise self.error
        super().write(*args)


class FailingDestination(_Failing):
    """A destination whose ``method`` raises ``error`` while the cache arrives (its
    ``check()`` once the cache's size is known, or a call that takes a chunk)."""

    def view(self, *args: Any) -> Any:
        if self.method == "view":
            raise self.error
        return None if self.method == "write" else super().view(*args)

    def ranges(self, *args: Any) -> Any:
        if self.method == "ranges":
            raise self.error
        return None if self.method in ("view", "write") else super().ranges(*args)

    def regions(self, *args: Any) -> Any:
        return None  # each chunk through view()/ranges()/write()


async def _send_into(dest: PagedDestination, codec: str) -> tuple[BaseException | None, BaseException | None]:
    """Send a cache into ``dest``, named before the cache arrives: (the sender's error,
    the receiving application's)."""
    src = filled(4, seed=7)
    received: BaseException | None = None
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, codec=codec, chunk_bytes=4096) as peer:
            waiting = asyncio.create_task(server.expect("req", into=dest, timeout=10))
            await asyncio.sleep(0)
            sending = asyncio.create_task(peer.send("req", SPEC.wire_spec(), PagedSource(SPEC, src, [2, 3]), timeout=10))
            transfer = await asyncio.wait_for(waiting, 10)
            try:
                async with asyncio.timeout(10):
                    async for _ in transfer:
                        pass
            except KvwireError as exc:
                received = exc
            sent = (await asyncio.wait_for(asyncio.gather(sending, return_exceptions=True), 10))[0]
    return sent, received


@pytest.mark.parametrize(("method", "codec"), [("check", "raw"), ("view", "raw"), ("write", "raw"), ("ranges", "fp8")])
async def test_a_destination_failing_while_the_cache_arrives_is_its_error_not_the_peers(method: str, codec: str) -> None:
    # Not PROTOCOL_ERROR "chunk could not be decoded": the destination failed, and both
    # sides say so (INTERNAL_ERROR, as for a destination refusing an arrived transfer).
    dest = FailingDestination(method, ValueError("engine says: no room for this request"), SPEC, zeros(4), [0, 1])
    sent, received = await _send_into(dest, codec)
    for err in (sent, received):
        assert type(err) is KvwireError, repr(err)
        assert err.code == ErrorCode.INTERNAL_ERROR
        assert f"its {method}() raised ValueError('engine says: no room for this request')" in str(err)
        assert "destination" in str(err)


async def test_a_destinations_own_kvwire_error_fails_the_transfer_as_it_is() -> None:
    dest = FailingDestination("write", LimitExceededError("the engine has no free blocks"), SPEC, zeros(4), [0, 1])
    sent, received = await _send_into(dest, "raw")
    for err in (sent, received):
        assert type(err) is LimitExceededError, repr(err)
        assert err.code == ErrorCode.LIMIT_EXCEEDED
        assert "the engine has no free blocks" in str(err)


class LateFailingDestination(_Failing):
    """A destination attached late whose ``method()`` raises ``error`` (``check()`` as
    attach() tells it the layer size once a layer is buffered; ``layer()`` too)."""

    def layer(self, index: int) -> Any:
        if self.method == "layer":
            raise self.error
        return super().layer(index)


async def _attach_late(dest: PagedDestination) -> tuple[BaseException | None, BaseException | None]:
    """Send a cache and give it ``dest`` once its first layer is buffered, the rest not yet
    sent (one layer's buffer per transfer): (the sender's error, the receiving
    application's, from ``attach()`` or from taking the layers)."""
    src = filled(4, seed=8)
    received: BaseException | None = None
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, transfer_buffer_bytes=64 * 1024) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, codec="raw") as peer:
            sending = asyncio.create_task(peer.send("req", SPEC.wire_spec(), PagedSource(SPEC, src, [2, 3]), timeout=10))
            transfer = await server.accept(timeout=10)
            async with asyncio.timeout(10):
                while transfer._arrived_layers < 1:
                    await asyncio.sleep(0.005)
            assert not transfer.complete  # the sender is still sending: it can be told
            try:
                transfer.attach(dest)
                async with asyncio.timeout(10):
                    async for _ in transfer:
                        pass
            except Exception as exc:
                received = exc
            sent = (await asyncio.wait_for(asyncio.gather(sending, return_exceptions=True), 10))[0]
            stats = server.statistics()
    assert stats["pending_arrivals"] == 0 and stats["buffered_bytes"] == 0
    return sent, received


@pytest.mark.parametrize(("method", "what"), [("check", "refused the cache"), ("write", "failed to take layer 0"),
                                              ("layer", "failed to give layer 0")])
async def test_a_destination_attached_late_failing_fails_the_transfer_on_both_sides(method: str, what: str) -> None:
    # check() as it is attached, write() copying the layer that arrived before it, layer()
    # handing that layer out: the same error on both sides as a destination failing while
    # the cache arrives, never the raw exception nor the sender's success.
    original = ValueError("engine says: no room for this request")
    sent, received = await _attach_late(LateFailingDestination(method, original, SPEC, zeros(4), [0, 1]))
    for err in (sent, received):
        assert type(err) is KvwireError, repr(err)
        assert err.code == ErrorCode.INTERNAL_ERROR
        assert str(err) == (f"the destination of transfer 'req' {what}: "
                            f"its {method}() raised ValueError('engine says: no room for this request')")
    assert received is not None and received.__cause__ is original


async def test_a_destination_attached_late_failing_with_its_own_kvwire_error_fails_the_transfer_with_it() -> None:
    sent, received = await _attach_late(
        LateFailingDestination("write", LimitExceededError("the engine has no free blocks"), SPEC, zeros(4), [0, 1]))
    for err in (sent, received):
        assert type(err) is LimitExceededError, repr(err)
        assert "the engine has no free blocks" in str(err)
