"""benchmarks/peers.py runs end to end on loopback (raw pair and kvwire, tiny caches) and
refuses arguments that would measure nothing."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.bench.script_helpers import BENCHMARKS, load_script, run_script
from tests.environment import IN_CI


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return run_script("peers.py", *args, timeout=timeout)


def test_a_burst_only_run_measures_both_systems(tmp_path: Path) -> None:
    out = tmp_path / "peers.json"
    got = _run("--systems", "raw,raw-paged,kvwire-raw,kvwire-raw*2,kvwire-raw/uvloop,kvwire-raw/paged+uvloop", "--links", "loopback",
               "--loads", "quiet", "--whole-tokens", "0", "--burst", "3x16", "--rounds", "1", "--json", str(out))
    assert got.returncode == 0, got.stderr
    data = json.loads(out.read_text())
    assert data["failures"] == {}
    assert sorted(data["samples"]) == ["loopback, quiet, 3 x 2 MiB / kvwire-raw",
                                      "loopback, quiet, 3 x 2 MiB / kvwire-raw*2",
                                      "loopback, quiet, 3 x 2 MiB / kvwire-raw/paged+uvloop",
                                      "loopback, quiet, 3 x 2 MiB / kvwire-raw/uvloop",
                                      "loopback, quiet, 3 x 2 MiB / raw",
                                      "loopback, quiet, 3 x 2 MiB / raw-paged"]
    for samples in data["samples"].values():
        # the whole host's busy CPU over the interval counts both processes' and more
        assert len(samples) == 1 and samples[0]["gbps"] > 0 and samples[0]["host_cpu"] >= 0
    one, two, paged = (data["samples"][f"loopback, quiet, 3 x 2 MiB / {name}"][0]["extra"]["chunks_by_codec"]
                       for name in ("kvwire-raw", "kvwire-raw*2", "kvwire-raw/paged+uvloop"))
    assert set(one) == {"raw"} and one == two  # two in flight: every send completed, each chunk raw
    assert set(paged) == {"raw"}  # out of a paged cache and into one (each transfer expected by id)
    assert "| kvwire-raw |" in got.stdout and "1 GiB" not in got.stdout  # no whole-cache shape


def test_the_raw_pair_with_kvwires_sending_habits(tmp_path: Path) -> None:
    """``raw/<habits>``: pieces, TCP_NOTSENT_LOWAT, non-blocking writes, a CRC after each
    write or on a second thread; every byte still arrives (the receiver reads each cache's whole size)."""
    out = tmp_path / "peers.json"
    systems = ["raw/p64KiB", "raw/p64KiB+lowat1MiB+nb+crc", "raw/lowat4MiB+nb", "raw/p64KiB+nb+crcthread"]
    got = _run("--systems", ",".join(systems), "--links", "loopback", "--loads", "quiet",
               "--whole-tokens", "0", "--burst", "3x16", "--rounds", "1", "--json", str(out))
    assert got.returncode == 0, got.stderr
    data = json.loads(out.read_text())
    assert data["failures"] == {}
    assert sorted(data["samples"]) == sorted(f"loopback, quiet, 3 x 2 MiB / {s}" for s in systems)
    for bad, says in (("raw/p0", "not a size"), ("raw/lowatx", "not a size"), ("raw/zerocopy", "unknown habit")):
        got = _run("--systems", bad, "--links", "loopback")
        assert got.returncode == 2, bad
        assert says in got.stderr, (bad, got.stderr)


def test_the_busy_load_starts_and_stops_without_a_trace() -> None:
    """The load processes end on terminate() as they should: no traceback of theirs."""
    got = _run("--systems", "raw", "--links", "loopback", "--loads", "busy", "--whole-tokens", "16",
               "--burst", "", "--rounds", "1", "--churn-mib", "8")
    assert got.returncode == 0, got.stderr
    assert "loopback, busy" in got.stdout
    assert "Traceback" not in got.stderr and "KeyboardInterrupt" not in got.stderr, got.stderr


def test_sends_in_flight_must_be_a_positive_count() -> None:
    for system in ("kvwire-raw*0", "kvwire-raw*x", "kvwire-raw*"):
        got = _run("--systems", system, "--links", "loopback")
        assert got.returncode == 2, system
        assert "N >= 1 sends in flight" in got.stderr, got.stderr


def test_an_unknown_option_is_refused() -> None:
    got = _run("--systems", "kvwire-raw/trio", "--links", "loopback")
    assert got.returncode == 2
    assert "unknown option 'trio' (uvloop, paged)" in got.stderr, got.stderr


def test_nothing_to_run_is_an_error() -> None:
    got = _run("--whole-tokens", "0", "--burst", "")
    assert got.returncode == 2
    assert "nothing to run" in got.stderr


def test_bad_shapes_are_refused() -> None:
    for args, says in ((["--burst", "20"], "COUNTxTOKENS"), (["--burst", "0x1024"], "at least 1"),
                       (["--whole-tokens", "-1"], "--whole-tokens")):
        got = _run(*args)
        assert got.returncode == 2, args
        assert says in got.stderr, (args, got.stderr)


def test_over_the_shaped_link_the_senders_tcp_segments_are_counted(tmp_path: Path) -> None:
    """On the veth link each sample says how many TCP segments the sender's namespace sent
    per MB of KV and what share of them were retransmissions (read from /proc/PID/net)."""
    from kvwire.bench.netns import netns_available

    reason = netns_available()
    if reason is not None and not IN_CI:  # in CI it runs, and fails without namespaces
        pytest.skip(reason)
    out = tmp_path / "peers.json"
    got = _run("--systems", "raw,kvwire-raw", "--links", "veth", "--rate", "1e9", "--loads", "quiet",
               "--whole-tokens", "64", "--burst", "", "--rounds", "1", "--json", str(out))
    assert got.returncode == 0, got.stderr
    data = json.loads(out.read_text())
    assert sorted(data["samples"]) == ["veth, quiet, 8 MiB / kvwire-raw", "veth, quiet, 8 MiB / raw"]
    for (sample,) in data["samples"].values():
        extra = sample["extra"]
        # at least one segment per MSS of the bytes sent; a retransmitted share in [0, 1]
        assert extra["segments_per_mb"] >= 1e6 / 65536 and 0 <= extra["retransmitted"] <= 1


def test_unknown_links_and_loads_are_refused() -> None:
    """A link or load of another name is refused, not taken as the veth link or the busy
    load (``--links lo`` built a shaped link, ``--loads quit`` started the busy load)."""
    for args, says in ((["--loads", "quit"], "--loads: unknown name 'quit' (one of quiet, busy)"),
                       (["--links", "lo"], "--links: unknown name 'lo' (one of loopback, veth)"),
                       (["--burst-links", "vth"], "--burst-links: unknown name 'vth'"),
                       (["--burst-loads", "bussy"], "--burst-loads: unknown name 'bussy'")):
        got = _run("--systems", "raw", "--links", "loopback", "--whole-tokens", "16", "--burst", "",
                   "--rounds", "1", *args, timeout=60)
        assert got.returncode == 2, (args, got.stdout)
        assert says in got.stderr, (args, got.stderr)


def test_a_busy_load_whose_process_ended_fails_the_scenario(tmp_path: Path) -> None:
    """The churning process cannot allocate 256 TiB and ends at once: the busy scenario
    fails, every system's row saying why, instead of reporting a quiet host as busy."""
    out = tmp_path / "peers.json"
    got = _run("--systems", "raw,kvwire-raw", "--links", "loopback", "--loads", "busy", "--whole-tokens", "16",
               "--burst", "", "--rounds", "2", "--churn-mib", str(1 << 28), "--json", str(out))
    assert got.returncode == 0, got.stderr
    data = json.loads(out.read_text())
    assert data["samples"] == {}
    why = "busy load: the memory-churning process ended (exit code 1), the host is not busy"
    assert data["failures"] == {"loopback, busy, 2 MiB / raw": why, "loopback, busy, 2 MiB / kvwire-raw": why}
    for system in ("raw", "kvwire-raw"):
        assert f"| {system} | failed: {why} | - | - | - | - | - | - | - |" in got.stdout.splitlines(), got.stdout


def _table_row(stdout: str, system: str) -> list[str]:
    line = next(x for x in stdout.splitlines() if x.startswith(f"| {system} |"))
    assert line.endswith("|"), line  # nothing outside the table's cells
    return [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]  # a cell's own | is escaped


def test_ratios_are_against_the_raw_pairs_samples_of_the_same_rounds(monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The raw pair measures 10 Gbit/s in round 1, then fails: kvwire's ratio is against
    raw's round 1 and kvwire's own round 1 (9 Gbit/s: 0.90), not its rounds 2 and 3 (20
    Gbit/s, as the host sped up) against raw's round 1 (2.00). The raw pair's row gives
    its failure inside the table's cells. measure() stubbed, no process started."""
    peers = load_script("peers.py", "peers_script_under_test", monkeypatch)
    calls: dict[str, int] = {}

    def fake_measure(name: str, link: Any, cache: Any, tokens: int, count: int, timeout: float) -> Any:
        calls[name] = calls.get(name, 0) + 1
        if name == "raw" and calls[name] == 2:
            raise TimeoutError("no end of | receiving within 120 s")
        rate = 10.0 if name == "raw" else (9.0 if calls[name] == 1 else 20.0)
        return peers.Sample(gbps=rate, send_cpu=0.3, recv_cpu=0.3 if calls[name] == 1 else 0.9)

    monkeypatch.setattr(peers, "measure", fake_measure)
    monkeypatch.setattr(peers, "make_cache", lambda nbytes: None)
    handler = signal.getsignal(signal.SIGTERM)
    try:
        assert peers.main(["--systems", "raw,kvwire-raw", "--links", "loopback", "--loads", "quiet",
                           "--whole-tokens", "1024", "--burst", "", "--rounds", "3"]) == 0
    finally:
        signal.signal(signal.SIGTERM, handler)
    out = capsys.readouterr().out
    kvwire = _table_row(out, "kvwire-raw")
    assert kvwire[1] == "20 (9-20)"  # its own rounds, all three
    assert kvwire[2] == "0.90" and kvwire[6] == "1.00", kvwire  # vs raw, CPU vs raw: round 1 alone
    raw = _table_row(out, "raw")
    assert len(raw) == 9 and raw[1] == "failed: TimeoutError: no end of \\| receiving within 120 s", raw
    assert "The raw pair failed after 1 round(s): the ratios to it are over round(s) 1 alone." in out


def _children(pid: int) -> dict[int, str]:
    """The processes whose parent is ``pid``: their start times, to know each again."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    fields = fh.read().rpartition(")")[2].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found[int(entry)] = fields[19]
    return found


def _running(pid: int, started: str) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rpartition(")")[2].split()
    except OSError:
        return False
    return fields[19] == started and fields[0] != "Z"  # the same process, not a zombie


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGKILL], ids=["SIGHUP", "SIGKILL"])
def test_no_process_outlives_the_script(sig: signal.Signals) -> None:
    """The busy load's processes and a measurement's sender and receiver end when the
    script does, whatever ends it: a closed terminal's SIGHUP or SIGKILL leave it no
    cleanup, and a spinner left behind would turn the next run's quiet rows busy."""
    proc = subprocess.Popen([sys.executable, str(BENCHMARKS / "peers.py"), "--systems", "raw", "--links",
                             "loopback", "--loads", "busy", "--whole-tokens", "16", "--burst", "",
                             "--rounds", "100000", "--churn-mib", "8"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    kids: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 60
        while len(kids) < 3:  # the load's two processes and at least one of a measurement's
            assert proc.poll() is None, "the script ended by itself"
            assert time.monotonic() < deadline, f"the script started {len(kids)} processes"
            time.sleep(0.05)
            kids = _children(proc.pid)
        proc.send_signal(sig)
        proc.wait(30)
        deadline = time.monotonic() + 30
        while (left := [k for k, started in kids.items() if _running(k, started)]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not left, f"processes left running after the script's {sig.name}: {left}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for k, started in kids.items():  # what the script left behind, if anything
            if _running(k, started):
                os.kill(k, signal.SIGKILL)
