"""What ``kvwire bench`` writes and prints: a ``--plot`` without a suffix is written to
the name given (matplotlib added ``.png``, replacing a ``--json`` of that name), the
summary table gives rates and times in the unit that suits them, and ``kvwire serve
--host`` takes an IPv6 address in brackets, as ``--peer`` does."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from kvwire.bench.command import _print_summary, plot_format
from kvwire.cli import build_parser, main

pytestmark = pytest.mark.timeout(90)

PNG = b"\x89PNG\r\n\x1a\n"


def _bench(folder: Path, *extra: str) -> dict[str, Any]:
    argv = ["bench", "--model", "tiny", "--tokens", "64", "--duration", "1", "--no-baseline", "--quiet",
            "--json", str(folder / "rep.png"), *extra]
    assert main(argv) == 0
    doc: dict[str, Any] = json.loads((folder / "rep.png").read_text())
    return doc


def test_a_plot_without_a_suffix_is_written_to_the_name_given(tmp_path: Path) -> None:
    """``--json rep.png --plot rep``: the paths differ, so both were allowed, and
    matplotlib wrote the plot to ``rep.png``, over the report."""
    import matplotlib  # noqa: F401  (--plot draws with it; the test extra installs it)
    folder = tmp_path
    doc = _bench(folder, "--plot", str(folder / "rep"))  # the report is intact
    assert doc["transfers"] >= 1
    assert (folder / "rep").read_bytes()[:8] == PNG
    assert sorted(p.name for p in folder.iterdir()) == ["rep", "rep.png"]


@pytest.mark.parametrize(("path", "fmt"), [("rep", "png"), ("rep.", "png"), ("a.d/rep", "png"),
                                           ("rep.SVG", "svg"), ("r.pdf", "pdf")])
def test_the_plots_format(path: str, fmt: str) -> None:
    assert plot_format(path) == fmt


def test_the_summary_gives_rates_and_times_in_their_units(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 100 kbit/s link, 1 s of RTT: the table said 'wire rate 0.000 Gbit/s' next to
    'utilization 99.5 %', and 'RTT 1e+03 ms'. (A loopback run's report, given the
    figures of such a run.)"""
    doc = _bench(tmp_path)
    slow = {**doc, "mode": "emulated", "link_gbps": 1e-4, "wire_gbps": 9.945e-5, "goodput_gbps": 8.2e-5,
            "estimated_gbps": 4.01e-5, "utilization": 0.9945, "rtt_ms": 1000.0,
            "time_to_first_layer_ms": 1500.0, "transfer_seconds_median": 0.0123, "baseline_gbps": 12.5,
            "baseline_ratio": 0.1}
    slow["start"] = {**doc["start"], "config": {**doc["start"]["config"], "emulator": "copy"}}
    capsys.readouterr()
    _print_summary(slow)
    rows = {m[1]: m[2] for m in re.finditer(r"│ (.+?) +│ +(.+?) │", capsys.readouterr().out)}
    assert rows["wire rate (measured)"] == "99.45 kbit/s", rows
    assert rows["goodput (fp16 KV)"] == "82 kbit/s", rows
    assert rows["estimate at end (from acks)"] == "40.1 kbit/s", rows
    assert rows["raw-socket baseline"] == "12.5 Gbit/s", rows
    assert rows["RTT"] == "1 s", rows
    assert rows["time to first layer (median)"] == "1.5 s", rows
    assert rows["transfer time (median)"] == "12.3 ms", rows


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


def test_serve_host_takes_an_ipv6_address_in_brackets() -> None:
    assert build_parser().parse_args(["serve", "--host", "[::1]"]).host == "::1"
    assert build_parser().parse_args(["serve", "--host", "::1"]).host == "::1"


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback address")
def test_serve_on_a_bracketed_ipv6_address_receives_a_bench() -> None:
    """``kvwire serve --host '[::1]'`` failed ('Name or service not known') while
    ``kvwire bench --peer '[::1]:PORT'`` takes the brackets."""
    from kvwire.aio import connect
    from kvwire.bench.models import MODELS, bench_cache
    from kvwire.bench.runner import DEV_SECRET

    env = {**{k: v for k, v in os.environ.items() if k != "KVWIRE_SECRET"}, "PYTHONUNBUFFERED": "1"}
    server = subprocess.Popen([sys.executable, "-m", "kvwire", "serve", "--host", "[::1]", "--port", "0", "--once"],
                              stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    timer = threading.Timer(60, server.kill)
    timer.start()
    try:
        assert server.stderr is not None
        for line in server.stderr:
            lines.append(line)
            if (match := re.search(r"listening on \[::1\]:(\d+)", line)) is not None:
                break
        else:
            raise AssertionError("".join(lines))
        tiny = MODELS["tiny"]

        async def bench() -> None:
            async with connect("::1", int(match[1]), secret=DEV_SECRET, streams=1) as peer:
                meta = {"kvwire_bench": {"id": "v6", "seed": 0}}
                await peer.send("v6-0", tiny.spec(), bench_cache(tiny, 4, 0), meta=meta, timeout=20)
                await peer.send("v6-end", tiny.spec(), bench_cache(tiny, 1, 0),
                                meta={"kvwire_bench": {**meta["kvwire_bench"], "end": True}}, timeout=20)

        asyncio.run(asyncio.wait_for(bench(), 60))
        lines.extend(server.stderr)
        assert server.wait(timeout=30) == 0, "".join(lines)
    finally:
        timer.cancel()
        if server.poll() is None:
            server.kill()
            server.wait()
        if server.stderr is not None:
            server.stderr.close()
    assert any("bench v6: 1 transfers" in x for x in lines), "".join(lines)
