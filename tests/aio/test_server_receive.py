"""The server's receive wiring over real sockets: raw payloads land in their layer in place,
other chunks are decoded once, a GPU server sends every chunk to its decoder (checked here
with a host stand-in for the device), and ``statistics()`` keeps its keys."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

import kvwire
from kvwire.aio import _gpu, _receive
from kvwire.aio._receive import ArrayStore
from kvwire.codec import numpy_dtype
from tests.conftest import SECRET, make_layers, same_cache

SPEC = kvwire.KVSpec(num_layers=3, num_kv_heads=4, head_dim=64, dtype="float16")


def counting(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    calls = {"decode": 0, "region": 0}
    decode, region = ArrayStore.decode, ArrayStore.region

    def counted_decode(self: ArrayStore, *args: Any) -> None:
        calls["decode"] += 1
        decode(self, *args)

    def counted_region(self: ArrayStore, *args: Any) -> memoryview | None:
        view = region(self, *args)
        calls["region"] += view is not None
        return view

    monkeypatch.setattr(ArrayStore, "decode", counted_decode)
    monkeypatch.setattr(ArrayStore, "region", counted_region)
    return calls


async def send_and_collect(server: Any, layers: list[Any], *, device: str | None = None, **connect: Any) -> Any:
    async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, **connect) as peer:
        recv = asyncio.create_task(server.expect("r", timeout=20))
        await peer.send("r", SPEC, layers, timeout=20)
        return await (await recv).collect(timeout=20, device=device)


async def test_raw_payloads_are_received_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = counting(monkeypatch)
    layers = make_layers(3, 1024, 4, 64)  # 512 KiB per layer half: chunks above 64 KiB
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        cache = await send_and_collect(server, layers, chunk_bytes=128 * 1024, streams=2)
        stats = server.statistics()
    assert same_cache(cache.layers, layers)
    assert calls["region"] > calls["decode"]  # most chunks never went through a decoder
    for key in ("sessions", "connections", "transfers_accepted", "transfers_refused",
                "pending_arrivals", "buffered_bytes"):
        assert key in stats
    assert stats["transfers_accepted"] == 1 and stats["buffered_bytes"] == 0


async def test_a_small_layer_goes_as_one_kv_chunk_and_lands_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """128 tokens: each layer half is 64 KiB, so a layer's K and V fit one chunk. Layer 0
    goes as a K and a V chunk, the others as one KV chunk each (protocol version 2), and
    each after the first (which tells the server the layer size) is read straight into its
    layer's array."""
    calls = counting(monkeypatch)
    layers = make_layers(3, 128, 4, 64)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            recv = asyncio.create_task(server.expect("r", timeout=20))
            receipt = await peer.send("r", SPEC, layers, timeout=20)
            transfer = await recv
            arrived = [layer async for layer in transfer]
    assert receipt.chunks == 2 + 2
    assert calls == {"decode": 1, "region": 3}
    assert sorted(layer.index for layer in arrived) == [0, 1, 2]
    for layer in arrived:
        k, v = layers[layer.index]
        assert np.array_equal(layer.k, k) and np.array_equal(layer.v, v)
        # the two halves of one pooled array: V right after K
        assert layer.v.ctypes.data == layer.k.ctypes.data + layer.k.nbytes


class HostGpu:
    """Stands in for ``_gpu.GpuReceiver``: "device" arrays are numpy arrays."""

    def __init__(self, device: str) -> None:
        self.decoded = 0

    def empty(self, shape: tuple[int, ...], dtype: str) -> Any:
        return np.empty(shape, numpy_dtype(dtype))

    def decode(self, codec: Any, params: bytes, payload: Any, out: Any, dtype: str, kind: Any) -> None:
        self.decoded += 1
        codec.decode(params, payload, shape=out.shape, dtype=dtype, kind=kind, out=out)


