from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

import pytest

import kvwire.scheduler
from kvwire.scheduler.command import add_parser, run

FORBIDDEN = {"asyncio", "socket", "ssl", "selectors", "time", "threading", "uvloop", "kvwire.aio"}


def test_scheduler_is_pure() -> None:
    root = Path(kvwire.scheduler.__file__).parent
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                assert top not in FORBIDDEN and not name.startswith("kvwire.aio"), (path, name)


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="kvwire")
    add_parser(ap.add_subparsers(dest="command", required=True))
    return ap.parse_args(argv)


def test_simulate_cli_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    args = parse(
        ["simulate", "--requests", "150", "--rate", "2", "--json", str(out), "--link", "10gbit"]
    )
    assert run(args) == 0
    doc = json.loads(out.read_text())
    assert set(doc["policies"]) == {"local", "offload-all", "selective", "adaptive"}
    for r in doc["policies"].values():
        for key in (
            "throughput_rps",
            "ttft_p50_s",
            "ttft_p90_s",
            "ttft_p99_s",
            "offload_fraction",
            "egress_gbps_mean",
            "cache_hit_ratio",
        ):
            assert key in r
    assert "threshold_tokens" in doc["policies"]["selective"]
    assert "selective" in capsys.readouterr().out


def test_simulate_cli_trace_and_plot(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    lines = [
        json.dumps(
            {
                "timestamp": i * 300,
                "input_length": 3000 + 997 * i,
                "output_length": 50,
                "hash_ids": list(range(i * 100, i * 100 + (3000 + 997 * i + 511) // 512)),
            }
        )
        for i in range(60)
    ]
    trace.write_text("\n".join(lines) + "\n")
    png = tmp_path / "t.png"
    args = parse(
        [
            "simulate",
            "--trace",
            str(trace),
            "--policy",
            "selective,local",
            "--plot",
            str(png),
            "--plot-points",
            "4",
            "--profile",
            "llama-3-70b",
        ]
    )
    assert run(args) == 0
    assert png.stat().st_size > 1000


def test_simulate_cli_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(parse(["simulate", "--policy", "bogus"])) == 2
    assert run(parse(["simulate", "--link", "fast", "--requests", "10"])) == 2
    assert run(parse(["simulate", "--trace", "/nonexistent.jsonl"])) == 2
