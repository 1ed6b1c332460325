"""A signal that ends ``kvwire bench`` while its event loop runs: the run stops, its
cleanup runs, and the process exits with the signal's status, wherever the signal came.

The signal is raised from inside one of the loop's protocol callbacks (a stream's
``get_buffer``), where a handler that raises had its exception taken by the loop for
that callback's failure: one connection closed and the bench ran on to its end."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from types import FrameType

import pytest

from kvwire.bench import _signals
from kvwire.bench.netns import netns_available
from tests.environment import IN_CI

pytestmark = pytest.mark.timeout(120)

#: A bench that raises ``signal`` in its own process from inside the loop's 20th
#: ``get_buffer`` call of a stream (the sender reading acknowledgements).
_SCRIPT = """
import signal, sys
from kvwire.aio._stream import Stream
from kvwire.cli import main

get_buffer, calls = Stream.get_buffer, [0]

def counting(self, sizehint):
    calls[0] += 1
    if calls[0] == 20:
        print("signal", flush=True)
        signal.raise_signal(signal.{signame})
    return get_buffer(self, sizehint)

Stream.get_buffer = counting
sys.exit(main(["bench", "--model", "tiny", "--tokens", "256", "--duration", "15s", "--quiet",
               *sys.argv[1:]]))
"""


def _bench_signalled(signame: str, *argv: str) -> tuple[subprocess.CompletedProcess[str], int]:
    env = {k: v for k, v in os.environ.items() if k != "KVWIRE_SECRET"}
    with subprocess.Popen([sys.executable, "-c", _SCRIPT.replace("{signame}", signame), *argv],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as proc:
        try:
            out, err = proc.communicate(timeout=90)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), proc.pid


@pytest.mark.parametrize(
    ("signame", "code", "says"),
    [("SIGTERM", 143, "terminated"), ("SIGHUP", 129, "hangup"), ("SIGINT", 130, "interrupted")],
)
def test_a_signal_inside_a_loop_callback_ends_the_bench(signame: str, code: int, says: str) -> None:
    """SIGTERM or SIGHUP inside a uvloop protocol callback was taken for that callback's
    failure ("Fatal error on transport"): the bench went on and exited 0."""
    proc, _ = _bench_signalled(signame, "--link", "1gbps", "--rtt", "1ms")
    assert proc.stdout == "signal\n"  # it came while the loop ran
    assert proc.returncode == code, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == says, proc.stderr
    assert "Fatal error" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize(("signame", "code", "says"), [("SIGINT", 130, "interrupted"), ("SIGTERM", 143, "terminated")])
def test_a_signal_inside_a_loop_callback_ends_a_kernel_bench(signame: str, code: int, says: str) -> None:
    """--kernel: the namespaces' own handler removed them at once, then raised inside the
    callback (lost there): the run went on over removed namespaces and failed with a
    ValueError traceback. Now the run stops first, then they are removed."""
    reason = netns_available()
    if reason is not None and not IN_CI:  # in CI it runs, and fails without namespaces
        pytest.skip(reason)
    proc, pid = _bench_signalled(signame, "--kernel", "--link", "1gbps")
    assert proc.stdout == "signal\n"
    assert proc.returncode == code, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == says, proc.stderr
    assert "Traceback" not in proc.stderr and "Fatal error" not in proc.stderr, proc.stderr
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"kvwire-{pid}-" not in listing


# -- kvwire.bench._signals.run ------------------------------------------------------------------


class _Ended(BaseException):
    pass


@pytest.fixture
def ending_handler() -> Iterator[list[str]]:
    """SIGHUP handled by a handler that ends the program (it raises _Ended), recording
    when it ran in the list yielded."""
    events: list[str] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        events.append("handler")
        raise _Ended(signum)

    _signals.ends_the_program(handler)
    previous = signal.signal(signal.SIGHUP, handler)
    try:
        yield events
    finally:
        signal.signal(signal.SIGHUP, previous)
        _signals._ending.discard(handler)


def test_run_cancels_the_main_task_and_raises_the_signal_after_the_loop(ending_handler: list[str]) -> None:
    handler = signal.getsignal(signal.SIGHUP)

    async def main() -> None:
        # In a callback of the loop's, not in the main task.
        asyncio.get_running_loop().call_soon(signal.raise_signal, signal.SIGHUP)
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            ending_handler.append("cancelled")
            raise
        ending_handler.append("slept")

    with pytest.raises(_Ended):
        _signals.run(main())
    assert ending_handler == ["cancelled", "handler"]
    assert signal.getsignal(signal.SIGHUP) is handler  # put back


def test_run_raises_the_signal_after_a_main_task_that_kept_running(ending_handler: list[str]) -> None:
    """A run that catches the cancellation and ends normally still ends the program."""

    async def main() -> str:
        asyncio.get_running_loop().call_soon(signal.raise_signal, signal.SIGHUP)
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            ending_handler.append("cancelled")
        return "done"

    with pytest.raises(_Ended):
        _signals.run(main())
    assert ending_handler == ["cancelled", "handler"]


def test_run_leaves_other_handlers_in_place() -> None:
    """A handler not marked as ending the program (a reload on SIGHUP) runs where the
    signal comes, and the run goes on."""
    seen: list[int] = []
    previous = signal.signal(signal.SIGHUP, lambda signum, frame: seen.append(signum))
    try:

        async def main() -> str:
            signal.raise_signal(signal.SIGHUP)
            await asyncio.sleep(0)
            return "done"

        assert _signals.run(main()) == "done"
        assert seen == [signal.SIGHUP]
    finally:
        signal.signal(signal.SIGHUP, previous)


#: A child of the bench checking whether its parent is still there, the parent being the
#: PID 1 of a container (the children's parent is 1 all along) or a parent already gone.
_PARENT_CHECK = """
import multiprocessing, os, sys
from kvwire.bench import runner

