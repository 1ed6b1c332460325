"""``kvwire bench`` as its users run it: a subprocess whose stdout and stderr are pipes."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import kvwire
from kvwire.cli import build_parser, main
from tests.bench.process_helpers import child_pids

# Generous: a loaded host (two suites at once on two cores) starts three processes slowly.
pytestmark = pytest.mark.timeout(300)

INTERVAL_LINE = re.compile(r"^\[\s*\d+\.\d-\s*\d+\.\d s\]  to TCP .* [kMG]?bit/s", re.MULTILINE)


def _kvwire(
    *argv: str, timeout: float = 240, env_extra: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "KVWIRE_SECRET"} | (env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "kvwire", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def _counts_dsack_dups() -> bool:
    """Whether this kernel's TCP_INFO carries ``tcpi_dsack_dups`` (Linux 5.0+), read on a
    loopback connection as ``peer.statistics()`` reads its streams."""
    from kvwire.aio.tcpinfo import read_tcp_info

    with socket.create_server(("127.0.0.1", 0)) as listener:
        with socket.create_connection(listener.getsockname()) as client:
            info = read_tcp_info(client)
    return info is not None and info.dsack_dups is not None


def test_json_to_stdout_interval_lines_and_what_auto_chose() -> None:
    proc = _kvwire(
        "bench",
        "--model",
        "tiny",
        "--tokens",
        "128",
        "--duration",
        "2s",
        "--link",
        "400mbps",
        "--rtt",
        "2ms",
        "--codec",
        "auto",
        "--streams",
        "auto",
        "--chunk-size",
        "64KiB",
        "--seed",
        "5",
        "--interval",
        "0.5s",
        "--json",
        "-",
    )
    assert proc.returncode == 0, proc.stderr
    doc: dict[str, Any] = json.loads(proc.stdout)  # stdout holds the report and nothing else
    # Not a terminal: one report line per interval on stderr, the table after them.
    assert len(INTERVAL_LINE.findall(proc.stderr)) >= 2, proc.stderr
    assert "wire rate (measured)" in proc.stderr and "note: trust the wire rate" in proc.stderr
    start = doc["start"]
    assert f"emulated ({start['config']['emulator']} pump)" in proc.stderr
    assert start["version"] == kvwire.__version__ and start["timestamp"]
    assert start["command"][:2] == ["kvwire", "bench"] and start["host"]["hostname"]
    assert start["config"]["chunk_bytes"] == 64 * 1024 and start["config"]["seed"] == 5
    assert start["config"]["link_bps"] == 400e6 and start["config"]["rtt"] == pytest.approx(0.002)
    assert doc["chunk_bytes"] == 64 * 1024 and doc["seed"] == 5
    # What auto chose, not "auto".
    assert doc["transfers"] >= 1 and "auto" not in doc["codecs_used"]
    assert set(doc["codec_shares"]) <= {"raw", "fp8", "int8", "int4"}
    assert sum(doc["codec_shares"].values()) == pytest.approx(1.0)
    assert doc["streams"] == "auto" and 1 <= doc["streams_min"] <= doc["streams_max"] <= 8
    assert doc["streams_over_time"] and all(isinstance(n, int) for _, n in doc["streams_over_time"])
    # Per-interval samples and the resource figures.
    assert len(doc["intervals"]) >= 2
    iv = doc["intervals"][0]
    assert {
        "start",
        "end",
        "sent_gbps",
        "wire_gbps",
        "estimated_gbps",
        "link_gbps",
        "streams",
        "retransmits",
        "sender_cpu",
        "chunks_by_codec",
        "transfers",
    } <= set(iv)
    assert sum(i["transfers"] for i in doc["intervals"]) == doc["transfers"]
    cpu = doc["cpu"]
    for side in ("sender", "receiver", "emulator"):
        assert cpu[side] > 0
    assert isinstance(doc["retransmits"], int) and doc["retransmits"] >= 0
    # Of them, those the receiver reported receiving twice (Linux 5.0+ counts them).
    spurious = doc["spurious_retransmits"]
    assert spurious is None or (isinstance(spurious, int) and spurious >= 0)
    if _counts_dsack_dups():  # peer.statistics() carries each stream's tcpi_dsack_dups
        assert isinstance(spurious, int)
    assert "wire rate" in doc["trust"]
    assert doc["diagnosis"] is None or doc["diagnosis"].startswith("utilization ")


def test_quiet_prints_nothing_and_writes_the_file(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    proc = _kvwire(
        "bench",
        "--model",
        "tiny",
        "--tokens",
        "32",
        "--duration",
        "0.5",
        "--no-baseline",
        "--quiet",
        "--json",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and proc.stderr == ""
    assert json.loads(out.read_text())["mode"] == "loopback"
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]  # no temporary left over


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_unwritable_output_fails_before_the_run(tmp_path: Path, flag: str) -> None:
    target = tmp_path / "missing-dir" / ("r.json" if flag == "--json" else "p.png")
    proc = _kvwire(
        "bench", "--model", "tiny", "--tokens", "32", "--duration", "30", flag, str(target)
    )
    assert proc.returncode == 2
    assert f"kvwire bench: error: {flag}" in proc.stderr and "no such directory" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "bench: tiny" not in proc.stderr  # the run never started (no header line)
    assert not target.parent.exists()


def test_output_is_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--duration", "30", "--json", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_plot_format_is_checked_first(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--duration", "30", "--plot", str(tmp_path / "p.nope")]) == 2
    assert "matplotlib cannot write .nope" in capsys.readouterr().err


def test_plot_without_matplotlib_fails_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert main(["bench", "--duration", "30", "--plot", str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err
    assert "--plot needs matplotlib: pip install 'kvwire[plot]'" in err


@pytest.mark.parametrize("command", ["bench", "serve"])
def test_every_option_has_help(command: str) -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    cmd = sub.choices[command]  # type: ignore[index]
    missing = [a.option_strings for a in cmd._actions if a.dest != "help" and not a.help]
    assert missing == []
    text = cmd.format_help()  # renders (a stray % in a help string would raise here)
    assert all(opt in text for a in cmd._actions for opt in a.option_strings)


def test_arguments_that_would_crash_or_hang_a_run_are_refused() -> None:
    for argv, says in (
        (["--seed", "-1"], "--seed must be >= 0"),
        (["--interval", "1ns"], "--interval must be at least"),
    ):
        proc = _kvwire("bench", "--model", "tiny", "--duration", "1s", *argv)
        assert proc.returncode == 2, (argv, proc.stderr)
        assert says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_json_keeps_the_files_mode_and_writes_through_a_link(tmp_path: Path) -> None:
    """The report is written as ``open`` would write it: an existing file keeps its mode,
    a new one gets 0666 less the umask (mkstemp's 0600 was kept), and a symbolic link
    is written through (it was replaced by a file of its own)."""
    from kvwire.bench.command import _write_atomic, check_output_path

    old = tmp_path / "old.json"
    old.write_text("{}")
    old.chmod(0o640)
    mask = os.umask(0o077)
    try:
        _write_atomic(str(old), "[1]")
        new = tmp_path / "new.json"
        _write_atomic(str(new), "[2]")
        os.umask(0o022)
        other = tmp_path / "other.json"
        _write_atomic(str(other), "[3]")
    finally:
        os.umask(mask)
    assert old.read_text() == "[1]" and (old.stat().st_mode & 0o777) == 0o640
    assert new.read_text() == "[2]" and (new.stat().st_mode & 0o777) == 0o600
    assert (other.stat().st_mode & 0o777) == 0o644

    elsewhere = tmp_path / "reports"
    elsewhere.mkdir()
    target = elsewhere / "target.json"
    target.write_text("{}")
    target.chmod(0o644)
    link = tmp_path / "link.json"
    link.symlink_to(target)
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(elsewhere / "made.json")
    for path in (link, dangling):
        check_output_path(str(path), "--json")
    _write_atomic(str(link), "[4]")
    _write_atomic(str(dangling), "[5]")
    assert (
        link.is_symlink()
        and target.read_text() == "[4]"
        and (target.stat().st_mode & 0o777) == 0o644
    )
    assert dangling.is_symlink() and (elsewhere / "made.json").read_text() == "[5]"
    assert sorted(p.name for p in elsewhere.iterdir()) == [
        "made.json",
        "target.json",
    ]  # no temporary


def test_json_into_a_pipe(tmp_path: Path) -> None:
    """``--json`` naming a pipe (or a device) writes into it, instead of renaming a file
    over it."""
    import threading

    fifo = tmp_path / "report.fifo"
    os.mkfifo(fifo)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()), daemon=True)
    reader.start()
    proc = _kvwire(
        "bench",
        "--model",
        "tiny",
        "--tokens",
        "64",
        "--duration",
        "1s",
        "--no-baseline",
        "--quiet",
        "--json",
        str(fifo),
    )
    reader.join(30)
    assert proc.returncode == 0, proc.stderr
    assert fifo.is_fifo() and json.loads(got[0])["transfers"] >= 1


def test_json_to_a_closed_stdout_fails_in_one_line() -> None:
    """``kvwire bench --json - | true``: the reader is gone when the report comes; one
    line and exit code 1, not a BrokenPipeError traceback."""
    env = {k: v for k, v in os.environ.items() if k != "KVWIRE_SECRET"}
    with subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvwire",
            "bench",
            "--model",
            "tiny",
            "--tokens",
            "64",
            "--duration",
            "1s",
            "--no-baseline",
            "--json",
            "-",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()  # before the report: the run takes a second and more
        err = proc.stderr.read()
        assert proc.wait(240) == 1
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert "kvwire bench: error: stdout was closed before the report (--json -) was written" in err


#: ``python -m kvwire`` with SIGHUP's disposition (argv[1]: SIG_DFL or SIG_IGN) and SIGTERM's
#: default one, whatever those of the test run are (one started under ``nohup`` ignores
#: SIGHUP, and so would the bench it starts: kvwire leaves an ignored SIGHUP ignored).
_LAUNCH = (
    "import runpy, signal, sys; "
    "signal.signal(signal.SIGHUP, getattr(signal, sys.argv.pop(1))); "
    "signal.signal(signal.SIGTERM, signal.SIG_DFL); "
    "runpy.run_module('kvwire', run_name='__main__', alter_sys=True)"
)


def _start_unbounded_run(sighup: str = "SIG_DFL") -> subprocess.Popen[str]:
    """A bench on an emulated link (a receiver and an emulator process) that would run
    for an hour: only a signal ends it in a test."""
    env = {k: v for k, v in os.environ.items() if k != "KVWIRE_SECRET"}
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            _LAUNCH,
            sighup,
            "bench",
            "--model",
            "tiny",
            "--tokens",
            "256",
            "--duration",
            "1h",
            "--link",
            "1gbps",
            "--interval",
            "0.5s",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _wait_for_transfers(proc: subprocess.Popen[str]) -> list[str]:
    """The run's stderr up to its first interval report: its transfer loop runs."""
    assert proc.stderr is not None
    lines: list[str] = []
    for line in proc.stderr:
        lines.append(line)
        if INTERVAL_LINE.match(line):
            return lines
    raise AssertionError(f"the run ended before its first interval report: {''.join(lines)}")


@pytest.mark.parametrize(
    ("signame", "code", "says"), [("SIGTERM", 143, "terminated"), ("SIGHUP", 129, "hangup")]
)
def test_sigterm_ends_the_run_and_its_processes(signame: str, code: int, says: str) -> None:
    """A run ended by SIGTERM (a supervisor stopping it) or SIGHUP (its terminal closed)
    cleans up as for Ctrl-C: its child processes end with it, and it exits 128 + the
    signal's number."""
    import signal
    import time

    with _start_unbounded_run() as proc:
        children: set[int] = set()
        try:
            _wait_for_transfers(proc)
            children = child_pids(proc.pid)
            assert (
                len(children) >= 2
            )  # the receiver and the emulator (and multiprocessing's tracker)
            proc.send_signal(getattr(signal, signame))
            assert proc.wait(90) == code
            assert proc.stderr is not None and says in proc.stderr.read()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    deadline = time.monotonic() + 60  # (a bound on a wait, not a measure)
    while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in children)


