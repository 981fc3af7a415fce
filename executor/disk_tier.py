"""The disk tier: the trailing part of each streamed layer's arena kept off host memory and read
back once a pass into pinned staging (the "disk" queue's READ), from which the layer's pages are
copied in with the rest (executor/weight_store.py).

Where the part's tensors are contiguous views of the checkpoint's own safetensors files in the
run's dtype, they are read from those files in place (the aligned pages around each, through a
bounce buffer). Otherwise (a compact format's rows, a dtype converted at load, a GGUF's
dequantized tensors, random weights) the part is written at load to one file of ours, each
layer's at a 4 KiB-aligned offset; the file is unlinked as soon as it is made and lives on its
open descriptor, so nothing stays behind even when the run is killed. Reads are O_DIRECT, 8 MiB
at a time (hrm.rules.placement.DISK_READ_BYTES), large and aligned, as a drive reads fastest;
where a filesystem refuses O_DIRECT the run is refused, unless buffered reads are asked for
(then the page cache may serve them).
"""

from __future__ import annotations

import errno
import fcntl
import os
import tempfile
from pathlib import Path

import torch

from executor.buffers import TURNS
from executor.pinning import HostPins, page_aligned_empty
from hrm.errors import HrmError
from hrm.rules.placement import DISK_READ_BYTES
from hrm.units import format_bytes

ALIGN = 4096  # O_DIRECT's alignment of offsets, sizes and buffers


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def check_directory(
    directory: str | os.PathLike, *, direct: bool = True, what: str = "--disk-dir"
) -> None:
    """Refuse, in one line and before anything loads, a directory the disk tier cannot use:
    missing, not writable, or (with direct) on a filesystem that refuses O_DIRECT; `what`
    names where it came from."""
    directory = Path(directory)
    if not directory.is_dir():
        raise HrmError(
            f"{what} {directory}: no such directory for the disk tier's file; give --disk-dir DIR"
        )
    try:
        fd, name = tempfile.mkstemp(prefix="hrm-disk-check-", dir=directory)
    except OSError as exc:
        raise HrmError(f"{what} {directory}: cannot write there ({exc.strerror})") from None
    os.close(fd)
    try:
        os.close(_open(Path(name), direct))
    finally:
        os.unlink(name)


def check_checkpoint(checkpoint: str | os.PathLike, *, direct: bool = True) -> None:
    """The disk tier reads a checkpoint's own files in place: refuse, before anything loads, one
    on a filesystem that refuses O_DIRECT (unless buffered reads are asked for)."""
    path = Path(checkpoint)
    for name in [path] if path.is_file() else sorted(path.glob("*.safetensors"))[:1]:
        os.close(_open(name, direct))


def _open(path: Path, direct: bool) -> int:
    """`path` opened for reads, O_DIRECT unless buffered reads are asked for; a filesystem that
    refuses O_DIRECT is refused in one line."""
    try:
        return os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    except OSError as exc:
        if not direct or exc.errno != errno.EINVAL:
            raise
        raise HrmError(_refused(path)) from None


def _refused(path: Path) -> str:
    return (
        f"{path.parent}: the filesystem refuses O_DIRECT reads, so the disk tier's reads "
        "would come from the page cache; give --disk-dir (and the checkpoint) on the device "
        "the plan's disk is, or --disk-buffered to read through the cache"
    )


