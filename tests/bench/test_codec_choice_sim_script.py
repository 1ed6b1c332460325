"""benchmarks/codec_choice_sim.py: every scenario for every tree, the same numbers for the
same chooser (seeded, no clocks), and clear refusals of bad arguments."""

from __future__ import annotations

from pathlib import Path

from tests.bench.script_helpers import run_script

REPO = Path(__file__).resolve().parents[2]


def _rows(stdout: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| scenario")]


def test_every_scenario_for_each_tree_and_one_chooser_gives_one_answer() -> None:
    done = run_script("codec_choice_sim.py", "--seeds", "2", "--chunks", "150", "--tree", f"again={REPO}",
                      timeout=120)
    assert done.returncode == 0, done.stderr
    rows = _rows(done.stdout)
    assert len(rows) == 2 * 11
    for this, again in zip(rows[::2], rows[1::2], strict=True):
        assert (this[1], again[1]) == ("this", "again")
        assert this[0] == again[0] and this[2:] == again[2:]  # the same chooser, the same seeds
        best, eff = float(this[2].split()[0]), float(this[3])
        assert 0 <= best <= 1 and 0 < eff <= 1


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    for args, message in ((["--seeds", "0"], "--seeds"), (["--tree", "noequals"], "--tree"),
                          (["--tree", f"this={REPO}"], "--tree"), (["--tree", f"x={tmp_path}"], "no chooser at")):
        done = run_script("codec_choice_sim.py", *args, timeout=60)
        assert done.returncode != 0
        assert message in done.stderr, (args, done.stderr)