def test_a_sighup_the_process_ignores_stays_ignored() -> None:
    """Started with SIGHUP ignored (``nohup kvwire bench``), the run keeps it ignored: a
    SIGHUP is lost on it (a SIGTERM after it ends the run, as SIGTERM)."""
    import signal

    with _start_unbounded_run("SIG_IGN") as proc:
        try:
            _wait_for_transfers(proc)
            assert _ignores(proc.pid, signal.SIGHUP) and not _ignores(proc.pid, signal.SIGTERM)
            proc.send_signal(signal.SIGHUP)  # (discarded as it is sent: ignored)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(90) == 143
            assert proc.stderr is not None
            rest = proc.stderr.read()
            assert "terminated" in rest and "hangup" not in rest
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _ignores(pid: int, signum: int) -> bool:
    """Whether process ``pid`` ignores ``signum`` (its SigIgn mask in /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    raise AssertionError("no SigIgn in /proc/PID/status")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_an_error_without_text_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    # An error raised with no message printed "kvwire bench: error: " and nothing after.
    from kvwire.bench.command import _fail
    from kvwire.errors import ConnectionLostError

    assert _fail("bench", ConnectionLostError(""), 1) == 1
    assert _fail("serve", TimeoutError(), 1) == 1
    assert capsys.readouterr().err.splitlines() == [
        "kvwire bench: error: ConnectionLostError",
        "kvwire serve: error: TimeoutError",
    ]


def test_a_run_on_pure_python_code_says_so() -> None:
    """An infrastructure engineer measuring a link should know when the figures are those of
    the pure-Python code (no compiler at install time): the summary says which parts, the
    JSON lists them."""
    run = ("bench", "--model", "tiny", "--tokens", "32", "--duration", "0.5", "--no-baseline", "--json", "-")
    proc = _kvwire(*run, env_extra={"KVWIRE_NO_EXTENSIONS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "runs pure-Python code for crc32c, host_codec, send_queue" in proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["start"]["host"]["extensions"] == {
        "crc32c": None,
        "host_codec": None,
        "send_queue": None,
    }
    compiled = _kvwire(*run)
    assert compiled.returncode == 0, compiled.stderr
    assert "pure-Python" not in compiled.stderr or None in kvwire.extensions().values()
