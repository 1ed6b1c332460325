"""Helpers the tests of the blocking front end (``kvwire.sync``) share: polling, a call
made from another thread, and what a dropped bridge, server or peer leaves behind."""

from __future__ import annotations

import re
import socket
import threading
import time
import warnings
from typing import Any

import numpy as np

from kvwire.sync import SyncServer


def refused(port: int) -> bool:
    """Whether a connection to ``port`` on 127.0.0.1 is refused (nothing listens there)."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=10).close()
    except ConnectionRefusedError:
        return True
    return False


def until(cond: Any, within: float = 20.0) -> bool:
    """Whether ``cond()`` became true within ``within`` s (polled)."""
    end = time.monotonic() + within
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def call_in_thread(call: Any, within: float = 10.0) -> BaseException | str:
    """What ``call()`` raised (or "returned"), from another thread; "blocked" if it did not
    end within ``within`` s (the thread is a daemon: a test of a wait that never ends ends)."""
    out: list[BaseException | str] = []

    def go() -> None:
        try:
            call()
            out.append("returned")
        except BaseException as exc:
            out.append(exc)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(within)
    return out[0] if out else "blocked"


def connections(server: SyncServer) -> int:
    """The connections ``server`` holds, counted on its loop."""
    async def count() -> int:
        return int(server.server.statistics()["connections"])

    return int(server.bridge.run(count(), 10))


def layers() -> list[tuple[np.ndarray, np.ndarray]]:
    """Two layers of ``KVSpec(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32")``."""
    return [(np.full((4, 1, 8), i, np.float32), np.full((4, 1, 8), -i, np.float32)) for i in range(2)]


def bridge_warning(name: str) -> str:
    """The pattern of the ResourceWarning of a dropped unclosed bridge called ``name``."""
    return rf"unclosed kvwire\.sync\.Bridge '{re.escape(name)}'"


def thread_ended(thread: threading.Thread) -> bool:
    """Whether ``thread`` (a bridge's loop thread) ended within 30 s."""
    thread.join(30)
    return not thread.is_alive()


def resource_warnings(seen: list[warnings.WarningMessage]) -> list[str]:
    """The messages of the ResourceWarnings among ``seen``."""
    return [str(w.message) for w in seen if issubclass(w.category, ResourceWarning)]
