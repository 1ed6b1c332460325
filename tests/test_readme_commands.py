"""README's command table and its account of the bench say what the commands do: the
``kvwire serve`` row lists every option ``kvwire serve --help`` lists, and a transfer still
under way when ``--duration`` ends is said to have the time the runner gives it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvwire.bench.runner import ABANDON_AFTER
from kvwire.cli import main

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_serve_row_lists_every_option_of_serve_help(capsys: pytest.CaptureFixture[str]) -> None:
    # --once was in --help, not in the table
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    options = set(re.findall(r"(--[a-z][a-z-]+)", capsys.readouterr().out)) - {"--help"}
    row = next(line for line in README.read_text().splitlines() if line.startswith("| `kvwire serve"))
    assert options and sorted(o for o in options if o not in row) == []


def test_a_transfer_under_way_at_the_end_is_given_the_runners_time() -> None:
    # it said such a transfer "is abandoned at its end"; the runner lets it finish within
    # ABANDON_AFTER (or the duration) past the end
    text = " ".join(README.read_text().split())
    assert "abandoned at its end" not in text
    assert f"may finish, for up to {ABANDON_AFTER:g} s past the end (as long again as `--duration`" in text
