"""benchmarks/peers.py runs end to end on loopback (raw pair and kvwire, tiny caches) and
refuses arguments that would measure nothing."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.bench.script_helpers import run_script
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
