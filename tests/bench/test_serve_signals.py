"""``kvwire serve`` (and any ``kvwire`` command) ended by a signal: it exits with
128 + the signal's number and one line saying why, without a traceback, and a
``kvwire bench --peer`` sending to it is told that the server is shutting down."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests.bench.process_helpers import child_env, read_until, stop

pytestmark = pytest.mark.timeout(120)

_SIGNALS = [("SIGTERM", 143, "terminated"), ("SIGHUP", 129, "hangup"), ("SIGINT", 130, "interrupted")]
_BAD = ("Traceback", "Fatal error", "Exception ignored", "Task was destroyed", "never awaited")


@pytest.mark.parametrize(("signame", "code", "says"), _SIGNALS)
def test_a_signal_stops_serve_and_tells_a_bench_peer(signame: str, code: int, says: str) -> None:
    """While a ``kvwire bench --peer`` sends to it: the server exits with 128 + the
    signal, its last line says why, and the bench fails saying the server is shutting
    down (not a lost connection, not a wait for its timeout)."""
    server = subprocess.Popen([sys.executable, "-m", "kvwire", "serve", "--port", "0"],
                              stderr=subprocess.PIPE, text=True, env=child_env())
    bench: subprocess.Popen[str] | None = None
    try:
        port = int(read_until(server, r"listening on 127\.0\.0\.1:(\d+)")[1])
        bench = subprocess.Popen(
            [sys.executable, "-m", "kvwire", "bench", "--peer", f"127.0.0.1:{port}", "--model", "tiny",
             "--tokens", "4096", "--duration", "60s", "--quiet"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=child_env(),
        )
        read_until(server, r": 4096 tokens, ")  # a transfer arrived whole: the bench is sending
        server.send_signal(getattr(signal, signame))
        rest = server.communicate(timeout=60)[1]
        bench_err = bench.communicate(timeout=60)[1]
    finally:
        for proc in (server, bench):
            if proc is not None:
                stop(proc)
    assert server.returncode == code, rest
    assert rest.strip().splitlines()[-1] == says, rest
    assert not [bad for bad in _BAD if bad in rest], rest
    assert bench.returncode == 1, bench_err
    assert "the server is shutting down" in bench_err.strip().splitlines()[-1], bench_err


#: ``kvwire serve`` whose stderr raises ``signal.{second}`` while the line saying why
#: the first signal stopped it is being written (Ctrl-C pressed twice, a supervisor's
#: second SIGTERM, at that moment).
_SECOND_SIGNAL = """
import signal, sys
from kvwire.cli import main

class Stderr:
    def __init__(self, f):
        self.f, self.sent = f, False

    def write(self, text):
        if text in ("terminated", "hangup", "interrupted") and not self.sent:
            self.sent = True
            signal.raise_signal(signal.{second})
        return self.f.write(text)

    def __getattr__(self, name):
        return getattr(self.f, name)

sys.stderr = Stderr(sys.stderr)
sys.exit(main(["serve", "--port", "0"]))
"""


@pytest.mark.parametrize(("signame", "code", "says"), _SIGNALS)
@pytest.mark.parametrize("second", ["SIGTERM", "SIGINT"])
def test_a_second_signal_while_the_first_is_reported_is_ignored(
    signame: str, code: int, says: str, second: str
) -> None:
    """The run has stopped and cleaned up when ``kvwire`` says why: a second signal then
    was raised out of main() (a ``_Terminated`` or KeyboardInterrupt traceback, and an
    exit as if by SIGINT). Now it is ignored: the first signal's status and line."""
    proc = subprocess.Popen([sys.executable, "-c", _SECOND_SIGNAL.replace("{second}", second)],
                            stderr=subprocess.PIPE, text=True, env=child_env())
    try:
        read_until(proc, r"listening on 127\.0\.0\.1:\d+")
        proc.send_signal(getattr(signal, signame))
        rest = proc.communicate(timeout=60)[1]
    finally:
        stop(proc)
    assert proc.returncode == code, rest
    assert rest.strip().splitlines()[-1] == says, rest
    assert "Traceback" not in rest, rest


#: ``_stopping_on`` left normally, a SIGTERM sent to the process (any of its threads may
#: take it: numpy's are there) at each step of giving the signals back: right after the
#: loop let go of its handler (where it uses one), and right after each handler set.
_AS_HANDLERS_GO_BACK = """
import asyncio, os, signal
import numpy
from kvwire.bench.runner import _stopping_on

got = []
signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))

class Server:
    async def close(self):
        pass

async def main():
    loop = asyncio.get_running_loop()
    with _stopping_on([signal.SIGTERM], Server(), loop.create_future()) as stopped:
        remove, setter = loop.remove_signal_handler, signal.signal

        def remove_then_kill(signum):
            done = remove(signum)
            os.kill(os.getpid(), signal.SIGTERM)
            return done

        def set_then_kill(signum, handler):
            old = setter(signum, handler)
            os.kill(os.getpid(), signal.SIGTERM)
            return old

        loop.remove_signal_handler = remove_then_kill
        signal.signal = set_then_kill
    signal.signal = setter
    assert not stopped

asyncio.run(main())
print("handled" if got and set(got) == {signal.SIGTERM} else f"got {got}")
"""


def test_a_signal_as_the_servers_handlers_are_given_back_reaches_the_programs_own() -> None:
    """Removing the loop's handler set the default action until the program's own was
    back: a SIGTERM then ended the process, the server not closed (and blocking it in the
    main thread only moved it to another thread).  The server's handler is now swapped
    back for the program's in one step."""
    done = subprocess.run([sys.executable, "-c", _AS_HANDLERS_GO_BACK], capture_output=True, text=True, timeout=60,
                          env=child_env())
    assert (done.returncode, done.stdout.strip()) == (0, "handled"), done.stderr