async def test_a_gpu_server_decodes_every_chunk_on_its_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_gpu, "parse_device", lambda device: 0)
    monkeypatch.setattr(_receive, "GpuReceiver", HostGpu)
    calls = counting(monkeypatch)
    layers = make_layers(3, 1024, 4, 64)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, device="gpu") as server:
        gpu = server._store.gpu
        assert isinstance(gpu, HostGpu)
        cache = await send_and_collect(server, layers, device="gpu", chunk_bytes=128 * 1024)
        assert same_cache(cache.layers, layers)
        assert calls["region"] == 0 and gpu.decoded == calls["decode"] > 0
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            recv = asyncio.create_task(server.expect("cpu", timeout=20))
            await peer.send("cpu", SPEC, layers, timeout=20)
            transfer = await recv
            with pytest.raises(kvwire.UsageError):
                await transfer.collect(device="cpu")
            with pytest.raises(kvwire.UsageError):
                transfer.attach(object())
            transfer.abort("test done")


async def test_collect_names_a_device_that_is_no_device_as_such() -> None:
    """collect(device="bogus") on a CPU server is no device at all (the parser serve() uses
    says so), not a hint to serve(device='bogus'); a device this server does not decode
    on is refused too; neither consumes the transfer."""
    layers = make_layers(3, 64, 4, 64)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            recv = asyncio.create_task(server.expect("r", timeout=20))
            await peer.send("r", SPEC, layers, timeout=20)
            transfer = await recv
            for bogus in ("bogus", "gpu:x", "", "CPU", 5):
                with pytest.raises(kvwire.UsageError, match="device must be 'cpu', 'gpu' or 'gpu:N'"):
                    await transfer.collect(device=bogus, timeout=20)
            for gpu_name in ("gpu", "gpu:1"):  # a CPU server: that is what is said, CuPy or not
                with pytest.raises(kvwire.UsageError, match=r"this server decodes on cpu; serve\(device="):
                    await transfer.collect(device=gpu_name, timeout=20)
            assert same_cache((await transfer.collect(device="cpu", timeout=20)).layers, layers)


async def test_a_gpu_server_refuses_a_device_that_is_no_device(monkeypatch: pytest.MonkeyPatch) -> None:
    parse = _gpu.parse_device
    monkeypatch.setattr(_gpu, "parse_device", lambda device: 0 if device in ("gpu", "gpu:0") else parse(device))
    monkeypatch.setattr(_receive, "GpuReceiver", HostGpu)
    layers = make_layers(3, 64, 4, 64)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, device="gpu") as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            recv = asyncio.create_task(server.expect("r", timeout=20))
            await peer.send("r", SPEC, layers, timeout=20)
            transfer = await recv
            with pytest.raises(kvwire.UsageError, match="device must be 'cpu', 'gpu' or 'gpu:N'"):
                await transfer.collect(device="bogus", timeout=20)
            with pytest.raises(kvwire.UsageError, match="decodes on gpu"):
                await transfer.collect(device="cpu", timeout=20)
            assert same_cache((await transfer.collect(device="gpu:0", timeout=20)).layers, layers)


@pytest.mark.parametrize("codec", ["int8", "auto"])
async def test_the_server_reports_its_costs_and_auto_weighs_them(
    monkeypatch: pytest.MonkeyPatch, codec: str,
) -> None:
    """REPORT end to end: the server measures its decode and its CPU per byte received
    (on its loop's thread), tells the client, and ``auto`` takes the decode speeds
    (docs/protocol.md 4.10).  Every pump is an interval here, so reports come at all."""
    from kvwire.aio import client, server

    monkeypatch.setattr(server, "REPORT_INTERVAL", 0.0)
    monkeypatch.setattr(server, "REPORT_MIN_BYTES", 1)
    monkeypatch.setattr(server, "REPORT_MIN_ELEMENTS", 1)
    seen: list[Any] = []
    costs = client.Peer._receiver_costs

    def record(self: client.Peer, ev: Any) -> None:
        seen.append(ev)
        costs(self, ev)

    monkeypatch.setattr(client.Peer, "_receiver_costs", record)
    layers = make_layers(3, 1024, 4, 64)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as srv, \
            kvwire.connect("127.0.0.1", srv.port, secret=SECRET, codec=codec, chunk_bytes=128 * 1024) as peer:
        for i in range(3):
            recv = asyncio.create_task(srv.expect(f"r{i}", timeout=20))
            await peer.send(f"r{i}", SPEC, layers, timeout=20)
            await (await recv).collect(timeout=20)
        stats = peer.statistics()["receiver"]
        chooser = peer.chooser
    assert seen, "no REPORT reached the client"
    assert stats["transport_s_per_gb"] is not None and stats["transport_s_per_gb"] > 0
    reported: dict[str, list[float]] = {}
    for ev in seen:
        for cid, seconds in ev.decode_s_per_element.items():
            assert cid != 0  # raw lands in place: never reported
            reported.setdefault(kvwire.codec.codec_by_id(cid).name, []).append(2 / seconds)
    assert set(stats["decode_gbps"]) == set(reported)
    if codec == "int8":
        assert chooser is None and set(reported) == {"int8"}
        return
    assert chooser is not None and reported  # auto sent some compact chunks (its probes at least)
    assert chooser.receiver_transport_cost is not None
    for name, speeds in reported.items():
        # The first report replaced the prior; later ones are blended in: within their range.
        assert min(speeds) * (1 - 1e-9) <= chooser.decode_speed(name) <= max(speeds) * (1 + 1e-9)


