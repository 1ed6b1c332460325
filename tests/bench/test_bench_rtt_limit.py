"""``kvwire bench`` refuses up front an --rtt (or --jitter) its connections' handshakes
cannot cross in time, reading a bare number as seconds and suggesting milliseconds; and
--duration's help says what becomes of a transfer still under way at the end."""

from __future__ import annotations

import pytest

from kvwire.bench import runner
from kvwire.bench.runner import ABANDON_AFTER, BenchConfig
from kvwire.cli import main
from kvwire.errors import UsageError


@pytest.mark.parametrize("rtt", ["20", "5", "9.5s"])
def test_an_rtt_the_handshake_cannot_cross_is_refused_suggesting_milliseconds(
    rtt: str, capsys: pytest.CaptureFixture[str],
) -> None:
    # --rtt 20 (meant 20 ms) ran 11 s, then failed with "handshake did not complete in time"
    assert main(["bench", "--rtt", rtt]) == 2
    err = capsys.readouterr().err
    assert "kvwire bench: error: --rtt" in err and "a bare number is seconds:" in err
    assert f"{float(rtt.rstrip('s')):g}ms?" in err


def test_a_jitter_the_handshake_cannot_cross_is_refused() -> None:
    with pytest.raises(UsageError, match=r"^--jitter 3 s is too long with --rtt 20 ms: .*: 3ms\?$"):
        BenchConfig(model="tiny", rtt=0.02, jitter=3.0)


def test_the_longest_rtt_taken_is_under_half_the_handshake_limit() -> None:
    limit = runner.HANDSHAKE_LIMIT
    assert limit == 10.0  # (connect_timeout's default)
    BenchConfig(model="tiny", rtt=4.9)  # two round trips within it
    BenchConfig(model="tiny", rtt=0.02, jitter=0.5)
    with pytest.raises(UsageError, match="two round trips"):
        BenchConfig(model="tiny", rtt=limit / 2)


def test_durations_help_says_a_transfer_under_way_may_finish_past_the_end(capsys: pytest.CaptureFixture[str]) -> None:
    # it said only "keep starting transfers for this long", the README that such a
    # transfer "is abandoned at its end"; the runner gives it ABANDON_AFTER more
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"for up to {ABANDON_AFTER:g} s more (as long again as --duration, if that is longer)" in text
