"""The bench report's pure parts: per-interval grouping, codec shares, the diagnosis of
low utilization and the start block, on hand-made samples (no network, no clock)."""

from __future__ import annotations

import datetime
import itertools
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvwire
from kvwire.bench import runner
from kvwire.bench.report import (
    codec_shares,
    diagnose,
    format_interval,
    format_retransmits,
    format_shares,
    intervals,
    start_block,
)
from kvwire.bench.runner import BenchConfig
from kvwire.errors import UsageError

MiB = 1 << 20


def _sample(t: float, sent: int, transfers: int, cpu: float, retr: int, chunks: dict[str, int],
            streams: int, wire: float = 1.0) -> dict[str, Any]:
    return {
        "t": t, "bytes_sent": sent, "kv_bytes_done": 2 * sent, "transfers": transfers,
        "cpu_s": cpu, "retransmits": retr, "chunks_by_codec": chunks, "streams": streams,
        "wire_gbps": wire, "estimated_gbps": wire * 1.1, "link_gbps": 2.0,
    }


def test_intervals_group_cumulative_counters() -> None:
    initial = {"t": 0.0, "bytes_sent": 0, "kv_bytes_done": 0, "transfers": 0, "cpu_s": 0.0,
               "retransmits": 5, "chunks_by_codec": {}}
    samples = [
        _sample(0.5, 125_000_000, 1, 0.25, 5, {"fp8": 10}, 2),
        _sample(1.0, 250_000_000, 2, 0.5, 6, {"fp8": 20}, 3),
        _sample(1.5, 375_000_000, 3, 1.0, 9, {"fp8": 20, "int8": 10}, 4),
        _sample(2.0, 500_000_000, 4, 1.5, 9, {"fp8": 25, "int8": 15}, 4),
        _sample(2.6, 560_000_000, 5, 1.6, 9, {"fp8": 25, "int8": 20}, 1),
    ]
    ivs = intervals(samples, 1.0, initial)
    assert [(iv["start"], iv["end"]) for iv in ivs] == [(0.0, 1.0), (1.0, 2.0), (2.0, 2.6)]
    first, second, last = ivs
    assert first["sent_gbps"] == pytest.approx(2.0) and first["goodput_gbps"] == pytest.approx(4.0)
    assert first["retransmits"] == 1 and first["transfers"] == 2
    assert first["chunks_by_codec"] == {"fp8": 20} and first["sender_cpu"] == pytest.approx(0.5)
    assert (first["streams"], first["streams_min"], first["streams_max"]) == (3, 2, 3)
    assert second["retransmits"] == 3 and second["chunks_by_codec"] == {"fp8": 5, "int8": 15}
    assert second["sender_cpu"] == pytest.approx(1.0) and second["link_gbps"] == pytest.approx(2.0)
    assert last["chunks_by_codec"] == {"int8": 5} and last["streams"] == 1
    assert last["sent_gbps"] == pytest.approx(60_000_000 * 8 / 0.6 / 1e9)
    line = format_interval(second, "auto")
    assert line.startswith("[  1.0-  2.0 s]") and "streams 4 (4-4)" not in line
    assert "codec int8 75% fp8 25%" in line and "retr 3" in line
    assert intervals([], 1.0, initial) == []


def test_an_interval_gives_its_rates_in_the_unit_that_suits_them() -> None:
    # At 100 kbit/s the line read 'sent 9.95e-05 Gbit/s'.
    iv = {"start": 1.0, "end": 2.0, "sent_gbps": 9.95e-5, "estimated_gbps": 1.2e-4, "link_gbps": 1e-4,
          "sender_cpu": 0.01, "transfers": 0}
    line = format_interval(iv, "raw")
    assert "to TCP 99.5 kbit/s" in line and "estimate 120 kbit/s" in line and "link 100 kbit/s" in line
    assert "e-0" not in line
    assert "to TCP 9.4 Gbit/s" in format_interval({**iv, "sent_gbps": 9.4}, "raw")


def test_codec_shares() -> None:
    assert codec_shares({"fp8": 3, "int8": 1, "raw": 0}) == {"fp8": 0.75, "int8": 0.25}
    assert codec_shares({}) == {}
    assert format_shares({"int4": 0.999, "raw": 0.001}) == "int4 100% raw <1%"


