"""Driving ``kvwire`` commands run as child processes: their environment, reading their
log until a line shows up, stopping them, and the processes they started."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import threading
from pathlib import Path


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment without ``KVWIRE_SECRET``, unbuffered, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k != "KVWIRE_SECRET"}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def read_until(proc: subprocess.Popen[str], pattern: str, timeout: float = 60) -> re.Match[str]:
    """The first line of ``proc``'s stderr that matches ``pattern``, within ``timeout``
    seconds (else the process is killed and the test fails with what it wrote)."""
    assert proc.stderr is not None
    seen: list[str] = []
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        for line in proc.stderr:
            seen.append(line)
            if (match := re.search(pattern, line)) is not None:
                return match
    finally:
        timer.cancel()
    raise AssertionError(f"no line matching {pattern!r} in:\n{''.join(seen)}")


def child_pids(pid: int) -> set[int]:
    """The ids of the processes that process ``pid``'s threads started (Linux /proc)."""
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            found |= {int(c) for c in (task / "children").read_text().split()}
    return found
