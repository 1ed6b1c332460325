"""Inputs the scheduler reads (traces, profiles) are checked, and bad ones are usage
errors that say where, not tracebacks."""

from __future__ import annotations

import argparse
import gzip
import json
import math
import re
from pathlib import Path

import pytest

from kvwire.errors import UsageError
from kvwire.scheduler.command import add_parser, run
from kvwire.scheduler.profile import ModelProfile, load_profile
from kvwire.scheduler.workload import load_trace


def _record(i: int, **over: object) -> dict[str, object]:
    rec: dict[str, object] = {
        "timestamp": 100 * i,
        "input_length": 4000,
        "output_length": 50,
        "hash_ids": [i],
    }
    rec.update(over)
    return rec


def _write_trace(path: Path, bad: dict[str, object]) -> None:
    lines = [json.dumps(_record(0)), json.dumps(_record(1)), json.dumps(_record(2, **bad))]
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize(
    "bad",
    [
        {"output_length": -100000},
        {"input_length": -5},
        {"timestamp": float("nan")},
        {"timestamp": float("inf")},
        {"timestamp": float("-inf")},
    ],
)
def test_trace_rejects_values_a_request_cannot_have(tmp_path: Path, bad: dict[str, object]) -> None:
    path = tmp_path / "t.jsonl"
    _write_trace(path, bad)  # json.dumps writes NaN / Infinity, which json.loads reads back
    with pytest.raises(UsageError, match=rf"{path}:3:"):
        load_trace(path)


@pytest.mark.parametrize(
    ("bad", "said"),
    [
        ({"input_length": 1000.7}, "input_length must be a whole number, not 1000.7"),
        ({"input_length": True}, "input_length must be a whole number, not true"),
        ({"output_length": "50"}, 'output_length must be a whole number, not "50"'),
        ({"hash_ids": [1.5, 2]}, "a hash id must be a whole number, not 1.5"),
        ({"hash_ids": [True]}, "a hash id must be a whole number, not true"),
        ({"hash_ids": "12"}, 'hash_ids must be a list, not "12"'),
        ({"timestamp": False}, "timestamp must be a number, not false"),
        ({"timestamp": "100"}, 'timestamp must be a number, not "100"'),
    ],
)
def test_trace_refuses_values_it_used_to_coerce(tmp_path: Path, bad: dict[str, object], said: str) -> None:
    # 1000.7 became 1000, true 1, [1.5, 2] the ids [1, 2], "50" 50.
    path = tmp_path / "t.jsonl"
    _write_trace(path, bad)
    with pytest.raises(UsageError, match=rf"{path}:3: .*{re.escape(said)}"):
        load_trace(path)


def test_trace_record_that_is_not_an_object(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(_record(0)) + "\n[1, 2]\n")
    with pytest.raises(UsageError, match=rf"{path}:2: .*a JSON object"):
        load_trace(path)


