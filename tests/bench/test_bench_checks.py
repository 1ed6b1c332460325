"""The bench's review fixes: the diagnosis of abandoned transfers and of runs without a
known utilization, the streams it suggests, the RTT its in-flight check uses with
--rtt 0, the interval line's labels, the report's schema and acknowledged KV, and the
options a run would ignore or cannot do as asked, refused (exit 2) before it starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvwire.bench import command, runner
from kvwire.bench.report import diagnose, format_interval
from kvwire.cli import main

MiB = 1 << 20


def _result(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "mode": "emulated", "utilization": 0.4, "link_gbps": 10.0, "rtt_ms": 1.0,
        "measured_rtt_ms": 1.0, "streams": 4, "streams_max": None, "estimated_gbps": 4.2,
        "wire_gbps": 4.0, "bytes_in_flight_mean": None, "chunk_bytes": 1 * MiB,
        "incomplete_transfers": 0,
        "cpu": {"sender": 0.3, "receiver": 0.3, "emulator": 0.3, "cores": 8,
                "machine_busy": 0.3, "others": 0.05},
    }
    base.update(over)
    return base


# -- the diagnosis ----------------------------------------------------------------------------


def test_a_transfer_too_big_for_the_link_is_diagnosed_at_full_utilization() -> None:
    """1 GB of KV over 100 Mbit/s in a 1 s run: the link stays busy (100%), no transfer
    completes, and the report said nothing. Now the diagnosis says so, with the numbers."""
    line = diagnose(_result(
        utilization=1.0, link_gbps=0.1, wire_gbps=0.094, acked_kv_gbps=0.09, incomplete_transfers=1,
        tokens=8192, kv_bytes_per_transfer=1_073_741_824, seconds=31.0,
        start={"config": {"duration": 1.0, "tokens": 8192}},
    ), window_bytes=32 * MiB)
    assert line is not None and line.startswith("utilization 100%: ")
    assert "1 transfer abandoned at the run's hard stop" in line
    assert "one transfer of 1074 MB of KV takes about 95.4 s at the 90 Mbit/s of KV acknowledged" in line
    assert "--duration 1 s" in line
    assert "try --tokens 21 or less, or --duration 382 s or more" in line
    assert "CPU" not in line  # a busy link is not held down by CPU


def test_an_abandoned_transfer_without_numbers_still_says_what_to_change() -> None:
    line = diagnose(_result(utilization=0.99, incomplete_transfers=2), window_bytes=32 * MiB)
    assert line is not None and "2 transfers abandoned" in line
    assert "try a smaller --tokens or a longer --duration" in line


def test_a_cpu_bound_sender_is_diagnosed_without_a_utilization() -> None:
    """A loopback or --peer run has no link to compare with: its CPU is checked anyway."""
    cpu = {"sender": 0.92, "receiver": 0.1, "cores": 2}
    line = diagnose(_result(mode="peer", utilization=None, link_gbps=None, cpu=cpu), window_bytes=32 * MiB)
    assert line == "sender CPU-bound (92% of a core)"
    busy = {"sender": 0.5, "cores": 2, "machine_busy": 0.95, "others": 0.4}
    line = diagnose(_result(mode="loopback", utilization=None, link_gbps=None, cpu=busy), window_bytes=32 * MiB)
    assert line is not None and "2 cores were 95% busy (40% of them by other processes)" in line
    # Nothing found and nothing to compare with: no diagnosis.
    quiet = {"sender": 0.5, "cores": 2}
    assert diagnose(_result(mode="peer", utilization=None, link_gbps=None, cpu=quiet), window_bytes=32 * MiB) is None


def test_the_streams_suggested_stay_within_the_limit() -> None:
    # 100 Gbit/s at 50 ms with 1 MiB windows takes 597 streams: more than 64 exist.
    line = diagnose(_result(link_gbps=100.0, rtt_ms=50.0, streams=4, mode="kernel"), window_bytes=1 * MiB)
    assert line is not None and "window/RTT limit" in line
    assert "try --streams" not in line
    assert "it takes 597 streams, and even --streams 64, the most, carry at most 10.7 Gbit/s" in line
    assert "streams alone cannot cover" in line
    # Within reach: the count to try.
    line = diagnose(_result(link_gbps=10.0, rtt_ms=20.0, streams=2, mode="kernel"), window_bytes=1 * MiB)
    assert line is not None and "try --streams 24" in line


def test_with_rtt_0_the_in_flight_check_uses_a_chunks_serialization() -> None:
    """--rtt 0 on an emulated link: the measured (application-level) minimum RTT of 50 ms
    made a bandwidth-delay product the link does not have."""
    line = diagnose(_result(link_gbps=1.0, rtt_ms=0.0, measured_rtt_ms=50.0, streams=64,
                            bytes_in_flight_mean=2 * MiB), window_bytes=32 * MiB)
    assert line is not None and "too little in flight" not in line
    # A configured RTT still counts, with the chunk's serialization added and named.
    line = diagnose(_result(link_gbps=1.0, rtt_ms=20.0, measured_rtt_ms=50.0, streams=64,
                            bytes_in_flight_mean=0.5 * MiB), window_bytes=32 * MiB)
    assert line is not None and "too little in flight: 0.5 MiB on average for a 3.38 MiB" in line
    assert "(28.4 ms RTT: --rtt 20 ms + 8.39 ms to serialize a chunk)" in line


# -- the interval line and the report --------------------------------------------------------


def test_an_interval_line_labels_the_bytes_handed_to_tcp_and_gives_the_kv_acknowledged() -> None:
    iv = {"start": 1.0, "end": 2.0, "sent_gbps": 0.5, "goodput_gbps": 0.09, "estimated_gbps": 0.1,
          "link_gbps": 0.1, "sender_cpu": 0.01, "transfers": 0}
    line = format_interval(iv, "raw")
    assert "to TCP 500 Mbit/s" in line and "KV acked 90 Mbit/s" in line and " sent " not in line


def test_the_plot_labels_the_wire_series_by_mode() -> None:
    assert command.wire_label("emulated") == command.wire_label("kernel") == "wire rate (TCP payload the link carried)"
    assert command.wire_label("loopback") == command.wire_label("peer") == "handed to TCP (sender's sockets)"


def test_the_report_has_a_schema_the_kv_acknowledged_and_a_reference_for_every_field() -> None:
    cfg = runner.BenchConfig(model="tiny", tokens=64, duration=0.3, baseline=False)
    result = runner.run_bench(cfg)
    assert result["schema"] == runner.REPORT_SCHEMA == 1
    assert result["acked_kv_bytes"] >= result["kv_bytes"] > 0
    assert result["acked_kv_gbps"] >= result["goodput_gbps"] > 0
    # docs/bench.md names every field of the report, its cpu, samples and intervals.
    doc = (Path(__file__).parents[2] / "docs" / "bench.md").read_text()
    assert [key for key in result if f"`{key}`" not in doc] == []
    for part in ("cpu", "samples", "intervals"):
        items = result[part] if part == "cpu" else result[part][0]
        assert [key for key in items if f"`{part}.{key}`" not in doc and f"`{key}`" not in doc] == []


# -- refusals ---------------------------------------------------------------------------------


@pytest.fixture
def no_run(monkeypatch: pytest.MonkeyPatch) -> None:
    def started(*args: Any, **kwargs: Any) -> dict[str, Any]:
        raise AssertionError("the run started")

    monkeypatch.setattr(runner, "run_bench", started)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--link", "1e30gbps"], "--link must be at most 1.6 Tbit/s"),
        (["--link", "2tbps"], "--link must be at most 1.6 Tbit/s"),
        (["--link-schedule", "0s:1gbps,1s:2tbps"], "every rate of --link-schedule must be at most 1.6 Tbit/s"),
        (["--codec", "int8", "--auto-codec", "measured"], "--auto-codec measured is for --codec auto"),
        (["--mtu", "9000"], "--mtu is for a shaped link"),
        (["--link-layer", "payload"], "plain loopback is not shaped, so --link-layer payload would be ignored"),
        (["--rtt", "10ms", "--mtu", "9000"], "a link with no rate (--rtt alone) is not shaped"),
        (["--peer", "127.0.0.1:7070", "--mtu", "9000"], "--peer's network is not shaped"),
        (["--link", "1gbps", "--rtt", "10ms", "--jitter", "1s"], "--jitter 1 s is more than half of --rtt 10 ms"),
        (["--link", "1gbps", "--jitter", "1ms"], "--jitter 1 ms is more than half of --rtt 0 s"),
    ],
)
def test_options_the_run_would_ignore_are_refused(
    argv: list[str], says: str, no_run: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "--model", "tiny", "--duration", "1", "--quiet", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvwire bench: error: ") and says in err, err


def test_the_options_that_apply_are_taken() -> None:
    for cfg in (
        runner.BenchConfig(model="tiny", codec="auto", auto_codec="measured"),
        runner.BenchConfig(model="tiny", link_bps=1e9, mtu=9000, link_layer="payload"),
        runner.BenchConfig(model="tiny", link_bps=1.6e12),
        runner.BenchConfig(model="tiny", link_bps=1e9, rtt=0.02, jitter=0.01),
    ):
        command.check_bench_options(cfg)


def test_ctrl_c_while_the_arguments_are_read_is_an_interruption(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--codec's check imports the bench runner (half a second): Ctrl-C then printed a
    KeyboardInterrupt traceback instead of "interrupted" and exit 130."""
    def interrupted(text: str) -> str:
        raise KeyboardInterrupt

    monkeypatch.setattr(command, "_codec", interrupted)
    try:
        code = main(["bench", "--codec", "int8", "--duration", "1"])
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt raised out of main: a traceback")
    assert code == 130
    assert capsys.readouterr().err == "interrupted\n"
