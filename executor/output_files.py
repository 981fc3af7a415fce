"""What guards a run's --output: one writer at a time, no input overwritten, no finished
answers thrown away.

- OUT.jsonl.lock: the process writing OUT holds an exclusive lock on it (flock: the kernel drops
  it when the process ends, however it ends, so a killed run leaves no stale lock); a second run
  into the same OUT is refused naming the live process.
- A finished OUT is replaced only with --overwrite.
- OUT, its partial files and its lock must not be any of the run's inputs (the prompts, the plan,
  a profile), through whatever path, symlink or hard link.
- Partial files: OUT.jsonl.partial (one process) and OUT.jsonl.partial.G (data-parallel group G,
  executor/world.py); a run finds them all, whatever world size left them.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
from pathlib import Path

from hrm.errors import HrmError


def partial_files(output: Path) -> list[Path]:
    """Every partial file of OUT a run may have left: OUT.partial and OUT.partial.G."""
    pattern = re.compile(re.escape(output.name) + r"\.partial(\.\d+)?")
    if not output.parent.is_dir():
        return []
    found = [p for p in output.parent.iterdir() if pattern.fullmatch(p.name)]
    return sorted(found, key=lambda p: (len(p.name), p.name))


def check_not_an_input(output: Path, inputs: dict[str, str | None]) -> None:
    """Refuse an OUT (or its partial or lock file) that is one of `inputs` ({flag: path}): the
    run would write over what it reads."""
    ours = [output, output.with_name(output.name + ".lock"), *partial_files(output)]
    for flag, given in inputs.items():
        if not given or not Path(given).is_file():
            continue
        for mine in ours:
            if mine.exists() and os.path.samefile(given, mine):
                what = "--output" if mine == output else f"--output's {mine.name}"
                raise HrmError(
                    f"{flag} {given} is the same file as {what}: the run would write over its "
                    "input; choose another --output"
                )


class OutputLock:
    """An exclusive lock on OUT.lock for as long as this process writes OUT."""

    def __init__(self, output: Path):
        self.path = output.with_name(output.name + ".lock")
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                raise HrmError(
                    f"{output} is being written by another hrm run ({holder}); wait for it to "
                    "finish, or choose another --output"
                ) from None
            # the holder before us may have removed the file as we opened it: lock the live one
            if _same_file(fd, self.path):
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": os.uname().nodename}).encode())
        self.fd: int | None = fd

    def release(self) -> None:
        """Remove the lock file, then drop the lock (in this order, so that no other run can
        hold a lock on a file that is gone)."""
        if self.fd is None:
            return
        self.path.unlink(missing_ok=True)
        os.close(self.fd)
        self.fd = None


def _holder(fd: int) -> str:
    """Who holds the lock, as its lock file says."""
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"process {int(data['pid'])} on {data['host']}"
    except (ValueError, KeyError, TypeError, OSError):
        return "a process that has not yet said its id"


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)
