"""A negative value of a kvwire bench option is refused for what it is: argparse took
``-5gbps`` for an option and said "argument --link: expected one argument"."""

from __future__ import annotations

import argparse

import pytest

from kvwire.cli import build_parser, main
from kvwire.units import argument_type, parse_rate, positive


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--link", "-5gbps"], "argument --link: '-5gbps' must not be negative"),
        (["--link=-5gbps"], "argument --link: '-5gbps' must not be negative"),
        (["--rtt", "-1ms"], "argument --rtt: '-1ms' must not be negative"),
        (["--jitter", "-1ms"], "argument --jitter: '-1ms' must not be negative"),
        (["--duration", "-1s"], "argument --duration: '-1s' must not be negative"),
        (["--interval", "-1s"], "argument --interval: '-1s' must not be negative"),
        (["--chunk-size", "-1KiB"], "argument --chunk-size: '-1KiB' must not be negative"),
        # A message that names the bound already is kept.
        (["--tokens", "-5"], "argument --tokens: '-5' must be >= 1"),
        (["--link-schedule", "-1s:1gbps"], "argument --link-schedule: schedule item '-1s:1gbps'"),
    ],
)
def test_negative_values_are_refused_as_negative(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", *argv])
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"kvwire bench: error: {message}")
    assert "expected one argument" not in last


def test_an_option_after_an_option_still_needs_its_value(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--link", "--rtt", "1ms"])
    assert "argument --link: expected one argument" in capsys.readouterr().err


def test_a_value_that_is_not_a_number_is_still_an_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--link", "-x"])
    assert "argument --link: expected one argument" in capsys.readouterr().err


def test_the_helper_alone() -> None:
    from kvwire.units import take_negative_values

    parser = argparse.ArgumentParser(prog="p", exit_on_error=False)
    parser.add_argument("--rate", type=argument_type(positive(parse_rate, "rate"), "rate"))
    parser.add_argument("--x", type=float)
    with pytest.raises(argparse.ArgumentError, match="expected one argument"):
        parser.parse_args(["--rate", "-5gbps"])
    assert take_negative_values(parser) is parser
    with pytest.raises(argparse.ArgumentError, match="'-5gbps' must not be negative"):
        parser.parse_args(["--rate", "-5gbps"])
    assert parser.parse_args(["--x", "-1e-3"]).x == -1e-3
    assert parser.parse_args(["--x", "-.5"]).x == -0.5
    assert parser.parse_args(["--rate", "5gbps"]).rate == 5e9


def test_positive_values_parse_as_before() -> None:
    args = build_parser().parse_args(["bench", "--link", "5gbps", "--rtt", "1ms", "--seed", "-1"])
    assert args.link == 5e9 and args.rtt == pytest.approx(1e-3) and args.seed == -1
