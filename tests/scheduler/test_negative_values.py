"""A negative value of a kvwire simulate option is refused for what it is: argparse took
``-5gbps`` (or ``-1e3``) for an option and said "argument --link: expected one argument"."""

from __future__ import annotations

import pytest

from kvwire.cli import build_parser, main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--link", "-5gbps"], "argument --link: '-5gbps' must not be negative"),
        (["--rtt", "-1ms"], "argument --rtt: '-1ms' must not be negative"),
        (["--decode-step", "-1ms"], "argument --decode-step: '-1ms' must not be negative"),
        (["--bandwidth-window", "-1s"], "argument --bandwidth-window: '-1s' must not be negative"),
        (["--egress-window", "-1s"], "argument --egress-window: '-1s' must not be negative"),
        # Numbers in exponent notation were options too; their checks name the bound.
        (["--load", "-1e3"], "argument --load: '-1e3' must be > 0"),
        (["--rate", "-2e0"], "argument --rate: '-2e0' must be > 0"),
        (["--threshold", "-5e3"], "argument --threshold: '-5e3' must be >= 0"),
        (["--speedup", "-1e1"], "argument --speedup: '-1e1' must be > 0"),
    ],
)
def test_negative_values_are_refused_as_negative(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["simulate", *argv])
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == f"kvwire simulate: error: {message}"


def test_mu_takes_a_negative_number_in_any_notation() -> None:
    # (-3 was read; -1e0 and -3.5e-1 were "expected one argument".)
    for text, value in (("-3", -3.0), ("-1e0", -1.0), ("-3.5e-1", -0.35)):
        assert build_parser().parse_args(["simulate", "--mu", text]).mu == value