def _result(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "utilization": 0.4, "link_gbps": 10.0, "rtt_ms": 1.0, "streams": 4,
        "streams_max": None, "estimated_gbps": 4.2, "wire_gbps": 4.0,
        "bytes_in_flight_mean": None,
        "cpu": {"sender": 0.3, "receiver": 0.3, "emulator": 0.3, "cores": 8,
                "machine_busy": 0.3, "others": 0.05},
    }
    base.update(over)
    return base


def test_no_diagnosis_when_utilization_is_high_or_unknown() -> None:
    assert diagnose(_result(utilization=0.95), window_bytes=32 * MiB) is None
    assert diagnose(_result(utilization=None), window_bytes=32 * MiB) is None


def test_diagnosis_names_the_cpu_bound_side_and_the_emulator() -> None:
    cpu = {"sender": 0.97, "receiver": 0.2, "emulator": 0.9, "cores": 2}
    line = diagnose(_result(cpu=cpu), window_bytes=32 * MiB)
    assert line is not None and line.startswith("utilization 40%:")
    assert "sender CPU-bound (97% of a core)" in line
    assert "the link emulator is the limit (90% of a core)" in line
    assert "receiver" not in line


def test_diagnosis_names_a_busy_machine() -> None:
    cpu = {"sender": 0.5, "receiver": 0.4, "emulator": 0.3, "cores": 2, "machine_busy": 0.98,
           "others": 0.4}
    line = diagnose(_result(cpu=cpu), window_bytes=32 * MiB)
    assert line is not None and "2 cores were 98% busy (40% of them by other processes)" in line


def test_diagnosis_window_per_rtt() -> None:
    # 2 streams x 1 MiB per 20 ms = 0.84 Gbit/s < 10 Gbit/s: the window is the limit.
    line = diagnose(_result(streams=2, rtt_ms=20.0), window_bytes=1 * MiB)
    assert line is not None and "window/RTT limit: 2 streams x 1 MiB window per 20 ms RTT" in line
    assert "try --streams 24" in line
    # The same with a big enough window: not named.
    line = diagnose(_result(streams=2, rtt_ms=20.0), window_bytes=64 * MiB)
    assert line is not None and "window/RTT" not in line


def test_diagnosis_too_little_in_flight_and_the_estimator() -> None:
    bdp = 10e9 / 8 * 0.02
    line = diagnose(_result(rtt_ms=20.0, streams=64, bytes_in_flight_mean=0.2 * bdp,
                            estimated_gbps=3.0, wire_gbps=4.0), window_bytes=32 * MiB)
    assert line is not None and "too little in flight" in line and "estimate 3 Gbit/s" in line
    # Nothing else found, and the estimate far from the measured rate: the estimator.
    line = diagnose(_result(rtt_ms=None, estimated_gbps=8.0, wire_gbps=4.0), window_bytes=32 * MiB)
    assert line is not None and "estimator: 8 Gbit/s at the end against 4 Gbit/s measured" in line
    line = diagnose(_result(rtt_ms=None), window_bytes=32 * MiB)
    assert line is not None and "no single limit found" in line


def test_diagnosis_of_a_run_with_an_abandoned_transfer_blames_no_estimator() -> None:
    """A run that waited on an abandoned transfer ends with an estimate that says nothing
    of the run: the diagnosis does not blame the estimator, and says a transfer was
    abandoned."""
    line = diagnose(_result(rtt_ms=None, estimated_gbps=8.0, wire_gbps=4.0, incomplete_transfers=1),
                    window_bytes=32 * MiB)
    assert line is not None and "estimator" not in line
    assert "1 transfer abandoned at the run's hard stop" in line


def test_trust_note_says_what_the_wire_rate_counts() -> None:
    from kvwire.bench.report import trust_note

    assert "bytes the link emulator forwarded, an abandoned transfer's included" in trust_note("emulated")
    assert "bytes the shaped veth transmitted" in trust_note("kernel")
    assert "chunk bytes the receiver acknowledged" in trust_note("loopback")
    assert "chunk bytes the remote receiver acknowledged" in trust_note("peer")


