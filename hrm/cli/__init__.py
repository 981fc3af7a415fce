"""The `hrm` command line: one module per subcommand, with add_parser(subparsers) and run(args).

Subcommand modules import nothing heavy at module level (no torch, no pulp); each `run` imports
what it needs. An HrmError becomes one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading

from hrm import __version__
from hrm.errors import HrmError

SUBCOMMANDS = ("roofline", "profile", "plan", "run", "report", "validate")


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (docs/architecture.md) and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="hrm",
        description="Plan and run high-throughput batch inference of MoE models on small GPUs.",
    )
    parser.add_argument("--version", action="version", version=f"hrm {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(f"hrm.cli.{name}").add_parser(subparsers)
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM (a kill, a batch system's time limit), handled like Ctrl-C: what finished is
    kept and the user is told how to go on."""


def _terminate(signum, frame) -> None:
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what a launcher starts again
    main_thread = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
    try:
        return int(args.run(args) or 0)
    except HrmError as exc:
        print(f"hrm {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        detail = f"; {exc}" if str(exc) else ""
        killed = isinstance(exc, Terminated)
        print(f"hrm {args.command}: {'terminated' if killed else 'interrupted'}{detail}",
              file=sys.stderr)  # fmt: skip
        return 128 + (signal.SIGTERM if killed else signal.SIGINT)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, before)
