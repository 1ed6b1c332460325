"""The rule "a link's TCP payload capacity where the report knows it, else its line rate"
is one function, kvwire.bench.report.payload_capacity (and payload_share, built on it):
the diagnosis, ``--plot`` and benchmarks/link.py all take it from there."""

from __future__ import annotations

from typing import Any

import pytest

from kvwire.bench import command, report
from tests.bench.script_helpers import load_script

CAPACITY_10G = 10 * 1448 / 1538  # 9.415 Gbit/s of TCP payload at MTU 1500


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
