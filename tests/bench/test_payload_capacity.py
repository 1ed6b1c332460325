"""--link is an Ethernet line rate: what still took it for the payload rate. The
diagnosis's window, in-flight and estimate checks and benchmarks/link.py's checks hold
TCP payload against the link's payload capacity; a last interval shorter than half an
--interval is folded into the one before; --no-baseline outside loopback is refused;
the plot draws the payload capacity; link_layer and mtu are null without a shaped link.
The rule "the payload capacity where the report knows it, else the line rate" is one
function, kvwire.bench.report.payload_capacity (and payload_share, built on it): the
diagnosis, ``--plot`` and benchmarks/link.py all take it from there."""

from __future__ import annotations

from typing import Any

import pytest

from kvwire.bench import command, report, runner
from kvwire.bench.report import diagnose, intervals
from kvwire.errors import UsageError
from tests.bench.script_helpers import load_script

MiB = 1 << 20
CAPACITY_10G = 10 * 1448 / 1538  # 9.415 Gbit/s of TCP payload at MTU 1500


def _result(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "mode": "kernel", "utilization": 0.4, "link_gbps": 10.0, "payload_capacity_gbps": CAPACITY_10G,
        "link_layer": "ethernet", "mtu": 1500, "rtt_ms": 55.0, "measured_rtt_ms": 55.0, "streams": 4,
        "streams_max": None, "estimated_gbps": 9.0, "wire_gbps": 3.8, "bytes_in_flight_mean": None,
        "chunk_bytes": 4 * MiB, "incomplete_transfers": 0,
        "cpu": {"sender": 0.3, "receiver": 0.3, "cores": 8, "machine_busy": 0.3, "others": 0.05},
    }
    base.update(over)
    return base


# -- the diagnosis ----------------------------------------------------------------------------


def test_a_window_that_covers_the_payload_capacity_is_not_blamed() -> None:
    """4 streams x 16 MiB per 55 ms carry 9.76 Gbit/s: more than the 9.415 Gbit/s of
    payload a 10 Gbit/s line carries, though less than the line rate. It read "carry at
    most 9.76 Gbit/s (try --streams 5)"."""
    line = diagnose(_result(), window_bytes=16 * MiB)
    assert line is None or "window/RTT limit" not in line
    # Below the payload capacity it is still named, against that capacity.
    line = diagnose(_result(rtt_ms=60.0, measured_rtt_ms=60.0), window_bytes=16 * MiB)
    assert line is not None and "window/RTT limit" in line
    assert "carry at most 8.95 Gbit/s, the link's TCP payload capacity 9.41 (try --streams 5)" in line


def test_the_in_flight_and_estimate_checks_use_the_payload_capacity() -> None:
    # 9.415 Gbit/s x 55 ms = 61.7 MiB of payload in flight; 0.7 of it is 43.2 MiB
    # (0.7 of the line rate's 65.6 MiB is 45.9 MiB): 44 MiB is enough.
    line = diagnose(_result(bytes_in_flight_mean=44 * MiB, estimated_gbps=7.8), window_bytes=64 * MiB)
    assert line is None or "too little in flight" not in line
    # Under it: named, with an estimate held against the payload capacity (7.6 is over
    # 0.8 x 9.415 = 7.53, so it is not "under" the link; 7.4 is).
    line = diagnose(_result(bytes_in_flight_mean=30 * MiB, estimated_gbps=7.6), window_bytes=64 * MiB)
    assert line is not None and "61.7 MiB bandwidth-delay product" in line
    assert "estimate" not in line
    line = diagnose(_result(bytes_in_flight_mean=30 * MiB, estimated_gbps=7.4), window_bytes=64 * MiB)
    assert line is not None
    assert "(estimate 7.4 Gbit/s under the link's TCP payload capacity 9.41)" in line


def test_the_emulated_links_rtt_adds_a_chunks_serialization_at_the_payload_rate() -> None:
    # 4 MiB at 9.415 Gbit/s: 3.56 ms (3.36 at the line rate), said without nested brackets.
    line = diagnose(_result(mode="emulated", rtt_ms=200.0, measured_rtt_ms=210.0,
                            bytes_in_flight_mean=10 * MiB), window_bytes=64 * MiB)
    assert line is not None
    assert "(204 ms RTT: --rtt 200 ms + 3.56 ms to serialize a chunk)" in line
    assert "((" not in line and "))" not in line
    # A report without payload_capacity_gbps: the link's rate, as before.
    line = diagnose(_result(mode="emulated", rtt_ms=200.0, payload_capacity_gbps=None,
                            bytes_in_flight_mean=10 * MiB), window_bytes=64 * MiB)
    assert line is not None and "+ 3.36 ms to serialize a chunk" in line


# -- the intervals ----------------------------------------------------------------------------


