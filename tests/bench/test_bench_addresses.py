"""Addresses on ``kvwire bench`` and ``kvwire serve``'s command lines and in what they
write: an IPv6 host of ``--peer`` in brackets, ``--host`` without a port, IPv6 addresses
written ``[host]:port`` in the report and the log, and every address ``kvwire serve``
listens on, all on one port."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvwire.cli import build_parser, main
from tests.bench.process_helpers import child_env, read_until, stop

pytestmark = pytest.mark.timeout(90)


@pytest.mark.parametrize("text", ["::1", "fe80::1", "::1:7070", "fe80::1%lo", "[::1]", "[::1]7070",
                                  "[localhost]:7070", "[::1:7070", "host", ":7070", "host:0", "host:65536"])
def test_peer_refuses_what_is_not_host_and_port(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``--peer ::1`` was read as host ':' port 1 (``fe80::1``: host 'fe80:'), then
    failed with 'Name or service not known'."""
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["bench", "--peer", text])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error: argument --peer" in err and "HOST:PORT" in err and "[::1]:7070" in err, err


@pytest.mark.parametrize(("text", "peer"), [
    ("[::1]:7070", ("::1", 7070)),
    ("[fe80::1%lo]:5", ("fe80::1%lo", 5)),
    ("[2001:db8::1:80]:443", ("2001:db8::1:80", 443)),
    ("127.0.0.1:9", ("127.0.0.1", 9)),
    ("decode-host:65535", ("decode-host", 65535)),
])
def test_peer_takes_host_and_port(text: str, peer: tuple[str, int]) -> None:
    assert build_parser().parse_args(["bench", "--peer", text]).peer == peer


@pytest.mark.parametrize("text", ["[::1]:7070", "localhost:7070", "0.0.0.0:7070", "[localhost]", "[::1"])
def test_serve_host_takes_no_port(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``--host '[::1]:7070'`` went to the resolver as a name."""
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "--host", text])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error: argument --host" in err and "--port" in err, err


@pytest.mark.parametrize(("text", "host"), [
    ("::1", "::1"), ("[::1]", "::1"), ("::", "::"), ("", ""), ("0.0.0.0", "0.0.0.0"),
    ("fe80::1%lo", "fe80::1%lo"), ("[fe80::1%lo]", "fe80::1%lo"), ("localhost", "localhost"),
])
def test_serve_host_takes_a_name_or_an_address(text: str, host: str) -> None:
    assert build_parser().parse_args(["serve", "--host", text]).host == host


def test_serve_help_says_what_each_host_listens_on(capsys: pytest.CaptureFixture[str]) -> None:
    """It called ``::`` every interface: it is every IPv6 interface, IPv6 only."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert ":: every IPv6 interface, IPv6 only" in text and "'' every interface, IPv4 and IPv6" in text
    assert "0.0.0.0 every IPv4 interface" in text


@pytest.mark.parametrize(("host", "shown"), [("::", r"\[::\]"), ("", r"every interface \(''\)")])
def test_serve_refusal_writes_the_host_as_an_address(
    host: str, shown: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KVWIRE_SECRET", raising=False)
    assert main(["serve", "--host", host, "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert re.search(rf"refusing to listen on {shown} with the public development secret", err), err


def test_serve_on_every_interface_says_each_address_on_its_one_port() -> None:
    """``kvwire serve --host '' --port 0`` listened on 0.0.0.0 and :: on two ports and
    said 'listening on :PORT' (one of them)."""
    server = subprocess.Popen(
        [sys.executable, "-m", "kvwire", "serve", "--host", "", "--port", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env=child_env(KVWIRE_SECRET="a-test-secret-of-our-own"),
    )
    try:
        match = read_until(server, r"listening on (\S+):(\d+) and (\S+):(\d+)$")
        assert sorted([match[1], match[3]]) == ["0.0.0.0", "[::]"] and match[2] == match[4], match[0]
        server.send_signal(signal.SIGTERM)
        server.communicate(timeout=30)
    finally:
        stop(server)
        if server.stderr is not None:
            server.stderr.close()


def test_bench_against_an_ipv6_peer_reports_it_in_brackets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """``kvwire bench --peer [::1]:PORT`` reported 'peer ::1:PORT' in its table, its
    header and its JSON."""
    server = subprocess.Popen(
        [sys.executable, "-m", "kvwire", "serve", "--host", "::1", "--port", "0", "--once"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=child_env(),
    )
    try:
        port = read_until(server, r"listening on \[::1\]:(\d+)")[1]
        assert server.stderr is not None
        reader = threading.Thread(target=server.stderr.read, daemon=True)  # never blocks it
        reader.start()
        out = tmp_path / "r.json"
        assert main(["bench", "--model", "tiny", "--tokens", "64", "--duration", "0.5",
                     "--peer", f"[::1]:{port}", "--json", str(out)]) == 0
        server.wait(timeout=30)
        reader.join(timeout=5)
    finally:
        stop(server)
        if server.stderr is not None:
            server.stderr.close()
    assert json.loads(out.read_text())["peer"] == f"[::1]:{port}"
    printed = capsys.readouterr()
    text = printed.out + printed.err
    assert f"peer [::1]:{port}" in text and f"peer ::1:{port}" not in text, text