def test_an_interval_shorter_than_the_sample_period_is_refused() -> None:
    """Intervals group the samples taken every 100 ms: a 10 ms --interval was accepted and
    reported 100 ms intervals."""
    with pytest.raises(UsageError, match="--interval must be at least 100 ms"):
        BenchConfig(model="tiny", interval=0.05)
    assert BenchConfig(model="tiny", interval=0.1).interval == 0.1
    with pytest.raises(UsageError, match="--interval must be at least 50 ms"):
        BenchConfig(model="tiny", interval=0.02, sample_interval=0.05)


def test_start_block_has_version_time_host_and_configuration() -> None:
    cfg = BenchConfig(model="tiny", tokens=16, codec="auto", auto_codec="measured", streams="auto", seed=7,
                      chunk_bytes=256 * 1024, secret=b"do-not-print-this")
    block = start_block(cfg, ["kvwire", "bench"])
    assert block["version"] == kvwire.__version__ and block["command"] == ["kvwire", "bench"]
    stamp = datetime.datetime.fromisoformat(block["timestamp"])
    assert stamp.tzinfo is not None
    assert block["host"]["hostname"] and block["host"]["cpus"] >= 1
    assert block["host"]["extensions"] == kvwire.extensions()
    config = block["config"]
    assert config["seed"] == 7 and config["chunk_bytes"] == 256 * 1024
    assert config["codec"] == "auto" and config["streams"] == "auto" and config["tokens"] == 16
    assert config["auto_codec"] == "measured"
    assert "secret" not in config and "do-not-print-this" not in repr(block)


def test_auto_codec_mode_is_checked() -> None:
    with pytest.raises(UsageError, match="--auto-codec"):
        BenchConfig(model="tiny", codec="auto", auto_codec="guess")


def test_emulator_pump_is_checked_and_resolved(monkeypatch: pytest.MonkeyPatch) -> None:
    expected = "splice" if runner.SPLICE_AVAILABLE else "copy"
    assert BenchConfig(model="tiny", link_bps=1e9).emulator == expected  # the pump that runs
    assert BenchConfig(model="tiny").emulator == "auto"  # loopback: no emulator runs
    assert BenchConfig(model="tiny", rtt=0.01, emulator="copy").emulator == "copy"
    with pytest.raises(UsageError, match="--emulator must be one of auto, splice, copy"):
        BenchConfig(model="tiny", link_bps=1e9, emulator="zerocopy")
    with pytest.raises(UsageError, match="--emulator is for the userspace emulator"):
        BenchConfig(model="tiny", emulator="copy")  # plain loopback
    with pytest.raises(UsageError, match="--emulator is for the userspace emulator"):
        BenchConfig(model="tiny", link_bps=1e9, kernel=True, emulator="splice")
    monkeypatch.setattr(runner, "SPLICE_AVAILABLE", False)
    assert BenchConfig(model="tiny", link_bps=1e9).emulator == "copy"
    with pytest.raises(UsageError, match=r"needs splice\(2\) \(Linux\)"):
        BenchConfig(model="tiny", link_bps=1e9, emulator="splice")


def test_codec_and_rates_are_checked() -> None:
    with pytest.raises(UsageError, match=r"unknown codec 'fp9'.*int8\+zstd"):
        BenchConfig(model="tiny", codec="fp9")
    # Slower than 10 kbit/s, the handshakes did not cross the link in time: a rate of
    # 1 bit/s was accepted and failed with "handshake did not complete in time".
    for bad in (0.0, -1e9, float("nan"), 1.0, 9_999.0):
        with pytest.raises(UsageError, match="--link must be at least 10 kbit/s"):
            BenchConfig(model="tiny", link_bps=bad)
    for slow in (0.0, 1.0):
        with pytest.raises(UsageError, match="every rate of --link-schedule must be at least 10 kbit/s"):
            BenchConfig(model="tiny", schedule=((0.0, 1e9), (1.0, slow)))
    assert BenchConfig(model="tiny", link_bps=10e3).link_bps == 10e3
    for codec in ("auto", "raw", "int4+lz4"):
        assert BenchConfig(model="tiny", codec=codec, link_bps=1e9).codec == codec


