"""Kernel shaping between two network namespaces: created, shaping, always removed."""

from __future__ import annotations

import subprocess
import threading
import time

import pytest

from kvwire.bench.netns import NetnsLink, netns_available
from kvwire.errors import UsageError
from tests.environment import IN_CI

reason = netns_available()
# Skipped without network namespaces (not root, no iproute2) outside CI only: in CI they
# run, and fail without namespaces.
pytestmark = pytest.mark.skipif(reason is not None and not IN_CI, reason=reason or "")


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_shapes_a_transfer_and_cleans_up() -> None:
    rate = 200e6
    nbytes = 15_000_000
    with NetnsLink(rate_bps=rate) as link:
        names = link.namespaces
        assert all(ns in _namespaces() for ns in names)
        server = link.socket(link.receiver_ns)
        server.bind((link.receiver_addr, 0))
        server.listen(1)
        port = server.getsockname()[1]
        done: list[float] = []

        def receive() -> None:
            conn, _ = server.accept()
            got = 0
            buf = bytearray(1 << 20)
            while got < nbytes:
                n = conn.recv_into(buf)
                if not n:
                    break
                got += n
            done.append(time.monotonic())
            conn.close()

        reader = threading.Thread(target=receive)
        reader.start()
        client = link.socket(link.sender_ns)
        client.settimeout(10)
        client.connect((link.receiver_addr, port))
        start = time.monotonic()
        client.sendall(bytes(nbytes))
        reader.join(10)
        client.close()
        server.close()
        assert done, "the receiver did not get every byte"
        achieved = 8 * nbytes / (done[0] - start)
        # The shaper is a ceiling: a busy machine may deliver slower, never faster than the
        # rate (plus the bucket that passes at once).
        assert 0 < achieved <= rate * nbytes / (nbytes - link._burst_for(rate)) * 1.02
        assert link.run(link.sender_ns, ["ip", "-o", "addr"]).stdout.count(b"10.") >= 1
        assert link.call(link.receiver_ns, _ns_inode) != _ns_inode()
    listing = _namespaces()
    assert all(ns not in listing for ns in names)


def _ns_inode() -> str:
    import os

    return os.readlink("/proc/self/ns/net")


def test_cleans_up_when_the_body_fails() -> None:
    with pytest.raises(RuntimeError, match="boom"), NetnsLink(rate_bps=1e9) as link:
        names = link.namespaces
        raise RuntimeError("boom")
    listing = _namespaces()
    assert all(ns not in listing for ns in names)
    with pytest.raises(ValueError):
        link.socket(link.sender_ns)


def test_a_closed_link_raises_a_usage_error() -> None:
    """Its byte counter on a closed link raised a bare ValueError (a ``kvwire bench
    --kernel`` whose namespaces were removed under it ended with its traceback)."""
    with NetnsLink(rate_bps=1e9) as link:
        assert link.tx_bytes() >= 0
    for use in (link.tx_bytes, lambda: link.socket(link.sender_ns),
                lambda: link.run(link.receiver_ns, ["true"])):
        with pytest.raises(UsageError, match="the link is closed"):
            use()
    with pytest.raises(UsageError, match="not a namespace of this link"):
        link.socket("elsewhere")


def test_a_rate_whose_queue_tbf_cannot_hold_is_refused() -> None:
    """tbf's queue is a 32-bit byte count: asked for 50 ms at 1 Tbit/s, tc wrapped it
    around and queued 15.6 ms without a word. Refused before anything is made."""
    before = _namespaces()
    with pytest.raises(UsageError, match="tbf cannot queue 50 ms at 1 Tbit/s"):
        NetnsLink(rate_bps=1e12).open()
    assert _namespaces() == before
    with NetnsLink(rate_bps=600e9) as link:  # the fastest it holds is about 670 Gbit/s
        shown = link.run(link.sender_ns, ["tc", "qdisc", "show", "dev", link.sender_dev]).stdout
        assert b"rate 600Gbit" in shown and b"lat 50ms" in shown, shown
        with pytest.raises(UsageError, match="tbf cannot queue"):
            link.set_rate(1e12)
        assert link.rate_bps == 600e9


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT", "SIGHUP"])
def test_cleans_up_when_the_process_is_signalled(signame: str) -> None:
    import signal
    import sys

    script = (
        "import time\n"
        "from kvwire.bench.netns import NetnsLink\n"
        "link = NetnsLink(rate_bps=1e9).open()\n"
        "print(link.sender_ns, link.receiver_ns, flush=True)\n"
        "time.sleep(30)\n"
    )
    with subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    ) as proc:
        try:
            assert proc.stdout is not None
            names = proc.stdout.readline().split()
            assert len(names) == 2 and all(ns in _namespaces() for ns in names)
            proc.send_signal(getattr(signal, signame))
            proc.wait(10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    listing = _namespaces()
    assert all(ns not in listing for ns in names)


def test_an_ignored_signal_stays_ignored() -> None:
    """A process that ignores SIGINT (a background job of a script, ``trap '' INT``) keeps
    ignoring it: the link's handler took its place and removed the namespaces on SIGINT
    while the process went on using them."""
    import signal
    import sys

    script = (
        "import signal, time\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "from kvwire.bench.netns import NetnsLink\n"
        "link = NetnsLink(rate_bps=1e9).open()\n"
        "print(link.sender_ns, link.receiver_ns, flush=True)\n"
        "time.sleep(30)\n"
    )
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True) as proc:
        try:
            assert proc.stdout is not None
            names = proc.stdout.readline().split()
            assert len(names) == 2
            proc.send_signal(signal.SIGINT)
            with pytest.raises(subprocess.TimeoutExpired):
                proc.wait(1)
            assert all(ns in _namespaces() for ns in names)
            proc.send_signal(signal.SIGTERM)
            proc.wait(10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert all(ns not in _namespaces() for ns in names)


def test_a_forked_child_stopped_by_a_signal_leaves_the_parents_namespaces() -> None:
    """A child forked while a link is open inherits its signal handlers and atexit hook
    (a benchmark's load process, stopped with SIGTERM): the namespaces stay until the
    process that made them closes the link."""
    import multiprocessing as mp

    with NetnsLink(rate_bps=1e9) as link:
        child = mp.get_context("fork").Process(target=time.sleep, args=(30,), daemon=True)
        child.start()
        time.sleep(0.2)
        child.terminate()
        child.join(10)
        assert child.exitcode is not None
        assert all(ns in _namespaces() for ns in link.namespaces)
        names = link.namespaces
    assert all(ns not in _namespaces() for ns in names)


def test_opening_removes_the_namespaces_of_ended_processes_only() -> None:
    """A run killed with SIGKILL (or from before SIGHUP was handled) leaves its
    namespaces: the next link removes them, unless their process still runs."""
    import os
    import sys

    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)
    dead = f"kvwire-{int(ended.stdout)}-abcdef-s"
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]) as running:
        alive = f"kvwire-{running.pid}-abcdef-r"
        other = f"other-{int(ended.stdout)}-abcdef-s"
        try:
            for name in (dead, alive, other):
                subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
            with NetnsLink(rate_bps=1e9) as link:
                assert link.swept == [dead]
                listing = _namespaces().split()
                assert dead not in listing and alive in listing and other in listing
                assert f"kvwire-{os.getpid()}-" in _namespaces()  # its own
        finally:
            running.kill()
            for name in (dead, alive, other):
                subprocess.run(["ip", "netns", "del", name], capture_output=True)
