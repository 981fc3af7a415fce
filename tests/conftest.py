"""Shared test helpers: run the command line in-process and check the one-line error convention."""

from __future__ import annotations

import pytest

from hrm.cli import main


@pytest.fixture
def run_cli(capsys):
    """Run `hrm ARGS...`; return (exit status, stdout, stderr)."""

    def run(*args: str) -> tuple[int, str, str]:
        try:
            status = main([str(a) for a in args])
        except SystemExit as exc:  # argparse usage errors
            status = exc.code
        out, err = capsys.readouterr()
        return status, out, err

    return run


def assert_one_line_error(status: int, err: str, *fragments: str) -> None:
    """Exit status 2, exactly one line on stderr, no traceback, and it names what is wrong."""
    assert status == 2, f"expected exit status 2, got {status}; stderr: {err!r}"
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}: {err!r}"
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
