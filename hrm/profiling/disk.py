"""`hrm profile --disk DIR`: the storage's sequential read rate against the size of each read.

Reads go through O_DIRECT into page-aligned buffers, so the device is timed, not the page cache
(a file just written sits in it). Where the filesystem refuses O_DIRECT, the measurement is
refused too, unless the user asks for buffered reads; those drop the file's cached pages
(posix_fadvise DONTNEED) before each size, and the profile records `direct: false`.
"""

from __future__ import annotations

import errno
import mmap
import os
import time
from collections.abc import Callable
from pathlib import Path

from hrm.errors import HrmError
from hrm.hardware.parts import Curve, DiskSpec

KIB, MIB = 1024, 1024 * 1024
READ_SIZES = (4 * KIB, 64 * KIB, 1 * MIB, 8 * MIB, 64 * MIB)
_WRITE_CHUNK = 8 * MIB


def _refused(directory: Path, exc: OSError) -> HrmError:
    return HrmError(
        f"--disk {directory}: the filesystem refuses O_DIRECT reads ({exc.strerror}), so a "
        "timing would measure the page cache; give a directory on the device the weights are "
        "read from, or add --disk-buffered to time buffered reads instead"
    )


def _write_probe(path: Path, nbytes: int) -> None:
    """A file of `nbytes` incompressible bytes, on the device (fsync'd)."""
    chunk = os.urandom(_WRITE_CHUNK)
    with open(path, "wb") as f:
        for start in range(0, nbytes, _WRITE_CHUNK):
            f.write(chunk[: min(_WRITE_CHUNK, nbytes - start)])
        f.flush()
        os.fsync(f.fileno())


def _read_rate(path: Path, size: int, budget_s: float, direct: bool, clock) -> float:
    """Bytes per second reading the file front to back in `size` reads (wrapping) until
    `budget_s` has passed and at least one read is done."""
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags)
    try:
        if not direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        end = os.fstat(fd).st_size // size * size
        buffer = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT needs
        done, offset, start = 0, 0, clock()
        while True:
            done += os.preadv(fd, [buffer], offset)
            offset = (offset + size) % end
            elapsed = clock() - start
            if elapsed >= budget_s:
                return done / elapsed
    finally:
        os.close(fd)


def measure_disk(
    directory: str | os.PathLike,
    *,
    file_bytes: int = 256 * MIB,
    budget_s: float = 0.5,
    direct: bool = True,
    clock: Callable[[], float] = time.perf_counter,
) -> DiskSpec:
    """The read curve of the device under `directory` (a probe file written there, removed)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise HrmError(f"--disk {directory}: no such directory; give one on the device to time")
    if not os.access(directory, os.W_OK):
        raise HrmError(f"--disk {directory}: not writable; the probe file is written there")
    probe = directory / f".hrm-disk-probe-{os.getpid()}"
    sizes = [s for s in READ_SIZES if s <= file_bytes]
    try:
        _write_probe(probe, file_bytes)
        points = []
        for size in sizes:
            try:
                points.append((float(size), _read_rate(probe, size, budget_s, direct, clock)))
            except OSError as exc:
                if direct and exc.errno == errno.EINVAL:
                    raise _refused(directory, exc) from None
                raise
    except OSError as exc:
        raise HrmError(f"--disk {directory}: cannot time reads there ({exc.strerror})") from None
    finally:
        probe.unlink(missing_ok=True)
    curve = Curve(points=tuple(points))
    return DiskSpec(read_bytes_per_s=curve.best, read_curve=curve,
                    path=str(directory.resolve()), direct=direct)  # fmt: skip
