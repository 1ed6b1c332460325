"""The pure-Python fallback end to end: with ``KVWIRE_NO_EXTENSIONS=1`` (as on a machine
without a C compiler) a real loopback transfer in raw, fp8, int8, int4 and behind an
entropy stage delivers the same bytes as this process, which uses the compiled parts
where they are built.  Runs everywhere, built or not; ``kvwire.extensions()`` says which
parts each side used."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kvwire
from kvwire.aio import _stream
from kvwire.codec import _host, numpy_dtype
from kvwire.wire import crc

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
SECRET = b"fallback-secret-0123"
CODECS = ["raw", "fp8", "int8", "int4", "int4+zstd", "fp8+lz4"]
DTYPES = ["float16", "bfloat16"]


async def received_digests() -> dict[str, str]:
    """SHA-256 of the layers received over loopback for each codec and dtype (two streams,
    small chunks: many frames, checksummed and queued by whatever code this process uses)."""
    digests: dict[str, str] = {}
    rng = np.random.default_rng(7)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, streams=2,
                                  chunk_bytes=16 * 1024) as peer:
            for dtype in DTYPES:
                spec = kvwire.KVSpec(num_layers=2, num_kv_heads=4, head_dim=64, dtype=dtype)
                layers = [
                    tuple((rng.standard_normal((96, 4, 64), dtype=np.float32) * 3).astype(numpy_dtype(dtype))
                          for _ in range(2))
                    for _ in range(2)
                ]
                for codec in CODECS:
                    request = f"{codec}-{dtype}"
                    receiving = asyncio.ensure_future(server.expect(request, timeout=20))
                    receipt = await peer.send(request, spec, layers, codec=codec, timeout=20)
                    cache = await (await receiving).collect(timeout=20)
                    assert receipt.codec == codec
                    digest = hashlib.sha256()
                    for (k, v), (k2, v2) in zip(layers, cache.layers, strict=True):
                        assert k2.dtype == k.dtype and k2.shape == k.shape and v2.shape == v.shape
                        if codec == "raw":
                            assert k2.tobytes() == k.tobytes() and v2.tobytes() == v.tobytes()
                        digest.update(np.ascontiguousarray(k2).tobytes())
                        digest.update(np.ascontiguousarray(v2).tobytes())
                    digests[request] = digest.hexdigest()
    return digests


def main() -> None:
    """The subprocess's side: the digests and the compiled parts it used, as JSON."""
    digests = asyncio.run(asyncio.wait_for(received_digests(), 60))
    print(json.dumps({"extensions": kvwire.extensions(), "digests": digests}))


def test_extensions_says_which_compiled_parts_are_used() -> None:
    found = kvwire.extensions()
    assert set(found) == {"crc32c", "host_codec", "send_queue"}
    assert found["crc32c"] == (None if crc.ext is None else crc.ext.isa())
    assert crc.implementation() == ("crc32c package" if found["crc32c"] is None else f"compiled {found['crc32c']}")
    assert found["host_codec"] == _host.isa()
    assert found["send_queue"] == (None if _stream._sendq is None else "sendmsg")
    assert all(value is None or (isinstance(value, str) and value) for value in found.values())
    assert kvwire.extensions is kvwire._extensions.extensions and "extensions" in kvwire.__all__


async def test_the_pure_python_path_delivers_the_compiled_paths_bytes() -> None:
    environ = {k: v for k, v in os.environ.items() if k != "KVWIRE_NO_EXTENSIONS"}
    environ["KVWIRE_NO_EXTENSIONS"] = "1"
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), environ.get("PYTHONPATH")]))
    fallback = asyncio.create_subprocess_exec(
        sys.executable, "-c", "from tests.system.test_fallback import main; main()",
        cwd=ROOT, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    process = await fallback
    try:
        here = await asyncio.wait_for(received_digests(), 60)
        stdout, stderr = await asyncio.wait_for(process.communicate(), 90)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 0, stderr.decode()
    there = json.loads(stdout.decode().strip().splitlines()[-1])
    assert there["extensions"] == {"crc32c": None, "host_codec": None, "send_queue": None}
    assert set(here) == {f"{codec}-{dtype}" for codec in CODECS for dtype in DTYPES}
    assert there["digests"] == here
