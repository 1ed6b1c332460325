from __future__ import annotations

import numpy as np
import pytest

from kvwire._extensions import extensions_disabled
from kvwire.codec import numpy_dtype
from tests.consistency.conftest import find_redis_server
from tests.environment import IN_CI

SECRET = b"test-secret-0123"


def require_send_queue() -> None:
    """Skip where the compiled send queue is turned off on purpose (``KVWIRE_NO_EXTENSIONS``:
    streams write through their transports, which other tests cover); fail where it was
    meant to be built and is not."""
    import kvwire.aio._stream as stream_mod

    if stream_mod._sendq is None:
        if extensions_disabled():
            pytest.skip("KVWIRE_NO_EXTENSIONS is set: streams write through their transports")
        raise AssertionError("kvwire.aio._sendq is not built: reinstall with a C compiler present")


def make_layers(num_layers: int, tokens: int, heads: int, head_dim: int, dtype: str = "float16", seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    dt = numpy_dtype(dtype)
    return [
        (
            rng.standard_normal((tokens, heads, head_dim), dtype=np.float32).astype(dt),
            rng.standard_normal((tokens, heads, head_dim), dtype=np.float32).astype(dt),
        )
        for _ in range(num_layers)
    ]


def same_cache(a: list[tuple[np.ndarray, np.ndarray]], b: list[tuple[np.ndarray, np.ndarray]]) -> bool:
    return len(a) == len(b) and all(
        k1.dtype == k2.dtype and k1.shape == k2.shape and k1.tobytes() == k2.tobytes()
        and v1.tobytes() == v2.tobytes()
        for (k1, v1), (k2, v2) in zip(a, b, strict=True)
    )


@pytest.fixture
def secret() -> bytes:
    return SECRET


@pytest.fixture(scope="session")
def redis_binary() -> str:
    """A real redis-server: missing, it fails the test in CI and skips it elsewhere."""
    binary = find_redis_server()
    if binary is None:
        message = (
            "redis-server not found: install it (apt-get install redis-server), put it on "
            "PATH, or set KVWIRE_REDIS_SERVER; the Redis registry tests need a real server"
        )
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    return binary
