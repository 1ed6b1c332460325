"""The ``kvwire`` command: ``bench``, ``serve`` and ``simulate``."""

from __future__ import annotations

import argparse
import signal
import sys
import threading


def build_parser() -> argparse.ArgumentParser:
    from kvwire import __version__
    from kvwire.bench import command as bench_cmd
    from kvwire.scheduler import command as simulate_cmd

    parser = argparse.ArgumentParser(prog="kvwire", description="Move LLM KV caches over TCP.")
    parser.add_argument("--version", action="version", version=f"kvwire {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    bench_cmd.add_parsers(sub)
    simulate_cmd.add_parser(sub)
    return parser


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is, so that it cleans up as for Ctrl-C."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise _Terminated


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    # For the run only: a caller that runs main() in its own process keeps its handler.
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if threading.current_thread() is threading.main_thread() else None
    try:
        return int(args.func(args) or 0)
    except _Terminated:
        print("terminated", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