@given(
    steps=st.lists(
        st.tuples(st.floats(0.01, 0.7), st.integers(0, 10**7), st.integers(0, 3),
                  st.dictionaries(st.sampled_from(["raw", "fp8", "int8", "int4"]), st.integers(0, 50))),
        min_size=1, max_size=40,
    ),
    interval=st.floats(0.1, 2.0),
)
def test_intervals_partition_the_run(steps: list[tuple[float, int, int, dict[str, int]]],
                                     interval: float) -> None:
    # Whatever the sample spacing: intervals are contiguous, and their deltas add up to
    # the run's totals (nothing counted twice or lost at the edges).
    initial = {"t": 0.0, "bytes_sent": 0, "kv_bytes_done": 0, "transfers": 0, "cpu_s": 0.0,
               "retransmits": 0, "chunks_by_codec": {}}
    t = sent = transfers = 0.0
    chunks: dict[str, int] = {}
    samples = []
    for dt, dbytes, dtransfers, dchunks in steps:
        t += dt
        sent += dbytes
        transfers += dtransfers
        for k, v in dchunks.items():
            chunks[k] = chunks.get(k, 0) + v
        samples.append(_sample(t, int(sent), int(transfers), t / 2, int(transfers), dict(chunks), 2))
    ivs = intervals(samples, interval, initial)
    assert ivs[0]["start"] == 0.0 and ivs[-1]["end"] == samples[-1]["t"]
    assert all(a["end"] == b["start"] for a, b in itertools.pairwise(ivs))
    assert sum(iv["transfers"] for iv in ivs) == transfers
    assert sum(iv["retransmits"] for iv in ivs) == transfers
    total: dict[str, int] = {}
    for iv in ivs:
        for k, v in iv["chunks_by_codec"].items():
            total[k] = total.get(k, 0) + v
    assert total == {k: v for k, v in chunks.items() if v}
    assert sum(iv["sent_gbps"] * (iv["end"] - iv["start"]) for iv in ivs) == pytest.approx(sent * 8 / 1e9)
    # Intervals end on a grid of ``interval`` from the start (iperf3-style): every one
    # but the last ends at the first sample at or past a grid edge its start had not reached.
    def cell(x: float) -> int:
        return int(x / interval + 1e-9)

    assert all(cell(iv["end"]) > cell(iv["start"]) for iv in ivs[:-1])


@pytest.mark.parametrize(("retransmits", "spurious", "text"), [
    (None, None, "-"),
    (None, 4, "-"),
    (0, 0, "0"),
    (12, None, "12"),  # a kernel without tcpi_dsack_dups
    (206, 205, "206 (205 of them not needed: D-SACK)"),
    (3, 0, "3 (0 of them not needed: D-SACK)"),
    # D-SACKs of retransmits from before the run can arrive in it: never more than sent.
    (3, 5, "3 (3 of them not needed: D-SACK)"),
])
def test_retransmits_with_the_ones_not_needed(retransmits: int | None, spurious: int | None, text: str) -> None:
    assert format_retransmits({"retransmits": retransmits, "spurious_retransmits": spurious}) == text
    if spurious is None:  # a report from before the field existed
        assert format_retransmits({"retransmits": retransmits}) == text


def test_steal_time_is_not_busy_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A virtual machine's steal time (its vCPUs waiting while the hypervisor runs others)
    is no work of this host's: two /proc/stat readings of an idle guest that had ticks
    stolen read no busy time between them, though the interval's total counts them."""
    import io

    from kvwire.bench import report

    #          user nice system idle iowait irq softirq steal guest guest_nice
    readings = iter(["cpu  1000 0 500 10000 0 0 0 100 0 0\n",
                     "cpu  1000 0 500 10100 0 0 0 200 0 0\n",  # +100 idle, +100 steal
                     "cpu  1050 0 525 10125 0 0 0 300 0 0\n"])  # +75 busy, +25 idle, +100 steal
    monkeypatch.setattr(report, "open", lambda path, *a, **k: io.StringIO(next(readings)), raising=False)
    monkeypatch.setattr(report.os, "sysconf", lambda name: 100)
    first, second, third = (report.machine_cpu_times() for _ in range(3))
    assert first is not None and second is not None and third is not None
    assert second[0] - first[0] == 0 and second[1] - first[1] == 2.0
    assert third[0] - second[0] == pytest.approx(0.75) and third[1] - second[1] == pytest.approx(2.0)
