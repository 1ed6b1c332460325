"""``throughput_rps``: completions per second between the first and the last completion,
n/a (NaN, ``null`` in the JSON, ``n/a`` in the table) when the arrivals span under
:data:`MIN_ARRIVAL_WINDOW_S` or fewer than two requests complete, as egress and
``saturated`` are: a burst has no rate to sustain."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvwire.cli import main
from kvwire.scheduler.simulator import (
    MIN_ARRIVAL_WINDOW_S,
    PolicyName,
    SimulationConfig,
    simulate,
)
from kvwire.scheduler.workload import TraceRequest
from tests.scheduler.worked_cluster import config as worked_config


def config() -> SimulationConfig:
    """The worked cluster of tests/scheduler/worked_cluster.py (1 s of remote and 10 s of
    local prefill per 1000 tokens, 1000 bytes of KV per token) with 8 local servers, 7 of
    them prefill."""
    return worked_config(local_instances=8, prefill_instances=7)


def at(times: list[float], n: int = 1000) -> list[TraceRequest]:
    return [TraceRequest(arrival_s=t, input_length=n + i, output_length=1, hash_ids=())
            for i, t in enumerate(times)]


def test_a_burst_has_no_throughput() -> None:
    # Five requests at one instant on seven local servers complete about 2 ms apart: it
    # read (5 - 1) / 0.008 s = 500 req/s, against a model capacity of 3.5.
    r = simulate(at([0.0] * 5), config(), PolicyName.LOCAL)
    assert r.completed == 5
    assert math.isnan(r.throughput_rps)
    assert r.as_json()["throughput_rps"] is None


@pytest.mark.parametrize("times", [[0.0], [0.0, 0.5], [3.0, 3.0 + MIN_ARRIVAL_WINDOW_S / 2, 3.9]])
def test_arrivals_under_the_minimum_window_have_no_throughput(times: list[float]) -> None:
    r = simulate(at(times), config(), PolicyName.LOCAL)
    assert math.isnan(r.throughput_rps)


def test_throughput_over_a_window_of_a_second_or_more_is_hand_computed() -> None:
    # Arrivals at 0, 1 and 2 s, each 10 ms a token of prefill on its own server (1000,
    # 1001, 1002 tokens) and one 50 ms decode step: done at 10.05, 11.06 and 12.07 s.
    r = simulate(at([0.0, 1.0, 2.0]), config(), PolicyName.LOCAL)
    assert r.throughput_rps == pytest.approx(2 / (12.07 - 10.05))


def test_the_command_prints_n_a_for_a_burst(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "burst.jsonl"
    trace.write_text("".join(
        json.dumps({"timestamp": 0, "input_length": 1000 + i, "output_length": 1}) + "\n"
        for i in range(5)
    ))
    assert main(["simulate", "--trace", str(trace), "--policy", "local", "--json", "-"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["policies"]["local"]["throughput_rps"] is None
    row = next(line for line in captured.err.splitlines() if "local" in line and "│" in line)
    cells = [c.strip() for c in row.split("│")]
    assert cells[4] == "n/a"  # thr rps
