"""kvwire bench takes --link or --link-schedule, not both, as kvwire simulate does: given
both, the schedule replaced --link without a word."""

from __future__ import annotations

import pytest

from kvwire.cli import build_parser, main


@pytest.mark.parametrize("command", ["bench", "simulate"])
def test_link_and_link_schedule_are_mutually_exclusive(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main([command, "--link", "1gbps", "--link-schedule", "0s:1gbps,1s:2gbps"])
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == (
        f"kvwire {command}: error: argument --link-schedule: not allowed with argument --link"
    )


def test_either_alone_is_accepted() -> None:
    parser = build_parser()
    args = parser.parse_args(["bench", "--link", "1gbps"])
    assert args.link == 1e9 and args.link_schedule is None
    args = parser.parse_args(["bench", "--link-schedule", "0s:1gbps,1s:2gbps"])
    assert args.link is None and args.link_schedule == ((0.0, 1e9), (1.0, 2e9))
