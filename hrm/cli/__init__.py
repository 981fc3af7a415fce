"""The `hrm` command line: one module per subcommand, with add_parser(subparsers) and run(args).

Subcommand modules import nothing heavy at module level (no torch, no pulp); each `run` imports
what it needs. An HrmError becomes one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

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
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(f"hrm.cli.{name}").add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except HrmError as exc:
        print(f"hrm {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        detail = f"; {exc}" if str(exc) else ""
        print(f"hrm {args.command}: interrupted{detail}", file=sys.stderr)
        return 130
