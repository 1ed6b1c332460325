"""``benchmarks/vllm_late_kv.py``'s arithmetic on timed tokens (the runs need vLLM), and its
command line, run as a user does."""

from __future__ import annotations

import pytest

from tests.bench.script_helpers import load_script, run_script


def test_summary_of_a_step_held_for_the_late_request() -> None:
    """Two requests decode a token every 0.1 s; the late one arrives at 1.0 and the step
    that gives it its first token ends at 3.0, the others' tokens of that step stamped the
    same.  Held: nothing else came while it waited (gap 2.0 s), each made 10 tokens/s
    before."""
    held = [{"times": [i / 10 for i in range(1, 11)] + [3.0, 3.1]} for _ in range(2)]
    late = {"added": 1.0, "times": [3.0, 3.1]}
    s = load_script("vllm_late_kv.py", "vllm_late_kv").summarize([*held, late])
    assert s["ttft_s"] == pytest.approx(2.0)
    assert s["longest_gap_s"] == pytest.approx(2.0)
    assert s["rate_while_waiting"] == 0.0
    assert s["rate_before"] == pytest.approx(20.0)


def test_summary_of_requests_that_go_on_while_it_waits() -> None:
    """Going on: their gaps stay 0.1 s, and their 2 x 19 tokens in (1.0, 3.0) count."""
    going = [{"times": [i / 10 for i in range(1, 41)]} for _ in range(2)]
    late = {"added": 1.0, "times": [3.0]}
    s = load_script("vllm_late_kv.py", "vllm_late_kv").summarize([*going, late])
    assert s["ttft_s"] == pytest.approx(2.0)
    assert s["longest_gap_s"] == pytest.approx(0.1)
    assert s["rate_while_waiting"] == pytest.approx(38 / 2.0)
    assert s["rate_before"] == pytest.approx(20.0)


def test_tokens_before_the_arrival_all_from_one_step_give_no_rate() -> None:
    """The late request arrives right after the others' first step: their tokens before it
    share one stamp, which spans no time (no rate, no division by zero)."""
    one_step = [{"times": [0.5, 1.5, 1.6]} for _ in range(2)]
    late = {"added": 1.0, "times": [1.55]}
    s = load_script("vllm_late_kv.py", "vllm_late_kv").summarize([*one_step, late])
    assert s["rate_before"] == 0.0
    assert s["rate_while_waiting"] == pytest.approx(2 / 0.55)


@pytest.mark.parametrize(("args", "message"), [
    (["--modes", "layer-wise,sometimes"], "--modes takes some of"),
    (["--modes", "async,async"], "each once"),
    (["--local", "0"], "--local and --after must be at least 1"),
])
def test_bad_arguments_are_refused(args: list[str], message: str) -> None:
    out = run_script("vllm_late_kv.py", *args, timeout=60)
    assert out.returncode == 2 and message in out.stderr
