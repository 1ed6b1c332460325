"""``kvwire serve``: loopback by default, no public secret on other addresses, log lines
through ``logging`` with timestamps and a level."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvwire.bench.command import is_loopback
from kvwire.cli import build_parser
from tests.bench.process_helpers import child_env

pytestmark = pytest.mark.timeout(60)

STAMPED = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (DEBUG|INFO|WARNING|ERROR) +kvwire")


def test_defaults_to_loopback() -> None:
    args = build_parser().parse_args(["serve"])
    assert args.host == "127.0.0.1" and args.log_level == "info"


@pytest.mark.parametrize("host", ["127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost"])
def test_loopback_addresses(host: str) -> None:
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "", "::", "10.1.2.3", "192.0.2.7", "2001:db8::1"])
def test_other_addresses(host: str) -> None:
    assert not is_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "192.0.2.7"])
def test_refuses_a_non_loopback_address_without_a_chosen_secret(host: str) -> None:
    # Refused before anything listens (192.0.2.7 is not even an address of this machine).
    proc = subprocess.run(
        [sys.executable, "-m", "kvwire", "serve", "--host", host, "--port", "0"],
        capture_output=True, text=True, timeout=30, env=child_env(), check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "refusing to listen on" in proc.stderr and "--secret-file" in proc.stderr
    assert STAMPED.match(proc.stderr), proc.stderr


def test_a_short_secret_file_is_refused(tmp_path: Path) -> None:
    secret = tmp_path / "s"
    secret.write_text("short\n")
    proc = subprocess.run(
        [sys.executable, "-m", "kvwire", "serve", "--secret-file", str(secret), "--port", "0"],
        capture_output=True, text=True, timeout=30, env=child_env(), check=False,
    )
    assert proc.returncode == 2 and "fewer than 8 bytes" in proc.stderr


def test_timestamped_log_lines_and_log_level() -> None:
    # Loopback with the development secret: allowed, with a warning; --log-level debug.
    server = subprocess.Popen(
        [sys.executable, "-m", "kvwire", "serve", "--port", "0", "--log-level", "debug"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
    )
    try:
        assert server.stderr is not None
        lines = [server.stderr.readline(), server.stderr.readline()]
    finally:
        server.kill()
        server.wait(timeout=10)
        for pipe in (server.stdout, server.stderr):
            if pipe is not None:
                pipe.close()
    assert all(STAMPED.match(line) for line in lines), lines
    assert "WARNING" in lines[0] and "development secret" in lines[0]
    assert re.search(r"INFO +kvwire: listening on 127\.0\.0\.1:\d+$", lines[1].rstrip()), lines


def test_warning_level_hides_info_lines() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvwire", "serve", "--host", "0.0.0.0", "--log-level", "error"],
        capture_output=True, text=True, timeout=30, env=child_env(), check=False,
    )
    assert proc.returncode == 2 and " ERROR " in proc.stderr and " INFO " not in proc.stderr


def test_bad_log_level_exits_2() -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "--log-level", "loud"])
    assert exc.value.code == 2


def test_a_secret_variable_that_is_not_utf8_is_used_as_its_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment holds bytes; one that does not decode as UTF-8 reaches Python
    surrogate-escaped, and is the secret all the same (it was a UnicodeEncodeError)."""
    from kvwire.bench.runner import load_secret

    raw = b"\xff\xfe-not-utf8-secret"
    monkeypatch.setenv("KVWIRE_SECRET", os.fsdecode(raw))
    assert load_secret(None) == (raw, None)


class _Layer:
    def __init__(self, index: int, k: Any, v: Any) -> None:
        self.index, self.k, self.v = index, k, v


class _Transfer:
    """What ``BenchReceiver.handle`` reads of a server's transfer: a bench's meta and its
    layers, or a failure after the first one."""

    def __init__(self, bench: str, n: int, *, fail: Exception | None = None, end: bool = False) -> None:
        from kvwire.bench.models import MODELS, bench_cache

        tiny = MODELS["tiny"]
        self.spec = tiny.spec()
        self.request_id = f"{bench}-{n}"
        self.meta = {"kvwire_bench": {"id": bench, "seed": 0, **({"end": True} if end else {})}}
        self.wire_bytes, self.started, self.finished = 0, 0.0, 1.0
        self._layers = bench_cache(tiny, 1 if end else 16, 0)
        self._fail = fail

    async def __aiter__(self) -> Any:
        for index, (k, v) in enumerate(self._layers):
            yield _Layer(index, k, v)
            if self._fail is not None:
                raise self._fail


