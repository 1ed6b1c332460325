"""benchmarks/paged_layer.py runs as a user runs it and reports every way it times."""

from __future__ import annotations

from tests.bench.script_helpers import run_script


def test_a_small_run_reports_each_way_against_the_copy() -> None:
    done = run_script("paged_layer.py", "--blocks", "2", "--cache-blocks", "4", "--layers", "1", "--reps", "1",
                      timeout=120)
    assert done.returncode == 0, done.stderr
    rows = [line.split("|")[1].strip() for line in done.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows == ["way", "np.copyto of the same bytes (baseline)", "gather_layer", "layer_rows"]
    assert "2 blocks of 512 KiB per layer (1 MiB)" in done.stdout
