"""Zero-copy, validated reading of .safetensors files.

`safetensors.safe_open(...).get_tensor` copies each tensor out of its memory map, so loading
through it holds the file pages and the copy at once (2x the checkpoint).  Here each file is
mapped once, private and read-only in practice, and each tensor is a view of the map, its pages
counted once.  `populate` reads a view's pages in at load: left to fault in on first touch, they
were read inside a run's timed prefill, and from disk when the page cache was cold or had been
paged out.  The header is checked against the file size so that a truncated or corrupt file is
an HrmError naming it, not a crash later.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path
from typing import NamedTuple

import torch

from hrm.errors import HrmError

STORED_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,  # FP8 checkpoints' weights (executor/stored_formats.py)
}
_MAX_HEADER_BYTES = 100 * 2**20  # the format's own limit
# linux/mman-common.h (Linux 5.14+): read the range in and map it; Python 3.11's mmap lacks the name
_MADV_POPULATE_READ = 22


class _Entry(NamedTuple):
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # byte offset from the start of the data section
    nbytes: int


class SafetensorsFile:
    """One memory-mapped .safetensors file: names, shapes, dtypes and zero-copy tensor views."""

    def __init__(self, path: Path):
        self.path = path
        try:
            with open(path, "rb") as f:
                size = path.stat().st_size
                if size < 8:
                    raise self._corrupt("shorter than a safetensors header")
                (header_len,) = struct.unpack("<Q", f.read(8))
                if header_len > min(size - 8, _MAX_HEADER_BYTES):
                    raise self._corrupt("header longer than the file")
                header = json.loads(f.read(header_len))
                # ACCESS_COPY maps the file private: writable buffer for torch.frombuffer, and a
                # stray write could never reach the file.
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except OSError as exc:
            raise HrmError(f"{path}: cannot read ({exc.strerror}); check the file") from None
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise self._corrupt("header is not valid JSON") from None
        if not isinstance(header, dict):
            raise self._corrupt("header is not a JSON object")
        header.pop("__metadata__", None)
        self._data_start = 8 + header_len
        self._entries = {name: self._check_entry(name, e, size) for name, e in header.items()}

    def _corrupt(self, why: str) -> HrmError:
        return HrmError(
            f"{self.path}: truncated or corrupt safetensors file ({why}); re-download it"
        )

    def _check_entry(self, name: str, entry, file_size: int) -> _Entry:
        try:
            dtype = STORED_DTYPES[entry["dtype"]]
            shape = tuple(int(n) for n in entry["shape"])
            begin, end = (int(n) for n in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise self._corrupt(f"bad header entry for {name}") from None
        numel = 1
        for n in shape:
            numel *= n
        nbytes = numel * dtype.itemsize
        if end - begin != nbytes or begin < 0:
            raise self._corrupt(f"{name}: data size does not match its shape")
        if self._data_start + end > file_size:
            raise self._corrupt(f"{name} runs past the end of the file")
        return _Entry(dtype, shape, begin, nbytes)

    def keys(self) -> list[str]:
        return list(self._entries)

    def source(self, tensor: torch.Tensor) -> int | None:
        """The file offset of `tensor`'s bytes when it is a contiguous view of this file (what
        the disk tier reads in place), else None."""
        if not tensor.is_contiguous() or tensor.device.type != "cpu":
            return None
        base = torch.frombuffer(self._map, dtype=torch.uint8, count=1).data_ptr()
        start, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        if base <= start and start + nbytes <= base + len(self._map):
            return start - base
        return None

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name].shape

    def dtype(self, name: str) -> torch.dtype:
        return self._entries[name].dtype

    def tensor(self, name: str) -> torch.Tensor:
        """A view of the mapped file: no copy, pages read on first touch."""
        e = self._entries[name]
        if e.nbytes == 0:
            return torch.empty(e.shape, dtype=e.dtype)
        count = e.nbytes // e.dtype.itemsize
        flat = torch.frombuffer(
            self._map, dtype=e.dtype, count=count, offset=self._data_start + e.begin
        )
        return flat.view(e.shape)

    def populate(self, name: str) -> None:
        """Read this tensor's pages now and map them, so that a run's timed steps find them
        resident: the kernel's MADV_POPULATE_READ, else a read of one byte per page."""
        e = self._entries[name]
        if e.nbytes == 0:
            return
        page = mmap.PAGESIZE
        start = self._data_start + e.begin
        first = start // page * page
        length = start + e.nbytes - first
        try:
            _populate_read(self._map, first, length)
        except (OSError, ValueError, AttributeError):  # an older kernel, or no madvise
            pages = torch.frombuffer(self._map, dtype=torch.uint8, count=length, offset=first)
            pages[::page].sum()

    def release(self, name: str) -> None:
        """Drop this tensor's pages from our resident set once it has been copied elsewhere.

        The mapping is private and never written, so the pages are clean: the kernel just unmaps
        them, and a later touch would read them again from the file.
        """
        e = self._entries[name]
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = self._data_start + e.begin
        end = start + e.nbytes
        page = mmap.PAGESIZE
        first, last = -(-start // page) * page, end // page * page  # whole pages inside the tensor
        if last > first:
            self._map.madvise(mmap.MADV_DONTNEED, first, last - first)


def _populate_read(mapped: mmap.mmap, start: int, length: int) -> None:
    mapped.madvise(_MADV_POPULATE_READ, start, length)
