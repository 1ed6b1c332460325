"""--load has an upper bound (1,000 x capacity), like the other bounded options of
kvwire simulate, and a load that cannot be reached is blamed on the link schedule only
when the link has one."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import cast

import pytest

from kvwire.cli import main
from kvwire.errors import UsageError
from kvwire.scheduler import command
from kvwire.scheduler.simulator import PolicyName, SimulationConfig
from kvwire.scheduler.workload import TraceRequest


@pytest.mark.parametrize("value", ["1001", "1e12", "1e308", "inf"])
def test_load_past_its_bound_is_a_usage_error(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    # 1e12 ran and printed a utilization of 1000000000000.00 that broke the table; 1e308
    # failed blaming a link schedule the run did not have.
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--requests", "20", "--policy", "selective", "--load", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("kvwire simulate: error: argument --load: ")
    assert ("must be at most 1,000" in last) if value != "inf" else ("finite" in last)
    assert "schedule" not in last and "Traceback" not in err


def test_load_at_its_bound_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--requests", "20", "--policy", "selective", "--load", "1000",
                 "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["workload"]["load"] == 1000.0
    assert doc["policies"]["selective"]["utilization"] == pytest.approx(1000.0, rel=2e-3)


def _jumping_capacity(monkeypatch: pytest.MonkeyPatch) -> tuple[TraceRequest, ...]:
    """A capacity that jumps past the load 0.05 as the window crosses 100 s."""

    def capacity(policy: object, reqs: tuple[TraceRequest, ...], config: object,
                 **kw: object) -> SimpleNamespace:
        span = max(r.arrival_s for r in reqs) - min(r.arrival_s for r in reqs)
        return SimpleNamespace(lambda_max_rps=10.0 if span > 100 else 1.0)

    monkeypatch.setattr(command, "policy_capacity", capacity)
    return tuple(TraceRequest(arrival_s=float(i), input_length=1000, output_length=10)
                 for i in range(11))


def test_unreached_load_under_one_rate_names_no_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    reqs = _jumping_capacity(monkeypatch)
    one_rate = cast(SimulationConfig, SimpleNamespace(link=SimpleNamespace(rates_bps=(1e11,))))
    with pytest.raises(UsageError) as exc:
        command._at_load(reqs, one_rate, 0.05, PolicyName.SELECTIVE)
    text = str(exc.value)
    assert text.startswith(
        "--load 0.05 cannot be reached: no rescaling of the arrivals offers 0.05 x selective's capacity"
    )
    assert "schedule" not in text


def test_unreached_load_under_a_schedule_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    reqs = _jumping_capacity(monkeypatch)
    scheduled = cast(SimulationConfig, SimpleNamespace(link=SimpleNamespace(rates_bps=(1e9, 1e11))))
    with pytest.raises(UsageError, match=r"^--load 0\.05 cannot be reached: selective's capacity "
                                         r"changes with the arrival window under the link schedule"):
        command._at_load(reqs, scheduled, 0.05, PolicyName.SELECTIVE)