class DiskTier:
    """The layers' disk parts (in the checkpoint's files, or one file of ours) and the pinned
    staging their reads land in."""

    def __init__(self, directory: str | os.PathLike, parts: dict[int, int], device, *,
                 direct: bool = True):  # fmt: skip
        """parts: layer -> bytes of its disk part; direct: O_DIRECT reads (else buffered)."""
        check_directory(directory, direct=direct)
        self.parts, self.direct, self.offsets = parts, direct, {}
        offset = 0
        for layer, nbytes in sorted(parts.items()):
            self.offsets[layer] = offset
            offset += _padded(nbytes)
        self.nbytes = offset
        self._fd: int | None
        self._fd, name = tempfile.mkstemp(prefix="hrm-disk-", suffix=".bin", dir=directory)
        os.unlink(name)  # the descriptor keeps it: a killed run leaves no file
        self.path = Path(name)
        largest = _padded(max(parts.values(), default=0))
        self.staging = [page_aligned_empty(largest, torch.uint8) for _ in range(TURNS)]
        self.pins = HostPins()
        if device.type == "cuda":
            self.pins.pin_all(self.staging)
        # layer -> its disk part read in place from the checkpoint's files: (offset in the
        # part, file, offset in the file, bytes) per tensor; nothing of it is in our file
        self.inplace: dict[int, list[tuple[int, Path, int, int]]] = {}
        self._fds: dict[Path, int] = {}
        self._bounce = page_aligned_empty(0, torch.uint8)

    def write(self, layer: int, data: torch.Tensor) -> None:
        """Layer `layer`'s disk part (uint8, its arena's tail), written at its offset."""
        view, done = memoryview(data.numpy()).cast("B"), 0
        while done < len(view):  # pwrite may write less than asked (2 GiB at most on Linux)
            done += os.pwrite(self._fd, view[done:], self.offsets[layer] + done)

    def point(self, layer: int, pieces: list[tuple[int, Path, int, int]]) -> None:
        """Layer `layer`'s disk part is read in place: each (offset in the part, checkpoint
        file, offset there, bytes)."""
        self.inplace[layer] = pieces
        span = max(_padded(off % ALIGN + n) + ALIGN for _, _, off, n in pieces)
        if span > self._bounce.numel():
            self._bounce = page_aligned_empty(span, torch.uint8)

    def open(self) -> None:
        """After the last write: flush to the device, and read on (O_DIRECT unless asked
        otherwise) our file and the checkpoint files read in place. A filesystem that refuses
        O_DIRECT is refused in one line."""
        os.ftruncate(self._fd, self.nbytes)
        os.fsync(self._fd)
        if self.direct:  # Linux lets a descriptor take O_DIRECT (fcntl(2), F_SETFL)
            try:
                fcntl.fcntl(
                    self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) | os.O_DIRECT
                )
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                raise HrmError(_refused(self.path)) from None
        for path in {p for pieces in self.inplace.values() for _, p, _, _ in pieces}:
            self._fds[path] = _open(path, self.direct)

    def read(self, layer: int, turn: int) -> None:
        """Layer `layer`'s disk part into staging `turn`, in aligned reads of DISK_READ_BYTES
        (the size the planner prices the reads at): from our file, or tensor by tensor from the
        checkpoint's own files through an aligned bounce buffer."""
        if layer not in self.inplace:
            view = memoryview(self.staging[turn].numpy())
            _read_into(self._fd, self.path, view, self.offsets[layer], self.parts[layer])
            return
        bounce, staging = memoryview(self._bounce.numpy()), self.staging[turn]
        for at, path, offset, nbytes in self.inplace[layer]:
            start = offset // ALIGN * ALIGN
            _read_into(self._fds[path], path, bounce, start, offset - start + nbytes)
            head = offset - start
            staging[at : at + nbytes].copy_(self._bounce[head : head + nbytes])

    def describe(self) -> str:
        how = "O_DIRECT" if self.direct else "buffered"
        kept = sum(self.parts[i] for i in self.inplace)
        spilled = sum(self.parts.values()) - kept
        return (f"disk tier: {format_bytes(kept, 3)} read in place from the checkpoint, "
                f"{format_bytes(spilled, 3)} written to a file in {self.path.parent} ({how} "
                f"reads of {format_bytes(DISK_READ_BYTES)}; unlinked once made, so it goes "
                "with the run)")  # fmt: skip

    def close(self) -> None:
        """Close the files (ours goes with its descriptor) and unpin; once."""
        if self._fd is None:
            return
        for fd in [*self._fds.values(), self._fd]:
            os.close(fd)
        self._fds.clear()
        self._fd = None
        self.pins.close()


def _read_into(fd: int, path: Path, view: memoryview, offset: int, nbytes: int) -> None:
    """`nbytes` (rounded up to ALIGN) from `offset` (aligned) into the front of `view`, in reads
    of DISK_READ_BYTES; a file's aligned last read may come back short at its end."""
    size, done = _padded(nbytes), 0
    while done < nbytes:
        got = os.preadv(fd, [view[done : min(size, done + DISK_READ_BYTES)]], offset + done)
        if got <= 0:
            raise HrmError(f"{path}: ended at byte {offset + done}, before the disk tier's part")
        done += got