recorded, now = (int(x) for x in sys.argv[1:3])
multiprocessing.parent_process = lambda: type("Parent", (), {"pid": recorded})()
os.getppid = lambda: now
runner._die_with_parent()
print("alive")
"""


@pytest.mark.parametrize(("recorded", "now", "alive"), [(1, 1, True), (4242, 4242, True), (4242, 1, False)])
def test_a_bench_child_ends_only_when_the_parent_it_was_started_by_is_gone(recorded: int, now: int, alive: bool) -> None:
    """A bench run as the PID 1 of a container keeps its children: a child ended when its
    parent's pid read 1, taking that for its parent gone before the parent-death signal
    was set; it now compares with the parent multiprocessing recorded."""
    done = subprocess.run([sys.executable, "-c", _PARENT_CHECK, str(recorded), str(now)],
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout.strip()) == ((0, "alive") if alive else (1, "")), done.stderr


def _tcp_inodes(pid: int) -> set[int]:
    """Inodes of the ESTABLISHED TCP sockets process ``pid`` holds (empty once it is gone)."""
    from pathlib import Path

    held: set[int] = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                held.add(int(target[8:-1]))
    except OSError:
        return set()
    established: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        established |= {int(cols[9]) for cols in (r.split() for r in rows) if cols[3] == "01"}
    return held & established


@pytest.mark.skipif(sys.platform != "linux", reason="reads the children's sockets in /proc")
def test_ctrl_c_during_the_raw_socket_baseline_prints_no_traceback() -> None:
    """Ctrl-C (SIGINT to the whole process group) while the raw-socket baseline ran: the
    bench said 'interrupted' and exited 130, but its two baseline processes each printed
    a KeyboardInterrupt traceback, unlike the bench's receiver and emulator."""
    import time

    from tests.bench.process_helpers import child_pids

    env = {k: v for k, v in os.environ.items() if k != "KVWIRE_SECRET"}
    with subprocess.Popen([sys.executable, "-m", "kvwire", "bench", "--model", "tiny", "--tokens", "4096",
                           "--duration", "60"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                          start_new_session=True) as proc:
        try:
            # Both baseline processes are inside their loops once each holds its end of
            # the TCP connection between them.
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                children = child_pids(proc.pid)
                if len(children) >= 2 and sum(bool(_tcp_inodes(c)) for c in children) >= 2:
                    break
                time.sleep(0.02)
            else:
                raise AssertionError("the baseline's processes never connected")
            os.killpg(proc.pid, signal.SIGINT)
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.strip().splitlines()[-1] == "interrupted", err