class _Server:
    def __init__(self) -> None:
        self.sessions = 1

    def statistics(self) -> dict[str, int]:
        return {"sessions": self.sessions}


def test_a_server_drops_the_state_of_benches_whose_sender_went_away(monkeypatch: pytest.MonkeyPatch) -> None:
    """``kvwire serve`` kept the state (the reference cache, every transfer's entry) of
    each bench that never sent its end: now a bench's state goes when a transfer of it
    fails with its session, when no client is left, when idle, or past a cap; each drop
    is logged."""
    import asyncio

    from kvwire.bench import runner
    from kvwire.errors import ConnectionLostError, TransferAbortedError

    lines: list[str] = []
    server = _Server()
    recv = runner.BenchReceiver(server, lines.append)

    async def feed(*transfers: _Transfer) -> list[Any]:
        return [await recv.handle(t) for t in transfers]

    def kept() -> set[str]:
        return set(recv._benches)

    # A transfer reset by its sender (abandoned at the run's hard stop) keeps the bench:
    # its end message follows.
    asyncio.run(feed(_Transfer("a", 0), _Transfer("b", 0), _Transfer("b", 1, fail=TransferAbortedError("reset"))))
    assert kept() == {"a", "b"}
    # Its session lost mid-transfer: no end will come.
    asyncio.run(feed(_Transfer("b", 2, fail=ConnectionLostError("client connection closed mid-transfer"))))
    assert kept() == {"a"} and any("bench b: dropped without its end (its session was lost)" in x for x in lines)
    # Idle for BENCH_IDLE while clients remain.
    recv.prune()
    assert kept() == {"a"}
    recv.prune(now=time.monotonic() + runner.BENCH_IDLE)
    assert kept() == set() and any("bench a: dropped" in x and "nothing of it arrived" in x for x in lines)
    # No client session left: every bench goes.
    asyncio.run(feed(_Transfer("c", 0)))
    server.sessions = 0
    recv.prune()
    assert kept() == set() and any("bench c: dropped without its end (its client is gone)" in x for x in lines)
    # At most MAX_BENCHES: a new one drops the least recently active.
    server.sessions = 1
    monkeypatch.setattr(runner, "MAX_BENCHES", 2)
    asyncio.run(feed(_Transfer("d", 0), _Transfer("e", 0), _Transfer("d", 1), _Transfer("f", 0)))
    assert kept() == {"d", "f"} and any("bench e: dropped" in x for x in lines)
    # A bench that ends is reported and forgotten, as before.
    report = asyncio.run(feed(_Transfer("d", 2), _Transfer("d", 3, end=True)))[-1]
    assert report["transfers"] == 3 and kept() == {"f"}


def test_serve_forgets_an_interrupted_bench() -> None:
    """End to end: a bench sender stopped with Ctrl-C leaves nothing on the server."""
    import asyncio
    import signal

    from kvwire.aio import serve
    from kvwire.bench.runner import DEV_SECRET, BenchReceiver

    async def main() -> tuple[bool, dict[str, Any]]:
        async with serve("127.0.0.1", 0, secret=DEV_SECRET) as server:
            recv = BenchReceiver(server)
            task = asyncio.create_task(recv.run())
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "kvwire", "bench", "--peer", f"127.0.0.1:{server.port}",
                "--model", "tiny", "--tokens", "4096", "--duration", "60", "--quiet",
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=child_env())
            try:
                deadline = time.monotonic() + 30
                while not recv._benches and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                had = bool(recv._benches)
                proc.send_signal(signal.SIGINT)
                await proc.wait()
                deadline = time.monotonic() + 30
                while recv._benches and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                return had, dict(recv._benches)
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    had, left = asyncio.run(main())
    assert had and left == {}
