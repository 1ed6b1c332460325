"""``kvwire --version`` names the release and the wire protocol versions it speaks."""

from __future__ import annotations

import pytest

import kvwire
from kvwire.cli import main
from kvwire.wire import PROTOCOL_VERSION
from kvwire.wire.frames import MIN_PROTOCOL_VERSION


def test_version_names_the_release_and_the_wire_protocol_versions(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out == f"kvwire {kvwire.__version__} (wire protocol versions {MIN_PROTOCOL_VERSION}-{PROTOCOL_VERSION})"
