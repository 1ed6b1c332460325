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


def test_simulate_cli_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--policy", "bogus"], ["--link", "fast"], ["--rtt", "soon"],
                 ["--link-schedule", "10gbps,1gbps@3s"], ["--load", "0"], ["--requests", "0"]):
        with pytest.raises(SystemExit) as exc:
            parse(["simulate", *argv])
        assert exc.value.code == 2
        assert "error" in capsys.readouterr().err
    assert run(parse(["simulate", "--trace", "/nonexistent.jsonl"])) == 2
    assert "cannot read trace" in capsys.readouterr().err


def test_simulate_cli_checks_outputs_before_running(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A huge workload: if the paths were checked after the run, this test would take hours.
    big = ["simulate", "--requests", "10000000"]
    assert run(parse([*big, "--json", str(tmp_path / "no" / "such" / "dir.json")])) == 2
    assert "does not exist" in capsys.readouterr().err
    assert run(parse([*big, "--plot", str(tmp_path)])) == 2
    assert "is a directory" in capsys.readouterr().err


def test_simulate_cli_plot_without_matplotlib(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    args = parse(["simulate", "--requests", "10000000", "--plot", str(tmp_path / "p.png")])
    assert run(args) == 2
    assert "needs matplotlib" in capsys.readouterr().err


def test_simulate_cli_json_to_stdout_load_and_schedule(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse(["simulate", "--requests", "200", "--load", "0.5", "--json", "-",
                  "--policy", "local,selective", "--link-schedule", "0s:10gbps,30s:1gbps,60s:10gbps",
                  "--split-granularity", "gpu"])
    assert run(args) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)  # stdout holds only the JSON
    assert "kvwire simulate" in captured.err  # the table went to stderr
    sel = doc["policies"]["selective"]
    assert doc["workload"]["load"] == 0.5
    assert doc["workload"]["offered_rps"] == pytest.approx(0.5 * sel["capacity_rps"], rel=0.01)
    assert sel["utilization"] == pytest.approx(0.5, rel=0.01)
    assert doc["policies"]["local"]["utilization"] > sel["utilization"]
    assert isinstance(sel["saturated"], bool)
    assert doc["system"]["link_schedule"] == [[0.0, 10e9], [30.0, 1e9], [60.0, 10e9]]
    assert doc["system"]["split_granularity"] == "gpu"
    assert doc["model"]["balance_slack"] is not None
    # The summary names every rate of the schedule and the saturated policies.
    flat = " ".join(captured.err.split())
    assert "0 s:10 Gbit/s, 30 s:1 Gbit/s, 60 s:10 Gbit/s" in flat
    assert "saturated:" in flat


def test_simulate_overload_is_flagged(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse(["simulate", "--requests", "300", "--load", "3", "--json", "-",
                  "--policy", "local,selective"])
    assert run(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["policies"]["selective"]["saturated"] is True
    assert doc["policies"]["local"]["saturated"] is True


def test_every_option_has_help() -> None:
    ap = argparse.ArgumentParser(prog="kvwire")
    sub = ap.add_subparsers(dest="command", required=True)
    add_parser(sub)
    sim = sub.choices["simulate"]
    for action in sim._actions:
        assert action.help, action.option_strings


@pytest.mark.parametrize(
    "argv",
    [["--seed", "-1"], ["--mu", "nan"], ["--mu", "inf"], ["--mu", "x"]],
)
def test_simulate_cli_rejects_bad_numbers(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    # --seed -1 was a numpy ValueError traceback, --mu nan an OverflowError one.
    with pytest.raises(SystemExit) as exc:
        parse(["simulate", *argv])
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_simulate_cli_accepts_a_negative_mu() -> None:
    assert parse(["simulate", "--mu", "-1.5"]).mu == -1.5


def test_simulate_cli_checks_the_plot_format_before_running(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # matplotlib is a test dependency (the format check needs it). A huge workload: if the
    # format were found wrong only when the plot is written, this test would take hours.
    args = parse(["simulate", "--requests", "10000000", "--plot", str(tmp_path / "p.svgx")])
    assert run(args) == 2
    assert "cannot write 'svgx'" in capsys.readouterr().err


def _trace_file(path: Path, offset_ms: int) -> Path:
    lines = [
        json.dumps({"timestamp": offset_ms + 700 * i, "input_length": 3000 + 997 * (i % 40),
                    "output_length": 20, "hash_ids": [i]})
        for i in range(120)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def _close(a: object, b: object) -> bool:
    """Equal, floats to 1e-9 (shifted timestamps round differently)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, float) and isinstance(b, float):
        return bool(a == pytest.approx(b, rel=1e-9, abs=1e-9))
    return a == b


@pytest.mark.parametrize("speedup", ["1", "2"])
def test_simulate_cli_link_schedule_counts_from_the_first_arrival(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], speedup: str
) -> None:
    # The same trace with timestamps starting at 0 and at 1000 s gives the same run: the
    # schedule's times (and the mean link rate the model uses) count from the first arrival.
    docs = []
    for offset in (0, 1_000_000):
        trace = _trace_file(tmp_path / f"t{offset}.jsonl", offset)
        args = parse(["simulate", "--trace", str(trace), "--policy", "selective", "--json", "-",
                      "--speedup", speedup, "--link-schedule", "0s:1gbps,30s:8gbps"])
        assert run(args) == 0
        docs.append(json.loads(capsys.readouterr().out))
    for part in ("model", "policies"):
        assert _close(docs[0][part], docs[1][part]), part
    # 84 s of arrivals (42 s at --speedup 2): 30 s at 1 Gbit/s, the rest at 8.
    span = 83.3 / float(speedup)
    assert docs[0]["model"]["egress_bps"] == pytest.approx((30 * 1e9 + (span - 30) * 8e9) / span)


def test_load_scales_to_selective_capacity_at_the_given_threshold(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # --load took the capacity at the optimizer's t*, not at --threshold: with a fixed
    # threshold of 60K the run was at utilization 1.89 instead of 0.5.
    args = parse(["simulate", "--requests", "200", "--policy", "selective", "--threshold", "60000",
                  "--load", "0.5", "--json", "-"])
    assert run(args) == 0
    sel = json.loads(capsys.readouterr().out)["policies"]["selective"]
    assert sel["threshold_tokens"] == 60000
    assert sel["utilization"] == pytest.approx(0.5, rel=0.01)


def test_simulate_cli_burst_reports_na(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Five arrivals at one timestamp: egress mean 0.0 but P99 9.96 and "saturated" were
    # printed; the window is too short to say either.
    trace = tmp_path / "same.jsonl"
    trace.write_text("".join(
        json.dumps({"timestamp": 7, "input_length": 3000 * (i + 1), "output_length": 10,
                    "hash_ids": [i]}) + "\n"
        for i in range(5)
    ))
    args = parse(["simulate", "--trace", str(trace), "--policy", "offload-all", "--json", "-"])
    assert run(args) == 0
    captured = capsys.readouterr()
    r = json.loads(captured.out)["policies"]["offload-all"]
    assert r["saturated"] is None and r["egress_gbps_mean"] is None and r["egress_gbps_p99"] is None
    assert r["egress_gbps_peak"] > 0
    assert "saturated: n/a" in " ".join(captured.err.split())


def test_simulate_cli_plot_without_a_suffix_is_written_to_the_name_given(tmp_path: Path) -> None:
    # --json rep.png --plot rep: matplotlib wrote the plot to rep.png, over the JSON.
    report, plot = tmp_path / "rep.png", tmp_path / "rep"
    args = parse(["simulate", "--requests", "30", "--json", str(report), "--plot", str(plot), "--plot-points", "2"])
    assert run(args) == 0
    assert json.loads(report.read_text())["policies"]
    assert plot.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("spelling", ["same", "dot", "link"])
def test_simulate_cli_refuses_one_file_for_two_outputs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], spelling: str
) -> None:
    # --json same.png --plot same.png exited 0: the plot, written last, replaced the JSON.
    out = tmp_path / "same.png"
    other = {"same": str(out), "dot": str(tmp_path / "." / "same.png"), "link": str(tmp_path / "ln.png")}[spelling]
    if spelling == "link":
        out.write_text("old")
        (tmp_path / "ln.png").hardlink_to(out)
    args = parse(["simulate", "--requests", "30", "--json", str(out), "--plot", other])
    assert run(args) == 2
    assert "--json and --plot name the same file" in capsys.readouterr().err
    assert not out.exists() or out.read_text() == "old"


@pytest.mark.parametrize("records", [1, 20])
def test_simulate_cli_offered_rate_without_a_span_is_na(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], records: int
) -> None:
    # One record printed "offered nan rps", twenty at one timestamp "offered inf rps".
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(
        json.dumps({"timestamp": 0, "input_length": 1000 + i, "output_length": 5, "hash_ids": [i]}) + "\n"
        for i in range(records)
    ))
    assert run(parse(["simulate", "--trace", str(trace), "--policy", "selective"])) == 0
    out = " ".join(capsys.readouterr().out.split())
    noun = "request" if records == 1 else "requests"
    assert f"{records} {noun}, offered rate n/a; saturated: n/a" in out
    assert "nan" not in out and "inf" not in out


def test_simulate_cli_egress_window(capsys: pytest.CaptureFixture[str]) -> None:
    # Off by default (no demand: decide's utilization rules never fire); --egress-window
    # turns them on, and the JSON says which ran.
    assert parse(["simulate"]).egress_window == 0.0
    docs, captions = [], []
    for extra in ([], ["--egress-window", "60s"]):
        args = parse(["simulate", "--requests", "50", "--policy", "selective", "--json", "-", *extra])
        assert run(args) == 0
        captured = capsys.readouterr()
        docs.append(json.loads(captured.out))
        captions.append(" ".join(captured.err.split()))
    assert [d["system"]["egress_window_s"] for d in docs] == [0.0, 60.0]
    assert "decide's link rules: off (no --egress-window)" in captions[0]
    assert "decide's link rules: on (egress demand over 60 s)" in captions[1]
    # Each request's reason from decide, counted: 50 in all.
    for d in docs:
        decisions = d["policies"]["selective"]["decisions"]
        assert set(decisions) <= {"long", "short", "remote-prefix", "bandwidth-tight", "link-saturated"}
        assert sum(decisions.values()) == 50


def test_load_under_a_link_schedule_is_the_load_it_runs_at(capsys: pytest.CaptureFixture[str]) -> None:
    """The schedule's step lands in the arrival window: the fixed point jumped between its
    two sides, and after four rounds `--load 2` ran at utilization 0.674, labelled 2."""
    args = parse(["simulate", "--requests", "300", "--rate", "2", "--link-schedule", "0s:1gbps,100s:100gbps",
                  "--load", "2", "--policy", "selective", "--json", "-"])
    assert run(args) == 0
    doc = json.loads(capsys.readouterr().out)
    sel = doc["policies"]["selective"]
    assert doc["workload"]["load"] == 2
    assert sel["utilization"] == pytest.approx(2.0, rel=2e-3)
    assert doc["workload"]["offered_rps"] == pytest.approx(2.0 * sel["capacity_rps"], rel=2e-3)


def test_a_load_no_rescaling_reaches_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A capacity that jumps past the load as the window crosses a span: 10 rps while the
    arrivals span more than 100 s, 1 rps below; the load (offered / capacity) goes from
    under 0.01 to at least 0.1 and never is 0.05."""
    from types import SimpleNamespace

    from kvwire.errors import UsageError
    from kvwire.scheduler import command
    from kvwire.scheduler.workload import TraceRequest

    def capacity(policy: object, reqs: tuple[TraceRequest, ...], config: object, **kw: object) -> SimpleNamespace:
        span = max(r.arrival_s for r in reqs) - min(r.arrival_s for r in reqs)
        return SimpleNamespace(lambda_max_rps=10.0 if span > 100 else 1.0)

    monkeypatch.setattr(command, "policy_capacity", capacity)
    reqs = tuple(TraceRequest(arrival_s=float(i), input_length=1000, output_length=10) for i in range(11))
    scheduled = SimpleNamespace(link=SimpleNamespace(rates_bps=(1e9, 1e11)))
    with pytest.raises(UsageError, match=r"--load 0\.05 cannot be reached: .* under the link schedule"):
        command._at_load(reqs, scheduled, 0.05, command.PolicyName.SELECTIVE)  # type: ignore[arg-type]
    # A load on either side of the jump is reached, and the arrivals offer it.
    for load in (0.005, 0.5):
        scaled, cap = command._at_load(reqs, None, load, command.PolicyName.SELECTIVE)  # type: ignore[arg-type]
        assert command.offered_rate(scaled) / cap == pytest.approx(load, rel=1e-3)


@pytest.mark.parametrize("extra", [["--policy", "local", "--remote-instances", "0"],
                                   ["--policy", "offload-all", "--prefill-instances", "0"],
                                   ["--policy", "local", "--local-instances", "1"]])
def test_a_plot_selective_cannot_run_for_fails_before_the_simulation(
    extra: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """--plot simulates selective whatever --policy says: after the table, outside the
    error handler, that was a traceback (exit 1) for a configuration valid for the
    policies asked."""
    import matplotlib  # noqa: F401  (--plot draws with it; the test extra installs it)
    png = tmp_path / "p.png"
    assert run(parse(["simulate", "--requests", "30", *extra, "--plot", str(png)])) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("kvwire simulate: --plot simulates selective")
    assert "kvwire simulate" not in captured.out  # no table: nothing was simulated
    assert not png.exists()


def test_an_error_while_plotting_is_a_usage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    import matplotlib  # noqa: F401  (--plot draws with it; the test extra installs it)

    from kvwire.errors import UsageError
    from kvwire.scheduler import command

    def fail(*args: object) -> None:
        raise UsageError("the plot failed")

    monkeypatch.setattr(command, "_plot", fail)
    assert run(parse(["simulate", "--requests", "30", "--policy", "local", "--plot", str(tmp_path / "p.png")])) == 2
    assert capsys.readouterr().err == "kvwire simulate: the plot failed\n"


@pytest.mark.parametrize("source", ["--trace", "--profile", "--local-profile"])
@pytest.mark.parametrize("output", ["--json", "--plot"])
def test_simulate_cli_refuses_an_output_that_is_an_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], source: str, output: str
) -> None:
    # --trace t.jsonl --json t.jsonl exited 0 having replaced the trace with the JSON.
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(
        json.dumps({"timestamp": i * 500, "input_length": 1000, "output_length": 10, "hash_ids": [i]}) + "\n"
        for i in range(20)
    ))
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"tokens": [1024, 8192], "kv_bytes": [2e8, 3.2e8], "prefill_s": [0.44, 0.72]}))
    inputs = {"--trace": trace, "--profile": profile, "--local-profile": profile}
    target = inputs[source]
    before = target.read_text()
    spelled = str(tmp_path / "." / target.name)  # another spelling of the same file
    argv = ["simulate", "--trace", str(trace), "--policy", "local"]
    if source != "--trace":
        argv += [source, str(profile)]
    assert run(parse([*argv, output, spelled])) == 2
    assert f"is the {source} file" in capsys.readouterr().err
    assert target.read_text() == before


def test_simulate_cli_json_next_to_a_builtin_profiles_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # --profile hybrid-1t names the built-in, not a file: a JSON output called so is fine.
    monkeypatch.chdir(tmp_path)
    assert run(parse(["simulate", "--requests", "30", "--policy", "local", "--json", "hybrid-1t"])) == 0
    assert json.loads((tmp_path / "hybrid-1t").read_text())["system"]["profile"]


@pytest.mark.parametrize("policies", ["local,local", "selective,local,selective", "adaptive, adaptive"])
def test_simulate_cli_refuses_a_policy_given_twice(policies: str, capsys: pytest.CaptureFixture[str]) -> None:
    # local,local gave two table rows and one JSON entry.
    with pytest.raises(SystemExit) as exc:
        parse(["simulate", "--policy", policies])
    assert exc.value.code == 2
    assert "given more than once" in capsys.readouterr().err


def test_simulate_cli_caps_plot_points(capsys: pytest.CaptureFixture[str]) -> None:
    # 3000000000 ran the whole simulation, then failed in numpy (MemoryError) on the grid.
    from kvwire.scheduler.command import MAX_PLOT_POINTS

    assert parse(["simulate", "--plot-points", str(MAX_PLOT_POINTS)]).plot_points == MAX_PLOT_POINTS
    with pytest.raises(SystemExit) as exc:
        parse(["simulate", "--plot-points", "3000000000"])
    assert exc.value.code == 2
    assert f"must be at most {MAX_PLOT_POINTS:,}" in capsys.readouterr().err


def test_simulate_cli_says_a_threshold_must_be_finite(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(["simulate", "--threshold", "inf"])
    assert "'inf' must be a finite number >= 0" in capsys.readouterr().err
