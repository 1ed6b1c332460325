from __future__ import annotations

import os
import shutil
import sysconfig
from collections.abc import Iterator

import numpy as np
import pytest

from kvwire._extensions import extensions_disabled
from kvwire.codec import numpy_dtype
from tests.consistency.conftest import RedisServer, find_redis_server, start_redis
from tests.environment import IN_CI

SECRET = b"test-secret-0123"


def c_compiler() -> str | None:
    """The C compiler a build here would use (``$CC``, else Python's own), if it is on PATH."""
    cc = (os.environ.get("CC") or str(sysconfig.get_config_var("CC") or "")).split()
    return shutil.which(cc[0]) if cc else None


def extension_skip_reason(loaded: bool, name: str) -> str | None:
    """Why a test that needs the compiled ``name`` is skipped here, or None where it runs.

    The one rule for every compiled extension: a test that needs it is skipped where it is
    turned off on purpose (``KVWIRE_NO_EXTENSIONS``) or could not be built (no C compiler
    here, outside CI: a supported install, the pure-Python code runs); in CI, or where a
    compiler is present, it runs and fails (:func:`require_extension`) when the extension
    is missing, since it was meant to be built."""
    if loaded:
        return None
    if extensions_disabled():
        return f"KVWIRE_NO_EXTENSIONS is set: {name} is not loaded"
    if not IN_CI and c_compiler() is None:
        return f"no C compiler here, so {name} could not be built"
    return None


def needs_extension(loaded: bool, name: str) -> pytest.MarkDecorator:
    """A mark that skips a test of the compiled ``name`` as :func:`extension_skip_reason`
    says; where it runs without the extension, the test fails."""
    reason = extension_skip_reason(loaded, name)
    return pytest.mark.skipif(reason is not None, reason=reason or "")


def require_extension(loaded: bool, name: str) -> None:
    """Skip as :func:`extension_skip_reason` says, else fail, with the reason, when the
    compiled ``name`` is not loaded."""
    reason = extension_skip_reason(loaded, name)
    if reason is not None:
        pytest.skip(reason)
    if not loaded:
        pytest.fail(
            f"{name} is not importable: the C extension was not built. Reinstall with a C "
            "compiler present (`python -m pip install -v -e '.[test]'`, or `python setup.py "
            "build_ext --inplace`) and read the build output for 'WARNING: could not build' "
            "(kvwire.extensions() says which compiled parts load); set KVWIRE_NO_EXTENSIONS=1 "
            "to test the pure-Python code alone."
        )


def require_send_queue() -> None:
    """The compiled send queue, as :func:`require_extension` requires it (without it
    streams write through their transports, which other tests cover)."""
    import kvwire.aio._stream as stream_mod

    require_extension(stream_mod._sendq is not None, "kvwire.aio._sendq")


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


@pytest.fixture(scope="module")
def redis_url(redis_binary: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The URL of a real redis-server of the test module's own."""
    server: RedisServer = start_redis(redis_binary, tmp_path_factory.mktemp("redis"))
    try:
        yield server.url
    finally:
        server.stop()
