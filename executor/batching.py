"""Resumable output of a prompts file run in batches of a plan's N (hrm/rules/batches.py) or
continuously.

Output: each finished batch's lines are appended (with their input index) to OUT.jsonl.partial,
whose first line names the run (a digest of the prompts, plan and generation settings); at the
end the lines are written in input order to OUT.jsonl and the partial file is removed. `--resume`
reads the partial files of the same run (any data-parallel group's too) and skips their batches:
a killed run loses at most the batches that were running (executor/output_files.py guards OUT).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from executor.output_files import partial_files
from hrm.errors import HrmError
from hrm.rules.batches import Batch


def run_digest(prompts: Sequence[Sequence[int]], settings: dict[str, Any]) -> str:
    """What makes two runs the same run: the prompts (token ids) and the settings."""
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for p in prompts:
        h.update(json.dumps(list(p)).encode())
    return h.hexdigest()[:16]


class PartialOutput:
    """OUT.jsonl.partial: a header naming the run, then one line per finished prompt."""

    def __init__(
        self, output: Path, digest: str, *, resume: bool, overwrite: bool = False, part=None,
        batching: str = "static",
    ):  # fmt: skip
        """resume: go on from every partial file of OUT (this process's, and those any
        data-parallel group left, whatever the world size: batches are cut by one rule);
        overwrite: discard them; neither: refuse them (they hold finished work of a killed
        run). part: a data-parallel group's own file, OUT.partial.PART (executor/world.py)."""
        self.output = output
        suffix = ".partial" if part is None else f".partial.{part}"
        self.path = output.with_name(output.name + suffix)
        self.digest, self.batching = digest, batching
        self.done: dict[int, dict[str, Any]] = {}
        found = partial_files(output)
        if resume:
            if not found and part is None:
                raise HrmError(f"--resume: {self.path} does not exist; run without --resume")
            for path in found:  # a group killed before its first batch left none of its own
                self._read(path)
        elif found:
            if not overwrite:
                names = ", ".join(str(p) for p in found)
                raise HrmError(
                    f"{names} {'holds' if len(found) == 1 else 'hold'} the finished batches of "
                    "a killed run: add --resume to continue it, or --overwrite to start over"
                )
            for path in found:
                path.unlink(missing_ok=True)

    def _read(self, path: Path) -> None:
        """The rows of one partial file; this process's own is cut after its last whole line
        (what the kill cut is not written after), another group's is only read."""
        with open(path, "rb") as f:
            lines = f.read().split(b"\n")
        if lines == [b""]:  # a kill before the header was written: nothing done yet
            return
        try:
            header = json.loads(lines[0])["hrm_partial"] if lines[0] else None
        except (ValueError, KeyError, TypeError):
            header = None
        if header is None:
            raise HrmError(f"--resume: {path} is not a partial output of hrm run")
        theirs = header.get("batching", "static")
        if theirs != self.batching:
            raise HrmError(
                f"--resume: {path} holds a {theirs} batching run's answers; resume it with "
                f"--batching {theirs}, or start over with --overwrite"
            )
        if header.get("run") != self.digest:
            raise HrmError(
                f"--resume: {path} is from a different run (its prompts, plan or settings "
                "differ); remove it or run with the same arguments"
            )
        end = len(lines[0]) + 1
        for line in lines[1:]:
            try:
                row = json.loads(line)
                self.done[int(row.pop("index"))] = row
            except (ValueError, KeyError, TypeError):
                break  # a line cut by the kill: that batch runs again
            end += len(line) + 1
        if path == self.path:
            with open(path, "r+b") as f:
                f.truncate(end)

    def pending(self, batches: list[Batch]) -> list[Batch]:
        return [b for b in batches if not all(i in self.done for i in b.indices)]

    def append(self, indices: Sequence[int], rows: Sequence[dict[str, Any]]) -> None:
        # a header first in a new file, or in an empty one (a kill before its header)
        new = not self.path.exists() or self.path.stat().st_size == 0
        with open(self.path, "a") as f:
            if new:
                header = {"run": self.digest}
                header |= {"batching": self.batching} if self.batching != "static" else {}
                f.write(json.dumps({"hrm_partial": header}) + "\n")
            for i, row in zip(indices, rows, strict=True):
                f.write(json.dumps({"index": i, **row}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.done.update(zip(indices, rows, strict=True))

    def saved(self) -> int:
        """Outputs whole on disk now: an interrupt may land between a write and `done`'s
        update, so what the user is told is read from the file."""
        if not self.path.exists():
            return 0
        with open(self.path, "rb") as f:
            return max(0, sum(1 for line in f if line.endswith(b"\n")) - 1)

    def finish(self, count: int) -> None:
        """All prompts done: OUT.jsonl in input order, the partial file removed."""
        from hrm.io import atomic_write_text

        atomic_write_text(self.output, in_input_order(self.done, count))
        for path in partial_files(self.output):
            path.unlink(missing_ok=True)


def in_input_order(rows: dict[int, dict[str, Any]], count: int) -> str:
    """The output lines of prompts 0 .. count - 1, JSONL in input order."""
    return "".join(json.dumps(rows[i]) + "\n" for i in range(count))


class InOrder:
    """Writes output lines in input order as batches finish (which is longest first): each line
    as soon as every line before it is written, so an interrupted run leaves what it finished."""

    def __init__(self, stream):
        self.stream, self.rows, self.next = stream, {}, 0

    def add(self, indices: Sequence[int], rows: Sequence[dict[str, Any]]) -> None:
        self.rows.update(zip(indices, rows, strict=True))
        while self.next in self.rows:
            self.stream.write(json.dumps(self.rows.pop(self.next)) + "\n")
            self.next += 1
        self.stream.flush()
