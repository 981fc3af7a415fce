"""Shared test helpers: run the command line in-process and check the one-line error convention."""

from __future__ import annotations

import os
import tempfile

import pytest

from hrm.cli import main

# This host's kept GEMM probes (hrm.profiling.host_gemm) go to one folder per test session, never
# the user's cache; subprocesses (torchrun ranks) inherit it.
os.environ["HRM_CACHE_DIR"] = tempfile.mkdtemp(prefix="hrm-test-cache-")


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


def record_flags() -> list[str]:
    """`hrm run`'s flags for its record on stdout: --json, and an --output of a fresh file for
    the answers (--json alone is refused: it would drop them)."""
    return ["--json", "--output", os.path.join(tempfile.mkdtemp(prefix="hrm-answers-"), "a.jsonl")]


def assert_one_line_error(status: int, err: str, *fragments: str) -> None:
    """Exit status 2, exactly one line on stderr, no traceback, and it names what is wrong."""
    assert status == 2, f"expected exit status 2, got {status}; stderr: {err!r}"
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}: {err!r}"
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"


def refuse_o_direct(monkeypatch, module) -> None:
    """`module`'s os.open refuses O_DIRECT as tmpfs and some network filesystems do (EINVAL)."""
    import errno

    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(module.os, "open", no_direct)
