"""The vLLM connector's paged spec knows where a block's tokens lie: vLLM hands kvwire
logical ``[num_blocks, 2, block_size, num_kv_heads, head_size]`` caches, so the connector
passes ``PagedSpec.token_axis=1`` for a block of 4+ dims whose axis 1 is ``block_size``
(also when ``num_kv_heads == block_size``): such a cache travels as one wire row per cache
token (its heads as the wire heads, int4 key groups per head and channel).  Any other
block (axis 1 not ``block_size``, as in a contiguous ``[num_blocks, 2, num_kv_heads,
block_size, head_size]``; no heads axis) keeps the opaque rows of one head, and so does a
block of one head, whose opaque rows already are its tokens (no ``/t1`` in the model).
"""

from __future__ import annotations

import threading
import time
import warnings
from typing import Any

import numpy as np
import pytest
import torch

from kvwire.codec import Int4Codec, TensorKind
from kvwire.paged import gather_layer

with warnings.catch_warnings():  # vLLM's import chain trips torch's own deprecation warnings
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvwire.integrations.vllm import KvwireConnector, KvwireConnectorMetadata, _Move

pytestmark = pytest.mark.timeout(180)

SECRET = "connector-test-secret"
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
BLOCK, HEADS, DIM = 16, 4, 32


def config(role: str, extra: dict[str, Any]) -> VllmConfig:
    return VllmConfig(
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvwireConnector", kv_connector_module_path="kvwire.integrations.vllm",
            kv_role=role, kv_connector_extra_config={"kvwire_secret": SECRET, **extra}),
        cache_config=CacheConfig(block_size=BLOCK))


def caches(shape: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(torch.float16) for _ in LAYERS]


def registered(role: str, extra: dict[str, Any], kv: list[torch.Tensor],
               workers: list[KvwireConnector]) -> KvwireConnector:
    worker = KvwireConnector(config(role, extra), KVConnectorRole.WORKER)
    workers.insert(0, worker)
    worker.register_kv_caches(dict(zip(LAYERS, kv, strict=True)))
    return worker


@pytest.mark.parametrize(("shape", "axis", "row", "model"), [
    ((8, 2, BLOCK, HEADS, DIM), 1, (HEADS, DIM), f"paged:2x{BLOCK}x{HEADS}x{DIM}/t1:"),  # NHD
    ((8, 2, BLOCK, BLOCK, DIM), 1, (BLOCK, DIM), f"paged:2x{BLOCK}x{BLOCK}x{DIM}/t1:"),  # heads == block_size
    ((8, 2, BLOCK, 1, DIM), 1, (1, DIM), f"paged:2x{BLOCK}x1x{DIM}:"),  # one head: the same rows, no mark
    ((8, 2, HEADS, BLOCK, DIM), None, (1, DIM), f"paged:2x{HEADS}x{BLOCK}x{DIM}:"),  # axis 1 not block_size
    ((8, 2, BLOCK, 64), None, (1, 64), f"paged:2x{BLOCK}x64:"),  # no heads axis
    ((8, 2, 8, 2, 64), None, (1, 64), "paged:2x8x2x64:"),  # no axis of block_size
])
def test_the_connectors_spec_takes_axis_1_as_the_token_axis(
        workers: list[KvwireConnector], shape: tuple[int, ...], axis: int | None, row: tuple[int, int],
        model: str) -> None:
    worker = registered("kv_consumer", {"kvwire_listen": "127.0.0.1:0"}, caches(shape, 0), workers)
    spec = worker._spec
    assert spec is not None
    assert spec.row_shape == row
    assert spec.token_axis == axis
    wire = spec.wire_spec()
    assert (wire.num_kv_heads, wire.head_dim) == row
    assert wire.model.startswith(model)
    assert worker._server is not None


def test_nhd_blocks_travel_as_rows_of_tokens_between_connectors(workers: list[KvwireConnector]) -> None:
    """A producer and a consumer on NHD caches, int4: the consumer's blocks hold what the
    reference int4 makes of the producer's blocks' rows of tokens (groups per head)."""
    shape = (12, 2, BLOCK, HEADS, DIM)
    ckv = caches(shape, 0)
    cons = registered("kv_consumer", {"kvwire_listen": "127.0.0.1:0", "kvwire_load_timeout": 60}, ckv, workers)
    pkv = caches(shape, 1)
    prod = registered("kv_producer", {"kvwire_peer": f"127.0.0.1:{cons.listen_port}", "kvwire_codec": "int4",
                                      "kvwire_load_timeout": 60}, pkv, workers)
    for _ in range(600):
        prod._poll_connect()
        if prod._peer is not None:
            break
        threading.Event().wait(0.05)
    assert prod._peer is not None, prod._connect_error
    assert prod._spec is not None and prod._spec.row_shape == (HEADS, DIM)
    name = f"r0#prompt:{0:032x}"
    cons.bind_connector_metadata(KvwireConnectorMetadata(loads=[_Move("r0", name, [3, 7])]))
    cons.start_load_kv(None)
    cons.clear_connector_metadata()
    prod.bind_connector_metadata(KvwireConnectorMetadata(saves=[_Move("r0", name, [5, 2])]))
    for layer, cache in zip(LAYERS, pkv, strict=True):
        prod.save_kv_layer(layer, cache, None)
    prod.wait_for_save()
    prod.get_finished(set())
    prod.clear_connector_metadata()
    got: set[str] = set()
    deadline = time.monotonic() + 60
    while "r0" not in got and time.monotonic() < deadline:
        cons.bind_connector_metadata(KvwireConnectorMetadata())
        cons.start_load_kv(None)
        for layer in LAYERS:
            cons.wait_for_layer_load(layer)
        _, recving = cons.get_finished(set())
        assert not cons.get_block_ids_with_load_errors()
        cons.clear_connector_metadata()
        got |= recving or set()
        threading.Event().wait(0.02)
    assert "r0" in got
    spec = prod._spec
    for src, dst in zip(pkv, ckv, strict=True):
        landed = gather_layer(spec, src.numpy(), [5, 2])
        into = gather_layer(spec, dst.numpy(), [3, 7])
        for kind, rows in enumerate(landed):
            assert rows.shape[1:] == (HEADS, DIM)
            codec = Int4Codec()
            enc = codec.encode_numpy(rows, TensorKind(kind))
            want = codec.decode_numpy(enc.params, enc.payload, shape=rows.shape, dtype="float16",
                                      kind=TensorKind(kind))
            assert np.asarray(into[kind]).tobytes() == want.tobytes()