def test_the_cost_meter_reports_per_interval_and_skips_an_idle_one() -> None:
    from kvwire.aio.server import REPORT_IDLE, REPORT_INTERVAL, _CostMeter

    class Core:
        def __init__(self) -> None:
            self.chunk_bytes_received = 0
            self.reports: list[tuple[float | None, dict[int, float]]] = []

        def report(self, transport: float | None, decode: dict[int, float]) -> int:
            self.reports.append((transport, decode))
            return 1

    class Store:
        def __init__(self) -> None:
            self.decoded: dict[int, list[int]] = {}
            self.allocated_ns = 0

    core, store = Core(), Store()
    meter = _CostMeter(core, store)  # type: ignore[arg-type]
    meter.tick(100.0)  # starts the first interval
    core.chunk_bytes_received = 64 << 20
    store.decoded = {2: [1 << 20, 2_000_000], 0: [1 << 20, 500_000]}
    meter.tick(100.0 + REPORT_INTERVAL / 2)  # not yet
    assert core.reports == []
    meter.tick(100.0 + REPORT_INTERVAL)
    [(transport, decode)] = core.reports
    assert decode == {2: pytest.approx(2e-3 / (1 << 20))}  # raw (0) is never reported
    assert transport is None or transport > 0  # the loop's CPU, decoding excluded, per byte
    core.chunk_bytes_received += 64 << 20
    store.decoded = {2: [2 << 20, 4_000_000]}
    idle = 100.0 + REPORT_INTERVAL + 2 * REPORT_IDLE
    meter.tick(idle)  # an idle stretch: no report, a new interval
    assert len(core.reports) == 1
    core.chunk_bytes_received += 64 << 20
    store.decoded = {2: [3 << 20, 5_000_000]}
    meter.tick(idle + REPORT_INTERVAL)
    assert len(core.reports) == 2 and core.reports[1][1] == {2: pytest.approx(1e-3 / (1 << 20))}


def test_the_cost_meter_leaves_out_what_allocating_layers_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slab new to the pool is faulted in once as it is made: not a cost per byte
    received. The loop thread spent 100 ms in an interval: 20 decoding, 70 allocating."""
    from kvwire.aio import server
    from kvwire.aio.server import REPORT_INTERVAL, _CostMeter

    cpu = [0]
    monkeypatch.setattr(server.time, "thread_time_ns", lambda: cpu[0])

    class Core:
        def __init__(self) -> None:
            self.chunk_bytes_received = 0
            self.reports: list[float | None] = []

        def report(self, transport: float | None, decode: dict[int, float]) -> int:
            self.reports.append(transport)
            return 1

    class Store:
        def __init__(self) -> None:
            self.decoded: dict[int, list[int]] = {}
            self.allocated_ns = 5_000_000  # before the interval: not this interval's

    core, store = Core(), Store()
    meter = _CostMeter(core, store)  # type: ignore[arg-type]
    meter.tick(100.0)
    core.chunk_bytes_received = 64 << 20
    store.decoded = {2: [1 << 20, 20_000_000]}
    store.allocated_ns += 70_000_000
    cpu[0] += 100_000_000
    meter.tick(100.0 + REPORT_INTERVAL)
    assert core.reports == [pytest.approx(10e-3 / (64 << 20))]
