"""``benchmarks/vllm_late_kv.py``'s arithmetic on timed tokens (the runs need vLLM), and its
command line, run as a user does."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from tests.bench.script_helpers import BENCHMARKS, run_script


def _module() -> Any:
    spec = importlib.util.spec_from_file_location("vllm_late_kv", BENCHMARKS / "vllm_late_kv.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_summary_of_a_step_held_for_the_late_request() -> None:
    """Two requests decode a token every 0.1 s; the late one arrives at 1.0 and its first
    token comes at 3.0.  Held: nothing else comes until then (gap 2.05 s, no tokens while
    it waits)."""
    held = [{"times": [i / 10 for i in range(1, 11)] + [3.05, 3.15]} for _ in range(2)]
    late = {"added": 1.0, "times": [3.0, 3.1]}
    s = _module().summarize([*held, late])
    assert s["ttft_s"] == pytest.approx(2.0)
    assert s["longest_gap_s"] == pytest.approx(2.05)
    assert s["rate_while_waiting"] == 0.0
    assert s["rate_before"] == pytest.approx(20 / 0.9)


def test_summary_of_requests_that_go_on_while_it_waits() -> None:
    """Going on: their gaps stay 0.1 s, and their 2 x 20 tokens in (1.0, 3.0] count."""
    going = [{"times": [i / 10 for i in range(1, 41)]} for _ in range(2)]
    late = {"added": 1.0, "times": [3.0]}
    s = _module().summarize([*going, late])
    assert s["ttft_s"] == pytest.approx(2.0)
    assert s["longest_gap_s"] == pytest.approx(0.1)
    assert s["rate_while_waiting"] == pytest.approx(40 / 2.0)


def test_an_unknown_mode_is_refused() -> None:
    out = run_script("vllm_late_kv.py", "--modes", "layer-wise,sometimes", timeout=60)
    assert out.returncode == 2 and "--modes takes some of" in out.stderr
