"""kvwire simulate refuses options the run would ignore, which it accepted and dropped
without a word: --limit without --trace, the synthetic workload's options with --trace,
--load-baseline without --load, --threshold when selective does not run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvwire.cli import build_parser, main
from kvwire.scheduler.command import run

TRACE = str(Path(__file__).resolve().parents[1] / "data" / "traces" / "mooncake_synthetic.jsonl.gz")


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["simulate", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvwire simulate: ")
    return lines[0]


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--requests", "10"], "--requests shapes"),
        (["--rate", "3"], "--rate shapes"),
        (["--mu", "9"], "--mu shapes"),
        (["--sigma", "0.5"], "--sigma shapes"),
        (["--min-tokens", "64"], "--min-tokens shapes"),
        (["--max-tokens", "4096"], "--max-tokens shapes"),
        (["--clip-lengths"], "--clip-lengths shapes"),
        (["--output-tokens", "16"], "--output-tokens shapes"),
        (["--requests", "10", "--mu", "9"], "--requests, --mu shape"),
        # Given at its default value, still given.
        (["--requests", "4000"], "--requests shapes"),
    ],
)
def test_synthetic_options_with_a_trace_are_refused(
    extra: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _refused(["--trace", TRACE, "--limit", "20", *extra], capsys)
    assert named in line and "not --trace" in line


def test_limit_without_a_trace_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    line = _refused(["--requests", "20", "--limit", "5"], capsys)
    assert "--limit N keeps the first N records of --trace" in line


def test_load_baseline_without_load_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    line = _refused(["--requests", "20", "--load-baseline", "local"], capsys)
    assert "--load-baseline names the policy whose capacity --load refers to" in line


@pytest.mark.parametrize("policy", ["local", "offload-all", "adaptive", "local,offload-all,adaptive"])
def test_threshold_without_selective_is_refused(policy: str, capsys: pytest.CaptureFixture[str]) -> None:
    line = _refused(["--requests", "20", "--policy", policy, "--threshold", "1000"], capsys)
    assert "--threshold fixes selective's t" in line and f"--policy {policy} does not" in line


def test_what_they_apply_to_is_accepted(capsys: pytest.CaptureFixture[str]) -> None:
    # --threshold with selective; with --load at the (default) selective baseline it sets
    # the capacity --load scales to, whatever --policy runs.
    for argv in (
        ["--trace", TRACE, "--limit", "30", "--policy", "selective", "--threshold", "20000"],
        ["--requests", "30", "--policy", "local", "--threshold", "20000", "--load", "0.5"],
        ["--requests", "30", "--policy", "local", "--load", "0.5", "--load-baseline", "local"],
        ["--requests", "30", "--rate", "3", "--mu", "9", "--sigma", "0.5", "--min-tokens", "64",
         "--max-tokens", "4096", "--clip-lengths", "--output-tokens", "16", "--policy", "local"],
    ):
        assert main(["simulate", *argv, "--json", "-"]) == 0, argv
        json.loads(capsys.readouterr().out)


def test_defaults_are_filled_in_and_the_parsed_namespace_is_left_alone(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = build_parser().parse_args(["simulate", "--requests", "30", "--policy", "local",
                                      "--load", "0.5", "--json", "-"])
    assert args.load_baseline is None and args.mu is None
    assert run(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["workload"]["load_baseline"] == "selective"
    assert doc["workload"]["requests"] == 30
    # A second run of the same namespace sees the options as given, not the defaults.
    assert args.load_baseline is None and args.mu is None
    assert run(args) == 0
    assert json.loads(capsys.readouterr().out) == doc
