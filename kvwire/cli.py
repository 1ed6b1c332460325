"""The ``kvwire`` command: ``bench``, ``serve`` and ``simulate``."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any

from kvwire.bench._signals import ends_the_program


def build_parser() -> argparse.ArgumentParser:
    from kvwire import __version__
    from kvwire.bench import command as bench_cmd
    from kvwire.scheduler import command as simulate_cmd
    from kvwire.wire.frames import MIN_PROTOCOL_VERSION, PROTOCOL_VERSION

    parser = argparse.ArgumentParser(prog="kvwire", description="Move LLM KV caches over TCP.")
    parser.add_argument(
        "--version", action="version",
        help="show kvwire's release and the wire protocol versions it speaks, and exit",
        version=f"kvwire {__version__} (wire protocol versions {MIN_PROTOCOL_VERSION}-{PROTOCOL_VERSION})",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    bench_cmd.add_parsers(sub)
    simulate_cmd.add_parser(sub)
    return parser


class _Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where the program is, so that it cleans up as for
    Ctrl-C (the default action ends the process without running any cleanup)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@ends_the_program
def _on_terminate(signum: int, frame: object) -> None:
    # While an event loop runs (kvwire.bench._signals.run), the signal cancels its main
    # task instead, and this runs once the loop has stopped: raised inside one of the
    # loop's callbacks, it would end that callback only.
    raise _Terminated(signum)


_TERMINATING: dict[int, str] = {signal.SIGTERM: "terminated", signal.SIGHUP: "hangup"}


def _stopped(why: str, code: int, previous: dict[int, Any]) -> int:
    """The run was stopped by a signal and has cleaned up: say why, and return ``code``.
    Another signal now (Ctrl-C pressed twice, a supervisor's second SIGTERM) has nothing
    left to stop: it is ignored until :func:`main` returns (which puts back the handlers
    kept in ``previous``), instead of being raised out of it as a traceback."""
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, *_TERMINATING):
            handler = signal.getsignal(signum)
            if handler is not None:  # (None: set outside Python, so left alone)
                signal.signal(signum, signal.SIG_IGN)
                previous.setdefault(signum, handler)
    print(why, file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    # For the run only: a caller that runs main() in its own process keeps its handlers.
    # A signal the process ignores (nohup's SIGHUP) stays ignored.
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for signum in _TERMINATING:
            if signal.getsignal(signum) is not signal.SIG_IGN:
                previous[signum] = signal.signal(signum, _on_terminate)
    try:
        # Parsed inside the try: building the parser and checking an argument import
        # kvwire's modules (--codec's check imports the bench runner), half a second in
        # which Ctrl-C is "interrupted" as later, not a traceback.
        args = build_parser().parse_args(argv)
        args.argv = list(sys.argv[1:] if argv is None else argv)
        return int(args.func(args) or 0)
    except _Terminated as exc:
        return _stopped(_TERMINATING.get(exc.signum, "terminated"), 128 + exc.signum, previous)
    except KeyboardInterrupt:
        return _stopped("interrupted", 130, previous)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


if __name__ == "__main__":
    sys.exit(main())
