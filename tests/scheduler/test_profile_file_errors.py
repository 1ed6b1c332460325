"""A profile file's errors name the file: its checks said "profile 'custom': token counts
must be positive", after the name a profile without one gets, not the file given."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvwire.cli import main
from kvwire.errors import UsageError
from kvwire.scheduler.profile import ModelProfile, load_profile

GOOD = {"tokens": [1000, 2000], "kv_bytes": [1.25e9, 2.5e9], "prefill_s": [2.0, 3.0]}
TRACE = '{"timestamp": 0, "input_length": 1000, "output_length": 20, "hash_ids": [1, 2]}\n'


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tokens": [0, 1000]}, "profile {}: token counts must be positive"),
        ({"tokens": [2000, 1000]}, "profile {}: tokens must be strictly increasing"),
        ({"prefill_s": [2.0, 0.0]}, "profile {}: sizes must be >= 0, latencies > 0"),
        ({"cache_blocks": -1}, "profile {}: cache_blocks must be >= 0"),
        ({"prefill_s": [3.0, 1.0]}, "profile {}: prefill_s extended past its last point"),
        ({"kv_bytes": [1.0]}, "profile {}: tokens, kv_bytes, prefill_s lengths differ"),
        ({"tokens": "159"}, "bad profile {}: tokens must be a list of numbers"),
        # Named or not, the file is what was given.
        ({"name": "mine", "tokens": [0, 1000]}, "profile {}: token counts must be positive"),
    ],
)
@pytest.mark.parametrize("option", ["--profile", "--local-profile"])
def test_a_bad_profile_file_is_named(
    tmp_path: Path, change: dict[str, object], message: str, option: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = tmp_path / "prof.json"
    path.write_text(json.dumps({**GOOD, **change}))
    with pytest.raises(UsageError) as exc:
        load_profile(path)
    assert str(exc.value).startswith(message.format(path))
    trace = tmp_path / "tiny.jsonl"
    trace.write_text(TRACE)
    assert main(["simulate", "--trace", str(trace), option, str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvwire simulate: {message.format(path)}")
    assert "'custom'" not in err and "'mine'" not in err


def test_a_missing_key_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text("tokens = [1000]\nkv_bytes = [1.0]\n")
    with pytest.raises(UsageError, match=rf"^bad profile {path}: 'prefill_s' missing$"):
        load_profile(path)


def test_a_table_without_a_file_is_named_as_before() -> None:
    with pytest.raises(UsageError, match=r"^profile 'custom': token counts must be positive$"):
        ModelProfile.from_dict({**GOOD, "tokens": [0, 1000]})
    with pytest.raises(UsageError, match=r"^bad profile: 'prefill_s' missing$"):
        ModelProfile.from_dict({"tokens": [1024], "kv_bytes": [1.0]})