def _sample(t: float, kv: int) -> dict[str, Any]:
    return {"t": t, "bytes_sent": kv, "kv_bytes_done": kv, "transfers": kv // (4 * MiB), "cpu_s": t / 2,
            "retransmits": 0, "chunks_by_codec": {"raw": kv // (4 * MiB)}, "streams": 4,
            "wire_gbps": 9.4, "estimated_gbps": 9.3, "link_gbps": 10.0}


INITIAL = {"t": 0.0, "bytes_sent": 0, "kv_bytes_done": 0, "transfers": 0, "cpu_s": 0.0,
           "retransmits": 0, "chunks_by_codec": {}}


def test_a_last_interval_shorter_than_half_an_interval_is_folded_into_the_one_before() -> None:
    """"[10.2-10.2 s] to TCP 0 bit/s KV acked 18.87 Gbit/s ... link 10 Gbit/s": a 4 MiB
    chunk credited over 0.13 s reads twice the link."""
    samples = [_sample(t / 10, t * 8 * MiB) for t in range(1, 21)] + [_sample(2.13, 164 * MiB)]
    ivs = intervals(samples, 1.0, INITIAL)
    assert [(iv["start"], iv["end"]) for iv in ivs] == [(0.0, 1.0), (1.0, 2.13)]
    assert ivs[-1]["goodput_gbps"] == pytest.approx((164 - 80) * MiB * 8 / 1.13 / 1e9)
    assert ivs[-1]["transfers"] == 41 - 20 and ivs[-1]["chunks_by_codec"] == {"raw": 21}
    assert sum(iv["goodput_gbps"] * (iv["end"] - iv["start"]) for iv in ivs) == pytest.approx(164 * MiB * 8 / 1e9)
    # Half an interval or more stays an interval of its own.
    samples[-1] = _sample(2.5, 164 * MiB)
    assert [(iv["start"], iv["end"]) for iv in intervals(samples, 1.0, INITIAL)] == [
        (0.0, 1.0), (1.0, 2.0), (2.0, 2.5)]
    # A run shorter than half an interval has one, short.
    assert [(iv["start"], iv["end"]) for iv in intervals(samples[:2], 1.0, INITIAL)] == [(0.0, 0.2)]


def test_a_loopback_run_prints_the_intervals_it_reports_and_no_link_layer() -> None:
    """The lines printed while it runs are the report's intervals (a short last one folded
    in both), and a run without a shaped link has no link layer or MTU."""
    printed: list[tuple[float, float]] = []
    cfg = runner.BenchConfig(model="tiny", tokens=64, duration=0.5, baseline=False, interval=0.2)
    result = runner.run_bench(cfg, on_interval=lambda iv: printed.append((iv["start"], iv["end"])))
    assert printed == [(iv["start"], iv["end"]) for iv in result["intervals"]]
    assert len(printed) == 1 or printed[-1][1] - printed[-1][0] >= 0.1
    assert result["link_layer"] is None and result["mtu"] is None
    assert result["payload_capacity_gbps"] is None


# -- options ----------------------------------------------------------------------------------


@pytest.mark.parametrize("over", [{"link_bps": 100e6}, {"rtt": 0.02}, {"link_bps": 1e9, "kernel": True}])
def test_no_baseline_is_refused_outside_loopback(over: dict[str, Any]) -> None:
    cfg = runner.BenchConfig(model="tiny", baseline=False, **over)
    with pytest.raises(UsageError, match="--no-baseline is for plain loopback runs"):
        command.check_bench_options(cfg)
    command.check_bench_options(runner.BenchConfig(model="tiny", baseline=False))


def test_jitter_without_an_rtt_says_to_drop_it_or_give_an_rtt() -> None:
    with pytest.raises(UsageError, match=r"drop --jitter, or give --rtt 2 ms or more$"):
        command.check_bench_options(runner.BenchConfig(model="tiny", rtt=0.0, jitter=0.001))
    with pytest.raises(UsageError, match=r"give --jitter 5 ms or less, or --rtt 40 ms or more$"):
        command.check_bench_options(runner.BenchConfig(model="tiny", rtt=0.01, jitter=0.02))


# -- the plot and benchmarks/link.py --------------------------------------------------------


def test_the_link_script_holds_the_estimate_against_the_payload_capacity() -> None:
    link = load_script("link.py", "link_script_payload")
    share = link.payload_share({"link_gbps": 10.0, "payload_capacity_gbps": CAPACITY_10G})
    assert share == pytest.approx(1448 / 1538)
    assert link.payload_share({"link_gbps": 10.0, "payload_capacity_gbps": None}) == 1.0
    # A saturated link's estimate, 9.4 Gbit/s of payload, is within 10% of its capacity
    # (it was 6% under the line rate); 8.4 is not.
    samples = [{"t": 2.0, "estimated_gbps": 9.4, "link_gbps": 10.0},
               {"t": 2.1, "estimated_gbps": 8.4, "link_gbps": 10.0}]
    assert link.within(samples, 0.10, share) == 0.5
    assert link.within([{"t": 2.0, "estimated_gbps": 9.2, "link_gbps": 10.0}], 0.01, share) == 0.0


# -- one rule: the capacity where the report knows it, else the line rate ----------------------


def test_the_capacity_where_known_else_the_line_rate() -> None:
    assert report.payload_capacity({"link_gbps": 10.0, "payload_capacity_gbps": CAPACITY_10G}) == (CAPACITY_10G, True)
    assert report.payload_capacity({"link_gbps": 10.0, "payload_capacity_gbps": None}) == (10.0, False)
    assert report.payload_capacity({"link_gbps": 10.0}) == (10.0, False)
    assert report.payload_capacity({"link_gbps": None, "payload_capacity_gbps": None}) == (None, False)
    # --link-layer payload: the capacity is the rate, and still the capacity.
    assert report.payload_capacity({"link_gbps": 10.0, "payload_capacity_gbps": 10.0}) == (10.0, True)


def test_the_share_of_the_line_rate() -> None:
    assert report.payload_share({"link_gbps": 10.0, "payload_capacity_gbps": CAPACITY_10G}) == CAPACITY_10G / 10.0
    assert report.payload_share({"link_gbps": 10.0, "payload_capacity_gbps": None}) == 1.0
    assert report.payload_share({"link_gbps": None, "payload_capacity_gbps": None}) == 1.0
    assert report.payload_share({}) == 1.0


def test_the_link_script_uses_the_reports_rule() -> None:
    link = load_script("link.py", "link_script_capacity_rule")
    assert link.payload_share is report.payload_share
    assert link.payload_capacity is report.payload_capacity


def _plot(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, result: dict[str, Any]) -> list[tuple[str, list[float]]]:
    from matplotlib.axes import Axes  # (the test extra installs matplotlib)

    drawn: list[tuple[str, list[float]]] = []
    step = Axes.step

    def spy(self: Any, x: Any, y: Any, *args: Any, **kw: Any) -> Any:
        drawn.append((kw.get("label", ""), list(y)))
        return step(self, x, y, *args, **kw)

    monkeypatch.setattr(Axes, "step", spy)
    samples = [{"t": t, "wire_gbps": 9.4, "estimated_gbps": 9.3, "link_gbps": 10.0} for t in (0.1, 0.2)]
    base = {"samples": samples, "mode": "emulated", "model": "tiny", "tokens": 64, "codec": "raw",
            "streams": 4, "rtt_ms": 20.0, "link_gbps": 10.0}
    command.write_plot({**base, **result}, str(tmp_path / "p.png"))
    return drawn


def test_the_plot_draws_the_capacity_where_known_else_the_line_rate(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    drawn = _plot(tmp_path, monkeypatch, {"payload_capacity_gbps": CAPACITY_10G})
    assert drawn == [("link's TCP payload capacity", [pytest.approx(CAPACITY_10G)] * 2)]
    drawn = _plot(tmp_path, monkeypatch, {"payload_capacity_gbps": None})
    assert drawn[-1] == ("link rate (line rate)", [10.0, 10.0])
    drawn = _plot(tmp_path, monkeypatch, {"payload_capacity_gbps": 10.0})
    assert drawn[-1] == ("link's TCP payload capacity", [10.0, 10.0])


def test_the_plot_takes_the_share_from_the_report(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(report, "payload_share", lambda result: 0.5)
    drawn = _plot(tmp_path, monkeypatch, {"payload_capacity_gbps": CAPACITY_10G})
    assert drawn == [("link's TCP payload capacity", [5.0, 5.0])]


def test_the_diagnosis_holds_the_window_against_the_reports_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    MiB = 1 << 20
    result = {"mode": "kernel", "utilization": 0.4, "link_gbps": 10.0, "payload_capacity_gbps": None,
              "rtt_ms": 60.0, "measured_rtt_ms": 60.0, "streams": 4, "streams_max": None,
              "estimated_gbps": 9.0, "wire_gbps": 3.8, "bytes_in_flight_mean": None,
              "chunk_bytes": 4 * MiB, "incomplete_transfers": 0,
              "cpu": {"sender": 0.3, "receiver": 0.3, "cores": 8, "machine_busy": 0.3, "others": 0.05}}
    # Without the capacity the line rate stands for it, named as such: 4 x 16 MiB per 60 ms,
    # 8.95 Gbit/s.
    line = report.diagnose(result, window_bytes=16 * MiB)
    assert line is not None and "carry at most 8.95 Gbit/s, the link's line rate 10" in line
    result["payload_capacity_gbps"] = CAPACITY_10G
    line = report.diagnose(result, window_bytes=16 * MiB)
    assert line is not None and "carry at most 8.95 Gbit/s, the link's TCP payload capacity 9.41" in line
