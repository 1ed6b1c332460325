"""--decode-step, --rtt and --bandwidth-noise have upper bounds, like the other options of
kvwire simulate: past them the command stops with a usage error naming the option."""

from __future__ import annotations

import json
import math

import pytest

from kvwire.cli import main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # It ran, exit status 0, and printed throughputs of 10^-300 req/s.
        (["--decode-step", "1e300"], "argument --decode-step: '1e300' must be at most 1 min"),
        (["--decode-step", "61s"], "argument --decode-step: '61s' must be at most 1 min"),
        # It ran and printed TTFTs of 300 digits that broke the table.
        (["--rtt", "1e300"], "argument --rtt: '1e300' must be at most 1 h"),
        (["--rtt", "3601"], "argument --rtt: '3601' must be at most 1 h"),
        # It failed naming decide()'s field (bandwidth_bps), not the option.
        (["--bandwidth-noise", "1e300"], "argument --bandwidth-noise: '1e300' must be at most 100"),
        (["--bandwidth-noise", "100.5"], "argument --bandwidth-noise: '100.5' must be at most 100"),
    ],
)
def test_options_past_their_bounds_are_usage_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--requests", "20", "--policy", "selective", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "kvwire simulate: " in err and message in err
    assert "bandwidth_bps" not in err and "Traceback" not in err


def test_the_bounds_themselves_are_accepted(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--requests", "20", "--rate", "0.01", "--output-tokens", "10",
                 "--policy", "local,adaptive", "--decode-step", "1min", "--rtt", "1h",
                 "--bandwidth-noise", "100", "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["system"]["decode_step_s"] == 60.0 and doc["system"]["rtt_s"] == 3600.0
    for result in doc["policies"].values():
        assert math.isfinite(result["throughput_rps"]) and math.isfinite(result["ttft_p99_s"])
