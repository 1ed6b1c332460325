"""``kvwire serve``: loopback by default, no public secret on other addresses, log lines
through ``logging`` with timestamps and a level."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvwire.bench.command import is_loopback
from kvwire.cli import build_parser

pytestmark = pytest.mark.timeout(60)

STAMPED = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (DEBUG|INFO|WARNING|ERROR) +kvwire")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "KVWIRE_SECRET"}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


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
        capture_output=True, text=True, timeout=30, env=_env(), check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "refusing to listen on" in proc.stderr and "--secret-file" in proc.stderr
    assert STAMPED.match(proc.stderr), proc.stderr


def test_a_short_secret_file_is_refused(tmp_path: Path) -> None:
    secret = tmp_path / "s"
    secret.write_text("short\n")
    proc = subprocess.run(
        [sys.executable, "-m", "kvwire", "serve", "--secret-file", str(secret), "--port", "0"],
        capture_output=True, text=True, timeout=30, env=_env(), check=False,
    )
    assert proc.returncode == 2 and "fewer than 8 bytes" in proc.stderr


def test_timestamped_log_lines_and_log_level() -> None:
    # Loopback with the development secret: allowed, with a warning; --log-level debug.
    server = subprocess.Popen(
        [sys.executable, "-m", "kvwire", "serve", "--port", "0", "--log-level", "debug"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
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
        capture_output=True, text=True, timeout=30, env=_env(), check=False,
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