def test_trace_takes_whole_numbers_written_as_floats(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    _write_trace(path, {"input_length": 4000.0, "hash_ids": [7.0], "timestamp": 250.5})
    last = load_trace(path)[-1]
    assert (last.input_length, last.hash_ids, last.arrival_s) == (4000, (7,), 0.2505)
    assert isinstance(last.input_length, int) and isinstance(last.hash_ids[0], int)


def test_trace_accepts_zero_lengths(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    _write_trace(path, {"input_length": 0, "output_length": 0})
    assert load_trace(path)[-1].input_length == 0


def test_corrupt_gzip_trace_is_a_usage_error(tmp_path: Path) -> None:
    raw = bytearray(gzip.compress(b"".join(
        json.dumps(_record(i, input_length=1000 + 37 * i)).encode() + b"\n" for i in range(2000)
    )))
    raw[40] ^= 0xFF  # inside the deflate stream: zlib.error, not OSError
    raw[41] ^= 0x55
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(bytes(raw))
    with pytest.raises(UsageError, match="cannot read trace"):
        load_trace(path)


def test_gzip_trace_with_an_upper_case_suffix(tmp_path: Path) -> None:
    path = tmp_path / "T.JSONL.GZ"
    path.write_bytes(gzip.compress(json.dumps(_record(0)).encode() + b"\n"))
    assert len(load_trace(path)) == 1


@pytest.mark.parametrize(
    "line",
    [
        "prefill_s=[0.4, inf]",
        "prefill_s=[0.4, nan]",
        "kv_bytes=[2e8, nan]",
        "tokens=[1024, inf]",
    ],
)
def test_profile_values_must_be_finite(tmp_path: Path, line: str) -> None:
    fields = {"tokens": "tokens=[1024, 8192]", "kv_bytes": "kv_bytes=[2e8, 3e8]",
              "prefill_s": "prefill_s=[0.4, 0.7]"}
    fields[line.split("=")[0]] = line
    path = tmp_path / "p.toml"
    path.write_text('name="x"\n' + "\n".join(fields.values()) + "\n")
    with pytest.raises(UsageError, match="finite"):
        load_profile(path)


def test_profile_json_nan_is_rejected() -> None:
    data = {"tokens": [1024, 8192], "kv_bytes": [2e8, 3e8], "prefill_s": [0.4, float("nan")]}
    with pytest.raises(UsageError, match="finite"):
        ModelProfile.from_dict(data)


def test_unreadable_profile_is_a_usage_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "p.json"
    path.write_text("{}")

    def refuse(self: Path) -> bytes:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", refuse)  # chmod does not stop root
    with pytest.raises(UsageError, match="cannot read profile"):
        load_profile(path)


@pytest.mark.parametrize(
    "text",
    [
        '{"tokens": [1024, 1' + "0" * 400 + '], "kv_bytes": [1, 2], "prefill_s": [1, 2]}',
        '{"tokens": [1024, 2048], "kv_bytes": [1, 2], "prefill_s": [1, 2], "cache_blocks": 1e400}',
    ],
)
def test_profile_number_too_large_is_a_usage_error(
    tmp_path: Path, text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # An integer too large for a float was an OverflowError traceback.
    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.raises(UsageError, match="bad profile"):
        load_profile(path)
    ap = argparse.ArgumentParser(prog="kvwire")
    add_parser(ap.add_subparsers(dest="command", required=True))
    assert run(ap.parse_args(["simulate", "--requests", "20", "--profile", str(path)])) == 2
    assert "bad profile" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("prefill_s", "where"),
    [((1.0, 3.0), "below its first point .* 500 tokens"), ((3.0, 1.0), "past its last point .* 2,500 tokens")],
)
def test_profile_whose_latency_line_reaches_zero_is_refused(prefill_s: tuple[float, float], where: str) -> None:
    # It was clamped to 0 s: prompts under 500 tokens (over 2,500) took no time, and the
    # model's local capacity for them was infinite.
    with pytest.raises(UsageError, match=f"prefill_s extended {where}"):
        ModelProfile(name="p", tokens=(1000.0, 2000.0), kv_bytes=(1e6, 2e6), prefill_s=prefill_s)


def test_profile_file_whose_latency_line_reaches_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "p.toml"
    path.write_text("tokens = [1000, 2000]\nkv_bytes = [1e6, 2e6]\nprefill_s = [1.0, 3.0]\n")
    with pytest.raises(UsageError, match="below its first point"):
        load_profile(path)
    ap = argparse.ArgumentParser()
    add_parser(ap.add_subparsers())
    assert run(ap.parse_args(["simulate", "--requests", "20", "--local-profile", str(path)])) == 2
    # The file, not 'custom' (the name a profile without one gets).
    assert f"kvwire simulate: profile {path}: prefill_s extended below" in capsys.readouterr().err


def test_profiles_through_zero_or_above_are_kept() -> None:
    for prefill_s in ((1.0, 2.0), (2.0, 2.0), (1.5, 2.0)):
        ModelProfile(name="p", tokens=(1000.0, 2000.0), kv_bytes=(1e6, 2e6), prefill_s=prefill_s)


def test_a_trace_line_nested_too_deep_is_not_a_trace_record(tmp_path: Path) -> None:
    """json.loads raised RecursionError, a traceback from kvwire simulate."""
    path = tmp_path / "deep.jsonl"
    path.write_text(json.dumps(_record(0)) + "\n" + "[" * 100000 + "\n")
    with pytest.raises(UsageError, match=rf"{re.escape(str(path))}:2: not a trace record \(maximum recursion"):
        load_trace(path)


@pytest.mark.parametrize("limit", [0, -5])
def test_a_limit_below_one_is_refused(tmp_path: Path, limit: int) -> None:
    """load_trace(limit=0) and limit=-5 returned one record."""
    path = tmp_path / "t.jsonl"
    _write_trace(path, {})
    with pytest.raises(UsageError, match="limit must be a whole number >= 1"):
        load_trace(path, limit=limit)
    assert len(load_trace(path, limit=1)) == 1


@pytest.mark.parametrize("limit", [1.5, math.inf, math.nan, "2"])
def test_a_limit_that_is_not_a_whole_number_is_refused(tmp_path: Path, limit: object) -> None:
    """load_trace(limit=1.5) kept two records."""
    path = tmp_path / "t.jsonl"
    _write_trace(path, {})  # three records
    with pytest.raises(UsageError, match="a whole number"):
        load_trace(path, limit=limit)  # type: ignore[arg-type]
    assert len(load_trace(path, limit=2.0)) == 2  # type: ignore[arg-type]


_PROFILE = {"tokens": [1024, 8192, 32768], "kv_bytes": [2e8, 3.2e8, 7.4e8], "prefill_s": [0.44, 0.72, 1.84]}


@pytest.mark.parametrize(
    ("over", "said"),
    [
        ({"cache_blocks": 4096.9}, "cache_blocks must be a whole number, not 4096.9"),  # was 4096
        ({"cache_blocks": True}, "cache_blocks must be a whole number, not true"),  # was 1
        ({"cache_blocks": "8192"}, 'cache_blocks must be a whole number, not "8192"'),  # was 8192
        ({"tokens": "159", "kv_bytes": [1, 2, 3], "prefill_s": [0.1, 0.2, 0.3]},
         'tokens must be a list of numbers, not "159"'),  # was (1.0, 5.0, 9.0)
        ({"tokens": [True, 2, 3], "kv_bytes": [1, 2, 3]}, "tokens\\[0\\] must be a number, not true"),
        ({"kv_bytes": [2e8, "3.2e8", 7.4e8]}, 'kv_bytes\\[1\\] must be a number, not "3.2e8"'),
        ({"prefill_s": 0.44}, "prefill_s must be a list of numbers, not 0.44"),
        ({"tokens": None}, "tokens must be a list of numbers, not null"),
    ],
)
def test_profile_refuses_values_it_used_to_coerce(
    tmp_path: Path, over: dict[str, object], said: str
) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps({**_PROFILE, **over}))
    with pytest.raises(UsageError, match=f"bad profile {re.escape(str(path))}: {said}"):
        load_profile(path)


def test_profile_takes_whole_blocks_written_as_floats_and_says_a_missing_key(tmp_path: Path) -> None:
    assert ModelProfile.from_dict({**_PROFILE, "cache_blocks": 4096.0}).cache_blocks == 4096
    assert ModelProfile.from_dict({**_PROFILE, "cache_blocks": None}).cache_blocks is None
    path = tmp_path / "p.toml"
    path.write_text("tokens = [1024, 8192]\nkv_bytes = [2e8, 3e8]\nprefill_s = [0.4, 0.7]\ncache_blocks = 8192\n")
    assert load_profile(path).cache_blocks == 8192
    with pytest.raises(UsageError, match="bad profile: 'prefill_s' missing"):
        ModelProfile.from_dict({"tokens": [1024], "kv_bytes": [1.0]})
    # A TOML date is no number, and the message says what it got.
    path.write_text("tokens = [1979-05-27]\nkv_bytes = [2e8]\nprefill_s = [0.4]\n")
    with pytest.raises(UsageError, match=r"tokens\[0\] must be a number, not datetime.date\(1979, 5, 27\)"):
        load_profile(path)


@pytest.mark.parametrize("gz", [False, True])
def test_trace_with_a_byte_order_mark(tmp_path: Path, gz: bool) -> None:
    # A UTF-8 BOM before the first record failed it as "not a trace record".
    text = "\ufeff" + "".join(json.dumps(_record(i)) + "\n" for i in range(3))
    path = tmp_path / ("t.jsonl.gz" if gz else "t.jsonl")
    path.write_bytes(gzip.compress(text.encode()) if gz else text.encode())
    assert [r.arrival_s for r in load_trace(path)] == [0.0, 0.1, 0.2]


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_profile_with_a_byte_order_mark(tmp_path: Path, suffix: str) -> None:
    text = json.dumps(_PROFILE) if suffix == ".json" else (
        "tokens = [1024, 8192, 32768]\nkv_bytes = [2e8, 3.2e8, 7.4e8]\nprefill_s = [0.44, 0.72, 1.84]\n")
    path = tmp_path / f"p{suffix}"
    path.write_bytes(("\ufeff" + text).encode())
    assert load_profile(path).tokens == (1024.0, 8192.0, 32768.0)
