"""Sends with ``codec="auto"``: caches holding values no quantizer carries, a chooser whose
choice the test sets, and a device path faked over host arrays."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

import kvwire
from kvwire.aio import _gpu, _send
from kvwire.codec.base import EncodedChunk
from kvwire.control import CodecChoice, CodecChooser
from tests.conftest import SECRET, make_layers

#: 64 tokens of 2 heads x 16: every K and V is one chunk (layer 0's K too: it is smaller
#: than the lead chunk), 6 chunks a send
TOKENS = 64
#: (layer, 0 for K or 1 for V, token, head, dim) of the values no quantizer carries
BAD_AT = [(1, 0, 5, 1, 3), (2, 1, 63, 0, 0)]


def nonfinite_spec(dtype: str = "float16") -> kvwire.KVSpec:
    return kvwire.KVSpec(num_layers=3, num_kv_heads=2, head_dim=16, dtype=dtype)


def nonfinite_cache(value: float, dtype: str = "float16") -> list[tuple[np.ndarray, np.ndarray]]:
    """Layers with ``value`` at each of :data:`BAD_AT`."""
    layers = make_layers(3, TOKENS, 2, 16, dtype=dtype, seed=11)
    for layer, half, *where in BAD_AT:
        layers[layer][half][tuple(where)] = value
    return layers


def record_choices(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``auto`` chooses the codec appended to the list this gives; the list then holds
    the codec of every size the chooser was told of (the ``chooses`` fixtures)."""
    told: list[str] = []

    def choose(self: CodecChooser, *args: Any, **kwargs: Any) -> CodecChoice:
        return CodecChoice(codec=told[0], delivered_bytes_per_s=1e9, meets_deadline=None)

    observe_size = CodecChooser.observe_size

    def observe(self: CodecChooser, codec: str, fp16_bytes: int, wire_bytes: int) -> None:
        told.append(codec)
        observe_size(self, codec, fp16_bytes, wire_bytes)

    monkeypatch.setattr(CodecChooser, "choose", choose)
    monkeypatch.setattr(CodecChooser, "observe_size", observe)
    return told


async def send_auto(layers: list[tuple[np.ndarray, np.ndarray]], spec: kvwire.KVSpec,
                    **connect: Any) -> tuple[kvwire.Receipt, list[tuple[np.ndarray, np.ndarray]]]:
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, codec="auto", **connect) as peer:
            recv = asyncio.create_task(server.accept())
            receipt = await peer.send("bad", spec, layers, timeout=20)
            cache = await (await recv).collect(timeout=20)
    return receipt, cache.layers


class FakeDevice:
    """A tensor 'on a GPU': only shape, size and nbytes are visible outside the fake."""

    def __init__(self, host: np.ndarray) -> None:
        self.host = host
        self.shape, self.size, self.nbytes, self.dtype = host.shape, host.size, host.nbytes, host.dtype

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        raise BufferError("not readable from the host")


def fake_device_path(monkeypatch: pytest.MonkeyPatch, calls: list[str] | None = None) -> None:
    """The send's device path over :class:`FakeDevice`: raw chunks copied out of it, a
    codec's chunks encoded from its host array (the whole tensor's before the first, as one
    launch would); each copy and encode noted in ``calls``."""
    noted = calls if calls is not None else []

    async def copy_raw_chunks(x: FakeDevice, plan: list[tuple[int, int]]) -> AsyncIterator[tuple[int, int, Any]]:
        noted.append("copy")
        for start, count in plan:
            yield start, count, np.array(x.host[start : start + count])

    async def encode_chunks(codec: Any, x: FakeDevice, kind: Any, plan: list[tuple[int, int]],
                            dtype: str) -> AsyncIterator[tuple[int, int, EncodedChunk]]:
        noted.append(f"encode:{codec.name}")
        # the whole tensor's chunks encoded (one launch) and its flags checked before the first
        encoded = [codec.encode(x.host[start : start + count], kind) for start, count in plan]
        for (start, count), enc in zip(plan, encoded, strict=True):
            payload = np.frombuffer(bytes(enc.payload), dtype=np.uint8).copy().data
            yield start, count, EncodedChunk(codec_id=enc.codec_id, params=enc.params, payload=payload)

    monkeypatch.setattr(_send, "is_device_array", lambda x: isinstance(x, FakeDevice))
    monkeypatch.setattr(_send, "as_device_array", lambda x, spec, what: x)
    monkeypatch.setattr(_gpu, "copy_raw_chunks", copy_raw_chunks)
    monkeypatch.setattr(_gpu, "encode_chunks", encode_chunks)
